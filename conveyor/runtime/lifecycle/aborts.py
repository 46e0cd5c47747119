"""Aborting a pipeline's communicators after a failure: each once, all of them together.

Under NCCL a rank waiting for a dead peer waits in a kernel that only an abort ends. Aborted
one after another, one communicator's abort can wait for another's kernel that still waits
for the dead peer, which only that other abort would end: a deadlock (pytorch#119797,
NCCL#1013). Between ncclGroupStart and ncclGroupEnd NCCL aborts them together, which is what
torch's own ``_abort_process_group`` does for the whole job; :class:`GroupAborter` does it for
one pipeline's groups (the user's stay usable), and remembers what it aborted, because the
watcher thread and the failing main thread may both get there.

Example (what :class:`~conveyor.runtime.lifecycle.rank.RankLifecycle` does)::

    aborter = GroupAborter(rank)
    aborter.abort(groups)          # the watcher, on a dead peer
    aborter.abort(groups)          # the failing call's close: nothing aborted twice
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class GroupAborter:
    """Aborts process groups' communicators, each group once, all of a call's in one NCCL group call."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        # id()s, not the groups: a reference here would keep a destroyed gloo group's threads
        # alive into interpreter exit (see conveyor.runtime.lifecycle.rank)
        self.aborted: set[int] = set()
        self._lock = threading.Lock()

    def abort(self, groups: Sequence[Any]) -> None:
        """Abort those of ``groups`` not aborted yet, together; one that fails is logged, the rest go on.

        Example:
            >>> GroupAborter(0).abort([])
        """
        with self._lock:
            todo = [group for group in groups if id(group) not in self.aborted]
            self.aborted.update(id(group) for group in todo)
            nccl = nccl_backend(todo)
            if nccl is not None:
                nccl._group_start()
            try:
                for group in todo:
                    try:
                        group.abort()
                    except Exception as exc:  # the others still need aborting; say which did not
                        log.warning("conveyor: rank %d could not abort group %s: %s: %s", self.rank,
                                    getattr(group, "group_name", group), type(exc).__name__, exc)
            finally:
                if nccl is not None:
                    nccl._group_end()


def nccl_backend(groups: Sequence[Any]) -> Any:
    """The NCCL backend of the first of ``groups`` that has one (None without NCCL).

    NCCL's group calls are per thread, so one communicator's ncclGroupStart brackets the
    aborts of every group's, as in torch's ``_abort_process_group``.

    Example:
        >>> nccl_backend([]) is None
        True
    """
    if not dist.is_nccl_available():
        return None
    for group in groups:
        try:
            backend = group._get_backend(torch.device("cuda"))
        except RuntimeError:  # no CUDA backend in this group
            continue
        if isinstance(backend, dist.ProcessGroupNCCL):
            return backend
    return None
