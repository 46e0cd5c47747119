"""The simulator: when each action of a schedule starts and ends, on per-stage costs.

:func:`simulate` verifies and times a schedule in one pass of the engine's stepping loop
(:func:`conveyor.schedule.engine.step`), its spans kept as per-rank arrays
(:class:`~conveyor.schedule.timeline.PackedSpans`):

- a compute action starts once its rank is free and what it needs is done,
  and takes ``costs.duration(action)``: looked up once per (kind, stage) for a
  :class:`CostModel`, asked per action for a subclass that overrides ``duration``;
- lowered programs run their SEND/RECV explicitly: a send takes no time, a
  receive ends ``latency`` after its send. In compute-only programs an action
  that needs another rank's output starts ``latency`` after it;
- a schedule straight from ``lower()`` times like its compute-only source
  (``Schedule.lowered_from``), which is stepped instead (a third of the actions);
- where the pass finds the schedule not clean, :func:`verify` words why;
- a pass with all-to-alls (``StageCosts.exchanges``) takes its compute plus its exchanges, each
  drawn as a :class:`~conveyor.schedule.timeline.CommSpan` and counted as exposed; a pair a rank
  runs overlapped (``Schedule.overlapped``) is one event: it starts once both its actions' inputs
  are in and lasts :func:`~conveyor.schedule.overlap.pair_timing`, its interval split between its
  two spans in proportion to their durations alone (so busy time, and the bubble, count it once).
  Only then are actions looked at one by one; other schedules take the engine's fast path.

:func:`step_timed` runs the same loop without the verdict: a schedule that blocks comes back
with its spans so far and where its ranks stopped.

Example:
    >>> import conveyor.schedule as cs
    >>> tl = cs.simulate(cs.build("1f1b", ranks=4, microbatches=8))
    >>> round(tl.bubble_ratio, 3)   # (P-1)/(M+P-1) with F=I=W=1
    0.273
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain, compress, repeat
from operator import gt

from conveyor.errors import CostError
from conveyor.schedule.cost import CostModel
from conveyor.schedule.engine import UNSET, Blocked, Run, blocked_ranks, key_tables, step
from conveyor.schedule.ir import KINDS, NUM_COMPUTE_KINDS, Action, ActionKind, PackedProgram, Schedule
from conveyor.schedule.lower import lower
from conveyor.schedule.overlap import PairTiming, pair_timing
from conveyor.schedule.passes import executable
from conveyor.schedule.timeline import CommSpan, PackedSpans, Span, Timeline, schedule_labels
from conveyor.schedule.verify import check_shape, verify


def simulate(schedule: Schedule, costs: CostModel | None = None, *, time_unit: str = "unit") -> Timeline:
    """Verify ``schedule``, then run it on ``costs`` (unit F=I=W=1, zero latency by default).

    ``time_unit`` names the unit of the costs ("s" for measured seconds).

    Example:
        >>> import conveyor.schedule as cs
        >>> costs = cs.CostModel.uniform(2, forward=1.0, backward_input=2.0, backward_weight=1.0)
        >>> cs.simulate(cs.build("1f1b", ranks=2, microbatches=2), costs).makespan
        12.0
    """
    # One straight from lower() is verified (and timed) through its source; any other Schedule
    # is checked in the pass that times it, verify() words what that pass finds wrong.
    if isinstance(schedule, Schedule) and schedule.lowered_from is None:
        check_shape(schedule)
    else:
        verify(schedule)
    try:
        costs = _checked_costs(schedule, costs)
    except CostError:
        verify(schedule)  # a broken schedule is named before broken costs
        raise
    source = schedule.lowered_from or schedule  # times exactly like it (see lower())
    S, M = source.num_stages, source.num_microbatches
    timings: dict[Action, PairTiming] = {}
    if source.overlapped:
        verify(schedule)
        spans, timings = _paired_spans(source, costs)
    else:
        run = None
        if sum(map(len, source.programs)) >= 2 * S * M:  # else incomplete: no table sized S x M
            took, duration = _durations(costs, S)
            run = step(source, took, costs.latency, duration, record=True)
        if run is None or not run.clean:
            verify(schedule)
            raise AssertionError(f"schedule {schedule.name!r} failed the timed check but verifies")
        spans = packed_spans(source, run)
    comm_spans, exposed = _exchange_spans(spans, costs, timings) if costs.has_exchanges else ((), ())
    title, metadata = schedule_labels(schedule)
    return Timeline(
        schedule.num_ranks,
        spans,
        title=title,
        source="simulated",
        time_unit=time_unit,
        stage_activation_bytes=tuple(s.activation_bytes for s in costs.stages),
        stage_weight_activation_bytes=tuple(s.weight_kept for s in costs.stages),
        metadata=metadata,
        comm_spans=comm_spans,
        exposed_comm=exposed,
    )


def _paired_spans(source: Schedule, costs: CostModel) -> tuple[PackedSpans, dict[Action, PairTiming]]:
    """Step ``source`` (verified) lowered as its pairs run: a pair's forward takes the pair's time, its
    backward none; then each pair's interval is split between its two spans (see the module docstring)."""
    lowered = source if source.is_lowered else lower(source)
    plain = type(costs).duration is CostModel.duration  # then a pair's time depends on kinds and stages only
    timings: dict[Action, PairTiming] = {}
    by_key: dict[tuple, PairTiming] = {}
    for forward, backward in chain.from_iterable(source.overlapped):
        key = (forward.stage, backward.kind, backward.stage)
        timing = by_key.get(key) if plain else None
        if timing is None:
            timing = by_key[key] = pair_timing(costs, forward, backward)
        timings[forward] = timing
    partners = frozenset(backward for _, backward in chain.from_iterable(source.overlapped))

    def duration(action: Action) -> float:
        timing = timings.get(action)
        if timing is not None:
            return timing.duration
        return 0.0 if action in partners else costs.duration(action)

    run = step(lowered, None, costs.latency, duration, record=True)
    if run is None or not run.clean:
        raise AssertionError(f"schedule {source.name!r} verifies but its lowered pairs do not run to the end")
    spans = packed_spans(lowered, run)
    for rank, pairs in enumerate(source.overlapped):
        program, starts, ends = spans.programs[rank], spans.starts[rank], spans.ends[rank]
        position = dict(zip(program.codes, range(len(program.codes))))
        for forward, backward in pairs:
            at = position[program.code_of(forward)]
            alone_forward, alone_backward = costs.duration(forward), costs.duration(backward)
            alone = alone_forward + alone_backward
            share = alone_forward / alone if alone > 0 else 0.0
            ends[at] = starts[at + 1] = starts[at] + (ends[at] - starts[at]) * share
    return spans, timings


def _exchange_spans(spans: PackedSpans, costs: CostModel,
                    timings: dict[Action, PairTiming]) -> tuple[tuple[CommSpan, ...], tuple[float, ...]]:
    """Each rank's all-to-alls and how long its compute waited for them: a pass alone waits for each of its
    exchanges (after each of its first n pieces of compute); a pair as :func:`pair_timing` found."""
    comm: list[CommSpan] = []
    exposed = []
    for rank, program in enumerate(spans.programs):
        starts, ends = spans.starts[rank], spans.ends[rank]
        actions, waited, at = program.actions(), 0.0, 0
        while at < len(actions):
            action, start = actions[at], starts[at]
            timing = timings.get(action)
            if timing is not None:  # a pair (its backward next): its exchanges, from its start
                names = (str(action), str(actions[at + 1]))
                comm += [CommSpan(rank, names[which], start + begin, start + end)
                         for which, begin, end in timing.exchanges]
                waited, at = waited + timing.exposed, at + 2
                continue
            stage = costs.stages[action.stage]
            if action.kind is not ActionKind.W and stage.exchange_time:
                count, exchange = stage.exchanges, stage.exchange
                piece = (ends[at] - start - stage.exchange_time) / (count + 1)
                comm += [CommSpan(rank, str(action), start + (k + 1) * piece + k * exchange,
                                  start + (k + 1) * (piece + exchange)) for k in range(count)]
                waited += stage.exchange_time
            at += 1
        exposed.append(waited)
    return tuple(comm), tuple(exposed)


def _checked_costs(schedule: Schedule, costs: CostModel | None) -> CostModel:
    if costs is None:
        costs = CostModel.uniform(schedule.num_stages)
    if not isinstance(costs, CostModel):
        raise CostError(
            f"simulate() takes costs as a CostModel (e.g. CostModel.uniform(num_stages, 1, 1, 1) or "
            f"CostModel.per_stage([...])), got {type(costs).__name__}"
        )
    costs.check_stages(schedule.num_stages)
    return costs


def _durations(costs: CostModel, S: int) -> tuple[list[float] | None, Callable[[Action], float] | None]:
    """The engine's durations: per (kind, stage) for a CostModel's own ``duration`` (it depends on
    them only), else ``duration`` itself, called per action (a subclass's may depend on more)."""
    if type(costs).duration is CostModel.duration:
        return [costs.duration(Action(kind, s, 0)) for kind in KINDS[:NUM_COMPUTE_KINDS] for s in range(S)], None
    return None, costs.duration


def packed_spans(schedule: Schedule, run: Run) -> PackedSpans:
    """The spans of the compute actions of a recorded :class:`~conveyor.schedule.engine.Run`
    (a lowered program's SEND/RECV take no time and have no span)."""
    if not run.lowered:
        return PackedSpans(schedule.programs, run.starts, run.ends)
    S, M = schedule.num_stages, schedule.num_microbatches
    programs, starts, ends = [], [], []
    for program, rank_starts, rank_ends in zip(schedule.programs, run.starts, run.ends):
        compute = list(map(gt, repeat(NUM_COMPUTE_KINDS * S * M), program.codes[:len(rank_starts)]))
        programs.append(PackedProgram(array("q", compress(program.codes, compute)), S, M, True))
        starts.append(array("d", compress(rank_starts, compute)))
        ends.append(array("d", compress(rank_ends, compute)))
    return PackedSpans(programs, starts, ends)


@dataclass(frozen=True, slots=True)
class TimedRun:
    """What :func:`step_timed` found: a span per compute action run, and the ranks that stopped early."""

    spans: PackedSpans
    blocked: tuple[Blocked, ...]

    @property
    def completed(self) -> bool:
        return not self.blocked


def step_timed(schedule: Schedule, duration: Callable[[Action], float], latency: float = 0.0) -> TimedRun:
    """Step every rank's program with timings: each compute action run gets a :class:`Span`.

    Unlike :func:`simulate` it does not verify first: a schedule that blocks
    comes back with its ``blocked`` ranks (and the spans up to there); a
    malformed one raises the verifier's error. ``duration`` is asked once per
    (kind, stage) where it is a plain :class:`CostModel`'s, else once per action.

    Example:
        >>> import conveyor.schedule as cs
        >>> run = step_timed(cs.build("1f1b", ranks=2, microbatches=2), lambda action: 1.0)
        >>> run.completed, [str(span.action) for span in run.spans if span.rank == 1]
        (True, ['1F0', '1B0', '1F1', '1B1'])
    """
    if sum(map(len, schedule.programs)) < schedule.num_stages * schedule.num_microbatches:
        verify(schedule)  # not every stage can even run forward: say what is missing
    owner = getattr(duration, "__self__", None)
    took, ask = (None, duration)
    if isinstance(owner, CostModel) and getattr(duration, "__func__", None) is CostModel.duration:
        took, ask = _durations(owner, schedule.num_stages)
    run = step(schedule, took, float(latency), ask, record=True)
    if run is None:
        verify(schedule)
        raise AssertionError(f"engine failed on schedule {schedule.name!r}, which verifies")
    return TimedRun(packed_spans(schedule, run), blocked_ranks(schedule, run))


def simulate_shared_cores(schedule: Schedule, costs: CostModel, cores: int) -> Timeline:
    """Time ``schedule``'s executed programs on ``costs`` when its ranks share ``cores`` CPU cores.

    Each rank runs its actions in order once what they need is done (the engine's data flow:
    :func:`~conveyor.schedule.engine.key_tables`, ``costs.latency`` after a producer on another rank ends); the
    ranks computing at a moment share the cores equally (each at ``min(1, cores / running)`` of
    full speed), as the kernel shares them between single-thread processes. With ``cores`` >=
    ranks it times like :func:`simulate`.

    Why a loop of its own rather than the engine's :func:`~conveyor.schedule.engine.step`:
    that loop runs one rank as far as it can before the next, and fixes an action's end when it
    starts (start + duration). Here an action's end depends on how many ranks compute at every
    moment until it finishes, which is known only by advancing every rank together in time
    order: an event loop over the moments an action ends or a waiting one becomes ready.

    Example:
        >>> import conveyor.schedule as cs
        >>> sched = cs.build("gpipe", ranks=2, microbatches=2)
        >>> simulate_shared_cores(sched, CostModel.uniform(2), cores=1).makespan
        12.0
    """
    compute = executable(schedule).compute
    programs = compute.programs
    M = compute.num_microbatches
    # The engine's tables: per (kind, stage), the deltas from a code to its slot, its need and its mark,
    # and the latency of a need produced on another rank (durations are asked per action below).
    tables = key_tables(compute.placement.stage_to_rank, M, [0.0] * (NUM_COMPUTE_KINDS * compute.num_stages),
                        costs.latency)
    codes = [program.codes for program in programs]
    # Per slot, when it was done; the always-done row (what a first-stage forward needs) is done from the start.
    SM = compute.num_stages * M
    done = [UNSET] * (NUM_COMPUTE_KINDS * SM) + [float("-inf")] * M
    num_ranks = compute.num_ranks
    position, free_at = [0] * num_ranks, [0.0] * num_ranks
    running: dict[int, list] = {}  # rank -> [action, work left, start]
    spans: list[Span] = []
    now = 0.0

    def ready_at(rank: int) -> float | None:
        code = codes[rank][position[rank]]
        _, need, _, _, lat = tables[rank][code // M]
        finished = done[code + need]
        if finished == UNSET:
            return None
        return max(free_at[rank], finished + lat)

    while True:
        waiting = {}
        for rank in range(num_ranks):
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
                spans.append(Span(rank, item[0], item[2], later))
                code = codes[rank][position[rank]]
                slot, _, mark, _, _ = tables[rank][code // M]
                done[code + slot] = done[code + mark] = later
                free_at[rank], position[rank] = later, position[rank] + 1
                del running[rank]
        now = later
    if any(p < len(program) for p, program in zip(position, programs)):
        raise AssertionError(f"{schedule.name}: ranks stopped at {position} in the shared-cores timing")
    return Timeline.from_spans(num_ranks, spans, title=f"{schedule_labels(schedule)[0]}, {cores} shared cores",
                               source="simulated", time_unit="s")
