"""Pieces the built-in schedules share: a fast program writer and the looped 1F1B shape.

A builder writes each rank's program with a :class:`ProgramWriter` (three
parallel int/enum lists) and turns it into :class:`Action` records in bulk at
the end: at P=64, V=2, M=1024 a schedule has 262,144 actions, and a frozen
dataclass's ``__init__`` per action would cost more than the whole rest of the
build.

:func:`looped_one_f_one_b` is the program shape that 1F1B, interleaved 1F1B,
ZB-H1 and ZB-H2 share on a looped placement (stage ``s`` on rank ``s % P``):
warm-up forwards, then one forward and one backward in turn, then the
remaining backwards; with the backward split, each ``W`` may wait a fixed
number of ``I`` behind.

Example:
    >>> writer = ProgramWriter()
    >>> looped_one_f_one_b(writer, rank=1, num_ranks=2, virtual=1,
    ...                    rounds=microbatch_rounds(2, 3), warmup=0)
    >>> [str(a) for a in writer.actions()]
    ['1F0', '1B0', '1F1', '1B1', '1F2', '1B2']
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, repeat

from conveyor.errors import ScheduleError
from conveyor.schedule.ir import Action, ActionKind, Placement, Schedule, actions_in_bulk

_F, _B, _I, _W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W



class ProgramWriter:
    """One rank's program, appended action by action, turned into Actions in one go.

    Example:
        >>> writer = ProgramWriter()
        >>> writer.forward(0, 0); writer.backward_input(0, 0); writer.backward_weight(0, 0)
        >>> [str(a) for a in writer.actions()]
        ['0F0', '0I0', '0W0']
    """

    __slots__ = ("kinds", "stages", "microbatches")

    def __init__(self) -> None:
        self.kinds: list[ActionKind] = []
        self.stages: list[int] = []
        self.microbatches: list[int] = []

    def add(self, kind: ActionKind, stage: int, microbatch: int) -> None:
        self.kinds.append(kind)
        self.stages.append(stage)
        self.microbatches.append(microbatch)

    def extend(self, kind: ActionKind, stages: Sequence[int], microbatches: Sequence[int]) -> None:
        """Append ``kind`` for each (stage, microbatch) pair of the two sequences."""
        self.kinds.extend(repeat(kind, len(stages)))
        self.stages.extend(stages)
        self.microbatches.extend(microbatches)

    def weave(self, columns: Sequence[tuple[ActionKind, Sequence[int], Sequence[int]]]) -> None:
        """Append n steps, step j running ``columns[0]``'s j-th action, then ``columns[1]``'s, ...

        Each column is (kind, stages, microbatches) of the same length n; the
        lists are interleaved by slice assignment, with no Python loop per action.

        Example:
            >>> writer = ProgramWriter()
            >>> writer.weave([(ActionKind.F, [0, 0], [2, 3]), (ActionKind.B, [0, 0], [0, 1])])
            >>> [str(a) for a in writer.actions()]
            ['0F2', '0B0', '0F3', '0B1']
        """
        width, steps = len(columns), len(columns[0][1])
        assert all(len(c[1]) == len(c[2]) == steps for c in columns), "columns of different lengths"
        kinds: list = [None] * (width * steps)
        stages: list = [0] * (width * steps)
        microbatches: list = [0] * (width * steps)
        for offset, (kind, column_stages, column_microbatches) in enumerate(columns):
            kinds[offset::width] = repeat(kind, steps)
            stages[offset::width] = column_stages
            microbatches[offset::width] = column_microbatches
        self.kinds.extend(kinds)
        self.stages.extend(stages)
        self.microbatches.extend(microbatches)

    def forward(self, stage: int, microbatch: int) -> None:
        self.add(_F, stage, microbatch)

    def backward(self, stage: int, microbatch: int) -> None:
        """Full backward (input and weight gradients together)."""
        self.add(_B, stage, microbatch)

    def backward_input(self, stage: int, microbatch: int) -> None:
        self.add(_I, stage, microbatch)

    def backward_weight(self, stage: int, microbatch: int) -> None:
        self.add(_W, stage, microbatch)

    def __len__(self) -> int:
        return len(self.kinds)

    def actions(self, below: int | None = None) -> tuple[Action, ...]:
        """The program as Actions; with ``below``, only those of microbatches ``< below``."""
        kinds, stages, microbatches = self.kinds, self.stages, self.microbatches
        if below is not None:
            keep = [m < below for m in microbatches]
            kinds = list(compress(kinds, keep))
            stages = list(compress(stages, keep))
            microbatches = list(compress(microbatches, keep))
        return tuple(actions_in_bulk(kinds, stages, microbatches))


def check_sizes(name: str, num_ranks: int, num_microbatches: int, virtual: int) -> None:
    """Raise ScheduleError unless all three sizes are positive integers (builders called directly)."""
    for what, value in (
        ("num_ranks", num_ranks),
        ("num_microbatches", num_microbatches),
        ("virtual", virtual),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(
                f"schedule {name!r}: {what} must be a positive integer, got {value!r}"
            )


def check_virtual(name: str, virtual: int, allowed: int) -> None:
    if virtual != allowed:
        raise ScheduleError(
            f"schedule {name!r} runs exactly {allowed} stage(s) per rank, got virtual={virtual}; "
            f"pass virtual={allowed} (or leave it out)"
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


def looped_one_f_one_b(
    writer: ProgramWriter,
    *,
    rank: int,
    num_ranks: int,
    virtual: int,
    rounds: Sequence[range],
    warmup: int,
    split_backward: bool = False,
    weights_behind: int = 0,
) -> None:
    """Write one rank's warm-up / one-forward-one-backward / cool-down program.

    Phases (n = virtual x M actions of each pass on this rank):
      1. warm-up: the first ``min(warmup, n)`` forwards;
      2. steady: the next forward, then the next backward, while forwards remain;
      3. cool-down: the remaining backwards;
    and with ``split_backward``, each backward is ``I`` and the oldest pending
    ``W`` follows it once more than ``weights_behind`` are pending; the rest
    end the program, in microbatch order per stage.
    """
    forward_stages, forward_microbatches = looped_order(
        rank, num_ranks, virtual, rounds, backward=False
    )
    backward_stages, backward_microbatches = looped_order(
        rank, num_ranks, virtual, rounds, backward=True
    )
    total = len(forward_stages)
    warmup = min(warmup, total)
    steady = total - warmup  # steps that start with a forward
    writer.extend(_F, forward_stages[:warmup], forward_microbatches[:warmup])
    if not split_backward:
        writer.weave(
            [
                (_F, forward_stages[warmup:], forward_microbatches[warmup:]),
                (_B, backward_stages[:steady], backward_microbatches[:steady]),
            ]
        )
        writer.extend(_B, backward_stages[steady:], backward_microbatches[steady:])
        return
    # Step k (one per I): F(warmup + k) while k < steady, then I(k), then W(k - behind) once
    # k >= behind. Between these two bounds each step has the same shape: weave it whole.
    behind = weights_behind
    bounds = sorted({0, min(steady, total), min(behind, total), total})
    for low, high in zip(bounds, bounds[1:]):
        columns = []
        if low < steady:
            columns.append(
                (
                    _F,
                    forward_stages[warmup + low : warmup + high],
                    forward_microbatches[warmup + low : warmup + high],
                )
            )
        columns.append((_I, backward_stages[low:high], backward_microbatches[low:high]))
        if low >= behind:
            columns.append(
                (
                    _W,
                    backward_stages[low - behind : high - behind],
                    backward_microbatches[low - behind : high - behind],
                )
            )
        writer.weave(columns)
    held_back = max(0, total - behind)
    writer.extend(_W, backward_stages[held_back:], backward_microbatches[held_back:])


def handcrafted_zero_bubble(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    virtual: int,
    *,
    warmup_per_hop: int,
    weights_behind_per_rank: int,
) -> Schedule:
    """ZB-H1 (1 and 1) and ZB-H2 (2 and 2): 1F1B-shaped programs with the backward split.

    Rank r warms up with ``(V-1) x G + warmup_per_hop x (P-1-r)`` forwards and lets
    its W lag ``weights_behind_per_rank x r`` I behind (see ``zb_h1.py``, ``zb_h2.py``).
    """
    check_sizes(name, num_ranks, num_microbatches, virtual)
    rounds = microbatch_rounds(num_ranks, num_microbatches)
    writers = []
    for rank in range(num_ranks):
        writer = ProgramWriter()
        looped_one_f_one_b(
            writer,
            rank=rank,
            num_ranks=num_ranks,
            virtual=virtual,
            rounds=rounds,
            warmup=(virtual - 1) * len(rounds[0]) + warmup_per_hop * (num_ranks - 1 - rank),
            split_backward=True,
            weights_behind=weights_behind_per_rank * rank,
        )
        writers.append(writer)
    return make_schedule(name, Placement.looped(num_ranks, virtual), num_microbatches, writers)


def make_schedule(
    name: str,
    placement: Placement,
    num_microbatches: int,
    writers: Sequence[ProgramWriter],
    below: int | None = None,
) -> Schedule:
    """A Schedule from one writer per rank (``below``: drop the padding microbatches >= it)."""
    return Schedule(name, placement, num_microbatches, tuple(w.actions(below) for w in writers))


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
