"""Check a schedule before anything runs: nothing missing, nothing twice, no deadlock.

:func:`verify` accepts compute-only and lowered schedules and raises a
:class:`~conveyor.errors.ScheduleError` naming the FIRST violation, in this order:

1. shape: a Schedule with a Placement and one sequence of Actions per rank;
2. each action, rank by rank, step by step: a real Action with int ids in range,
   on the rank its stage is placed on; a SEND/RECV only where its two stages
   sit on different ranks (a Schedule refuses an action that is no Action with
   int ids in range when it is made, with this message: :func:`check_actions`);
3. each action at most once; every (stage, microbatch) forwarded once and
   backwarded once (``B``, or ``I`` then ``W``);
4. lowered programs: every SEND has its RECV on the peer rank and vice versa,
   and every compute action whose input or output crosses ranks has them;
5. order and deadlock, by running the programs (``engine.stuck_ranks``): sends never
   block, a receive waits for its send. A rank that runs an action before
   something it needs from its own program is reported as such; otherwise the
   message names every blocked rank, what it waits for, from which rank, what
   that rank is stuck on, the cycle, and shows the step x rank grid;
6. a schedule with overlapped pairs (``Schedule.overlapped``): checks 1-5 without them, each
   pair, then 5 on its lowered form, each pair's receives before it and sends after it
   (:func:`conveyor.schedule.overlap.verify_overlapped`).

A valid schedule costs one fused pass of the engine (``engine.runs_clean``:
each action looked up and stepped once, then C-speed counts); only a schedule
that fails it is walked through the checks above, one by one, for the message.
A pass is remembered on the Schedule itself (``Schedule._verified``, outside its
equality), and ``simulate`` of one not yet verified checks it in the pass that
times it. One straight from ``lower()`` is checked through its compute-only source
(``Schedule.lowered_from``).

Example:
    >>> from conveyor.schedule.ir import Placement, Schedule
    >>> bad = Schedule.from_programs("swap", Placement.looped(2), 2,
    ...     [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]])
    >>> try:
    ...     verify(bad)
    ... except ScheduleError as error:
    ...     print(str(error).splitlines()[0])
    schedule 'swap' deadlocks: ranks 0 and 1 wait for each other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from itertools import repeat
from operator import floordiv

from conveyor.errors import ScheduleError, positive_int
from conveyor.schedule.engine import Blocked, key_tables, runs_clean, stuck_ranks
from conveyor.schedule.grid import AWAITED, STUCK, render_grid
from conveyor.schedule.ir import NUM_COMPUTE_KINDS, Action, ActionKind, PackedProgram, Placement, Schedule

K = ActionKind
# By id(): ActionKind members are singletons, and a plain "F" string compares equal to ActionKind.F.
_KNOWN_KIND_IDS = frozenset(map(id, ActionKind))
_COMM_KIND_IDS = frozenset(id(kind) for kind in ActionKind if kind.is_comm)
_MAX_LISTED_RANKS = 8
_Where = int | tuple[int, int]  # a step of a rank, or (rank, step)



def verify(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` naming the first violation; return None when valid.

    Example:
        >>> import conveyor.schedule as cs
        >>> verify(cs.build("1f1b", ranks=4, microbatches=8))
        >>> verify(cs.lower(cs.build("1f1b", ranks=4, microbatches=8)))
    """
    check_shape(schedule)
    if schedule._verified:
        return
    if schedule.overlapped:  # its pairs, and its lowered form with them (conveyor.schedule.overlap)
        from conveyor.schedule.overlap import verify_overlapped

        verify_overlapped(schedule)
        object.__setattr__(schedule, "_verified", True)
        return
    if _source_runs_clean(schedule) or runs_clean(schedule):
        object.__setattr__(schedule, "_verified", True)  # a frozen record: its one memo, see Schedule
        return
    _diagnose(schedule)
    raise AssertionError(f"schedule {schedule.name!r} failed the fast check but no violation was found")


def _source_runs_clean(schedule: Schedule) -> bool:
    """Whether this schedule came straight from lower() of a schedule that runs clean.

    Such a schedule is valid exactly when its compute-only source is: lower()
    puts each RECV right before the action that consumes it and each SEND right
    after the one that produces it, on every crossing, so the two step alike
    (``simulate`` times the source for the same reason). The source has about a
    third of the actions. When it fails, the lowered schedule is diagnosed itself.
    """
    source = schedule.lowered_from
    return source is not None and (source._verified or runs_clean(source))


def _diagnose(schedule: Schedule) -> None:
    """The checks one by one, in the documented order: raise at the first violation."""
    codes, kinds = _check_actions(schedule)
    lowered = any(not _COMM_KIND_IDS.isdisjoint(map(id, rank_kinds)) for rank_kinds in kinds)
    _check_each_once(schedule, codes)
    _check_complete(schedule, codes, kinds)
    if lowered:
        _check_comms(schedule, codes, kinds)
    _check_runs(schedule, codes, lowered)


def _find(schedule: Schedule, index: dict[int, _Where], kind: ActionKind, stage: int, microbatch: int) -> _Where | None:
    """Where ``index`` (by code of the schedule's packed programs) puts ``kind`` of (stage, microbatch);
    ``B`` finds the backward, B or I (a (stage, microbatch) has one of them)."""
    code_of = schedule.programs[0].code_of
    found = index.get(code_of(Action(kind, stage, microbatch)))
    return index.get(code_of(Action(K.I, stage, microbatch))) if found is None and kind is K.B else found


# -- 1. shape -----------------------------------------------------------------------------------


def check_shape(schedule: object) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is a Schedule with a Placement and one program per rank."""
    if not isinstance(schedule, Schedule):
        raise ScheduleError(
            f"verify() expects a Schedule, got {type(schedule).__name__}; build one with "
            "Schedule.from_programs(name, placement, num_microbatches, programs)"
        )
    placement = schedule.placement
    if not isinstance(placement, Placement):
        raise ScheduleError(
            f"schedule {schedule.name!r}: placement must be a Placement (e.g. Placement.looped(num_ranks, virtual)), "
            f"got {type(placement).__name__}"
        )
    placement.__post_init__()  # re-check: a Placement can be built around its checks
    programs = schedule.programs
    if not isinstance(programs, tuple | list) or len(programs) != placement.num_ranks:
        got = f"{len(programs)} programs" if isinstance(programs, tuple | list) else type(programs).__name__
        raise ScheduleError(
            f"schedule {schedule.name!r} needs one program per rank ({placement.num_ranks}), got {got}"
        )
    for rank, program in enumerate(programs):
        if not isinstance(program, PackedProgram):
            raise ScheduleError(
                f"schedule {schedule.name!r}: the program of rank {rank} must be a sequence of actions, "
                f"got {type(program).__name__}"
            )
    M = schedule.num_microbatches
    if not positive_int(M):
        raise ScheduleError(f"schedule {schedule.name!r}: num_microbatches must be a positive integer, got {M!r}")


# -- 2. each action --------------------------------------------------------------------------------


def _check_actions(schedule: Schedule) -> tuple[list[list[int]], list[list[ActionKind]]]:
    """Codes (a packed program's) and kinds of every rank's actions; raises at the first bad action.

    The fast path packs whole programs, which checks types and ranges with set/min/max (C
    loops), and looks each (kind, stage) up in the engine's tables of what may run on a rank;
    only a program that fails is walked action by action for the message.
    """
    S, M = schedule.num_stages, schedule.num_microbatches
    allowed = key_tables(schedule.placement.stage_to_rank, M, [0.0] * (NUM_COMPUTE_KINDS * S), lowered=True)
    codes: list[list[int]] = []
    kinds: list[list[ActionKind]] = []
    for rank, packed in enumerate(schedule.programs):  # well-formed actions only, packed (see ir.Schedule)
        if not all(allowed[rank][key] is not None for key in set(map(floordiv, packed.codes, repeat(M)))):
            # The ranks before it pass check 2 as they passed the fast check: the first bad action is this rank's.
            check_actions(schedule.placement, M, schedule.programs)
            raise AssertionError(f"rank {rank}'s program failed a fast check that no action fails")
        codes.append(list(packed.codes))
        kinds.append(packed.fields()[0])
    return codes, kinds


def check_actions(placement: Placement, num_microbatches: int, programs: Sequence[Sequence[object]]) -> None:
    """Raise :class:`ScheduleError` at the first action, rank by rank and step by step, that is not a
    well-formed Action on its own rank (check 2); a Schedule calls it on programs it cannot pack.

    Example:
        >>> from conveyor.schedule.ir import Placement, F
        >>> try:
        ...     check_actions(Placement.looped(2), 1, [[F(0, 0)], [F(1, 0), "1B0"]])
        ... except ScheduleError as error:
        ...     print(str(error).split(";")[0])
        rank 1, step 1: found the string '1B0' where an Action belongs
    """
    for rank, program in enumerate(programs):
        for i, action in enumerate(program):
            _check_action(placement, num_microbatches, programs, rank, i, action)


def _check_action(placement: Placement, num_microbatches: int, programs: Sequence[Sequence[object]],
                  rank: int, i: int, action: object) -> None:
    where = f"rank {rank}, step {i}"
    if type(action) is not Action:
        if isinstance(action, str):
            raise ScheduleError(
                f"{where}: found the string {action!r} where an Action belongs; build the schedule with "
                "Schedule.from_programs(...), which parses strings such as '2F0'"
            )
        raise ScheduleError(
            f"{where}: expected an Action such as F(2, 0) or Action.parse('2F0'), "
            f"got {action!r} ({type(action).__name__})"
        )
    kind, stage, microbatch = action.kind, action.stage, action.microbatch
    if id(kind) not in _KNOWN_KIND_IDS:
        known = ", ".join(k.name for k in ActionKind)
        raise ScheduleError(f"{where}: action kind must be an ActionKind ({known}), got {kind!r}")
    for name, value in (("stage", stage), ("microbatch", microbatch)):
        if type(value) is not int:
            raise ScheduleError(
                f"{where}: the {name} of an action must be an int, got {value!r} ({type(value).__name__}) "
                f"in Action(kind={kind.name}, stage={stage!r}, microbatch={microbatch!r})"
            )
    S, M, stage_to_rank = placement.num_stages, num_microbatches, placement.stage_to_rank
    label = f"action {action}"
    # What is wrong with it, if anything: each reason raised the same way, its cell marked on the grid.
    if not 0 <= stage < S:
        problem = f"{label} names stage {stage}, but the schedule has {S} stages (0..{S - 1})"
    elif microbatch < 0:
        problem = f"{label} names microbatch {microbatch}; microbatch ids run from 0 to num_microbatches - 1"
    elif microbatch >= M:
        problem = (f"{label} names microbatch {microbatch}, but the schedule has num_microbatches={M} "
                   f"(0..{M - 1}); give num_microbatches={microbatch + 1} or more, or fix the action")
    elif stage_to_rank[stage] != rank:
        owner = stage_to_rank[stage]
        problem = (f"{label} runs stage {stage}, which the placement puts on rank {owner} "
                   f"(stage_to_rank={stage_to_rank}); move it to rank {owner}'s program or change the placement")
    else:
        problem = _misplaced_comm(stage_to_rank, action) if kind.is_comm else None
    if problem is not None:
        raise ScheduleError(f"{where}: {problem}", grid=render_grid(programs, {(rank, i): STUCK}))


def _misplaced_comm(stage_to_rank: tuple[int, ...], action: Action) -> str | None:
    """What is wrong with a SEND/RECV that does not connect its stage to a neighbour stage on another rank;
    None where it does."""
    s, kind, last = action.stage, action.kind, len(stage_to_rank) - 1
    if kind is K.SEND_F and s == last:
        return f"{action} sends the output of the last stage {s}, which goes to the loss; remove it"
    if kind is K.RECV_B and s == last:
        return f"{action}: the last stage {s} starts its backward from the loss and receives no gradient; remove it"
    if kind is K.RECV_F and s == 0:
        return f"{action}: stage 0 takes the microbatch itself and receives no forward input; remove it"
    if kind is K.SEND_B and s == 0:
        return f"{action}: stage 0 has no previous stage to send an input gradient to; remove it"
    peer = s + 1 if kind in (K.SEND_F, K.RECV_B) else s - 1
    if stage_to_rank[peer] != stage_to_rank[s]:
        return None
    return (
        f"{action} connects stages {min(s, peer)} and {max(s, peer)}, which both run on rank "
        f"{stage_to_rank[s]} and pass tensors in memory; remove it "
        "(lower() adds only the sends and receives that cross ranks)"
    )


# -- 3. each action once, every pass present ------------------------------------------------------


def _check_each_once(schedule: Schedule, codes: list[list[int]]) -> None:
    SM = schedule.num_stages * schedule.num_microbatches
    for rank, packed_codes in enumerate(codes):
        # B and I of one (stage, microbatch) count as one backward: an I's code is a B's plus S * M.
        rank_codes = [code - SM if 2 * SM <= code < 3 * SM else code for code in packed_codes]
        if len(set(rank_codes)) == len(rank_codes):
            continue
        first_step: dict[int, int] = {}
        for i, code in enumerate(rank_codes):
            j = first_step.setdefault(code, i)
            if j == i:
                continue
            a, b = schedule.programs[rank][j], schedule.programs[rank][i]
            if a.kind is b.kind:
                problem = f"rank {rank} runs {a} twice, at steps {j} and {i}; each action must appear exactly once"
            else:  # a B and an I
                problem = (f"stage {a.stage} microbatch {a.microbatch} has two backward passes on rank {rank}: "
                           f"{a} at step {j} and {b} at step {i}; use either B, or I followed by W")
            raise ScheduleError(problem, grid=_grid(schedule, {(rank, j): STUCK, (rank, i): STUCK}))


def _check_complete(schedule: Schedule, codes: list[list[int]], kinds: list[list[ActionKind]]) -> None:
    M = schedule.num_microbatches
    SM = schedule.num_stages * M
    stage_to_rank = schedule.placement.stage_to_rank
    # Codes are unique, in range and on their own rank: counting is enough.
    forwards = sum(k.count(K.F) for k in kinds)
    backwards = sum(k.count(K.B) + k.count(K.I) for k in kinds)
    if forwards < SM:
        have = {c for rank_codes in codes for c in rank_codes if c < SM}
        code = next(c for c in range(SM) if c not in have)
        s, m = divmod(code, M)
        raise ScheduleError(
            f"stage {s} microbatch {m} is never forwarded: add {s}F{m} to the program of rank "
            f"{stage_to_rank[s]}, which runs stage {s}"
        )
    if backwards < SM:
        have = {c % SM for rank_codes in codes for c in rank_codes if SM <= c < 3 * SM}  # B or I
        code = next(c for c in range(SM) if c not in have)
        s, m = divmod(code, M)
        raise ScheduleError(
            f"stage {s} microbatch {m} has no backward: add {s}B{m} (or {s}I{m} followed by {s}W{m}) "
            f"to the program of rank {stage_to_rank[s]}, which runs stage {s}"
        )
    for rank, rank_kinds in enumerate(kinds):
        if K.I not in rank_kinds and K.W not in rank_kinds:
            continue
        program = schedule.programs[rank]
        split = {codes[rank][i] for i, k in enumerate(rank_kinds) if k is K.I}
        weights = {codes[rank][i] - SM for i, k in enumerate(rank_kinds) if k is K.W}  # a W's code is its I's + S*M
        if split == weights:
            continue
        for i, action in enumerate(program):
            code = codes[rank][i]
            label = f"rank {rank}, step {i}"
            if action.kind is K.W and code - SM not in split:
                full = next((j for j, c in enumerate(codes[rank]) if c == code - 2 * SM), None)  # its B
                how = "" if full is None else f" (it runs the full backward {program[full]} at step {full})"
                raise ScheduleError(
                    f"{label}: {action} computes a weight gradient, but stage {action.stage} microbatch "
                    f"{action.microbatch} has no {action.stage}I{action.microbatch}{how}; W only follows an I: "
                    f"remove {action}, or split the backward into {action.stage}I{action.microbatch} and {action}",
                    grid=_grid(schedule, {(rank, i): STUCK}),
                )
            if action.kind is K.I and code not in weights:
                raise ScheduleError(
                    f"{label}: {action} computes only the input gradient and no "
                    f"{action.stage}W{action.microbatch} follows, so the weight gradient would be lost; "
                    f"add {action.stage}W{action.microbatch} after it on rank {rank} (or use a full backward "
                    f"{action.stage}B{action.microbatch})",
                    grid=_grid(schedule, {(rank, i): STUCK}),
                )


def _check_comms(schedule: Schedule, codes: list[list[int]], kinds: list[list[ActionKind]]) -> None:
    """Lowered programs: each crossing of ranks has its SEND and its RECV, on the right ranks."""
    S, M = schedule.num_stages, schedule.num_microbatches
    stage_to_rank = schedule.placement.stage_to_rank
    crossings = sum(1 for s in range(S - 1) if stage_to_rank[s] != stage_to_rank[s + 1])
    counts = [sum(k.count(kind) for k in kinds) for kind in (K.SEND_F, K.RECV_F, K.SEND_B, K.RECV_B)]
    if counts == [crossings * M] * 4:
        return  # each comm action is unique and sits on a crossing: all are there
    where = {code: (rank, i) for rank, rank_codes in enumerate(codes) for i, code in enumerate(rank_codes)}

    at = functools.partial(_find, schedule, where)  # (rank, step) of an action; of the backward, B or I, for B

    for rank, program in enumerate(schedule.programs):
        for i, action in enumerate(program):
            s, m, kind = action.stage, action.microbatch, action.kind
            # (this action, the comm it needs on its own rank, the comm that pairs with it on the peer)
            checks = []
            if kind is K.F:
                if s > 0 and stage_to_rank[s - 1] != rank:
                    checks.append((K.RECV_F, s, K.SEND_F, s - 1, "before"))
                if s < S - 1 and stage_to_rank[s + 1] != rank:
                    checks.append((K.SEND_F, s, K.RECV_F, s + 1, "after"))
            elif kind is K.B or kind is K.I:
                if s < S - 1 and stage_to_rank[s + 1] != rank:
                    checks.append((K.RECV_B, s, K.SEND_B, s + 1, "before"))
                if s > 0 and stage_to_rank[s - 1] != rank:
                    checks.append((K.SEND_B, s, K.RECV_B, s - 1, "after"))
            for own_kind, own_stage, peer_kind, peer_stage, side in checks:
                own = at(own_kind, own_stage, m)
                peer = at(peer_kind, peer_stage, m)
                own_label = str(Action(own_kind, own_stage, m))
                peer_label = str(Action(peer_kind, peer_stage, m))
                peer_rank = stage_to_rank[peer_stage]
                if own is not None and peer is not None:
                    continue
                if own is None and peer is not None:
                    # The peer's SEND/RECV is an orphan; ours belongs next to `action`.
                    verb = "sends" if peer_kind in (K.SEND_F, K.SEND_B) else "receives"
                    raise ScheduleError(
                        f"rank {peer_rank} {verb} {peer_label} at step {peer[1]}, but rank {rank} has no matching "
                        f"{own_label}: add it {side} {action} (step {i}) on rank {rank}",
                        grid=_grid(schedule, {peer: STUCK, (rank, i): AWAITED}),
                    )
                if own is not None and peer is None:
                    peer_side = "before" if side == "after" else "after"
                    peer_compute = _peer_compute(peer_kind, peer_stage, m, at)
                    marks = {own: STUCK}
                    if peer_compute[1] is not None:
                        marks[peer_compute[1]] = AWAITED
                    raise ScheduleError(
                        f"rank {rank} has {own_label} at step {own[1]}, but rank {peer_rank} has no matching "
                        f"{peer_label}: add it {peer_side} {peer_compute[0]} on rank {peer_rank}",
                        grid=_grid(schedule, marks),
                    )
                raise ScheduleError(
                    f"rank {rank} runs {action} at step {i}, whose {'input' if side == 'before' else 'output'} "
                    f"crosses to stage {peer_stage} on rank {peer_rank}, but the lowered program has neither "
                    f"{own_label} on rank {rank} nor {peer_label} on rank {peer_rank}; add both "
                    "(lower() adds every missing send and receive)",
                    grid=_grid(schedule, {(rank, i): STUCK}),
                )
    raise AssertionError("communication counts differ but every crossing has its SEND and RECV")


def _peer_compute(
    peer_kind: ActionKind, stage: int, microbatch: int, at: Callable[[ActionKind, int, int], tuple[int, int] | None]
) -> tuple[str, tuple[int, int] | None]:
    """The compute action next to which the peer's SEND/RECV belongs (its label and where it is)."""
    forward = peer_kind in (K.SEND_F, K.RECV_F)
    where = at(K.F if forward else K.B, stage, microbatch)  # for B: B or I
    label = f"{stage}F{microbatch}" if forward else f"the backward of stage {stage}, microbatch {microbatch}"
    return label + ("" if where is None else f" (step {where[1]})"), where


# -- 5. order and deadlock -----------------------------------------------------------------------


def _check_runs(schedule: Schedule, codes: list[list[int]], lowered: bool) -> None:
    blocked = stuck_ranks(schedule)
    if not blocked:
        return
    _check_order(schedule, codes, lowered)
    raise _deadlock_error(schedule, blocked)


def _check_order(schedule: Schedule, codes: list[list[int]], lowered: bool) -> None:
    """Report an action placed before something it needs from its own rank (the usual root of a deadlock)."""
    last = schedule.num_stages - 1
    stage_to_rank = schedule.placement.stage_to_rank
    for rank, program in enumerate(schedule.programs):
        step_of = {code: i for i, code in enumerate(codes[rank])}
        for i, action in enumerate(program):
            kind, s, m = action.kind, action.stage, action.microbatch
            before: list[tuple[ActionKind, int]] = []  # (kind, stage) of microbatch m that must come earlier here
            if kind is K.B or kind is K.I:
                before.append((K.F, s))
                if s < last and stage_to_rank[s + 1] == rank:
                    before.append((K.B, s + 1))
                if lowered and s < last and stage_to_rank[s + 1] != rank:
                    before.append((K.RECV_B, s))
            elif kind is K.F:
                if s > 0 and stage_to_rank[s - 1] == rank:
                    before.append((K.F, s - 1))
                if lowered and s > 0 and stage_to_rank[s - 1] != rank:
                    before.append((K.RECV_F, s))
            elif kind is K.W or kind is K.SEND_B:
                before.append((K.B, s))
            elif kind is K.SEND_F:
                before.append((K.F, s))
            for need_kind, need_stage in before:
                j = _find(schedule, step_of, need_kind, need_stage, m)  # for B: the backward, B or I
                if j is not None and j > i:
                    needed = program[j]
                    raise ScheduleError(
                        f"rank {rank} runs {action} at step {i}, before {needed} at step {j}, which it needs "
                        f"({_why(action, needed)}); move {needed} before {action}",
                        grid=_grid(schedule, {(rank, i): STUCK, (rank, j): AWAITED}),
                    )


def _why(action: Action, needed: Action) -> str:
    kind, other = action.kind, needed.kind
    if kind is K.W:
        return "the weight gradient pass follows the input gradient pass"
    if kind in (K.SEND_F, K.SEND_B):
        return f"{action} sends what {needed} computes"
    if other in (K.RECV_F, K.RECV_B):
        return f"{needed} receives the input of {action}"
    if other is K.F and needed.stage == action.stage:
        return "a backward pass needs its forward pass"
    if kind is K.F:
        return f"stage {action.stage} takes the output of stage {needed.stage}"
    return f"stage {action.stage} takes the input gradient of stage {needed.stage}"


def _deadlock_error(schedule: Schedule, blocked: Sequence[Blocked]) -> ScheduleError:
    by_rank = {b.rank: b for b in blocked}
    cycle = _find_cycle(by_rank)
    in_cycle = set(cycle)
    if len(cycle) == 2:
        head = f"ranks {cycle[0]} and {cycle[1]} wait for each other"
    else:
        head = "ranks " + " -> ".join(map(str, cycle + [cycle[0]])) + " wait for one another in a cycle"
    lines = [f"schedule {schedule.name!r} deadlocks: {head}."]
    lines += ["  " + _blocked_line(by_rank[rank], by_rank) for rank in cycle]
    fixes = []
    for rank in cycle:
        # The action another rank of the cycle waits for, which this rank would have to run earlier
        # (not possible where a rank is stuck at that very action).
        waiter = next(b for b in blocked if b.rank in in_cycle and b.producer_rank == rank)
        if waiter.producer_position is not None and waiter.producer_position > by_rank[rank].position:
            fixes.append(f"{waiter.producer} before {by_rank[rank].action} on rank {rank}")
    lines.append(
        "  To break the cycle, one of these ranks must run the awaited action earlier: " + ", or ".join(fixes) + "."
    )
    others = [b for b in blocked if b.rank not in in_cycle]
    if others:
        lines.append(f"  {len(others)} more rank(s) wait on these:")
        lines += ["    " + _blocked_line(b, by_rank) for b in others[:_MAX_LISTED_RANKS]]
        if len(others) > _MAX_LISTED_RANKS:
            lines.append(f"    ... and {len(others) - _MAX_LISTED_RANKS} more")
    shown = [by_rank[r] for r in cycle] + others[: max(0, _MAX_LISTED_RANKS - len(cycle))]
    marks = {(b.producer_rank, b.producer_position): AWAITED for b in shown if b.producer_position is not None}
    marks.update({(b.rank, b.position): STUCK for b in shown})
    legend = f"step x rank grid ({STUCK.format('stuck')}, {AWAITED.format('awaited')}):"
    return ScheduleError("\n".join(lines), grid=legend + "\n" + _grid(schedule, marks))


def _blocked_line(b: Blocked, by_rank: dict[int, Blocked]) -> str:
    text = f"rank {b.rank} is stuck at step {b.position} ({b.action}): it waits for "
    at = f"at step {b.producer_position} of rank {b.producer_rank}"
    if b.producer is None:
        text += f"{b.waits_for}, from rank {b.producer_rank}"
    elif b.producer.kind.is_comm:
        text += f"{b.producer} {at}"
    else:
        text += f"{b.waits_for}, which {b.producer} computes {at}"
    stuck_there = by_rank.get(b.producer_rank)
    if stuck_there is not None and stuck_there.position == b.producer_position:
        text += ", which is stuck at that very action"
    elif stuck_there is not None:
        text += f", which is stuck at step {stuck_there.position} ({stuck_there.action})"
    return text + "."


def _find_cycle(by_rank: dict[int, Blocked]) -> list[int]:
    """Follow "waits for a rank" links from the lowest blocked rank until one repeats."""
    rank = min(by_rank)
    seen: list[int] = []
    while rank not in seen:
        seen.append(rank)
        rank = by_rank[rank].producer_rank
        if rank not in by_rank:  # cannot happen once checks 1-4 passed: every producer exists
            raise AssertionError(f"blocked rank waits for rank {rank}, which is not blocked")
    return seen[seen.index(rank) :]


# -- helpers ---------------------------------------------------------------------------------------


def _grid(schedule: Schedule, marks: dict[tuple[int, int], str]) -> str:
    return render_grid(schedule.programs, marks)
