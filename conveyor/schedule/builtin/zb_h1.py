"""ZB-H1, the memory-efficient handcrafted zero-bubble schedule (Qi et al., "Zero Bubble
(Almost) Pipeline Parallelism", ICLR 2024, Section 2.1, Figure 3 top).

1F1B with the backward split in two: ``I`` computes the input gradient (the
paper's B, on the critical path to the previous stage) and ``W`` the weight
gradient (off the critical path, run any time after its ``I``). Rank r lets
its ``W`` lag r ``I`` behind: the first backwards reach rank 0 sooner, and the
held-back ``W`` fill the cool-down, where 1F1B waits. The warm-up is 1F1B's,
so memory stays 1F1B's first-rank peak, now on every rank.

With V > 1 it is interleaved like torch's ``ScheduleInterleavedZeroBubble``:
V stages per rank, looped, microbatches in rounds as in interleaved 1F1B, and
one forward of warm-up per rank to go instead of interleaved 1F1B's two.

Phases on rank r of P, with n = V x M forwards per rank and G the first round's
size (G = M for V = 1):
  1. warm-up: the first w forwards, w = min((V-1) x G + P-1-r, n);
  2. steady: the next forward, then the next I, then the oldest W once more
     than r are pending;
  3. cool-down: the remaining I, each followed by the oldest W once more than r
     are pending;
  4. the r held-back W, oldest first.

Idle time per rank (P-1)(T_F+T_I-T_W) against 1F1B's (P-1)(T_F+T_I+T_W) when
M >= P (the paper's T_B is our T_I; uniform stage costs, T_W <= T_F, T_I);
peak live activations min(P, M) on every rank for V = 1. Serves every P >= 1,
M >= 1 and V >= 1; the default is V = 1.

Programs of build("zb-h1", ranks=4, microbatches=8), V=1, one line per rank::

    rank 0: 0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0F6 0I3 0W3 0F7 0I4 0W4 0I5 0W5 0I6
            0W6 0I7 0W7
    rank 1: 1F0 1F1 1F2 1I0 1F3 1I1 1W0 1F4 1I2 1W1 1F5 1I3 1W2 1F6 1I4 1W3 1F7 1I5 1W4 1I6 1W5
            1I7 1W6 1W7
    rank 2: 2F0 2F1 2I0 2F2 2I1 2F3 2I2 2W0 2F4 2I3 2W1 2F5 2I4 2W2 2F6 2I5 2W3 2F7 2I6 2W4 2I7
            2W5 2W6 2W7
    rank 3: 3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3F6 3I6 3W3 3F7 3I7 3W4
            3W5 3W6 3W7

Simulated with F=I=W=1 (so B=2), no latency: makespan 27, idle fraction 0.111,
peak live activations per rank [4, 4, 4, 4].
"""

from __future__ import annotations

from conveyor.schedule.builtin._program import looped_schedule
from conveyor.schedule.ir import Schedule
from conveyor.schedule.registry import register


def zb_h1(num_ranks: int, num_microbatches: int, virtual: int = 1) -> Schedule:
    """ZB-H1 on ``num_ranks`` ranks (interleaved when ``virtual`` > 1).

    Example:
        >>> [str(a) for a in zb_h1(2, 2).programs[1]]
        ['1F0', '1I0', '1F1', '1I1', '1W0', '1W1']
    """
    return looped_schedule(
        "zb-h1", num_ranks, num_microbatches, virtual, warmup_per_hop=1, weights_behind_per_rank=1
    )


register(
    "zb-h1",
    zb_h1,
    description="zero bubble H1: backward split I/W, 1F1B memory, bubble (P-1)(F+I-W) (Qi et al. 2024)",
    default_virtual=1,
    virtual_choices=None,
)
