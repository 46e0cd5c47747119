"""Each stage's pass costs, measured in one plain single-thread process: the ideal's input.

:class:`StageCostProbe` times each stage's F, I and full backward in one plain
process; the ideal step time of a schedule is conveyor's simulator run on those
costs, so the blocks' own Python and autograd cost is inside the ideal.

Example:
    >>> from conveyor.testing.models import Emulated
    >>> wl = Emulated(num_ranks=2, forward_ms=1, input_grad_ms=1, weight_grad_ms=1)
    >>> costs = measure_stage_costs(wl, 2, repeats=1, warmup=0)
    >>> len(costs.forward_ms), costs.backward_input_ms[0]
    (2, 0.0)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from benchmarks.libraries import build_blocks
from conveyor.testing.models.workloads import Workload


@dataclass(frozen=True, slots=True)
class MeasuredCosts:
    """Milliseconds per microbatch of each stage's passes, measured in one process.

    ``backward_weight_ms`` is full backward minus input backward: the weight part a
    runtime that walks the graph once would pay. A stage whose input takes no
    gradient (stage 0) has ``backward_input_ms == 0``: nothing waits on it, so all
    of its backward counts as deferrable weight work.
    """

    forward_ms: tuple[float, ...]
    backward_input_ms: tuple[float, ...]
    backward_ms: tuple[float, ...]

    @property
    def backward_weight_ms(self) -> tuple[float, ...]:
        return tuple(max(b - i, 0.0) for b, i in zip(self.backward_ms, self.backward_input_ms))

    def as_rows(self) -> list[tuple[float, float, float]]:
        """``(forward, backward_input, backward_weight)`` per stage, for ``CostModel.per_stage``."""
        return list(zip(self.forward_ms, self.backward_input_ms, self.backward_weight_ms))


def _as_args(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _detach_inputs(value) -> tuple[torch.Tensor, ...]:
    out = []
    for t in _as_args(value):
        t = t.detach()
        if t.is_floating_point():
            t.requires_grad_(True)
        out.append(t)
    return tuple(out)


_SAMPLE_SPAN_MS = 5.0  # a stage's passes are timed until they add up to this much
_SAMPLE_MAX_RUNS = 64


class StageCostProbe:
    """Every stage of a cut model, ready to time its passes on one microbatch in this process.

    Stage ``s`` is fed the output of stage ``s - 1`` (computed once, detached,
    requiring grad); the last stage includes the loss in its forward. Each
    :meth:`sample` runs every stage's F, I and full backward once, stage after
    stage, so one sample sees the moment it is taken, as one pipeline step does.

    Example:
        >>> from conveyor.testing.models import Emulated
        >>> wl = Emulated(num_ranks=2, forward_ms=1, input_grad_ms=1, weight_grad_ms=1)
        >>> costs = StageCostProbe(wl, 2).sample()
        >>> len(costs.forward_ms), costs.backward_input_ms[0]
        (2, 0.0)
    """

    def __init__(self, workload: Workload, num_stages: int, *, split: tuple[int, ...] | None = None,
                 microbatch_rows: int | None = None) -> None:
        # ``split`` (blocks per stage) and ``microbatch_rows`` probe a plan's own cut and microbatch.
        rows = workload.rows_per_microbatch if microbatch_rows is None else microbatch_rows
        x, target = workload.batch(-(-rows // workload.rows_per_microbatch))
        x, self.target = x[:rows], target[:rows]
        self.loss_fn = workload.loss_fn
        self.num_stages = num_stages
        self.modules: list[nn.Module] = []
        self.inputs: list[tuple] = []
        stage_input: tuple = (x,)
        for stage in range(num_stages):
            module = (workload.build_stage(stage, num_stages) if split is None
                      else build_blocks(workload, stage, split))
            inputs = stage_input if stage == 0 else _detach_inputs(stage_input)
            self.modules.append(module)
            self.inputs.append(inputs)
            with torch.no_grad():
                stage_input = _as_args(module(*inputs))

    def _forward(self, stage: int) -> tuple:
        out = self.modules[stage](*self.inputs[stage])
        return _as_args(self.loss_fn(out, self.target) if stage == self.num_stages - 1 else out)

    def sample(self) -> MeasuredCosts:
        """Each stage's F, I and full backward (ms), as one pipeline step would meet them.

        A stage whose three passes together take at least ``_SAMPLE_SPAN_MS`` is timed
        once. Passes of microseconds (the overhead workload) are timed again and again,
        up to that span, and averaged: one timer tick or one late wake-up would otherwise
        stand for every microbatch of the simulated step.
        """
        forward_ms, input_ms, backward_ms = [], [], []
        for stage in range(self.num_stages):
            runs = []
            while not runs or (sum(sum(r) for r in runs) < _SAMPLE_SPAN_MS and len(runs) < _SAMPLE_MAX_RUNS):
                runs.append(self._time_passes(stage))
            forward_ms.append(sum(r[0] for r in runs) / len(runs))
            input_ms.append(sum(r[1] for r in runs) / len(runs))
            backward_ms.append(sum(r[2] for r in runs) / len(runs))
        return MeasuredCosts(tuple(forward_ms), tuple(input_ms), tuple(backward_ms))

    def _time_passes(self, stage: int) -> tuple[float, float, float]:
        module = self.modules[stage]
        grad_inputs = [t for t in self.inputs[stage] if t.requires_grad]
        start = time.perf_counter()
        outs = self._forward(stage)
        forward = time.perf_counter() - start
        grads = tuple(torch.ones_like(o) for o in outs)
        backward_input = 0.0
        if grad_inputs:
            start = time.perf_counter()
            torch.autograd.grad(outs, grad_inputs, grads, retain_graph=False)
            backward_input = time.perf_counter() - start
            # I freed the graph; the full backward is timed on a fresh forward (untimed).
            outs = self._forward(stage)
        start = time.perf_counter()
        torch.autograd.backward(outs, grads)
        backward = time.perf_counter() - start
        module.zero_grad(set_to_none=True)
        for t in grad_inputs:
            t.grad = None
        return forward * 1e3, backward_input * 1e3, backward * 1e3


def per_pass(
    samples: list[MeasuredCosts], statistic: Callable[[list[float]], float]
) -> MeasuredCosts:
    """``statistic`` (``min``, ``statistics.median``) of each pass of each stage over ``samples``.

    Example:
        >>> a = MeasuredCosts((1.0,), (0.0,), (3.0,))
        >>> per_pass([a, MeasuredCosts((2.0,), (0.0,), (2.0,))], min)
        MeasuredCosts(forward_ms=(1.0,), backward_input_ms=(0.0,), backward_ms=(2.0,))
    """
    if not samples:
        raise ValueError("per_pass needs at least one sample, got none")

    def each(field: str) -> tuple[float, ...]:
        columns = zip(*(getattr(s, field) for s in samples))
        return tuple(statistic(list(values)) for values in columns)

    return MeasuredCosts(each("forward_ms"), each("backward_input_ms"), each("backward_ms"))


def measure_stage_costs(
    workload: Workload, num_stages: int, *, repeats: int = 5, warmup: int = 1
) -> MeasuredCosts:
    """F, I and full B of every stage on one microbatch, each the fastest of ``repeats`` samples.

    Other work on the machine only ever adds time (a sleeping block wakes late
    when the cores are busy), so the minimum estimates the blocks' own cost; it
    is biased low against step times taken as medians on a noisy machine, which
    is why compare.py reports it only as ``ideal_fastest_ms``.

    Example:
        >>> from conveyor.testing.models import Emulated
        >>> wl = Emulated(num_ranks=2, forward_ms=1, input_grad_ms=1, weight_grad_ms=1)
        >>> costs = measure_stage_costs(wl, 2, repeats=1, warmup=0)
        >>> len(costs.forward_ms), costs.backward_input_ms[0]
        (2, 0.0)
    """
    probe = StageCostProbe(workload, num_stages)
    for _ in range(warmup):
        probe.sample()
    return per_pass([probe.sample() for _ in range(repeats)], min)
