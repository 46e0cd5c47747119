"""Lowering: insert the sends and receives a compute-only schedule implies.

For stage ``s`` and microbatch ``m``, where the neighbour stage runs on another rank:

  RECV_F(s, m)  right before F(s, m)        (input from stage s-1)
  SEND_F(s, m)  right after  F(s, m)        (output to stage s+1)
  RECV_B(s, m)  right before B/I(s, m)      (output gradient from stage s+1)
  SEND_B(s, m)  right after  B/I(s, m)      (input gradient to stage s-1)

A pair of actions a rank runs overlapped (``Schedule.overlapped``: a forward F(a) and a backward
X(b), X = B or I, see :mod:`conveyor.schedule.overlap`) needs both inputs before either starts and
gives both outputs when both are done: ``RECV_F(a) RECV_B(b) F(a) X(b) SEND_F(a) SEND_B(b)``
(those of them that cross ranks). The lowered schedule keeps the pairs.

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
from itertools import chain, repeat
from operator import add, floordiv

from conveyor.errors import ScheduleError
from conveyor.schedule.ir import KIND_INDEX, KINDS, NUM_COMPUTE_KINDS, ActionKind, PackedProgram, Schedule

K = ActionKind


def lower(schedule: Schedule) -> Schedule:
    """Return ``schedule`` with SEND/RECV actions inserted (see the module docstring).

    It does not check the schedule: :func:`conveyor.schedule.verify.verify` the
    result. Each program of a compute-only schedule is lowered when first read (a
    rank's runtime reads its own), and the result records where it came from.

    Example:
        >>> import conveyor.schedule as cs
        >>> sched = cs.build("1f1b", ranks=4, microbatches=8)
        >>> lower(sched) == lower(lower(sched))
        True
    """
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"lower() expects a Schedule, got {type(schedule).__name__}")
    S, M = schedule.num_stages, schedule.num_microbatches
    before, after = _comm_deltas(schedule.placement.stage_to_rank, M)
    pairs = schedule.overlapped
    if not schedule.is_lowered:
        programs = tuple(
            PackedProgram(functools.partial(_lower_paired_codes, program, before, after, pairs[rank])
                          if pairs and pairs[rank] else functools.partial(_lower_codes, program, before, after),
                          S, M, compute_only=False)
            for rank, program in enumerate(schedule.programs))
        return Schedule(schedule.name, schedule.placement, M, programs, lowered_from=schedule, overlapped=pairs)
    programs = tuple(PackedProgram(_lower_codes(program, before, after), S, M, compute_only=False)
                     for program in schedule.programs)
    # Where lowering placed every SEND/RECV (each RECV right before its consumer, each SEND right
    # after its producer), the result verifies and simulates exactly like its source.
    first_comm = NUM_COMPUTE_KINDS * S * M
    placed_all = all(max(program.codes, default=-1) < first_comm for program in schedule.programs)
    return Schedule(schedule.name, schedule.placement, M, programs, lowered_from=schedule if placed_all else None,
                    overlapped=pairs)


_NONE = -(1 << 62)  # a delta that makes a code negative: no communication there


def _lower_codes(program: PackedProgram, before: list[int], after: list[int]) -> array:
    """Each code ``c`` becomes ``[c + before[key]] c [c + after[key]]`` (negative codes dropped).

    A comm code is its compute action's code plus a delta that depends on the (kind, stage)
    only (``key``; kinds are indexed F B I W SEND_F RECV_F SEND_B RECV_B): lowering is C loops
    over the codes. A SEND/RECV the program holds already stays where it is and is not added.
    """
    codes, M = program.codes, program.num_microbatches
    befores = map(add, codes, map(before.__getitem__, map(floordiv, codes, repeat(M))))
    afters = map(add, codes, map(after.__getitem__, map(floordiv, codes, repeat(M))))
    present = set(filter((NUM_COMPUTE_KINDS * program.num_stages * M).__le__, codes))
    if present:  # hand-placed communication: add only what is missing
        befores = [_NONE if code in present else code for code in befores]
        afters = [_NONE if code in present else code for code in afters]
    return array("q", filter((-1).__lt__, chain.from_iterable(zip(befores, codes, afters))))


def _lower_paired_codes(program: PackedProgram, before: list[int], after: list[int], pairs: tuple) -> array:
    """:func:`_lower_codes` of a compute-only program whose ``pairs`` run overlapped: around each pair
    (its forward directly followed by its backward), both receives before it and both sends after it."""
    M = program.num_microbatches
    partner = {program.code_of(forward): program.code_of(backward) for forward, backward in pairs}
    codes, out = program.codes, array("q")
    at, end = 0, len(codes)
    while at < end:
        code = codes[at]
        # A pair whose actions are not adjacent lowers as two actions: verify() refuses it anyway.
        group = (code, codes[at + 1]) if at + 1 < end and partner.get(code) == codes[at + 1] else (code,)
        out.extend(c + before[c // M] for c in group if before[c // M] != _NONE)
        out.extend(group)
        out.extend(c + after[c // M] for c in group if after[c // M] != _NONE)
        at += len(group)
    return out


def _comm_deltas(stage_to_rank: tuple[int, ...], num_microbatches: int) -> tuple[list[int], list[int]]:
    """Per key ``kind_index * S + stage``: the code delta of the comm that goes before / after that
    action (``_NONE``: none there)."""
    S = len(stage_to_rank)
    SM = S * num_microbatches

    def crosses(stage: int, peer: int) -> bool:
        return 0 <= peer < S and stage_to_rank[peer] != stage_to_rank[stage]

    before, after = [_NONE] * (len(KINDS) * S), [_NONE] * (len(KINDS) * S)
    # (kind, what goes before it and the peer stage it comes from, what goes after it and the peer it goes to)
    for kind, receive, source, send, target in (
        (K.F, K.RECV_F, -1, K.SEND_F, 1),
        (K.B, K.RECV_B, 1, K.SEND_B, -1),
        (K.I, K.RECV_B, 1, K.SEND_B, -1),
    ):
        index = KIND_INDEX[id(kind)]
        for s in range(S):
            if crosses(s, s + source):
                before[index * S + s] = (KIND_INDEX[id(receive)] - index) * SM
            if crosses(s, s + target):
                after[index * S + s] = (KIND_INDEX[id(send)] - index) * SM
    return before, after
