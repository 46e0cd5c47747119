"""What the simulator leaves out of a real step, measured on this machine: the :class:`Calibration`.

The simulator times each compute action by its profiled cost and lets a message arrive
``latency`` after its producer ends. A real step also pays, measured here on the timelines
a real :class:`conveyor.Pipeline` records:

* ``action_s``: what the runtime adds to each compute action (F, I, W or B) over the
  module's own pass timed alone (its bookkeeping, and caches gone cold while the rank waited);
* ``receive_s``: the rank's own time to take a message that has already arrived (the
  runtime's receive span when it did not wait), charged to the action that consumes it: a
  forward whose input comes from another rank, a backward (I or B) whose output gradient does;
* ``latency_s + seconds_per_byte * bytes``: from the end of the producing action to the
  start of the consumer that waited for it, less ``receive_s`` (send, delivery, a sleeping
  receiver's wake-up); the byte term from a second run with 1 MiB messages;
* ``step_s``: the step's wall time outside the compute spans (splitting the minibatch, the
  loss broadcast, the ranks leaving the barrier apart);
* per rank, what runs after the schedule (the optimizer step): ``rank_extra_s`` of
  :func:`conveyor.plan.predict.predict_step`, profiled by the caller.

:func:`calibrate` measures it (a few seconds): two short 1F1B runs of sleeping blocks
(:class:`~conveyor.plan.emulated.Emulated`, whose cost a busy machine hardly changes) on fresh
local ranks (:func:`measure_steps`), read by :func:`calibration_from_timelines`, the pure part.
The planner sits below the pipeline, so it is handed the pipeline class to run
(``conveyor.Pipeline``) rather than importing it. :mod:`conveyor.plan.predict` predicts a step
with the result; ``conveyor plan --calibrate`` and ``python -m benchmarks --plan`` measure one.

Example:
    >>> import conveyor.schedule as cs
    >>> run = cs.simulate(cs.build("1f1b", ranks=2, microbatches=2))
    >>> calibration_from_timelines([run], [9.5]).step_s
    0.5
    >>> # measured: conveyor.plan.plan(model, example, ranks=2, global_batch=16,
    >>> #               machine=conveyor.plan.Machine(calibration=calibrate(conveyor.Pipeline, ranks=2)))
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch
import torch.distributed as dist

import conveyor.schedule as cs
from conveyor.errors import PlanError
from conveyor.options import TransferOptions
from conveyor.plan.emulated import Emulated, Workload
from conveyor.plan.profile import synchronize
from conveyor.processes import RankGroup
from conveyor.schedule.ir import ActionKind
from conveyor.schedule.timeline import Timeline

CALIBRATION_SCHEDULE = "1f1b"
LARGE_MESSAGE_SHAPE = (2048, 128)  # rows x width of float32: 1 MiB per message


@dataclass(frozen=True, slots=True)
class Calibration:
    """Seconds a real step pays beyond the simulator's compute costs (see the module docstring).

    Example:
        >>> round(Calibration(latency_s=2e-4, seconds_per_byte=1e-9).latency(1_000_000), 6)
        0.0012
    """

    action_s: float = 0.0
    receive_s: float = 0.0
    latency_s: float = 0.0
    seconds_per_byte: float = 0.0
    step_s: float = 0.0
    transport: str = ""
    samples: dict = field(default_factory=dict, compare=False)

    def latency(self, message_bytes: float) -> float:
        """Seconds from a producer's end to its consumer's start for a message of ``message_bytes``."""
        return self.latency_s + self.seconds_per_byte * message_bytes

    def as_dict(self) -> dict[str, Any]:
        """The figures, JSON-ready (``samples``: how many measurements each rests on).

        Example:
            >>> Calibration(receive_s=1e-4).as_dict()["receive_s"]
            0.0001
        """
        return asdict(self)


def calibration_of(value: Calibration | dict | None, ranks: int) -> Calibration | None:
    """A :class:`Calibration` from one or from its ``as_dict()``; None stays None.

    Example:
        >>> calibration_of({"receive_s": 1e-4, "transport": "x", "samples": {}}, 2).receive_s
        0.0001
    """
    if value is None or value is False:
        return None
    if value is True:
        # Measuring runs real pipelines, whose class sits above the planner: the caller hands it over.
        raise PlanError(
            f"Machine(calibration=True): the planner does not start pipelines; measure this machine with "
            f"conveyor.plan.calibration.calibrate(conveyor.Pipeline, ranks={ranks}) (a few seconds) and pass the "
            "result as Machine(calibration=...), or its as_dict() from an earlier run (`conveyor plan "
            "--calibrate` does this)")
    if isinstance(value, dict):
        names = {f.name for f in fields(Calibration)}
        return Calibration(**{k: v for k, v in value.items() if k in names})
    return value


def _receive_samples(timeline: Timeline, receives: list[float], waits: list[float]) -> None:
    """Add a receive span's length when the message was there, else producer end -> consumer start."""
    ends = {}  # ("F" or "B", stage, microbatch): when the pass that sends that message ended
    for span in timeline.spans:
        a = span.action
        if a.kind in (ActionKind.F, ActionKind.I, ActionKind.B):
            ends[("F" if a.kind is ActionKind.F else "B", a.stage, a.microbatch)] = span.end
    for rank in range(timeline.num_ranks):
        spans = timeline.spans_of(rank)
        for index, span in enumerate(spans):
            a = span.action
            if a.kind is ActionKind.RECV_F:
                produced = ends.get(("F", a.stage - 1, a.microbatch))
            elif a.kind is ActionKind.RECV_B:
                produced = ends.get(("B", a.stage + 1, a.microbatch))
            else:
                continue
            if produced is None:
                continue
            if span.start >= produced:
                receives.append(span.duration)
                continue
            after = next((s for s in spans[index + 1:] if s.action.kind.is_compute), None)
            if after is not None:
                waits.append(after.start - produced)


def compute_makespan(timeline: Timeline) -> float:
    """First compute start to last compute end (a measured timeline also holds receive waits).

    Example:
        >>> import conveyor.schedule as cs
        >>> compute_makespan(cs.simulate(cs.build("1f1b", ranks=2, microbatches=2)))
        9.0
    """
    compute = [s for s in timeline.spans if s.action.kind.is_compute]
    if not compute:
        return 0.0
    return max(s.end for s in compute) - min(s.start for s in compute)


def calibration_from_timelines(
    timelines: Sequence[Timeline], step_walls_s: Sequence[float], *, transport: str = "",
    alone_s: dict[tuple[str, int], float] | None = None,
) -> Calibration:
    """A :class:`Calibration` (no byte term) from measured steps: medians over every step given.

    ``step_walls_s[i]`` is step i's wall time (the slowest rank's, barrier to return);
    ``alone_s[("F" or "B", stage)]``: each pass timed alone, against which the runtime's
    spans give ``action_s`` (0 without it).

    Example:
        >>> import conveyor.schedule as cs
        >>> run = cs.simulate(cs.build("1f1b", ranks=2, microbatches=2))
        >>> calibration_from_timelines([run], [9.5]).step_s
        0.5
    """
    receives: list[float] = []
    waits: list[float] = []
    for timeline in timelines:
        _receive_samples(timeline, receives, waits)
    receive = statistics.median(receives) if receives else 0.0
    added = [
        span.duration - alone_s[(span.action.kind.name, span.action.stage)]
        for timeline in timelines for span in timeline.spans
        if alone_s and (span.action.kind.name, span.action.stage) in alone_s
    ]
    outside = [wall - compute_makespan(tl) for tl, wall in zip(timelines, step_walls_s)]
    return Calibration(
        action_s=max(0.0, statistics.median(added)) if added else 0.0,
        receive_s=receive,
        latency_s=max(0.0, statistics.median(waits) - receive) if waits else 0.0,
        step_s=max(0.0, statistics.median(outside)) if outside else 0.0,
        transport=transport,
        samples={"actions": len(added), "receives": len(receives), "waits": len(waits), "steps": len(outside)},
    )


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


# -- measuring: calls run on every rank of a conveyor.processes.RankGroup


def _rank_setup(worker, make_pipeline: Callable[..., Any], workload: Workload, microbatches: int,
                transport: str) -> str:
    sched = cs.build(CALIBRATION_SCHEDULE, ranks=worker.world_size, microbatches=microbatches)
    modules = [workload.build_stage(s, sched.num_stages) for s in sched.stages_of(worker.rank)]
    pipe = make_pipeline(modules, schedule=sched, loss_fn=workload.loss_fn,
                         transfer=TransferOptions(transport=transport))
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


def measure_steps(make_pipeline: Callable[..., Any], workload: Workload, *, ranks: int, microbatches: int,
                  steps: int, warmup: int, transport: str = "auto",
                  timeout_s: float = 120.0) -> tuple[list[Timeline], list[float], str]:
    """Run ``workload`` under 1F1B on ``ranks`` fresh ranks: each timed step's timeline and wall time.

    ``make_pipeline(modules, schedule=, loss_fn=, transfer=)`` builds each rank's pipeline
    (``conveyor.Pipeline``; it travels to the ranks pickled, so a class or a module-level function).

    Example:
        >>> import conveyor
        >>> tls, walls, _ = measure_steps(conveyor.Pipeline, Emulated(2), ranks=2, microbatches=2,
        ...                               steps=1, warmup=0)  # doctest: +SKIP
    """
    timelines, walls = [], []
    with RankGroup(ranks, timeout_s=timeout_s) as group:
        transport_name = group.call(_rank_setup, make_pipeline, workload, microbatches, transport)[0]
        for index in range(warmup + steps):
            wall = max(group.call(_rank_step))
            timeline = group.call(_rank_timeline)[0]
            if index >= warmup:
                timelines.append(timeline)
                walls.append(wall)
        group.call(_rank_close)
    return timelines, walls, transport_name


def calibrate(make_pipeline: Callable[..., Any], *, ranks: int = 2, microbatches: int = 8, steps: int = 6,
              warmup: int = 2, sleep_ms: float = 2.0, transport: str = "auto",
              timeout_s: float = 120.0) -> Calibration:
    """Measure this machine's :class:`Calibration` on ``ranks`` ranks (a few seconds), running
    pipelines built by ``make_pipeline`` (``conveyor.Pipeline``, see :func:`measure_steps`).

    Two 1F1B runs of blocks that sleep ``sleep_ms`` per pass: tiny messages (receive,
    latency, the step's own time), then 1 MiB messages (the seconds per byte). Sleeping
    blocks leave the cores to the runtime, so the figures are its own.

    Example:
        >>> import conveyor
        >>> calibrate(conveyor.Pipeline, ranks=2).latency_s < 0.01   # doctest: +SKIP
        True
        >>> # then: conveyor.plan.plan(model, example, ranks=2, global_batch=16,
        >>> #                               machine=conveyor.plan.Machine(calibration=that))
    """
    def run(width: int, rows: int) -> tuple[Calibration, float]:
        workload = Emulated(ranks, sleep_ms, sleep_ms, sleep_ms, blocks_per_rank=1,
                            width=width, rows_per_microbatch=rows)
        alone = passes_alone(workload, ranks)
        timelines, walls, name = measure_steps(make_pipeline, workload, ranks=ranks, microbatches=microbatches,
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
