"""Running a stage on a rank: forward, backward and its I / W split, and what wraps them.

What it holds: the runner (:mod:`~conveyor.runtime.stage.runner`), the backward split, mixed
precision and fp32 gradient accumulation, recomputation, ``torch.compile``, the random
streams, activation memory, the stage device and the timing of actions.

What it may import: torch, :mod:`conveyor.errors`, :mod:`conveyor.options` (the stage record),
the schedule layer's timeline. Never :mod:`conveyor.runtime.transport` or
:mod:`conveyor.runtime.lifecycle`: a stage computes on tensors it is handed and does not know
how they came or whether its peers live (``tests/test_layers.py`` keeps that true).
"""
