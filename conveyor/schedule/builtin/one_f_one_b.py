"""1F1B, also PipeDream-Flush (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN
Training", ICML 2021, Section 3; the schedule of Megatron-LM, SC 2021, Section 2.2.1).

One stage per rank (stage r on rank r). Same idle time as GPipe, but a rank
starts backwards as soon as the first one reaches it, so it never holds more
than P-r microbatches' activations.

Phases on rank r of P, M microbatches:
  1. warm-up: forward microbatches 0..w-1, w = min(P-1-r, M);
  2. steady: forward microbatch w+k, then backward microbatch k, while forwards remain;
  3. cool-down: backward the remaining microbatches.

Idle fraction (P-1)/(M+P-1); peak live activations min(P-r, M) on rank r.
Serves every P >= 1 and M >= 1 (with M < P the warm-up simply runs out of
microbatches). Unlike torch's ``Schedule1F1B`` action list, the last rank's
forwards are numbered from 0.

Programs of build("1f1b", ranks=4, microbatches=8), V=1, one line per rank::

    rank 0: 0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7
    rank 1: 1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7
    rank 2: 2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7
    rank 3: 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7

Simulated with F=I=W=1 (so B=2), no latency: makespan 33, idle fraction 0.273,
peak live activations per rank [4, 3, 2, 1].
"""

from __future__ import annotations

from conveyor.schedule.builtin._program import looped_schedule
from conveyor.schedule.ir import Schedule
from conveyor.schedule.registry import register


def one_f_one_b(num_ranks: int, num_microbatches: int, virtual: int = 1) -> Schedule:
    """One forward one backward on ``num_ranks`` ranks.

    Example:
        >>> [str(a) for a in one_f_one_b(2, 3).programs[0]]
        ['0F0', '0F1', '0B0', '0F2', '0B1', '0B2']
    """
    # With one stage per rank, the forward order is microbatches 0..M-1 whatever the rounds.
    return looped_schedule("1f1b", num_ranks, num_microbatches, virtual, warmup_per_hop=1, only_virtual=1)


register(
    "1f1b",
    one_f_one_b,
    description="one forward one backward (PipeDream-Flush); memory min(P-r, M) (Narayanan et al. 2021)",
    default_virtual=1,
    virtual_choices=(1,),
)
