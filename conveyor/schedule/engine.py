"""The one stepping loop: per-rank programs in order, each action starting once what it needs is done.

It serves the verifier (does every rank reach the end, each action once? if not, who
waits for what: :func:`runs_clean`, :func:`stuck_ranks`) and the simulator (when does each
action start and end: :func:`step`, read by :mod:`conveyor.schedule.simulate`).
Semantics are those of the runtime: a send never blocks; a receive blocks until
the matching send was executed; an action that needs another stage's output
waits until that output was produced (plus the message latency when it
crosses ranks).

What each action waits for (stage ``s``, microbatch ``m``; one need per action,
the others follow from it, e.g. ``B(s, m)`` waits for ``B/I(s+1, m)``, which
could only run after ``F(s+1, m)`` and hence after ``F(s, m)``):

  compute-only programs          lowered programs (with SEND/RECV)
  F(s, m)    F(s-1, m)           RECV_F(s, m) if stage s-1 is on another rank, else F(s-1, m)
  B/I(s, m)  B/I(s+1, m)         RECV_B(s, m) if stage s+1 is on another rank, else B/I(s+1, m)
             (F(s, m) on the last stage)
  W(s, m)    I(s, m)             I(s, m)
  SEND_F(s, m)                   F(s, m)       SEND_B(s, m)  B/I(s, m)
  RECV_F(s, m)                   SEND_F(s-1, m)  RECV_B(s, m)  SEND_B(s+1, m)

The loop reads the programs' own codes (:class:`~conveyor.schedule.ir.PackedProgram`:
``(kind * S + stage) * M + microbatch``), touching integers and float arrays only: no
Action is made unless a :class:`CostModel` of the user's asks for one. Its one table is
the *finish table*: per slot, when it was done (``UNSET`` while not). Slots come in regions
of ``S * M``, then one row of ``M`` that is always done (what a first-stage forward needs):

  region   written by                    region   written by
  F        F                             SPLIT    an I (a mark: what its W waits for)
  G        B or I (one per (s, m))       SEND_F, RECV_F, SEND_B, RECV_B: themselves
  WEIGHT   W                             (the last four in lowered programs only)

An action finds its slot, the slot it needs and a second slot it marks by adding deltas
that depend on its (kind, stage) only (:func:`key_tables`). A W needs its I's mark, which a
B never writes: a W after a B never runs. So once every rank reached its end, counts of
unset slots say the rest of what the verifier asks (:func:`_each_action_once`): every
(stage, microbatch) forwarded and backwarded, no action twice, a W exactly where an I ran.

A waiting rank is parked on the slot it needs and woken when the rank that finishes that
slot stops, so each action is looked at once or twice and the loop cannot hang, at any size
(zbv at P=256, M=2048 has 3 million actions: ``python -m benchmarks --schedule-scale``).

Two steppers keep a loop of their own, each saying why where it lives: ranks sharing CPU
cores (:func:`conveyor.schedule.simulate.simulate_shared_cores`: an action's end depends on
every rank at once; it reads this module's tables), zb-auto's list scheduler
(:mod:`conveyor.schedule.builtin.zb_auto`: it writes the programs as it steps). The posts a
rank makes (:mod:`conveyor.schedule.posts`) are checked by this loop too: they are written as
actions it steps.

Example:
    >>> import conveyor.schedule as cs
    >>> runs_clean(cs.build("1f1b", ranks=2, microbatches=2))
    True
    >>> run = step(cs.build("1f1b", ranks=2, microbatches=2), took=[1.0] * 8, record=True)
    >>> [list(ends) for ends in run.ends]
    [[1.0, 2.0, 4.0, 6.0], [2.0, 3.0, 4.0, 5.0]]
    >>> from conveyor.schedule.ir import Placement, Schedule
    >>> swap = Schedule.from_programs("swap", Placement.looped(2), 2,
    ...     [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]])
    >>> [(b.rank, b.position, str(b.action), str(b.producer)) for b in stuck_ranks(swap)]
    [(0, 1, '0B0', '1B0'), (1, 0, '1F1', '0F1')]
    >>> stuck_ranks(swap)[1].waits_for
    'the forward output of stage 0, microbatch 1'
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

from conveyor.schedule.ir import KINDS, NUM_COMPUTE_KINDS, Action, Schedule

UNSET = -1.0  # no time is negative: clocks start at 0 and costs and latency are >= 0
# Kind indices of the codes (ir.KINDS), and the regions of the finish table.
_F, _B, _I, _W, _SEND_F, _RECV_F, _SEND_B, _RECV_B = range(len(KINDS))
REGION_F, REGION_G, REGION_WEIGHT, REGION_SPLIT = range(NUM_COMPUTE_KINDS)
REGION_SEND_F, REGION_RECV_F, REGION_SEND_B, REGION_RECV_B = range(NUM_COMPUTE_KINDS, len(KINDS))
_CHUNK = 1 << 16


@dataclass(frozen=True, slots=True)
class Blocked:
    """A rank that cannot go on: its action at ``position`` waits for ``waits_for``.

    ``producer_rank`` runs ``producer`` (the action that would unblock it, if the
    schedule has one), at ``producer_position`` of its program.
    """

    rank: int
    position: int
    action: Action
    waits_for: str
    producer_rank: int
    producer: Action | None = None
    producer_position: int | None = None


@dataclass(frozen=True, slots=True)
class Run:
    """What :func:`step` found.

    ``starts``/``ends``: per rank, the start and end of each action it ran, in program order
    (SEND/RECV included, taking no time; empty unless recorded). ``stopped_at[rank]``: the
    position of the action the rank waits at, None if it reached its end (unless recorded, the
    first position of that action: the same in a program without duplicates); ``waiting_for``:
    the slot that action needs (:func:`describe_slot` words it). ``clean``: every rank reached
    its end, each action once, every pass there, a W exactly after an I.
    """

    starts: tuple[array, ...]
    ends: tuple[array, ...]
    stopped_at: tuple[int | None, ...]
    waiting_for: tuple[int | None, ...]
    clean: bool
    lowered: bool

    @property
    def completed(self) -> bool:
        return all(position is None for position in self.stopped_at)


def key_tables(
    stage_to_rank: Sequence[int], num_microbatches: int, took: Sequence[float | None], latency: float = 0.0,
    lowered: bool = False,
) -> list[list[tuple | None]]:
    """Per rank, per key ``kind * S + stage`` (a code's ``code // M``): ``(slot, need, mark, took, lat)``,
    the deltas from a code to its finish slot, to the slot it needs and to a second slot it
    marks, its duration (None: ask per action) and the latency of its need (where another
    rank produces it); None where the key may not appear on the rank, so that the look-up
    doubles as the check that an action runs on its stage's rank (and a SEND/RECV only
    between neighbour stages on different ranks, in lowered programs only).

    Example:
        >>> key_tables((0, 1), 1, [1.0] * 8)[1][1]   # F of stage 1 on rank 1: needs F of stage 0
        (0, -1, 0, 1.0, 0.0)
    """
    S, M = len(stage_to_rank), num_microbatches
    SM = S * M
    kinds = len(KINDS) if lowered else NUM_COMPUTE_KINDS  # (a SEND/RECV code then misses the table)
    always = kinds * SM  # the always-done row
    tables: list[list[tuple | None]] = [[None] * (kinds * S) for _ in range(max(stage_to_rank) + 1)]
    for s, rank in enumerate(stage_to_rank):
        previous_remote = s > 0 and stage_to_rank[s - 1] != rank
        next_remote = s < S - 1 and stage_to_rank[s + 1] != rank
        rows = {_F: (0, always if s == 0 else (REGION_RECV_F * SM if lowered and previous_remote else -M),
                     previous_remote and not lowered),
                _W: (-SM, 0, False)}  # a W writes the WEIGHT region and needs its I's SPLIT mark
        for kind in (_B, _I):  # the input gradient of s+1, or on the last stage its own forward
            if s == S - 1:
                need = (REGION_F - kind) * SM
            else:
                need = (REGION_RECV_B - kind) * SM if lowered and next_remote else (REGION_G - kind) * SM + M
            rows[kind] = (REGION_G - kind) * SM, need, next_remote and not lowered
        if lowered and next_remote:
            rows[_SEND_F] = 0, (REGION_F - _SEND_F) * SM, False
            rows[_RECV_B] = 0, (REGION_SEND_B - _RECV_B) * SM + M, True
        if lowered and previous_remote:
            rows[_RECV_F] = 0, (REGION_SEND_F - _RECV_F) * SM - M, True
            rows[_SEND_B] = 0, (REGION_G - _SEND_B) * SM, False
        for kind, (slot, need, remote) in rows.items():
            mark = SM if kind == _I else slot
            duration = took[kind * S + s] if kind < NUM_COMPUTE_KINDS else 0.0
            tables[rank][kind * S + s] = (slot, need, mark, duration, latency if remote else 0.0)
    return tables


def step(
    schedule: Schedule,
    took: Sequence[float] | None = None,
    latency: float = 0.0,
    duration: Callable[[Action], float] | None = None,
    record: bool = False,
) -> Run | None:
    """Step every rank of ``schedule`` as far as it goes; None where an action cannot be stepped.

    ``took[kind * S + stage]``: the duration of each compute (kind, stage) (all 0.0 when
    None); ``duration(action)``, where given, is called per compute action instead (a cost
    model whose times depend on more than the kind and stage). ``latency``: what a need
    produced on another rank adds (in lowered programs, what a receive waits after its send).
    ``record=False`` keeps no times (a verdict and where ranks stop: the arrays are empty).
    None: a program is not packed (a malformed action: ``verify`` words it), or an action
    runs off its stage's rank, or a SEND/RECV sits where no ranks are crossed.

    Example:
        >>> import conveyor.schedule as cs
        >>> lowered = cs.lower(cs.build("1f1b", ranks=2, microbatches=1))
        >>> [" ".join(map(str, program)) for program in lowered.programs]
        ['0F0 0SEND_F0 0RECV_B0 0B0', '1RECV_F0 1F0 1B0 1SEND_B0']
        >>> run = step(lowered, took=[1.0] * 8, latency=0.5, record=True)
        >>> run.clean, run.lowered, [list(ends) for ends in run.ends]
        (True, True, [[1.0, 1.0, 4.0, 5.0], [1.5, 2.5, 3.5, 3.5]])
    """
    S, M, lowered = schedule.num_stages, schedule.num_microbatches, schedule.is_lowered
    SM = S * M
    regions = len(KINDS) if lowered else NUM_COMPUTE_KINDS
    if took is None:
        took = [0.0] * (NUM_COMPUTE_KINDS * S)
    if duration is not None:
        took = [None] * (NUM_COMPUTE_KINDS * S)
    tables = key_tables(schedule.placement.stage_to_rank, M, took, latency, lowered)
    codes = [program.codes for program in schedule.programs]
    finish = array("d", [UNSET]) * (regions * SM + M)
    finish[regions * SM:] = array("d", [float("-inf")]) * M
    producer = list(schedule.placement.stage_to_rank) * regions  # per row (slot // M) of the finish table
    starts = tuple(array("d") if record else deque(maxlen=0) for _ in codes)
    ends = tuple(array("d") if record else deque(maxlen=0) for _ in codes)
    remaining = list(map(iter, codes))
    ask = None
    if duration is not None:
        action_of = schedule.programs[0].action_of
        ask = lambda code: duration(action_of(code))  # noqa: E731 - the loop's one call per action
    try:
        parked = _loop(remaining, tables, finish, producer, M, starts, ends, ask)
    except (TypeError, IndexError):  # a key missing from the rank's table: an action off its rank
        return None
    # Where a rank stopped: past the actions it ran (an array's iterator does not tell its position).
    stopped_at = tuple(None if code is None else len(ends[rank]) if record else codes[rank].index(code)
                       for rank, code in enumerate(parked))
    waiting_for = tuple(None if code is None else code + tables[rank][code // M][1]
                        for rank, code in enumerate(parked))
    clean = all(code is None for code in parked) and _each_action_once(finish, SM, sum(map(len, codes)), lowered)
    if not record:
        starts, ends = (), ()
    return Run(starts, ends, stopped_at, waiting_for, clean, lowered)


def _loop(remaining: list, tables: list, finish: array, producer: list[int], M: int,
          starts: tuple, ends: tuple, ask: Callable[[int], float] | None) -> list[int | None]:
    """The stepping loop: per rank, the code it is parked at (None: it reached its end).

    A rank runs its next action once the slot it needs is done (plus ``lat`` where another rank
    produced it), else it is parked and another rank runs. ``producer[slot // M]`` is the rank
    that finishes a slot; when a rank stops, the ranks parked on what it finished go on (no
    look-up per finished slot). A duration of None asks ``ask(code)``.
    """
    num_ranks = len(remaining)
    waiters: list[list[tuple[int, int]]] = [[] for _ in range(num_ranks)]
    clock = [0.0] * num_ranks
    parked: list[int | None] = [None] * num_ranks
    work = list(range(num_ranks - 1, -1, -1))
    while work:
        rank = work.pop()
        now, table, add_start, add_end = clock[rank], tables[rank], starts[rank].append, ends[rank].append
        codes = remaining[rank]
        if parked[rank] is not None:
            codes, parked[rank] = chain((parked[rank],), codes), None
        for code in codes:
            slot, need, mark, took, lat = table[code // M]
            ready = finish[code + need]
            if ready == UNSET:
                waiters[producer[(code + need) // M]].append((code + need, rank))
                parked[rank] = code
                break
            ready += lat
            if ready > now:
                now = ready
            add_start(now)
            if took is None:
                took = ask(code)
            now += took
            finish[code + slot] = now
            finish[code + mark] = now
            add_end(now)
        clock[rank] = now
        if waiters[rank]:
            _wake(waiters, rank, finish, work)
    return parked


def _wake(waiters: list[list[tuple[int, int]]], rank: int, finish: array, work: list[int]) -> None:
    """Put the ranks parked on a slot ``rank`` has finished back to work."""
    still = []
    for need, waiter in waiters[rank]:
        if finish[need] == UNSET:
            still.append((need, waiter))
        else:
            work.append(waiter)
    waiters[rank] = still


def _each_action_once(finish: array, SM: int, num_actions: int, lowered: bool) -> bool:  # noqa: N803
    """After every rank reached its end: every F and B/I finished, no action twice (each writes
    its own slot once), a W exactly where the backward was an I (B-then-W and I-without-W fail)."""
    if _count_unset(finish, 0, 2 * SM):
        return False  # a (stage, microbatch) not forwarded or not backwarded
    written = 3 * SM - _count_unset(finish, 0, 3 * SM)
    if lowered:
        written += 4 * SM - _count_unset(finish, REGION_SEND_F * SM, (REGION_RECV_B + 1) * SM)
    if written != num_actions:
        return False  # an action twice (or B and I of one (stage, microbatch))
    return _count_unset(finish, REGION_SPLIT * SM, 4 * SM) == _count_unset(finish, REGION_WEIGHT * SM, 3 * SM)


def _count_unset(finish: array, start: int, stop: int) -> int:
    # A chunk at a time: a whole region would copy 8 bytes per (stage, microbatch) at once.
    return sum(finish[at:min(at + _CHUNK, stop)].count(UNSET) for at in range(start, stop, _CHUNK))


# -- verdicts and words ----------------------------------------------------------------------------


def runs_clean(schedule: Schedule) -> bool:
    """Whether every rank runs to its end, each action once, every pass there (the verifier's fast path).

    False means *something* is wrong (including a malformed action); the
    verifier then finds and words the first violation.

    Example:
        >>> import conveyor.schedule as cs
        >>> runs_clean(cs.lower(cs.build("zbv", ranks=2, microbatches=4)))
        True
    """
    if sum(map(len, schedule.programs)) < 2 * schedule.num_stages * schedule.num_microbatches:
        return False  # incomplete (and no table sized S x M for a handful of actions)
    run = step(schedule)
    return run is not None and run.clean


def describe_slot(schedule: Schedule, slot: int) -> str:
    """What a slot of the finish table stands for, in words (what a stopped rank waits for).

    Example:
        >>> import conveyor.schedule as cs
        >>> describe_slot(cs.build("1f1b", ranks=2, microbatches=4), 4 * 2 + 3)
        'the input gradient of stage 0, microbatch 3'
    """
    M = schedule.num_microbatches
    region, stage_microbatch = divmod(slot, schedule.num_stages * M)
    stage, microbatch = divmod(stage_microbatch, M)
    if region == REGION_F:
        return f"the forward output of stage {stage}, microbatch {microbatch}"
    if region in (REGION_G, REGION_SPLIT):  # a W waits for its I's mark: the input gradient pass
        return f"the input gradient of stage {stage}, microbatch {microbatch}"
    if region == REGION_WEIGHT:
        return f"the weight gradient of stage {stage}, microbatch {microbatch}"
    if REGION_SEND_F <= region <= REGION_RECV_B and schedule.is_lowered:
        verb = "send" if region in (REGION_SEND_F, REGION_SEND_B) else "receive"
        return f"the {verb} {stage}{KINDS[region].name}{microbatch}"
    return "nothing"


def stuck_ranks(schedule: Schedule) -> tuple[Blocked, ...]:
    """Every rank that stops before its end, with what it waits for (the actions must be valid).

    Example:
        >>> import conveyor.schedule as cs
        >>> stuck_ranks(cs.build("1f1b", ranks=2, microbatches=2))
        ()
    """
    run = step(schedule, record=True)  # (the times tell where each rank stopped)
    if run is None:
        raise ValueError(f"schedule {schedule.name!r} holds an action the engine cannot step; verify() names it")
    return blocked_ranks(schedule, run)


def blocked_ranks(schedule: Schedule, run: Run) -> tuple[Blocked, ...]:
    """Describe every rank that stopped before the end of its program."""
    stuck = [rank for rank, position in enumerate(run.stopped_at) if position is not None]
    if not stuck:
        return ()
    S, M, programs = schedule.num_stages, schedule.num_microbatches, schedule.programs
    tables = key_tables(schedule.placement.stage_to_rank, M, [0.0] * (NUM_COMPUTE_KINDS * S), 0.0, run.lowered)
    where: dict[int, tuple[int, int]] = {}  # slot -> (rank, position) of the action that writes it
    for rank, program in enumerate(programs):
        table = tables[rank]
        for position, code in enumerate(program.codes):
            slot, _, mark, _, _ = table[code // M]
            where[code + slot] = where[code + mark] = rank, position
    blocked = []
    for rank in stuck:
        position, need = run.stopped_at[rank], run.waiting_for[rank]
        stage = need % (S * M) // M
        producer_rank, producer_position = where.get(need, (schedule.placement.stage_to_rank[stage], None))
        producer = None if producer_position is None else programs[producer_rank][producer_position]
        blocked.append(Blocked(rank, position, programs[rank][position], describe_slot(schedule, need),
                               producer_rank, producer, producer_position))
    return tuple(blocked)

