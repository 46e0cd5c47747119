"""ZB-H2, the zero-bubble handcrafted schedule (Qi et al., "Zero Bubble (Almost) Pipeline
Parallelism", ICLR 2024, Section 2.2, Figure 3 bottom).

ZB-H1 with twice the warm-up and twice the held-back ``W``: rank r runs
P-1-r more forwards before its first ``I`` (filling the wait for the first
backward) and lets its ``W`` lag 2r ``I`` behind (filling the cool-down).
With T_F = T_I = T_W every rank then works without a single gap from its
first action to its last; the price is 2P-1 live activations on every rank.

With V > 1 it is interleaved like ZB-H1 (looped, rounds as in interleaved
1F1B, warm-up (V-1) x G + 2(P-1-r)). It then beats ZB-H1 when T_W < T_F, T_I
and M >= 2P; with equal costs interleaved ZB-H1 already reaches the lower
bound, and ZB-H2 gains nothing (from P = 7 on it loses up to 2 T_F to gaps in
its ramp-up).

Phases on rank r of P, with n = V x M forwards per rank and G the first round's
size (G = M for V = 1):
  1. warm-up: the first w forwards, w = min((V-1) x G + 2(P-1-r), n);
  2. steady: the next forward, then the next I, then the oldest W once more
     than 2r are pending;
  3. cool-down: the remaining I, each followed by the oldest W once more than
     2r are pending;
  4. the 2r held-back W, oldest first.

With uniform stage costs and M >= 2P-1 (V = 1): no rank has an internal gap
when T_F = T_I = T_W; rank 0's internal idle is (P-1) max(0, T_F+T_I-2T_W) in general
(the paper's bubble, T_B = our T_I); what is left is the start-up skew, rank r
starting at r x T_F, which the paper removes by overlapping consecutive steps
(its optimizer post-validation). Peak live activations min(2P-1, M) on every
rank for V = 1. Serves every P >= 1, M >= 1 and V >= 1; the default is V = 1.

Programs of build("zb-h2", ranks=4, microbatches=8), V=1, one line per rank::

    rank 0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 0I0 0W0 0F7 0I1 0W1 0I2 0W2 0I3 0W3 0I4 0W4 0I5 0W5 0I6
            0W6 0I7 0W7
    rank 1: 1F0 1F1 1F2 1F3 1F4 1I0 1F5 1I1 1F6 1I2 1W0 1F7 1I3 1W1 1I4 1W2 1I5 1W3 1I6 1W4 1I7
            1W5 1W6 1W7
    rank 2: 2F0 2F1 2F2 2I0 2F3 2I1 2F4 2I2 2F5 2I3 2F6 2I4 2W0 2F7 2I5 2W1 2I6 2W2 2I7 2W3 2W4
            2W5 2W6 2W7
    rank 3: 3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3F4 3I4 3F5 3I5 3F6 3I6 3W0 3F7 3I7 3W1 3W2 3W3 3W4
            3W5 3W6 3W7

Simulated with F=I=W=1 (so B=2), no latency: makespan 27, idle fraction 0.111,
peak live activations per rank [7, 7, 7, 7].
"""

from __future__ import annotations

from conveyor.schedule.builtin._program import looped_schedule
from conveyor.schedule.ir import Schedule
from conveyor.schedule.registry import register


def zb_h2(num_ranks: int, num_microbatches: int, virtual: int = 1) -> Schedule:
    """ZB-H2 on ``num_ranks`` ranks (interleaved when ``virtual`` > 1).

    Example:
        >>> [str(a) for a in zb_h2(2, 3).programs[0]]
        ['0F0', '0F1', '0F2', '0I0', '0W0', '0I1', '0W1', '0I2', '0W2']
    """
    return looped_schedule(
        "zb-h2", num_ranks, num_microbatches, virtual, warmup_per_hop=2, weights_behind_per_rank=2
    )


register(
    "zb-h2",
    zb_h2,
    description="zero bubble H2: twice ZB-H1's warm-up, no gap when F=I=W, memory 2P-1 (Qi et al. 2024)",
    default_virtual=1,
    virtual_choices=None,
)
