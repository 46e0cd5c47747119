"""ZB-V, the V-shaped zero-bubble schedule (Qi et al., "Zero Bubble (Almost) Pipeline
Parallelism", ICLR 2024, arXiv version Section 6, "Memory efficient zero bubble schedule").

Two stages per rank folded into a V (``Placement.vshape``): rank r runs stage
r on the way down and stage 2P-1-r on the way up, so rank 0 holds the first
and the last stage and a microbatch turns around on rank P-1 without a
message. The backward is split into ``I`` then ``W``. Every rank does the same
work in the same rhythm, so peak memory is balanced: 2P stage activations
(P of a whole rank's) everywhere, 1F1B's first-rank peak.

Phases on rank r of P ("down" = stage r, "up" = stage 2P-1-r; n = max(M, 2P-1)):
  1. warm-up down: forward 2(P-r)-1 microbatches down;
  2. warm-up both: r times, forward the next up, then the next down;
  3. warm-up up: P-r times, forward up, I up, W up;
  4. steady: while forwards remain: forward down (while any remain), I down,
     W down, forward up, I up, W up;
  5. cool-down both: r times, I down, I up;
  6. cool-down down: P-r times, I down, W down;
  7. the held-back W: up, then down, oldest first.
For M < 2P-1 the programs for n microbatches are built and microbatches >= M
left out: removing a microbatch everywhere cannot create a wait (every
dependency is within one microbatch), so every M >= 1 is served.

With T_F = T_I = T_W, uniform costs and M >= 2P-1, no rank has an internal gap;
what is left is the start-up skew (rank r starts at r x T_F), as in ZB-H2.
Serves every P >= 1 and M >= 1, exactly V = 2.

Programs of build("zbv", ranks=4, microbatches=8), V=2, one line per rank::

    rank 0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 7I3 7W3 0F7 0I0
            0W0 7F4 7I4 7W4 0I1 0W1 7F5 7I5 7W5 0I2 0W2 7F6 7I6 7W6 0I3 0W3 7F7 7I7 7W7 0I4 0W4
            0I5 0W5 0I6 0W6 0I7 0W7
    rank 1: 1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 6F3 6I2 6W2 1F6 1I0 1W0 6F4 6I3
            6W3 1F7 1I1 1W1 6F5 6I4 6W4 1I2 1W2 6F6 6I5 6W5 1I3 1W3 6F7 6I6 6W6 1I4 6I7 1I5 1W4
            1I6 1W5 1I7 1W6 6W7 1W7
    rank 2: 2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 5I1 5W1 2F5 2I0 2W0 5F4 5I2 5W2 2F6 2I1
            2W1 5F5 5I3 5W3 2F7 2I2 2W2 5F6 5I4 5W4 2I3 2W3 5F7 5I5 5W5 2I4 5I6 2I5 5I7 2I6 2W4
            2I7 2W5 5W6 5W7 2W6 2W7
    rank 3: 3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4I0 4W0 3F4 3I0 3W0 4F4 4I1 4W1 3F5 3I1 3W1 4F5 4I2
            4W2 3F6 3I2 3W2 4F6 4I3 4W3 3F7 3I3 3W3 4F7 4I4 4W4 3I4 4I5 3I5 4I6 3I6 4I7 3I7 3W4
            4W5 4W6 4W7 3W5 3W6 3W7

Simulated with F=I=W=1 (so B=2), no latency: makespan 51, idle fraction 0.059,
peak live activations per rank [8, 8, 8, 8].
"""

from __future__ import annotations

from conveyor.schedule.builtin._program import ProgramWriter, vshape_schedule
from conveyor.schedule.ir import ActionKind, Schedule
from conveyor.schedule.registry import register

F, I, W = ActionKind.F, ActionKind.I, ActionKind.W  # noqa: E741


def zbv(num_ranks: int, num_microbatches: int, virtual: int = 2) -> Schedule:
    """ZB-V on ``num_ranks`` ranks, two stages each.

    Example:
        >>> [str(a) for a in zbv(1, 1).programs[0]]
        ['0F0', '1F0', '1I0', '1W0', '0I0', '0W0']
    """
    return vshape_schedule("zbv", num_ranks, num_microbatches, virtual, 2 * num_ranks - 1, _rank_program)


def _rank_program(rank: int, num_ranks: int, num_microbatches: int) -> ProgramWriter:
    """Rank ``rank``'s program for ``num_microbatches`` >= 2P-1, phase by phase (see the module)."""
    P, r, n = num_ranks, rank, num_microbatches
    down, up = r, 2 * P - 1 - r
    writer = ProgramWriter()

    def run(
        kind: ActionKind, stage: int, microbatches: range
    ) -> tuple[ActionKind, list[int], range]:
        return kind, [stage] * len(microbatches), microbatches

    first = 2 * (P - r) - 1  # forwards down before the first one up
    with_down = n - first - r  # steady steps that still have a forward down
    writer.extend(F, [down] * first, range(first))  # 1
    writer.weave([run(F, up, range(r)), run(F, down, range(first, first + r))])  # 2
    writer.weave([run(F, up, range(r, P)), run(I, up, range(P - r)), run(W, up, range(P - r))])  # 3
    writer.weave(  # 4, steps 0 .. with_down-1
        [
            run(F, down, range(first + r, n)),
            run(I, down, range(with_down)),
            run(W, down, range(with_down)),
            run(F, up, range(P, P + with_down)),
            run(I, up, range(P - r, P - r + with_down)),
            run(W, up, range(P - r, P - r + with_down)),
        ]
    )
    writer.weave(  # 4, the last P-1-r steps: no forward down left
        [
            run(I, down, range(with_down, n - P)),
            run(W, down, range(with_down, n - P)),
            run(F, up, range(P + with_down, n)),
            run(I, up, range(P - r + with_down, n - r)),
            run(W, up, range(P - r + with_down, n - r)),
        ]
    )
    writer.weave([run(I, down, range(n - P, n - P + r)), run(I, up, range(n - r, n))])  # 5
    writer.weave([run(I, down, range(n - P + r, n)), run(W, down, range(n - P, n - r))])  # 6
    writer.extend(W, [up] * r, range(n - r, n))  # 7
    writer.extend(W, [down] * r, range(n - r, n))
    return writer


register(
    "zbv",
    zbv,
    description="zero bubble V: two stages per rank in a V, no gap when F=I=W, balanced memory (Qi et al. 2024)",
    default_virtual=2,
    virtual_choices=(2,),
)
