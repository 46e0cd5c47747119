"""A rank that stays alive and silent until its peer has what it waited for: the timeout and gone-peer tests.

Those tests need rank 1 to live (its watcher answering where-is-everyone) but never to take part, while rank 0
times out or finds it gone. Rank 1 waits for rank 0's answer instead of sleeping a fixed time past the timeout,
and rank 0, which serves the store, leaves last: rank 1 may still be reading the store when rank 0 is done.

The waits poll with ``store.check``: a blocking ``store.wait`` holds the store's connection, which the rank's
watcher shares, so its answers to where-is-everyone would wait behind it.

Example (a rank function under ``conveyor.processes.run_ranks``)::

    def rank_fn(rank, world_size):
        ...  # both ranks build their pipeline
        return silent_until_answered(rank, "never comes", lambda: step_and_describe(pipe))
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def poll_until(done: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Return once ``done()`` holds, polling every 20 ms; a ``TimeoutError`` naming ``what`` after ``timeout_s``.

    Example:
        >>> poll_until(lambda: True, "nothing")
    """
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout_s:g} s")
        time.sleep(0.02)


def silent_until_answered(rank: int, name: str, answer: Callable[[], Any] | None = None) -> Any:
    """Rank 1: alive and silent until rank 0 has its answer, then None. Rank 0: ``answer()``'s value (or its
    exception), once rank 1 has left. ``name`` keys this test's store entries."""
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()

    def until_set(key: str) -> None:
        poll_until(lambda: store.check([key]), f"{key!r} set")

    if rank == 1:
        until_set(f"{name}: answered")
        store.set(f"{name}: left 1", "1")
        return None
    try:
        return answer()
    finally:
        store.set(f"{name}: answered", "1")
        until_set(f"{name}: left 1")
