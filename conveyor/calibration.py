"""This machine's :class:`~conveyor.plan.calibrate.Calibration`, measured on real pipelines.

The planner (:mod:`conveyor.plan`) sits below :class:`~conveyor.Pipeline`: it predicts a step
from a calibration but starts no ranks. This module, at the pipeline's level, measures one:
:func:`calibrate` runs two short 1F1B steps of sleeping blocks on fresh local ranks
(:func:`measure_steps`) and reads what the runtime added from their timelines
(:func:`conveyor.plan.calibrate.calibration_from_timelines`). ``conveyor plan --calibrate``
and ``python -m benchmarks --plan`` call it.

Example::

    from conveyor.calibration import calibrate
    chosen = conveyor.plan.plan(model, example, ranks=2, global_batch=16, calibration=calibrate(ranks=2))
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

import conveyor.schedule as cs
from conveyor.frontend.profile import synchronize
from conveyor.options import TransferOptions
from conveyor.pipe import Pipeline
from conveyor.plan.calibrate import (
    CALIBRATION_SCHEDULE,
    LARGE_MESSAGE_SHAPE,
    Calibration,
    calibration_from_timelines,
)
from conveyor.plan.emulated import Emulated, Workload
from conveyor.ranks import RankGroup
from conveyor.schedule.timeline import Timeline


def passes_alone(workload: Workload, num_stages: int, repeats: int = 5) -> dict[tuple[str, int], float]:
    """Each stage's forward (with the loss on the last) and full backward, timed alone in this process.

    The median of ``repeats`` runs after one warm-up; stage s is fed stage s - 1's output.

    Example:
        >>> from conveyor.plan.emulated import Emulated
        >>> alone = passes_alone(Emulated(2, 1.0, 1.0, 1.0), 2, repeats=1)
        >>> sorted(alone), alone[("F", 0)] > 0.001
        ([('B', 0), ('B', 1), ('F', 0), ('F', 1)], True)
    """
    x, target = workload.batch(1)
    out: dict[tuple[str, int], float] = {}
    for stage in range(num_stages):
        module = workload.build_stage(stage, num_stages)
        last = stage == num_stages - 1
        forward, backward = [], []
        device = x.device
        for _ in range(repeats + 1):
            # On a GPU the host only queues the passes: each clock reads after the device caught up.
            synchronize(device)
            start = time.perf_counter()
            y = module(x)
            loss = workload.loss_fn(y, target) if last else y
            synchronize(device)
            middle = time.perf_counter()
            loss.backward(torch.ones_like(loss))
            synchronize(device)
            forward.append(middle - start)
            backward.append(time.perf_counter() - middle)
        out[("F", stage)] = statistics.median(forward[1:])
        out[("B", stage)] = statistics.median(backward[1:])
        x = y.detach().requires_grad_(True)
    return out


# calls run on every rank of a conveyor.ranks.RankGroup


def _rank_setup(worker, workload, microbatches: int, transport: str) -> str:
    sched = cs.build(CALIBRATION_SCHEDULE, ranks=worker.world_size, microbatches=microbatches)
    modules = [workload.build_stage(s, sched.num_stages) for s in sched.stages_of(worker.rank)]
    pipe = Pipeline(modules, schedule=sched, loss_fn=workload.loss_fn, transfer=TransferOptions(transport=transport))
    worker.state.update(pipe=pipe, batch=workload.batch(microbatches))
    return type(pipe.ranks.transport).__name__


def _rank_step(worker) -> float:
    pipe = worker.state["pipe"]
    x, y = worker.state["batch"]
    synchronize(pipe.device)  # on a GPU: nothing of an earlier step still queued
    dist.barrier()
    start = time.perf_counter()
    pipe.step(x if pipe.needs_inputs else None, target=y if pipe.needs_target else None)
    synchronize(pipe.device)  # the step's queued work is part of its time
    return time.perf_counter() - start


def _rank_timeline(worker) -> Timeline:
    return worker.state["pipe"].timeline()


def _rank_close(worker) -> None:
    worker.state.pop("pipe").close()


def measure_steps(workload: Workload, *, ranks: int, microbatches: int, steps: int, warmup: int,
                  transport: str = "auto", timeout_s: float = 120.0) -> tuple[list[Timeline], list[float], str]:
    """Run ``workload`` under 1F1B on ``ranks`` fresh ranks: each timed step's timeline and wall time.

    Example:
        >>> from conveyor.plan.emulated import Emulated
        >>> tls, walls, _ = measure_steps(Emulated(2), ranks=2, microbatches=2, steps=1, warmup=0)  # doctest: +SKIP
    """
    timelines, walls = [], []
    with RankGroup(ranks, timeout_s=timeout_s) as group:
        transport_name = group.call(_rank_setup, workload, microbatches, transport)[0]
        for index in range(warmup + steps):
            wall = max(group.call(_rank_step))
            timeline = group.call(_rank_timeline)[0]
            if index >= warmup:
                timelines.append(timeline)
                walls.append(wall)
        group.call(_rank_close)
    return timelines, walls, transport_name


def calibrate(*, ranks: int = 2, microbatches: int = 8, steps: int = 6, warmup: int = 2,
              sleep_ms: float = 2.0, transport: str = "auto", timeout_s: float = 120.0) -> Calibration:
    """Measure this machine's :class:`Calibration` on ``ranks`` ranks (a few seconds).

    Two 1F1B runs of blocks that sleep ``sleep_ms`` per pass: tiny messages (receive,
    latency, the step's own time), then 1 MiB messages (the seconds per byte). Sleeping
    blocks leave the cores to the runtime, so the figures are its own.

    Example:
        >>> calibrate(ranks=2).latency_s < 0.01   # doctest: +SKIP
        True
        >>> # then: conveyor.plan.plan(model, example, ranks=2, global_batch=16, calibration=that)
    """
    def run(width: int, rows: int) -> tuple[Calibration, float]:
        workload = Emulated(ranks, sleep_ms, sleep_ms, sleep_ms, blocks_per_rank=1,
                            width=width, rows_per_microbatch=rows)
        alone = passes_alone(workload, ranks)
        timelines, walls, name = measure_steps(workload, ranks=ranks, microbatches=microbatches,
                                               steps=steps, warmup=warmup, transport=transport,
                                               timeout_s=timeout_s)
        return calibration_from_timelines(timelines, walls, transport=name, alone_s=alone), 4.0 * rows * width

    small, small_bytes = run(16, 4)
    rows, width = LARGE_MESSAGE_SHAPE
    large, large_bytes = run(width, rows)
    per_byte = (large.latency_s + large.receive_s - small.latency_s - small.receive_s) / (large_bytes - small_bytes)
    latency = max(0.0, small.latency_s - max(0.0, per_byte) * small_bytes)
    return replace(small, latency_s=latency, seconds_per_byte=max(0.0, per_byte),
                   samples={**small.samples, "large_waits": large.samples["waits"]})
