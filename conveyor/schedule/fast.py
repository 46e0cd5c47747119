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
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from operator import add, floordiv

from conveyor.schedule.ir import NUM_COMPUTE_KINDS, Schedule

UNSET = -1.0  # no time is negative: clocks start at 0 and costs and latency are >= 0
_F, _B, _I, _W = range(NUM_COMPUTE_KINDS)
_CHUNK = 1 << 16


def fast_eligible(schedule: Schedule) -> bool:
    """Whether :func:`step_packed` serves ``schedule``: packed programs of compute actions only."""
    return isinstance(schedule, Schedule) and schedule.packed and not schedule.is_lowered


@dataclass(frozen=True, slots=True)
class PackedRun:
    """Per rank, the start and end of each action of its program, in program order."""

    starts: tuple[array, ...]
    ends: tuple[array, ...]


def key_tables(stage_to_rank: Sequence[int], num_microbatches: int) -> tuple[list[int], list[int], list[bool]]:
    """Per (kind, stage) key ``kind * S + stage``: the delta from a code to its finish slot, to
    the slot it needs, and whether that need comes from another rank."""
    S, M = len(stage_to_rank), num_microbatches
    SM = S * M
    finish = [0] * S + [0] * S + [-SM] * S + [-SM] * S
    need: list[int] = []
    remote: list[bool] = []
    for kind in range(NUM_COMPUTE_KINDS):
        for s in range(S):
            if kind == _F:
                need.append(-M if s > 0 else 3 * SM)  # F(s-1, m); stage 0: the always-done row
                remote.append(s > 0 and stage_to_rank[s - 1] != stage_to_rank[s])
            elif kind == _W:
                need.append(-2 * SM)  # I(s, m)
                remote.append(False)
            else:  # B or I: the input gradient of s+1, or on the last stage its own forward
                offset = 0 if kind == _B else -SM
                need.append(offset + (M if s < S - 1 else -SM))
                remote.append(s < S - 1 and stage_to_rank[s + 1] != stage_to_rank[s])
    return finish, need, remote


def step_packed(schedule: Schedule, took: Sequence[float], latency: float = 0.0) -> PackedRun | None:
    """Run a :func:`fast_eligible` schedule, ``took[key]`` the duration of each (kind, stage)
    key; None unless it runs clean (``engine.runs_clean``'s verdict)."""
    S, M = schedule.num_stages, schedule.num_microbatches
    SM = S * M
    codes = [p.codes for p in schedule.programs]
    num_actions = sum(map(len, codes))
    if num_actions < 2 * SM or not _on_their_ranks(schedule, codes):
        return None  # incomplete (and no tables sized S x M), or an action off its rank
    finish_delta, need_delta, remote = key_tables(schedule.placement.stage_to_rank, M)
    lat = [latency if r else 0.0 for r in remote] if latency else None
    finish = array("d", [UNSET]) * (3 * SM + M)
    finish[3 * SM:] = array("d", [float("-inf")]) * M
    # Per rank, each action's (kind, stage) key, finish slot and needed slot (4 + 16 bytes each).
    keys = [array("I", map(floordiv, c, repeat(M))) for c in codes]
    slots = [array("q", map(add, c, map(finish_delta.__getitem__, k))) for c, k in zip(codes, keys)]
    needs = [array("q", map(add, c, map(need_delta.__getitem__, k))) for c, k in zip(codes, keys)]
    tooks = [map(took.__getitem__, k) for k in keys]
    if lat is None:
        clean = _loop(list(map(zip, slots, needs, tooks)), finish)
    else:
        clean = _loop_with_latency(list(map(zip, slots, needs, tooks, (map(lat.__getitem__, k) for k in keys))), finish)
    if not clean or not _each_once(finish, SM, num_actions) or not _weights_follow_inputs(codes, SM):
        return None
    ends = tuple(array("d", map(finish.__getitem__, s)) for s in slots)
    # A rank's action starts when both the rank (its previous action's end) and its need are ready.
    starts = []
    for rank_ends, rank_needs, rank_keys in zip(ends, needs, keys):
        ready = map(finish.__getitem__, rank_needs)
        if lat is not None:
            ready = map(add, ready, map(lat.__getitem__, rank_keys))
        starts.append(array("d", map(max, chain((0.0,), rank_ends[:-1]), ready)))
    return PackedRun(tuple(starts), ends)


def _loop(rank_steps: list, finish: array) -> bool:
    """The engine's stepping loop on slots: whether every rank reached its end.

    A rank runs its next action once the slot it needs is done, else it is parked on that
    slot and another rank runs; finishing a slot wakes the rank parked on it.
    """
    num_ranks = len(rank_steps)
    waiting: dict[int, int] = {}
    clock = [0.0] * num_ranks
    parked: list[tuple | None] = [None] * num_ranks
    work = list(range(num_ranks - 1, -1, -1))
    while work:
        rank = work.pop()
        now = clock[rank]
        steps = rank_steps[rank]
        if parked[rank] is not None:  # -- resume: the parked action first
            steps, parked[rank] = chain((parked[rank],), steps), None
        for slot, need, took in steps:
            ready = finish[need]
            if ready == UNSET:
                waiting[need] = rank
                parked[rank] = (slot, need, took)
                break
            if ready > now:
                now = ready
            now += took
            finish[slot] = now
            if slot in waiting:
                work.append(waiting.pop(slot))
        clock[rank] = now
    return all(p is None for p in parked)


def _loop_with_latency(rank_steps: list, finish: array) -> bool:
    """:func:`_loop` where what another rank produced arrives ``lat`` later."""
    num_ranks = len(rank_steps)
    waiting: dict[int, int] = {}
    clock = [0.0] * num_ranks
    parked: list[tuple | None] = [None] * num_ranks
    work = list(range(num_ranks - 1, -1, -1))
    while work:
        rank = work.pop()
        now = clock[rank]
        steps = rank_steps[rank]
        if parked[rank] is not None:
            steps, parked[rank] = chain((parked[rank],), steps), None
        for slot, need, took, lat in steps:
            ready = finish[need]
            if ready == UNSET:
                waiting[need] = rank
                parked[rank] = (slot, need, took, lat)
                break
            ready += lat
            if ready > now:
                now = ready
            now += took
            finish[slot] = now
            if slot in waiting:
                work.append(waiting.pop(slot))
        clock[rank] = now
    return all(p is None for p in parked)


def _on_their_ranks(schedule: Schedule, codes: list[array]) -> bool:
    """Every action's stage on the action's rank (the engine's tables reject the others)."""
    S, M = schedule.num_stages, schedule.num_microbatches
    for rank, rank_codes in enumerate(codes):
        own = {kind * S + s for s in schedule.placement.stages_of(rank) for kind in range(NUM_COMPUTE_KINDS)}
        if rank_codes and not set(map(floordiv, rank_codes, repeat(M))) <= own:
            return False
    return True


def _each_once(finish: array, SM: int, num_actions: int) -> bool:
    """Every F and B/I done, and as many slots done as there are actions (none twice)."""
    if _count_unset(finish, 0, 2 * SM):
        return False
    return 3 * SM - _count_unset(finish, 0, 3 * SM) == num_actions


def _count_unset(finish: array, start: int, stop: int) -> int:
    return sum(finish[at:min(at + _CHUNK, stop)].count(UNSET) for at in range(start, stop, _CHUNK))


def _weights_follow_inputs(codes: list[array], SM: int) -> bool:
    """A W exactly where the backward was an I (B-then-W and I-without-W both fail)."""
    inputs, weights = range(2 * SM, 3 * SM).__contains__, range(3 * SM, 4 * SM).__contains__
    for rank_codes in codes:  # no action twice (checked before): sets will do
        if set(map(add, filter(inputs, rank_codes), repeat(SM))) != set(filter(weights, rank_codes)):
            return False
    return True
