"""The pipelines ``conveyor train`` builds, kept for a test to look at after (or before) the trainer's steps.

Used by ``tests/train/test_tensor_parallel.py``, ``test_expert_parallel_train.py`` and
``test_layouts_save_and_start_alike.py``, each in the rank functions it runs through
:func:`conveyor.testing.run_ranks`.

Example (in a rank: a forked process, so the patch ends with it)::

    kept = keep_built_pipelines()
    summary = train(cfg)
    names = [name for name, _ in kept["pipe"].named_parameters()]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def keep_built_pipelines(on_build: Callable[[Any, dict], None] | None = None) -> dict:
    """Have this process's trainer keep each pipeline it builds at ``kept["pipe"]`` (the last one built) and call
    ``on_build(pipe, kept)`` right after building it, before any step; returns ``kept``. Patches
    ``conveyor.train.loop.build_pipeline`` for the rest of the process: call it in a rank, never in pytest's process.
    """
    import conveyor.train.loop as loop

    original = loop.build_pipeline
    kept: dict = {}

    def build_and_keep(cfg, model, loss_fn=None):
        pipe = kept["pipe"] = original(cfg, model, loss_fn)
        if on_build is not None:
            on_build(pipe, kept)
        return pipe

    loop.build_pipeline = build_and_keep
    return kept
