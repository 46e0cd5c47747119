"""DualPipeV, DeepSeek's V-shaped DualPipe (DeepSeek-AI, "DeepSeek-V3 Technical Report",
arXiv 2412.19437, Section 3.2.1; the V form by Sea AI Lab's "cut-in-half" of DualPipe,
code and table in github.com/deepseek-ai/DualPipe).

Two stages per rank folded into a V (``Placement.vshape``): rank r runs stage
r on the way down and stage 2P-1-r on the way up. Its steady phase pairs a
forward of one stage with a full backward of the other, which DeepSeek run
overlapped ("F&B": one stream's communication hidden behind the other's
compute); here a pair is the F then the B, adjacent in the program. The
ramp-down splits backwards into I and W to fill its gaps.

Phases on rank r of P ("down" = stage r, "up" = stage 2P-1-r; n = max(M, 2P)):
  1. forward 2(P-1-r) microbatches down;
  2. r+1 times: forward down, forward up;
  3. P-1-r times: I up, W (oldest held back), forward up;
  4. n-2P+r+1 times: the pairs (F down & B up), (F up & B down);
  5. P-1-r times: B up, then the pair (F up & B down);
  6. r+1 times: backward up, backward down, full B for the first half of these
     and I from the middle on (from the up one on odd ranks, the down one on even);
  7. P-1-r times: W (oldest held back), then I down;
  8. r+1 times: W (oldest held back).
Held-back W run oldest first, so each stage's W stay in microbatch order. For
M < 2P the programs for n microbatches are built and microbatches >= M left
out (DeepSeek's code requires M >= 2P): dropping a microbatch everywhere cannot
create a wait, as every dependency is within one microbatch, so every M >= 1
is served.

DeepSeek's table (PP = 2P stages, F and B per stage, B a full backward,
F&B an overlapped pair): bubble (PP/2-1)(F&B+B-3W) = (P-1)(F&B+B-3W),
activations PP+1 = 2P+1 stage activations per rank. The bubble holds when each
pair waits for both its inputs, as DeepSeek's runtime does; run as F then B
the forward need not wait for the backward's gradient, and the idle time is
lower ((P-1) x T_F with T_F = T_I = T_W). Serves every P >= 1 and M >= 1,
exactly V = 2.

Programs of build("dualpipev", ranks=4, microbatches=8), V=2, one line per rank::

    rank 0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 0F7 7B3 7F4 0B0
            7B4 7F5 0B1 7B5 7F6 0B2 7B6 7F7 0B3 7B7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7
    rank 1: 1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 6F3 1F6 6B2 6F4 1B0 1F7 6B3 6F5
            1B1 6B4 6F6 1B2 6B5 6F7 1B3 6B6 1B4 6I7 1I5 6W7 1I6 1W5 1I7 1W6 1W7
    rank 2: 2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 2F5 5B1 5F4 2B0 2F6 5B2 5F5 2B1 2F7 5B3
            5F6 2B2 5B4 5F7 2B3 5B5 2B4 5B6 2I5 5I7 2I6 2W5 2I7 5W7 2W6 2W7
    rank 3: 3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 3F4 4B0 4F4 3B0 3F5 4B1 4F5 3B1 3F6 4B2 4F6 3B2 3F7
            4B3 4F7 3B3 4B4 3B4 4B5 3B5 4I6 3I6 4I7 3I7 4W6 3W6 4W7 3W7

Simulated with F=I=W=1 (so B=2), no latency: makespan 51, idle fraction 0.059,
peak live activations per rank [9, 9, 9, 9].
"""

from __future__ import annotations

from collections import deque

from conveyor.schedule.builtin._program import ProgramWriter, vshape_schedule
from conveyor.schedule.ir import ActionKind, Schedule
from conveyor.schedule.registry import register


def dualpipev(num_ranks: int, num_microbatches: int, virtual: int = 2) -> Schedule:
    """DualPipeV on ``num_ranks`` ranks, two stages each.

    Example:
        >>> [str(a) for a in dualpipev(1, 2).programs[0]]
        ['0F0', '1F0', '0F1', '1B0', '1F1', '0B0', '1B1', '0I1', '0W1']
    """
    return vshape_schedule("dualpipev", num_ranks, num_microbatches, virtual, 2 * num_ranks, _rank_program)


def _rank_program(rank: int, num_ranks: int, num_microbatches: int) -> ProgramWriter:
    writer = ProgramWriter()
    down, up = rank, 2 * num_ranks - 1 - rank
    forward = {down: 0, up: 0}
    backward = {down: 0, up: 0}
    held_back: deque[tuple[int, int]] = (
        deque()
    )  # (stage, microbatch) of each I whose W is still to run

    def f(stage: int) -> None:
        writer.add(ActionKind.F, stage, forward[stage])
        forward[stage] += 1

    def b(stage: int, split: bool = False) -> None:
        microbatch = backward[stage]
        backward[stage] += 1
        if split:
            writer.add(ActionKind.I, stage, microbatch)
            held_back.append((stage, microbatch))
        else:
            writer.add(ActionKind.B, stage, microbatch)

    def w() -> None:
        writer.add(ActionKind.W, *held_back.popleft())

    def run(
        kind: ActionKind, stage: int, counters: dict[int, int], steps: int
    ) -> tuple[ActionKind, list[int], range]:
        """The next ``steps`` microbatches of ``counters[stage]``, as a column for ``weave``."""
        first = counters[stage]
        counters[stage] = first + steps
        return kind, [stage] * steps, range(first, first + steps)

    P, r = num_ranks, rank
    for _ in range(2 * (P - 1 - r)):  # 1
        f(down)
    for _ in range(r + 1):  # 2
        f(down)
        f(up)
    for _ in range(P - 1 - r):  # 3
        b(up, split=True)
        w()
        f(up)
    # 4 and 5 hold almost all of the program: written in bulk, counters moved on after.
    steps = num_microbatches - 2 * P + r + 1  # 4
    writer.weave(
        [
            run(ActionKind.F, down, forward, steps),
            run(ActionKind.B, up, backward, steps),
            run(ActionKind.F, up, forward, steps),
            run(ActionKind.B, down, backward, steps),
        ]
    )
    steps = P - 1 - r  # 5
    writer.weave(
        [
            run(ActionKind.B, up, backward, steps),
            run(ActionKind.F, up, forward, steps),
            run(ActionKind.B, down, backward, steps),
        ]
    )
    middle = (r + 1) // 2
    for index in range(r + 1):  # 6: split from the middle on, starting with the up one on odd ranks
        b(up, index > middle or (index == middle and r % 2 == 1))
        b(down, index >= middle)
    for _ in range(P - 1 - r):  # 7
        w()
        b(down, split=True)
    while held_back:  # 8: r+1 of them
        w()
    return writer


register(
    "dualpipev",
    dualpipev,
    description="DeepSeek DualPipeV: V-shaped, forward of one stage paired with backward of the other (2024)",
    default_virtual=2,
    virtual_choices=(2,),
)
