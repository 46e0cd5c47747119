"""Lowering: insert the sends and receives a compute-only schedule implies.

For stage ``s`` and microbatch ``m``, where the neighbour stage runs on another rank:

  RECV_F(s, m)  right before F(s, m)        (input from stage s-1)
  SEND_F(s, m)  right after  F(s, m)        (output to stage s+1)
  RECV_B(s, m)  right before B/I(s, m)      (output gradient from stage s+1)
  SEND_B(s, m)  right after  B/I(s, m)      (input gradient to stage s-1)

A RECV names the receiving stage (torch's convention: ``2RECV_F0`` receives
what ``1SEND_F0`` sends). Stages on the same rank (the fold of a V placement)
pass tensors in memory and get no communication. Lowering a lowered schedule
adds only what is missing, so ``lower(lower(s)) == lower(s)`` and hand-placed
communication stays where it is.

Example:
    >>> import conveyor.schedule as cs
    >>> lowered = lower(cs.build("gpipe", ranks=2, microbatches=1))
    >>> [str(a) for a in lowered.programs[1]]
    ['1RECV_F0', '1F0', '1B0', '1SEND_B0']
"""

from __future__ import annotations

import functools
from array import array
from collections import deque
from collections.abc import Sequence
from itertools import chain, compress, repeat
from operator import add, floordiv

from conveyor.errors import ScheduleError
from conveyor.schedule.engine import COMM_KIND_IDS
from conveyor.schedule.ir import (
    NUM_COMPUTE_KINDS,
    Action,
    ActionKind,
    PackedProgram,
    Schedule,
    actions_in_bulk,
    gc_paused,
)

K = ActionKind

_KINDS = tuple(ActionKind)


def lower(schedule: Schedule) -> Schedule:
    """Return ``schedule`` with SEND/RECV actions inserted (see the module docstring).

    It does not check the schedule: :func:`conveyor.schedule.verify.verify` the
    result. Malformed actions raise the verifier's :class:`ScheduleError`.

    Example:
        >>> import conveyor.schedule as cs
        >>> sched = cs.build("1f1b", ranks=4, microbatches=8)
        >>> lower(sched) == lower(lower(sched))
        True
    """
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"lower() expects a Schedule, got {type(schedule).__name__}")
    if schedule.packed and not schedule.is_lowered:
        return _lower_packed(schedule)
    try:
        with gc_paused():
            before, after = _comm_tables(schedule.placement.stage_to_rank)
            lowered_ranks = [_lower_rank(schedule, rank, before, after) for rank in range(schedule.num_ranks)]
    except (AttributeError, TypeError, IndexError, KeyError, ValueError) as error:
        from conveyor.schedule.verify import verify

        verify(schedule)  # raises the precise message for the malformed action
        raise AssertionError(f"lower() failed on a schedule that verifies: {error!r}") from error
    programs = tuple(program for program, _ in lowered_ranks)
    # Where lowering placed every SEND/RECV (each RECV right before its consumer, each SEND right
    # after its producer), the result verifies and simulates exactly like its source.
    placed_all = not any(had_comms for _, had_comms in lowered_ranks)
    return Schedule(schedule.name, schedule.placement, schedule.num_microbatches, programs,
                    lowered_from=schedule if placed_all else None)


_NONE = -(1 << 62)  # a delta that makes a code negative: no communication there


def _lower_packed(schedule: Schedule) -> Schedule:
    """:func:`lower` of packed compute-only programs, each lowered when first read.

    A comm code is its compute action's code plus a delta that depends on the (kind, stage)
    only (kinds are indexed F B I W SEND_F RECV_F SEND_B RECV_B): lowering is C loops over
    the codes.
    """
    before, after = _packed_comm_deltas(schedule.placement.stage_to_rank, schedule.num_microbatches)
    programs = tuple(
        PackedProgram(functools.partial(_lower_codes, program, before, after),
                      program.num_stages, program.num_microbatches, compute_only=False)
        for program in schedule.programs
    )
    return Schedule(schedule.name, schedule.placement, schedule.num_microbatches, programs, lowered_from=schedule)


def _lower_codes(program: PackedProgram, before: list[int], after: list[int]) -> array:
    codes, M = program.codes, program.num_microbatches
    befores = map(add, codes, map(before.__getitem__, map(floordiv, codes, repeat(M))))
    afters = map(add, codes, map(after.__getitem__, map(floordiv, codes, repeat(M))))
    return array("q", filter((-1).__lt__, chain.from_iterable(zip(befores, codes, afters))))


def _packed_comm_deltas(stage_to_rank: tuple[int, ...], num_microbatches: int) -> tuple[list[int], list[int]]:
    """Per compute key ``kind * S + stage``: the code delta of the comm that goes before / after it."""
    S = len(stage_to_rank)
    SM = S * num_microbatches
    before_kinds, after_kinds = _comm_tables(stage_to_rank)
    index = {id(kind): i for i, kind in enumerate(_KINDS)}
    before, after = [], []
    for key in range(NUM_COMPUTE_KINDS * S):
        kind_index = key // S
        for table, out in ((before_kinds, before), (after_kinds, after)):
            comm = table[key]
            out.append(_NONE if comm is None else (index[id(comm)] - kind_index) * SM)
    return before, after


def _lower_rank(
    schedule: Schedule, rank: int, before: list[ActionKind | None], after: list[ActionKind | None]
) -> tuple[tuple[Action, ...], bool]:
    """One rank's program with its communication, and whether it had any already.

    Built with C loops (map/compress/filter) only.

    Each action i expands to ``[before_i] action_i [after_i]``: the kinds of
    what goes before and after come from a (kind, stage) table; the new
    actions are built in bulk and zipped in.
    """
    program = schedule.programs[rank]
    if not program:
        return (), False
    S = schedule.num_stages
    kind_offset = {id(kind): index * S for index, kind in enumerate(_KINDS)}
    stages = [a.stage for a in program]
    microbatches = [a.microbatch for a in program]
    if min(stages) < 0 or max(stages) >= S:
        raise IndexError("stage out of range")  # -> verify() words it
    kind_ids = list(map(id, [a.kind for a in program]))
    kind_stage = list(map(add, map(kind_offset.__getitem__, kind_ids), stages))
    had_comms = not set(kind_ids).isdisjoint(COMM_KIND_IDS)
    present = _present_comms(program) if had_comms else set()
    sides = []
    for table in (before, after):
        kinds = list(map(table.__getitem__, kind_stage))  # a comm kind, or None
        if present:
            kinds = [
                None if k is None or (id(k), s, m) in present else k for k, s, m in zip(kinds, stages, microbatches)
            ]
        new = actions_in_bulk(
            list(filter(None, kinds)), list(compress(stages, kinds)), list(compress(microbatches, kinds))
        )
        # Scatter the new actions back to their positions (None elsewhere).
        aligned: list[Action | None] = [None] * len(kinds)
        deque(map(aligned.__setitem__, compress(range(len(kinds)), kinds), new), maxlen=0)
        sides.append(aligned)
    # Actions are truthy and the gaps None: filter(None) drops the gaps.
    return tuple(filter(None, chain.from_iterable(zip(sides[0], program, sides[1])))), had_comms


def _comm_tables(stage_to_rank: tuple[int, ...]) -> tuple[list, list]:
    """For each ``kind_index * S + stage``: the comm kind that goes before / after that action, or None."""
    S = len(stage_to_rank)

    def crosses(stage: int, peer: int) -> bool:
        return 0 <= peer < S and stage_to_rank[peer] != stage_to_rank[stage]

    before: list[ActionKind | None] = [None] * (len(_KINDS) * S)
    after: list[ActionKind | None] = [None] * (len(_KINDS) * S)
    for index, kind in enumerate(_KINDS):
        for s in range(S):
            if kind is K.F:
                before[index * S + s] = K.RECV_F if crosses(s, s - 1) else None
                after[index * S + s] = K.SEND_F if crosses(s, s + 1) else None
            elif kind is K.B or kind is K.I:
                before[index * S + s] = K.RECV_B if crosses(s, s + 1) else None
                after[index * S + s] = K.SEND_B if crosses(s, s - 1) else None
    return before, after


def _present_comms(program: Sequence[Action]) -> set[tuple[int, int, int]]:
    """The SEND/RECV already in a (partly) lowered program, as (id(kind), stage, microbatch)."""
    return {(id(a.kind), a.stage, a.microbatch) for a in program if id(a.kind) in COMM_KIND_IDS}
