"""What the simulator leaves out of a real step, measured on this machine, and a step predicted with it.

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
  :func:`predict_step`, profiled by the caller.

:func:`conveyor.calibration.calibrate` runs the measurement (a few seconds: two short runs of
sleeping blocks, whose cost a busy machine hardly changes; it starts real pipelines, so it
lives above this layer); :func:`calibration_from_timelines` is the pure part;
:func:`predict_step` simulates a plan with it.

Example:
    >>> import conveyor.schedule as cs
    >>> sched = cs.build("1f1b", ranks=2, microbatches=4)
    >>> costs = cs.CostModel.uniform(2, 0.010, 0.010, 0.010)
    >>> cal = Calibration(receive_s=1e-4, latency_s=3e-4, step_s=1e-3)
    >>> round(predict_step(sched, costs, cal).step_s, 4)
    0.1527
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import conveyor.schedule as cs
from conveyor.schedule.cost import CostModel, StageCosts
from conveyor.schedule.ir import ActionKind, Schedule
from conveyor.schedule.timeline import Span, Timeline

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
        return {
            "action_s": self.action_s, "receive_s": self.receive_s, "latency_s": self.latency_s,
            "seconds_per_byte": self.seconds_per_byte, "step_s": self.step_s,
            "transport": self.transport, "samples": dict(self.samples),
        }


@dataclass(frozen=True)
class Prediction:
    """A plan's predicted step: ``step_s = makespan_s + step_s of the calibration + the ranks' extra``.

    The ranks' extra is the longest ``rank_extra_s``, or their sum over the cores when they share fewer.
    """

    step_s: float
    makespan_s: float
    timeline: Timeline
    rank_extra_s: tuple[float, ...]


def with_overheads(schedule: Schedule, costs: CostModel, calibration: Calibration) -> CostModel:
    """``costs`` with what the runtime adds: ``action_s`` per compute action, ``receive_s`` per message taken.

    Every forward and input gradient gets ``action_s``; a weight gradient too on a stage whose W
    runs on its own in ``schedule``'s executed programs (elsewhere I + W run as one B, one action).
    ``receive_s`` goes to a forward of stage s > 0 whose stage s - 1 runs on another rank, and
    to an input gradient (so a full backward) of stage s < S - 1 whose stage s + 1 does.

    Example:
        >>> import conveyor.schedule as cs
        >>> sched = cs.build("1f1b", ranks=2, microbatches=2)
        >>> model = with_overheads(sched, CostModel.uniform(2), Calibration(action_s=0.25, receive_s=0.5))
        >>> [(s.forward, s.backward_input, s.backward_weight) for s in model.stages]
        [(1.25, 1.75, 1.0), (1.75, 1.25, 1.0)]
    """
    compute = cs.executable(schedule).compute
    split = {a.stage for program in compute.programs for a in program if a.kind is ActionKind.W}
    rank_of = schedule.placement.rank_of
    last = len(costs.stages) - 1
    act, receive = calibration.action_s, calibration.receive_s
    stages = []
    for stage, c in enumerate(costs.stages):
        takes_input = stage > 0 and rank_of(stage - 1) != rank_of(stage)
        takes_grad = stage < last and rank_of(stage + 1) != rank_of(stage)
        stages.append(replace(
            c,
            forward=c.forward + act + (receive if takes_input else 0.0),
            backward_input=c.backward_input + act + (receive if takes_grad else 0.0),
            backward_weight=c.backward_weight + (act if stage in split else 0.0),
        ))
    return CostModel(tuple(stages), costs.latency)


def predict_step(
    schedule: Schedule,
    costs: CostModel | Sequence[StageCosts | Sequence[float]],
    calibration: Calibration,
    *,
    message_bytes: float = 0.0,
    rank_extra_s: Sequence[float] = (),
    cores: int | None = None,
) -> Prediction:
    """The step time of ``schedule`` on per-stage ``costs`` (seconds) on the calibrated machine.

    What is simulated is what the ranks run (:func:`conveyor.schedule.executable`), with
    :func:`with_overheads` costs and ``calibration.latency(message_bytes)`` per message;
    ``rank_extra_s`` is each rank's time after the schedule (its optimizer step). ``cores``:
    CPU cores the ranks share when fewer than the ranks and the stages compute on the CPU
    (:func:`shared_cores_timeline`); None: one device per rank.

    Example:
        >>> import conveyor.schedule as cs
        >>> sched = cs.build("gpipe", ranks=2, microbatches=2)
        >>> p = predict_step(sched, [(0.01, 0.01, 0.01)] * 2, Calibration(), rank_extra_s=[0.002, 0.001])
        >>> round(p.makespan_s, 3), round(p.step_s, 3)
        (0.09, 0.092)
    """
    model = costs if isinstance(costs, CostModel) else CostModel.per_stage(costs)
    model = replace(with_overheads(schedule, model, calibration), latency=calibration.latency(message_bytes))
    if cores is not None and cores < schedule.num_ranks:
        timeline = shared_cores_timeline(schedule, model, cores)
    else:
        timeline = cs.simulate(cs.executable(schedule).compute, model, time_unit="s")
    extra = tuple(float(x) for x in rank_extra_s)
    after = max(extra, default=0.0)
    if cores is not None and cores < len(extra):
        after = max(after, sum(extra) / cores)  # every rank steps its optimizer at once
    step = timeline.makespan + calibration.step_s + after
    return Prediction(step, timeline.makespan, timeline, extra)


_KEYS = {ActionKind.F: ("F",), ActionKind.I: ("I", "B"), ActionKind.B: ("B",), ActionKind.W: ("W",)}


def _needs(action, last: int) -> list[tuple[str, int, int]]:
    """What a compute action waits for, by (kind, stage, microbatch): the data flow of a step."""
    s, m = action.stage, action.microbatch
    if action.kind is ActionKind.F:
        return [("F", s - 1, m)] if s > 0 else []
    if action.kind is ActionKind.W:
        return [("I", s, m)]
    return [("F", s, m)] + ([("B", s + 1, m)] if s < last else [])


def shared_cores_timeline(schedule: Schedule, costs: CostModel, cores: int) -> Timeline:
    """Time ``schedule``'s executed programs on ``costs`` when its ranks share ``cores`` CPU cores.

    Each rank runs its actions in order once their inputs are there (``costs.latency`` after a
    producer on another rank ends); the ranks computing at a moment share the cores equally
    (each at ``min(1, cores / running)`` of full speed), as the kernel shares them between
    single-thread processes. With ``cores`` >= ranks it times like :func:`conveyor.schedule.simulate`.

    Example:
        >>> import conveyor.schedule as cs
        >>> sched = cs.build("gpipe", ranks=2, microbatches=2)
        >>> shared_cores_timeline(sched, CostModel.uniform(2), cores=1).makespan
        12.0
    """
    compute = cs.executable(schedule).compute
    programs, rank_of, last = compute.programs, compute.placement.rank_of, compute.num_stages - 1
    done: dict[tuple[str, int, int], float] = {}
    position, free_at = [0] * compute.num_ranks, [0.0] * compute.num_ranks
    running: dict[int, list] = {}  # rank -> [action, work left, start]
    spans: list[Span] = []
    now = 0.0

    def ready_at(rank: int) -> float | None:
        action = programs[rank][position[rank]]
        times = [free_at[rank]]
        for need in _needs(action, last):
            if need not in done:
                return None
            times.append(done[need] + (costs.latency if rank_of(need[1]) != rank else 0.0))
        return max(times)

    while True:
        waiting = {}
        for rank in range(compute.num_ranks):
            if rank not in running and position[rank] < len(programs[rank]):
                when = ready_at(rank)
                if when is not None and when <= now:
                    action = programs[rank][position[rank]]
                    running[rank] = [action, costs.duration(action), now]
                elif when is not None:
                    waiting[rank] = when
        if not running and not waiting:
            break
        rate = min(1.0, cores / len(running)) if running else 1.0
        finish = now + min(left for _, left, _ in running.values()) / rate if running else float("inf")
        later = min(finish, min(waiting.values(), default=float("inf")))
        for rank, item in list(running.items()):
            item[1] -= (later - now) * rate
            if item[1] <= 1e-12 * max(1.0, later):
                action = item[0]
                spans.append(Span(rank, action, item[2], later))
                for kind in _KEYS[action.kind]:
                    done[(kind, action.stage, action.microbatch)] = later
                free_at[rank], position[rank] = later, position[rank] + 1
                del running[rank]
        now = later
    if any(p < len(program) for p, program in zip(position, programs)):
        raise AssertionError(f"{schedule.name}: ranks stopped at {position} in the shared-cores timing")
    return Timeline.from_spans(compute.num_ranks, spans, title=(f"{schedule.name} P={schedule.num_ranks} V={schedule.virtual} "
                                      f"M={schedule.num_microbatches}, {cores} shared cores"),
                               source="simulated", time_unit="s")


def _producer_ends(timeline: Timeline) -> dict[tuple[str, int, int], float]:
    ends = {}
    for span in timeline.spans:
        kind, a = span.action.kind, span.action
        if kind is ActionKind.F:
            ends[("F", a.stage, a.microbatch)] = span.end
        elif kind is ActionKind.I or kind is ActionKind.B:
            ends[("B", a.stage, a.microbatch)] = span.end
    return ends


def _receive_samples(timeline: Timeline, receives: list[float], waits: list[float]) -> None:
    """Add a receive span's length when the message was there, else producer end -> consumer start."""
    ends = _producer_ends(timeline)
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


def split_backward_seconds(roots: Sequence[Any], root_grads: Sequence[Any], inputs: Sequence[Any],
                           params: Sequence[Any], analyses: Any = None) -> tuple[float, float]:
    """Seconds of conveyor's input-gradient pass (I) then weight-gradient pass (W) on one graph.

    What the runtime runs where a schedule splits a backward (``conveyor.runtime.backward``):
    I walks the graph and keeps the gradients at the weights' frontier, W re-enters there once
    per group of weights, so I + W costs more than one full backward (a small GPT stage: 5.7 +
    5.4 ms against 9.3 ms). Profile I and W this way for a split schedule; pass the same
    ``analyses`` (a ``GraphAnalysisCache``) for every microbatch of a stage, as the runtime does.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(4, 4)
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> i, w = split_backward_seconds([lin(x)], [torch.ones(2, 4)], [x], list(lin.parameters()))
        >>> i > 0 and w > 0 and lin.weight.grad is not None
        True
    """
    from conveyor.runtime.backward import backward_input

    start = time.perf_counter()
    pending = backward_input(roots, root_grads, inputs, params, analyses)
    middle = time.perf_counter()
    pending.backward_weight()
    return middle - start, time.perf_counter() - middle
