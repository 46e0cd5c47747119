"""Overlapped forward/backward pairs: one microbatch's forward computes while another's backward communicates.

An MoE layer moves its tokens all-to-all twice per pass (dispatch, combine). Run alone, a pass
waits for each exchange; run beside a pass of another microbatch, each waits while the other
computes. A *pair* is a forward ``F(a)`` and a backward ``X(b)`` (X = B, or the I of a split
backward) that a rank runs together: ``Schedule.overlapped[rank]`` lists them, each
``(forward, backward)``, the two adjacent in that rank's compute program, forward first.

- :func:`pair_forward_backward` finds the pairs a schedule already has (DualPipeV, ZB-V and
  the steady state of 1F1B run a forward right before a backward of another microbatch);
- :func:`pairs_of` is what a rank's executor reads: forward -> its partner;
- lowering (:func:`~conveyor.schedule.lower.lower`) gives each pair both receives before it and
  both sends after it, and :func:`verify_overlapped` (called by ``verify``) checks the pairs and
  that the schedule, so lowered, cannot deadlock;
- :func:`overlap_pair` times one pair from its pieces of compute and its exchanges, as the
  executor runs it; :func:`pair_timing` does so from a :class:`~conveyor.schedule.cost.CostModel`.
  ``simulate`` times each pair as one event of that duration.

Example:
    >>> import conveyor.schedule as cs
    >>> paired = pair_forward_backward(cs.build("1f1b", ranks=2, microbatches=4))
    >>> {str(f): str(b) for f, b in pairs_of(paired, 0).items()}
    {'0F1': '0B0', '0F2': '0B1', '0F3': '0B2'}
    >>> [str(a) for a in cs.lower(paired).programs[0]][2:8]
    ['0RECV_B0', '0F1', '0B0', '0SEND_F1', '0RECV_B1', '0F2']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.errors import ScheduleError
from conveyor.schedule.cost import CostModel
from conveyor.schedule.engine import runs_clean, stuck_ranks
from conveyor.schedule.ir import Action, ActionKind, PackedProgram, Schedule
from conveyor.schedule.lower import lower

K = ActionKind
_B_CODE_KIND, _I_CODE_KIND = 1, 2  # kind indices of packed codes (ir.KINDS)


def pair_forward_backward(schedule: Schedule) -> Schedule:
    """``schedule`` with, per rank, the forward/backward pairs its compute program already holds.

    One greedy walk, left to right, over each rank's compute program: a forward F followed
    directly by a backward (B or I) of a *different* microbatch forms a pair, and both are then
    consumed. A backward of the forward's own microbatch is never paired: it needs that very
    forward's output (through the later stages), so the two cannot run at once. A pair that would
    stop the schedule is dropped: lowered, its rank waits in front of it for the backward's input,
    which may need the pair's forward output first (GPipe's last forward and first backward), so
    the result verifies whenever ``schedule`` does. The programs are unchanged.

    Whether the pairs pay depends on the costs: they hide exchanges, but a pair starts only once
    both inputs are in and sends only once both passes are done. With one stage per rank (1F1B,
    ZB-H1) a pair's forward feeds the very rank its backward's gradient comes from, which then
    idles for the whole pair every microbatch: simulate both (V >= 2 and DualPipeV gain).

    A schedule that already lists pairs (written by hand, or loaded from text or CSV with them) comes back
    as it is: its own pairs are the ones run. A lowered schedule is paired on its compute actions; one straight
    from ``lower()``
    comes back as the lowering of its paired source (each pair's communication around it), a
    hand-lowered one keeps its communication where it is.

    Example (1F1B, 2 ranks, 4 microbatches: rank 0's steady state pairs, rank 1 pairs nothing,
    since each of its forwards is followed by its own backward):
        >>> import conveyor.schedule as cs
        >>> sched = cs.build("1f1b", ranks=2, microbatches=4)
        >>> [" ".join(map(str, p)) for p in sched.programs]
        ['0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3', '1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3']
        >>> [[f"{f}+{b}" for f, b in pairs] for pairs in pair_forward_backward(sched).overlapped]
        [['0F1+0B0', '0F2+0B1', '0F3+0B2'], []]
    """
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"pair_forward_backward() expects a Schedule, got {type(schedule).__name__}")
    if any(schedule.overlapped):  # its own pairs (written by hand, or loaded): kept, and checked by verify()
        return schedule
    if schedule.lowered_from is not None:
        return lower(pair_forward_backward(schedule.lowered_from))
    compute = schedule.compute_only() if schedule.is_lowered else schedule
    pairs = [list(_greedy_pairs(program)) for program in compute.programs]
    valid = compute._verified or runs_clean(compute)
    if any(pairs) and valid:  # (an invalid schedule keeps its pairs: verify() words what is wrong)
        _drop_deadlocking(compute, pairs)
    paired = schedule.with_programs(schedule.programs, pairs if any(pairs) else ())  # (Schedule makes them tuples)
    if valid and not schedule.is_lowered:  # what verify() would check: every pair is well formed by construction
        object.__setattr__(paired, "_verified", True)
    return paired


def without_stopping_pairs(schedule: Schedule) -> Schedule:
    """``schedule`` (compute-only) less those of its own pairs that would stop it, lowered as pairs run: what a
    pair torch's runtime would run in turn becomes (a CSV's ``OVERLAP_F_B`` cells). A schedule that does not run
    even without its pairs keeps them all: ``verify`` says what is wrong.

    Example:
        >>> from conveyor.schedule.csv_io import parse_schedule
        >>> gpipe = parse_schedule("rank 0: 0F0 0F1 0B0 0B1\\nrank 1: 1F0 1F1 1B0 1B1\\nrank 0 overlaps: 0F1+0B0")
        >>> without_stopping_pairs(gpipe).overlapped   # 0B0 needs what 0F1 sends first
        ()
    """
    compute = schedule.compute_only() if schedule.is_lowered else schedule
    if not any(schedule.overlapped) or not runs_clean(compute.with_programs(compute.programs, ())):
        return schedule
    pairs = [list(pairs) for pairs in schedule.overlapped]
    _drop_deadlocking(compute.with_programs(compute.programs, ()), pairs)
    return schedule.with_programs(schedule.programs, tuple(map(tuple, pairs)) if any(pairs) else ())


def _greedy_pairs(program: PackedProgram) -> tuple[tuple[Action, Action], ...]:
    codes, M = program.codes, program.num_microbatches
    SM = program.num_stages * M
    pairs = []
    at = 0
    while at + 1 < len(codes):
        first, second = codes[at], codes[at + 1]
        if first < SM and second // SM in (_B_CODE_KIND, _I_CODE_KIND) and first % M != second % M:
            pairs.append((program.action_of(first), program.action_of(second)))
            at += 2
        else:
            at += 1
    return tuple(pairs)


def _drop_deadlocking(compute: Schedule, pairs: list[list[tuple[Action, Action]]]) -> None:
    """Drop from ``pairs`` (per rank, in place) those that stop the lowered schedule: step it, drop the pair
    each stuck rank waits in front of (else the next pair of each stuck rank), until every rank ends."""
    while True:
        lowered = lower(compute.with_programs(compute.programs, tuple(map(tuple, pairs)) if any(pairs) else ()))
        if runs_clean(lowered):
            return
        stuck = stuck_ranks(lowered)
        before = sum(map(len, pairs))
        for must_contain in (True, False):
            for blocked in stuck:
                program = lowered.programs[blocked.rank]
                # The first compute action from where the rank waits: a pair's forward, if it waits in front of one.
                ahead = (a for a in program[blocked.position:] if a.kind.is_compute)
                forwards = {forward for forward, _ in pairs[blocked.rank]}
                target = next(ahead, None) if must_contain else next((a for a in ahead if a in forwards), None)
                pairs[blocked.rank] = [pair for pair in pairs[blocked.rank] if pair[0] != target]
            if sum(map(len, pairs)) < before:
                break
        else:
            raise AssertionError(f"schedule {compute.name!r} deadlocks with its pairs, and no stuck rank waits "
                                 "in front of one")


def pairs_of(schedule: Schedule, rank: int) -> dict[Action, Action]:
    """``{forward: backward}`` of the pairs ``rank`` runs overlapped (empty when it has none).

    Example:
        >>> import conveyor.schedule as cs
        >>> pairs_of(cs.build("1f1b", ranks=2, microbatches=4), 0)
        {}
    """
    if not 0 <= rank < schedule.num_ranks:
        raise ScheduleError(f"rank {rank} is outside schedule {schedule.name!r}, "
                            f"which has ranks 0..{schedule.num_ranks - 1}")
    return dict(schedule.overlapped[rank]) if schedule.overlapped else {}


# -- checks ------------------------------------------------------------------------------------------


def verify_overlapped(schedule: Schedule) -> None:
    """What :func:`~conveyor.schedule.verify.verify` checks of a schedule with pairs; raises ScheduleError.

    In order: the schedule without its pairs (complete, each action once, no deadlock); each
    pair (:func:`check_pairs`); then its lowered form, each pair's receives before it and its sends
    after it, must run to the end: a pair whose backward's input can only come once the pair's
    forward output was sent deadlocks there.

    Example:
        >>> from conveyor.schedule.ir import B, F, Placement
        >>> sched = Schedule.from_programs("gpipe-ish", Placement.looped(2), 2,
        ...     [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1F1", "1B0", "1B1"]])
        >>> try:
        ...     verify_overlapped(sched.with_programs(sched.programs, ((( F(0, 1), B(0, 0)),), ())))
        ... except ScheduleError as error:
        ...     print(str(error).splitlines()[1])
        schedule 'gpipe-ish' deadlocks: ranks 0 and 1 wait for each other.
    """
    from conveyor.schedule.verify import verify  # verify() calls this module

    compute = schedule.compute_only() if schedule.is_lowered else schedule
    verify(compute.with_programs(compute.programs, ()))
    check_pairs(compute)
    lowered = schedule if schedule.is_lowered else lower(schedule)
    if runs_clean(lowered):
        return
    try:
        verify(lowered.with_programs(lowered.programs, ()))
    except ScheduleError as error:
        raise ScheduleError(
            f"schedule {schedule.name!r} runs without its overlapped pairs but not with them, lowered as they run "
            "(both receives of a pair before it, both sends after it): a pair whose backward waits for what "
            "its forward sends cannot start; drop that pair (or reorder the ranks). What blocks:\n" + error.message,
            grid=error.grid) from None
    raise AssertionError(f"schedule {schedule.name!r}: its lowered pairs failed the fast check but verify")


def check_pairs(schedule: Schedule) -> None:
    """Raise ScheduleError at the first pair that is not a forward directly followed, on its rank's compute
    program, by a backward (B or I) of another microbatch, both of stages that rank runs.

    Example:
        >>> import conveyor.schedule as cs
        >>> from conveyor.schedule.ir import B, F
        >>> sched = cs.build("1f1b", ranks=2, microbatches=4)
        >>> try:
        ...     check_pairs(sched.with_programs(sched.programs, (((F(0, 1), B(0, 1)),), ())))
        ... except ScheduleError as error:
        ...     print(str(error).split(":")[1].split(",")[0])
         both work on microbatch 1
    """
    compute = schedule.compute_only() if schedule.is_lowered else schedule
    S, stage_to_rank = schedule.num_stages, schedule.placement.stage_to_rank
    for rank, pairs in enumerate(schedule.overlapped):
        program = compute.programs[rank]
        position = dict(zip(program.codes, range(len(program.codes))))
        seen: set[Action] = set()
        for forward, backward in pairs:
            where = f"schedule {schedule.name!r}, rank {rank}, pair ({forward}, {backward})"
            if forward.kind is not K.F:
                raise ScheduleError(f"{where}: its first action must be a forward F, got {forward.kind.name}; "
                                    "write each pair as (forward, backward)")
            if backward.kind is not K.B and backward.kind is not K.I:
                raise ScheduleError(f"{where}: its second action must be a backward B or I (the passes that "
                                    f"exchange), got {backward.kind.name}; pair the forward with a B or an I")
            if forward.microbatch == backward.microbatch:
                raise ScheduleError(
                    f"{where}: both work on microbatch {forward.microbatch}, and a backward needs its own "
                    "microbatch's forward done first; pair the forward with a backward of another microbatch")
            for action in (forward, backward):
                owner = stage_to_rank[action.stage] if 0 <= action.stage < S else None
                if owner != rank:
                    raise ScheduleError(
                        f"{where}: {action} runs stage {action.stage}, which "
                        + ("the schedule does not have" if owner is None else f"the placement puts on rank {owner}")
                        + f"; a pair runs on one rank: list it under rank {owner}, or pair actions of rank {rank}")
                if position.get(program.code_of(action)) is None:
                    raise ScheduleError(f"{where}: {action} is not in rank {rank}'s program; pair actions it runs")
            i, j = position[program.code_of(forward)], position[program.code_of(backward)]
            if j != i + 1:
                raise ScheduleError(
                    f"{where}: a pair runs its two actions together, so its backward must directly follow its "
                    f"forward in the rank's compute program, but {forward} is at step {i} and {backward} at "
                    f"step {j}; move {backward} right after {forward}, or drop the pair")
            if forward in seen or backward in seen:
                raise ScheduleError(f"{where}: an action of this pair is in another pair too; list each once")
            seen.update((forward, backward))


# -- timing ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PairTiming:
    """How one overlapped pair runs, times from its start: ``duration`` until both passes are done;
    ``exposed``, the part of it the compute lane waited for an exchange; ``exchanges``, each
    all-to-all on the communication lane as ``(pass, start, end)``, pass 0 the forward, 1 the backward."""

    duration: float
    exposed: float
    exchanges: tuple[tuple[int, float, float], ...]


def overlap_pair(forward: Sequence[float], forward_exchanges: Sequence[float],
                 backward: Sequence[float], backward_exchanges: Sequence[float]) -> PairTiming:
    """Time a forward and a backward run as two coroutines on one compute lane and one communication lane.

    ``forward``: the forward's pieces of compute, in order; ``forward_exchanges[k]``: the
    all-to-all it makes after piece k (one fewer than pieces); likewise the backward. As the
    executor runs a pair: a coroutine computes a piece, posts the exchange that follows it
    (asynchronously: it starts once the piece is done and the exchanges posted before it are,
    one in flight at a time, in posting order) and yields to the other; before its next piece it
    waits for that exchange. The compute lane takes whichever coroutine can compute first, the one
    that did not compute last on a tie: so the forward starts, and the two alternate (with one
    lane, exchanges end in posting order, so the alternation never waits for a later one). The
    lane waits only when neither can compute; the pair ends with the last piece.

    Example (forward: 3 pieces of 1, 2 exchanges of 1; backward: 3 pieces of 2, 2 exchanges of 1;
    alone they take 5 + 8 = 13; together every exchange hides behind the other's compute):
        >>> timing = overlap_pair([1, 1, 1], [1, 1], [2, 2, 2], [1, 1])
        >>> timing.duration, timing.exposed, timing.exchanges
        (9, 0, ((0, 1, 2), (1, 3, 4), (0, 4, 5), (1, 6, 7)))
        >>> overlap_pair([1, 1], [3], [1, 1], [3]).duration   # 3 units of exchange vs 1 of compute
        8
    """
    pieces, exchanges = (list(forward), list(backward)), (list(forward_exchanges), list(backward_exchanges))
    for name, own, posted in (("forward", pieces[0], exchanges[0]), ("backward", pieces[1], exchanges[1])):
        if not own or len(posted) != len(own) - 1 or min(own) < 0 or min(posted, default=0) < 0:
            raise ValueError(f"the {name} needs at least one piece of compute and one exchange fewer than pieces, "
                             f"all >= 0; got pieces {own} and exchanges {posted}")
    done = [0, 0]  # pieces computed, per coroutine
    ready = [0, 0]  # when each may compute its next piece (its last exchange done)
    compute_free = comm_free = 0
    last = 1  # as if the backward computed last: the forward starts
    spans = []
    while done[0] < len(pieces[0]) or done[1] < len(pieces[1]):
        who = min((c for c in (0, 1) if done[c] < len(pieces[c])), key=lambda c: (ready[c], c == last))
        compute_free = max(compute_free, ready[who]) + pieces[who][done[who]]
        if done[who] < len(exchanges[who]):
            start = max(compute_free, comm_free)
            comm_free = ready[who] = start + exchanges[who][done[who]]
            spans.append((who, start, comm_free))
        done[who] += 1
        last = who
    return PairTiming(compute_free, max(0, compute_free - sum(pieces[0]) - sum(pieces[1])), tuple(spans))


def pass_pieces(costs: CostModel, action: Action) -> tuple[list[float], list[float]]:
    """The model of one pass: its compute in ``exchanges + 1`` equal pieces, and its exchanges.

    Its compute is ``costs.duration(action)`` less its exchanges (a W makes none).

    Example:
        >>> costs = CostModel.uniform(1, forward=3.0, exchange=0.5, exchanges=2)
        >>> pass_pieces(costs, Action(ActionKind.F, 0, 0))
        ([1.0, 1.0, 1.0], [0.5, 0.5])
    """
    stage = costs.stages[action.stage]
    count = 0 if action.kind is K.W else stage.exchanges
    compute = max(0.0, costs.duration(action) - count * stage.exchange)
    return [compute / (count + 1)] * (count + 1), [stage.exchange] * count


def pair_timing(costs: CostModel, forward: Action, backward: Action) -> PairTiming:
    """:func:`overlap_pair` of two actions on ``costs``; with no exchange time, exactly one after the other.

    Example:
        >>> costs = CostModel.uniform(2, forward=3.0, backward_input=5.0, backward_weight=1.0,
        ...                           exchange=1.0, exchanges=2)
        >>> alone = costs.duration(Action(ActionKind.F, 1, 1)) + costs.duration(Action(ActionKind.B, 0, 0))
        >>> alone, pair_timing(costs, Action(ActionKind.F, 1, 1), Action(ActionKind.B, 0, 0)).duration
        (13.0, 9.0)
    """
    if costs.stages[forward.stage].exchange_time == 0 and costs.stages[backward.stage].exchange_time == 0:
        return PairTiming(costs.duration(forward) + costs.duration(backward), 0.0, ())
    return overlap_pair(*pass_pieces(costs, forward), *pass_pieces(costs, backward))
