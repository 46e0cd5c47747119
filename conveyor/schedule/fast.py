"""One pass that verifies and times a packed, compute-only schedule (the common case, at any size).

The engine (:mod:`conveyor.schedule.engine`) serves every schedule, lowered or not, and
names what is wrong; this module serves schedules whose programs are all
:class:`~conveyor.schedule.ir.PackedProgram` of compute actions, where it touches
integers and two float arrays only: no Action is made. Its verdict is the engine's
``runs_clean`` and its times are the engine's, bit for bit (tests/schedule/test_golden.py
pins them); where it says "not clean", the caller goes to the engine for the message.

The finish table holds, per (region, stage, microbatch), when it was done (``UNSET`` while
not): regions F, G (B or I: a (stage, microbatch) has one of them) and W, then one row that
is always done (what a first-stage forward waits for). A packed code
``(kind * S + stage) * M + microbatch`` finds its slot, and the slot it needs, by adding
a delta that depends on its (kind, stage) only.

Example:
    >>> import conveyor.schedule as cs
    >>> run = step_packed(cs.build("1f1b", ranks=2, microbatches=2, check=False), [1.0] * 8)
    >>> [list(ends) for ends in run.ends]
    [[1.0, 2.0, 4.0, 6.0], [2.0, 3.0, 4.0, 5.0]]
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

from conveyor.schedule.ir import NUM_COMPUTE_KINDS, Schedule

UNSET = -1.0  # no time is negative: clocks start at 0 and costs and latency are >= 0
_F, _B, _I, _W = range(NUM_COMPUTE_KINDS)
_CHUNK = 1 << 16


def fast_eligible(schedule: Schedule) -> bool:
    """Whether :func:`step_packed` serves ``schedule``: packed programs of compute actions only.

    Example:
        >>> import conveyor.schedule as cs
        >>> sched = cs.build("1f1b", ranks=2, microbatches=2)
        >>> fast_eligible(sched), fast_eligible(cs.lower(sched))
        (True, False)
    """
    return isinstance(schedule, Schedule) and not schedule.is_lowered


@dataclass(frozen=True, slots=True)
class PackedRun:
    """Per rank, the start and end of each action of its program, in program order."""

    starts: tuple[array, ...]
    ends: tuple[array, ...]


def key_tables(
    stage_to_rank: Sequence[int], num_microbatches: int, took: Sequence[float], latency: float = 0.0
) -> list[list[tuple | None]]:
    """Per rank, per (kind, stage) key ``kind * S + stage``: ``(slot, need, mark, took, lat)``,
    the deltas from a code to its finish slot, to the slot it needs and to a second slot it
    finishes, its duration (and the latency of its need); None where the key is not the rank's.

    Slots: F, G (B or I), W, then MARK (what only an I finishes: a W waits for it, so a W after a B
    never runs) and the always-done row (what a first-stage forward waits for).

    Example:
        >>> key_tables((0, 1), 1, [1.0] * 8)[1][1]   # F of stage 1 on rank 1: needs F of stage 0
        (0, -1, 0, 1.0, 0.0)
    """
    S, M = len(stage_to_rank), num_microbatches
    SM = S * M
    tables: list[list[tuple | None]] = [[None] * (NUM_COMPUTE_KINDS * S) for _ in range(max(stage_to_rank) + 1)]
    for kind in range(NUM_COMPUTE_KINDS):
        for s in range(S):
            if kind == _F:
                slot, need = 0, (-M if s > 0 else 4 * SM)  # F(s-1, m); stage 0: the always-done row
                remote = s > 0 and stage_to_rank[s - 1] != stage_to_rank[s]
            elif kind == _W:
                slot, need, remote = -SM, 0, False  # the W code is its I's MARK slot
            else:  # B or I: the input gradient of s+1, or on the last stage its own forward
                slot = 0 if kind == _B else -SM
                need = slot + (M if s < S - 1 else -SM)
                remote = s < S - 1 and stage_to_rank[s + 1] != stage_to_rank[s]
            mark = SM if kind == _I else slot
            key = kind * S + s
            row = (slot, need, mark, took[key], latency if remote else 0.0)
            tables[stage_to_rank[s]][key] = row
    return tables


def step_packed(
    schedule: Schedule, took: Sequence[float], latency: float = 0.0, record: bool = True
) -> PackedRun | None:
    """Run a :func:`fast_eligible` schedule, ``took[key]`` the duration of each (kind, stage)
    key; None unless it runs clean (``engine.runs_clean``'s verdict). ``record=False``
    keeps no times (a verdict only: the run's arrays are empty)."""
    S, M = schedule.num_stages, schedule.num_microbatches
    SM = S * M
    codes = [p.codes for p in schedule.programs]
    num_actions = sum(map(len, codes))
    if num_actions < 2 * SM:
        return None  # incomplete (and no tables sized S x M)
    tables = key_tables(schedule.placement.stage_to_rank, M, took, latency)
    finish = array("d", [UNSET]) * (4 * SM + M)
    finish[4 * SM:] = array("d", [float("-inf")]) * M
    producer = list(schedule.placement.stage_to_rank) * 4  # per row (code // M) of the finish table
    starts = tuple(array("d") if record else deque(maxlen=0) for _ in codes)
    ends = tuple(array("d") if record else deque(maxlen=0) for _ in codes)
    try:
        clean = _loop(list(map(iter, codes)), tables, finish, producer, M, starts, ends)
    except TypeError:  # a key missing from the rank's table: an action off its rank
        return None
    if not clean or _count_unset(finish, 0, 2 * SM):
        return None  # a rank stopped early, or a (stage, microbatch) not forwarded or not backwarded
    if 3 * SM - _count_unset(finish, 0, 3 * SM) != num_actions:
        return None  # an action twice (or B and I of one (stage, microbatch))
    if _count_unset(finish, 3 * SM, 4 * SM) != _count_unset(finish, 2 * SM, 3 * SM):
        return None  # an I without its W (a W waits for its I, so none runs without one)
    return PackedRun(starts, ends) if record else PackedRun((), ())


def _loop(remaining: list, tables: list, finish: array, producer: list[int], M: int,
          starts: tuple[array, ...], ends: tuple[array, ...]) -> bool:
    """The engine's stepping loop on slots: whether every rank reached its end.

    A rank runs its next action once the slot it needs is done (plus ``lat`` where another rank
    produced it), else it is parked and another rank runs. ``producer[slot // M]`` is the rank
    that finishes a slot; when a rank stops, the ranks parked on what it finished go on (no
    look-up per finished slot).
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
            now += took
            finish[code + slot] = now
            finish[code + mark] = now
            add_end(now)
        clock[rank] = now
        if waiters[rank]:
            _wake(waiters, rank, finish, work)
    return all(p is None for p in parked)


def _wake(waiters: list[list[tuple[int, int]]], rank: int, finish: array, work: list[int]) -> None:
    """Put the ranks parked on a slot ``rank`` has finished back to work."""
    still = []
    for need, waiter in waiters[rank]:
        if finish[need] == UNSET:
            still.append((need, waiter))
        else:
            work.append(waiter)
    waiters[rank] = still


def _count_unset(finish: array, start: int, stop: int) -> int:
    return sum(finish[at:min(at + _CHUNK, stop)].count(UNSET) for at in range(start, stop, _CHUNK))
