"""A pipeline's lifetime and failure on a rank: its own groups, its peers' health, aborts, where everyone is.

What it holds: :class:`~conveyor.runtime.lifecycle.rank.RankLifecycle` (groups, agreement,
failure and close), what the store says of the peers (:mod:`~conveyor.runtime.lifecycle.peers`),
aborting communicators together, every rank's position on request, and the static check of
what could block a rank's host in a first step.

What it may import: torch, :mod:`conveyor.errors`, the schedule layer's program and posts. It is
the bottom of the runtime: never :mod:`conveyor.runtime.stage` nor :mod:`conveyor.runtime.transport`.
It holds a transport only as the object it was handed (``attach``) and calls the contract's
``publish_failure``, ``finish_sends`` and ``close`` on it (``tests/test_layers.py`` keeps that true).
"""
