"""The simulator: when each action of a schedule starts and ends, on per-stage costs.

:func:`simulate` verifies and times a packed compute-only schedule (or the one a
lowered schedule came from, ``Schedule.lowered_from``) in one pass of :mod:`conveyor.schedule.fast`, its
spans kept as per-rank arrays (:class:`~conveyor.schedule.timeline.PackedSpans`).
Any other schedule it verifies, then times with :func:`step_timed`, which runs
the engine's stepping loop (:mod:`conveyor.schedule.engine`) with
rows that carry each action's duration:

- a compute action starts once its rank is free and what it needs is done,
  and takes ``duration(action)`` (looked up once per (kind, stage) for a
  :class:`CostModel`);
- lowered programs run their SEND/RECV explicitly: a send takes no time, a
  receive ends ``latency`` after its send. In compute-only programs an action
  that needs another rank's output starts ``latency`` after it. Each code then
  has a second slot, ``size`` further on, holding when it reaches another rank;
- a schedule straight from ``lower()`` times like its compute-only source,
  which is stepped instead (fewer actions);
- spans come out per rank in time order, built in bulk.

Example:
    >>> import conveyor.schedule as cs
    >>> tl = cs.simulate(cs.build("1f1b", ranks=4, microbatches=8))
    >>> round(tl.bubble_ratio, 3)   # (P-1)/(M+P-1) with F=I=W=1
    0.273
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat

from conveyor.errors import CostError, UnknownAction
from conveyor.schedule.cost import CostModel
from conveyor.schedule.engine import (
    ASK_DURATION,
    COMM_KIND_IDS,
    Blocked,
    CodeSpace,
    Row,
    blocked_ranks,
    checked_pass,
    step_schedule,
)
from conveyor.schedule.fast import fast_eligible, step_packed
from conveyor.schedule.ir import KINDS, NUM_COMPUTE_KINDS, Action, ActionKind, Schedule, gc_paused
from conveyor.schedule.passes import executable
from conveyor.schedule.timeline import PackedSpans, Span, Timeline
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
    unverified = isinstance(schedule, Schedule) and schedule.lowered_from is None
    if unverified:
        check_shape(schedule)
    else:
        verify(schedule)
    try:
        costs = _checked_costs(schedule, costs)
    except CostError:
        verify(schedule)  # a broken schedule is named before broken costs
        raise
    source = schedule.lowered_from or schedule  # times exactly like it (see lower())
    if fast_eligible(source) and type(costs).duration is CostModel.duration:
        spans = _simulate_packed(schedule, source, costs)
    else:
        spans = _simulate_stepped(schedule, costs, unverified)
    return Timeline(
        schedule.num_ranks,
        spans,
        title=f"{schedule.name} P={schedule.num_ranks} V={schedule.virtual} M={schedule.num_microbatches}",
        source="simulated",
        time_unit=time_unit,
        stage_activation_bytes=tuple(s.activation_bytes for s in costs.stages),
        stage_weight_activation_bytes=tuple(s.weight_kept for s in costs.stages),
        metadata={
            "schedule": schedule.name,
            "ranks": schedule.num_ranks,
            "virtual": schedule.virtual,
            "microbatches": schedule.num_microbatches,
        },
    )


def _simulate_packed(schedule: Schedule, source: Schedule, costs: CostModel) -> PackedSpans:
    """Verify and time a packed compute-only schedule (or the one ``schedule`` was lowered from) in one pass."""
    S = source.num_stages
    took = [costs.duration(Action(kind, s, 0)) for kind in KINDS[:NUM_COMPUTE_KINDS] for s in range(S)]
    run = step_packed(source, took, costs.latency)
    if run is None:
        verify(schedule)
        raise AssertionError(f"schedule {schedule.name!r} failed the timed check but verifies")
    return PackedSpans(source.programs, run.starts, run.ends)


def _simulate_stepped(schedule: Schedule, costs: CostModel, unverified: bool) -> tuple[Span, ...]:
    """Time any other schedule with the engine (lowered by hand, or a CostModel of the user's)."""
    if unverified and not costs.latency:
        # Without latency the timed pass can check everything verify() checks: one pass, not two.
        result = _step_timed_and_checked(schedule, costs.duration)
        if result is None:
            verify(schedule)
            raise AssertionError(f"schedule {schedule.name!r} failed the timed check but verifies")
    else:
        if unverified:
            verify(schedule)  # (one from lower() was verified through its source already)
        # A schedule straight from lower() times exactly like its compute-only source (a receive
        # ends `latency` after the send that follows its producer), which steps ~40% faster.
        result = step_timed(schedule.lowered_from or schedule, costs.duration, costs.latency)
    assert result.completed, "verify() passed but the engine blocked"
    # The engine lists each rank's spans in time order already; a global sort would be
    # about 40% of the simulation at P=64, M=1024 and nothing reads spans in that order.
    return tuple(result.spans)


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


@dataclass(frozen=True, slots=True)
class TimedRun:
    """What :func:`step_timed` found: a span per compute action run, and the ranks that stopped early."""

    spans: tuple[Span, ...]
    blocked: tuple[Blocked, ...]

    @property
    def completed(self) -> bool:
        return not self.blocked


def step_timed(schedule: Schedule, duration: Callable[[Action], float], latency: float = 0.0) -> TimedRun:
    """Step every rank's program with timings: each compute action run gets a :class:`Span`.

    Unlike :func:`simulate` it does not verify first: a schedule that blocks
    comes back with its ``blocked`` ranks (and the spans up to there); a
    malformed one raises the verifier's error.

    Example:
        >>> import conveyor.schedule as cs
        >>> run = step_timed(cs.build("1f1b", ranks=2, microbatches=2), lambda action: 1.0)
        >>> run.completed, [str(span.action) for span in run.spans if span.rank == 1]
        (True, ['1F0', '1B0', '1F1', '1B1'])
    """
    space = CodeSpace.of(schedule)
    if sum(map(len, schedule.programs)) < space.region_size:
        verify(schedule)  # not every stage can even run forward: say what is missing, not size tables by S x M
    latency = float(latency)
    # With latency, every code has a second, "remote" slot finished `latency` later: an action
    # whose need comes from another rank reads that slot, so the loop has no branch for it.
    copy_offset = space.size if latency else 0
    took_of = _duration_table(duration)

    def make_row(kind: ActionKind, stage: int, base: int, need_delta: int, need_is_remote: bool) -> Row:
        return Row(base, need_delta + (copy_offset if need_is_remote else 0), took_of(kind, stage), copy_offset)

    try:
        with gc_paused():
            progress = step_schedule(schedule, space, make_row, 2 if latency else 1, 0, latency, duration)
    except (AttributeError, TypeError, IndexError, UnknownAction) as error:
        verify(schedule)
        raise AssertionError(f"engine failed on a schedule that verifies: {error!r}") from error
    with gc_paused():
        spans = _spans(schedule.programs, progress.starts, progress.ends)
    return TimedRun(spans, blocked_ranks(schedule, space, progress))


def _step_timed_and_checked(schedule: Schedule, duration: Callable[[Action], float]) -> TimedRun | None:
    """:func:`step_timed` without latency, through the verifier's checks: None if the schedule is not clean."""
    took_of = _duration_table(duration)

    def make_row(kind: ActionKind, stage: int, base: int, need_delta: int, need_is_remote: bool) -> Row:
        return Row(base, need_delta, took_of(kind, stage), 0)

    with gc_paused():
        progress = checked_pass(schedule, make_row, duration)
        if progress is None:
            return None
        return TimedRun(_spans(schedule.programs, progress.starts, progress.ends), ())


def _duration_table(duration: Callable[[Action], float]) -> Callable[[ActionKind, int], object]:
    """(kind, stage) -> duration, None for communication, or ASK_DURATION to call ``duration`` per action."""
    owner = getattr(duration, "__self__", None)
    if isinstance(owner, CostModel) and getattr(duration, "__func__", None) is CostModel.duration:
        # A CostModel's duration depends on (kind, stage) only: look it up once.
        return lambda kind, stage: owner.duration(Action(kind, stage, 0)) if kind.is_compute else None
    return lambda kind, stage: ASK_DURATION if kind.is_compute else None


_span_new = object.__new__
_set_span_fields = tuple(Span.__dict__[name].__set__ for name in ("rank", "action", "start", "end"))


def _spans(
    programs: Sequence[Sequence[Action]], starts: list[list[float]], ends: list[list[float]]
) -> tuple[Span, ...]:
    """Spans of the compute actions, built without Span.__init__ (frozen: 4 object.__setattr__ calls each)."""
    set_rank, set_action, set_start, set_end = _set_span_fields
    out: list[Span] = []
    for rank, program in enumerate(programs):
        count = len(starts[rank])
        if not count:
            continue
        actions = program if count == len(program) else [a for a in program if id(a.kind) not in COMM_KIND_IDS][:count]
        spans = list(map(_span_new, repeat(Span, count)))
        for setter, values in (
            (set_rank, repeat(rank, count)),
            (set_action, actions),
            (set_start, starts[rank]),
            (set_end, ends[rank]),
        ):
            deque(map(setter, spans, values), maxlen=0)  # consume in C
        out.extend(spans)
    return tuple(out)


def simulate_shared_cores(schedule: Schedule, costs: CostModel, cores: int) -> Timeline:
    """Time ``schedule``'s executed programs on ``costs`` when its ranks share ``cores`` CPU cores.

    Each rank runs its actions in order once what they need is done (the engine's data flow:
    :meth:`CodeSpace.need_deltas`, ``costs.latency`` after a producer on another rank ends); the
    ranks computing at a moment share the cores equally (each at ``min(1, cores / running)`` of
    full speed), as the kernel shares them between single-thread processes. With ``cores`` >=
    ranks it times like :func:`simulate`.

    Why a loop of its own rather than the engine's :func:`~conveyor.schedule.engine.step_ranks`:
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
    space = CodeSpace.of(compute)
    deltas, remote = space.need_deltas(lowered=False), space.remote_needs(lowered=False)
    codes = [space.encode(program) for program in programs]
    # Per code, when it was done; REGION_NONE (what a first-stage forward needs) is done from the start.
    done: list[float | None] = space.finish_table()
    num_ranks = compute.num_ranks
    position, free_at = [0] * num_ranks, [0.0] * num_ranks
    running: dict[int, list] = {}  # rank -> [action, work left, start]
    spans: list[Span] = []
    now = 0.0

    def ready_at(rank: int) -> float | None:
        code = codes[rank][position[rank]]
        region_stage = code // space.num_microbatches
        finished = done[code + deltas[region_stage]]
        if finished is None:
            return None
        return max(free_at[rank], finished + (costs.latency if remote[region_stage] else 0.0))

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
                done[codes[rank][position[rank]]] = later
                free_at[rank], position[rank] = later, position[rank] + 1
                del running[rank]
        now = later
    if any(p < len(program) for p, program in zip(position, programs)):
        raise AssertionError(f"{schedule.name}: ranks stopped at {position} in the shared-cores timing")
    return Timeline.from_spans(num_ranks, spans, title=(f"{schedule.name} P={schedule.num_ranks} V={schedule.virtual} "
                                                        f"M={schedule.num_microbatches}, {cores} shared cores"),
                               source="simulated", time_unit="s")
