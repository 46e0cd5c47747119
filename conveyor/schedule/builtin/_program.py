"""Pieces the built-in schedules share: a fast program writer and the looped 1F1B shape.

A builder writes each rank's program with a :class:`ProgramWriter` (three
parallel int/enum lists) and encodes it in one go at the end (a :class:`PackedProgram`,
an integer per action): at P=64, V=2, M=1024 a schedule has 262,144 actions, and a frozen
dataclass's ``__init__`` per action would cost more than the whole rest of the
build.

:func:`looped_schedule` builds 1F1B, interleaved 1F1B, ZB-H1 and ZB-H2, which share
one program shape on a looped placement (stage ``s`` on rank ``s % P``): warm-up
forwards, then one forward and one backward in turn, then the remaining backwards;
with the backward split, each ``W`` may wait a fixed number of ``I`` behind.
:func:`breadth_first` builds GPipe and looped BFS, :func:`vshape_schedule` ZB-V and DualPipeV.

Example:
    >>> [str(a) for a in looped_schedule("1f1b", 2, 3, 1, warmup_per_hop=1).programs[1]]
    ['1F0', '1B0', '1F1', '1B1', '1F2', '1B2']
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from itertools import compress, repeat
from operator import add, mul

from conveyor.errors import ScheduleError, positive_int
from conveyor.schedule.ir import (
    KIND_INDEX,
    NUM_COMPUTE_KINDS,
    ActionKind,
    PackedProgram,
    Placement,
    Schedule,
)

_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W



class ProgramWriter:
    """One rank's program, appended action by action or column by column, encoded in one go.

    Columns stay as given until :meth:`packed` encodes them: a column of one stage over a
    range of microbatches is a range of codes, built with no loop per action. The sequences
    a column is given are read then: do not change them after handing them over.

    Example:
        >>> writer = ProgramWriter()
        >>> writer.add(ActionKind.F, 0, 0); writer.add(ActionKind.I, 0, 0); writer.add(ActionKind.W, 0, 0)
        >>> [str(a) for a in writer.packed(1, 1)]
        ['0F0', '0I0', '0W0']
    """

    __slots__ = ("_segments", "_rows", "_length")

    def __init__(self) -> None:
        # ("rows", (kinds, stages, microbatches)) from add(), or ("weave", columns).
        self._segments: list[tuple[str, object]] = []
        self._rows: tuple[list, list, list] | None = None
        self._length = 0

    def add(self, kind: ActionKind, stage: int, microbatch: int) -> None:
        if self._rows is None:
            self._rows = ([], [], [])
            self._segments.append(("rows", self._rows))
        kinds, stages, microbatches = self._rows
        kinds.append(kind)
        stages.append(stage)
        microbatches.append(microbatch)
        self._length += 1

    def extend(self, kind: ActionKind, stages: Sequence[int], microbatches: Sequence[int]) -> None:
        """Append ``kind`` for each (stage, microbatch) pair of the two sequences."""
        self.weave([(kind, stages, microbatches)])

    def weave(self, columns: Sequence[tuple[ActionKind, Sequence[int], Sequence[int]]]) -> None:
        """Append n steps, step j running ``columns[0]``'s j-th action, then ``columns[1]``'s, ...

        Each column is (kind, stages, microbatches) of the same length n; the
        lists are interleaved by slice assignment, with no Python loop per action.

        Example:
            >>> writer = ProgramWriter()
            >>> writer.weave([(ActionKind.F, [0, 0], [2, 3]), (ActionKind.B, [0, 0], [0, 1])])
            >>> [str(a) for a in writer.packed(1, 4)]
            ['0F2', '0B0', '0F3', '0B1']
        """
        steps = len(columns[0][1])
        assert all(len(c[1]) == len(c[2]) == steps for c in columns), "columns of different lengths"
        self._rows = None
        self._segments.append(("weave", list(columns)))
        self._length += len(columns) * steps

    def __len__(self) -> int:
        return self._length

    def packed(self, num_stages: int, num_microbatches: int, below: int | None = None) -> PackedProgram:
        """The program as integer codes (see :class:`PackedProgram`), then the writer is emptied.

        Example:
            >>> writer = ProgramWriter()
            >>> writer.add(ActionKind.F, 1, 0); writer.add(ActionKind.B, 1, 0)
            >>> [str(a) for a in writer.packed(2, 1)]
            ['1F0', '1B0']
        """
        program = None
        if below is None:  # with padding microbatches (>= M, no code) the fields are filtered first
            program = self._packed(num_stages, num_microbatches)
        if program is None:
            program = PackedProgram.from_fields(*self._fields(below), num_stages, num_microbatches)
        if program is None:
            raise ScheduleError(
                f"a builder wrote an action outside {num_stages} stages x {num_microbatches} microbatches"
            )
        self.__init__()  # a P=256 build holds one rank's columns at a time
        return program

    def _packed(self, S: int, M: int) -> PackedProgram | None:
        codes, compute_only = array("q"), True
        for what, segment in self._segments:
            if what == "rows":
                part = PackedProgram.from_fields(*segment, S, M)
                if part is None:
                    return None
                compute_only &= part.compute_only
                codes.extend(part.codes)
                continue
            columns = [_column_codes(kind, stages, microbatches, S, M) for kind, stages, microbatches in segment]
            if any(c is None for c in columns):
                return None
            compute_only &= all(KIND_INDEX[id(kind)] < NUM_COMPUTE_KINDS for kind, _, _ in segment)
            if len(columns) == 1:
                codes.extend(columns[0])
                continue
            woven = array("q", bytes(8 * len(columns) * len(columns[0])))
            for offset, column in enumerate(columns):
                woven[offset::len(columns)] = column
            codes.extend(woven)
        return PackedProgram(codes, S, M, compute_only)

    def _fields(self, below: int | None) -> tuple[list, list, list]:
        kinds: list = []
        stages: list = []
        microbatches: list = []
        for what, segment in self._segments:
            if what == "rows":
                for out, values in zip((kinds, stages, microbatches), segment):
                    out.extend(values)
                continue
            width, steps = len(segment), len(segment[0][1])
            woven: tuple[list, list, list] = ([None] * (width * steps), [0] * (width * steps), [0] * (width * steps))
            for offset, (kind, column_stages, column_microbatches) in enumerate(segment):
                woven[0][offset::width] = repeat(kind, steps)
                woven[1][offset::width] = column_stages
                woven[2][offset::width] = column_microbatches
            for out, values in zip((kinds, stages, microbatches), woven):
                out.extend(values)
        if below is not None:
            keep = [m < below for m in microbatches]
            kinds, stages, microbatches = (list(compress(values, keep)) for values in (kinds, stages, microbatches))
        return kinds, stages, microbatches


def _column_codes(kind: ActionKind, stages: Sequence[int], microbatches: Sequence[int], S: int, M: int) -> array | None:
    """The codes of one column; None where an id is no int in range (the caller words it)."""
    index = KIND_INDEX.get(id(kind))
    n = len(stages)
    if index is None or not n:
        return None if index is None else array("q")
    if not _within(stages, S) or not _within(microbatches, M):
        return None
    first = stages[0]
    try:  # array("q") refuses what is not an int: no pass over the types
        if stages.count(first) != n:
            key = map(add, stages, repeat(index * S))
            return array("q", map(add, map(mul, key, repeat(M)), microbatches))
        if type(first) is not int:
            return None
        base = (index * S + first) * M
        if type(microbatches) is range:  # one stage, a range of microbatches: a range of codes
            return array("q", range(base + microbatches.start, base + microbatches.stop, microbatches.step))
        return array("q", map(add, microbatches, repeat(base)))
    except TypeError:
        return None


def _within(values: Sequence[int], bound: int) -> bool:
    """Every value in ``0..bound-1`` (C loops; a range by its ends)."""
    if type(values) is range:
        return not values or (0 <= values[0] < bound and 0 <= values[-1] < bound)
    try:
        return min(values) >= 0 and max(values) < bound
    except TypeError:  # not numbers
        return False


def check_sizes(
    name: str, num_ranks: int, num_microbatches: int, virtual: int, only_virtual: int | None = None
) -> None:
    """Raise ScheduleError unless all three sizes are positive integers (builders called directly) and,
    for a schedule of a fixed number of stages per rank, ``virtual`` is ``only_virtual``."""
    for what, value in (
        ("num_ranks", num_ranks),
        ("num_microbatches", num_microbatches),
        ("virtual", virtual),
    ):
        if not positive_int(value):
            raise ScheduleError(
                f"schedule {name!r}: {what} must be a positive integer, got {value!r}"
            )
    if only_virtual is not None and virtual != only_virtual:
        raise ScheduleError(
            f"schedule {name!r} runs exactly {only_virtual} stage(s) per rank, got virtual={virtual}; "
            f"pass virtual={only_virtual} (or leave it out)"
        )


def microbatch_rounds(num_ranks: int, num_microbatches: int) -> list[range]:
    """Microbatches in consecutive rounds of at least ``num_ranks`` each, larger rounds first.

    A looped schedule runs a whole round through one local stage before the
    next (Megatron's "microbatch group"). ``max(1, M // P)`` rounds whose sizes
    differ by at most one cover every M, and the larger rounds go first: a
    round larger than the first would make the last rank's warm-up too short
    to hold its forwards, which deadlocks.

    Example:
        >>> microbatch_rounds(4, 8), microbatch_rounds(4, 9), microbatch_rounds(4, 3)
        ([range(0, 4), range(4, 8)], [range(0, 5), range(5, 9)], [range(0, 3)])
    """
    num_rounds = max(1, num_microbatches // num_ranks)
    size, larger = divmod(num_microbatches, num_rounds)
    rounds, start = [], 0
    for index in range(num_rounds):
        end = start + size + (1 if index < larger else 0)
        rounds.append(range(start, end))
        start = end
    return rounds


def looped_order(
    rank: int, num_ranks: int, virtual: int, rounds: Sequence[range], *, backward: bool
) -> tuple[list[int], list[int]]:
    """(stages, microbatches) in the order ``rank`` forwards them (or backwards, last local stage first)."""
    local_stages = range(virtual - 1, -1, -1) if backward else range(virtual)
    stages: list[int] = []
    microbatches: list[int] = []
    for microbatch_round in rounds:
        for local in local_stages:
            stages.extend(repeat(local * num_ranks + rank, len(microbatch_round)))
            microbatches.extend(microbatch_round)
    return stages, microbatches


def looped_schedule(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    virtual: int,
    *,
    warmup_per_hop: int,
    weights_behind_per_rank: int | None = None,
    only_virtual: int | None = None,
) -> Schedule:
    """A schedule of warm-up / one-forward-one-backward / cool-down programs on a looped placement:
    1F1B (1, None), interleaved 1F1B (2 for V > 1, None), ZB-H1 (1 and 1) and ZB-H2 (2 and 2).

    Phases on rank r (n = V x M actions of each pass on it, G the first round's size):
      1. warm-up: the first ``min(w, n)`` forwards, w = ``(V-1) x G + warmup_per_hop x (P-1-r)``;
      2. steady: the next forward, then the next backward, while forwards remain;
      3. cool-down: the remaining backwards;
    and with ``weights_behind_per_rank``, the backward is split: each backward is ``I`` and the
    oldest pending ``W`` follows it once more than ``weights_behind_per_rank x r`` are pending; the
    rest end the program, in microbatch order per stage (see ``zb_h1.py``, ``zb_h2.py``).
    """
    check_sizes(name, num_ranks, num_microbatches, virtual, only_virtual)
    rounds = microbatch_rounds(num_ranks, num_microbatches)

    def part(kind: ActionKind, order: tuple[list[int], list[int]], low: int, high: int) -> tuple:
        """``kind`` of the ``low``-th to ``high``-th (stage, microbatch) of ``order``, as a column."""
        return kind, order[0][low:high], order[1][low:high]

    programs = []
    for rank in range(num_ranks):
        forward = looped_order(rank, num_ranks, virtual, rounds, backward=False)
        backward = looped_order(rank, num_ranks, virtual, rounds, backward=True)
        total = len(forward[0])
        warmup = min((virtual - 1) * len(rounds[0]) + warmup_per_hop * (num_ranks - 1 - rank), total)
        steady = total - warmup  # steps that start with a forward
        writer = ProgramWriter()
        writer.extend(*part(_F, forward, 0, warmup))
        if weights_behind_per_rank is None:
            writer.weave([part(_F, forward, warmup, total), part(_B, backward, 0, steady)])
            writer.extend(*part(_B, backward, steady, total))
        else:
            # Step k (one per I): F(warmup + k) while k < steady, then I(k), then W(k - behind) once
            # k >= behind. Between these two bounds each step has the same shape: weave it whole.
            behind = weights_behind_per_rank * rank
            bounds = sorted({0, min(steady, total), min(behind, total), total})
            for low, high in zip(bounds, bounds[1:]):
                columns = [part(_F, forward, warmup + low, warmup + high)] if low < steady else []
                columns.append(part(_I, backward, low, high))
                if low >= behind:
                    columns.append(part(_W, backward, low - behind, high - behind))
                writer.weave(columns)
            writer.extend(*part(_W, backward, max(0, total - behind), total))
        programs.append(writer.packed(num_ranks * virtual, num_microbatches))  # one rank's lists at a time
    return Schedule(name, Placement.looped(num_ranks, virtual), num_microbatches, tuple(programs))


def breadth_first(name: str, num_ranks: int, num_microbatches: int, virtual: int,
                  only_virtual: int | None = None) -> Schedule:
    """GPipe (V = 1) and looped BFS: on a looped placement, each rank forwards every microbatch
    through each local stage in turn, then backwards them through its local stages in reverse: the looped
    order of one round of all M microbatches."""
    check_sizes(name, num_ranks, num_microbatches, virtual, only_virtual)
    rounds, programs = [range(num_microbatches)], []
    for rank in range(num_ranks):
        writer = ProgramWriter()
        writer.extend(_F, *looped_order(rank, num_ranks, virtual, rounds, backward=False))
        writer.extend(_B, *looped_order(rank, num_ranks, virtual, rounds, backward=True))
        programs.append(writer.packed(num_ranks * virtual, num_microbatches))
    return Schedule(name, Placement.looped(num_ranks, virtual), num_microbatches, tuple(programs))


def vshape_schedule(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    virtual: int,
    least: int,
    rank_program: Callable[[int, int, int], ProgramWriter],
) -> Schedule:
    """ZB-V and DualPipeV: two stages per rank in a V, ``rank_program(rank, P, n)`` writing each rank's
    program for n = max(M, ``least``) microbatches; for M < ``least`` the padding microbatches (>= M)
    are left out, which cannot create a wait (every dependency is within one microbatch)."""
    check_sizes(name, num_ranks, num_microbatches, virtual, only_virtual=2)
    padded = max(num_microbatches, least)
    below = num_microbatches if padded > num_microbatches else None  # leave the padding out
    programs = tuple(rank_program(rank, num_ranks, padded).packed(2 * num_ranks, num_microbatches, below)
                     for rank in range(num_ranks))
    return Schedule(name, Placement.vshape(num_ranks), num_microbatches, programs)


def listing(schedule: Schedule, width: int = 96) -> str:
    """Each rank's program on its own line(s), wrapped at ``width`` characters (used in docstrings).

    Example:
        >>> import conveyor.schedule as cs
        >>> print(listing(cs.build("1f1b", ranks=2, microbatches=3)))
        rank 0: 0F0 0F1 0B0 0F2 0B1 0B2
        rank 1: 1F0 1B0 1F1 1B1 1F2 1B2
    """
    lines = []
    label_width = len(f"rank {schedule.num_ranks - 1}: ")
    for rank, program in enumerate(schedule.programs):
        line, on_line = f"rank {rank}: ".ljust(label_width), 0
        for action in map(str, program):
            if on_line and len(line) + len(action) > width:
                lines.append(line.rstrip())
                line, on_line = " " * label_width, 0
            line += action + " "
            on_line += 1
        lines.append(line.rstrip())
    return "\n".join(lines)
