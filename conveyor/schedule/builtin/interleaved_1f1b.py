"""Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC 2021, Section 2.2.2, Figure 4).

V stages per rank on a looped placement: stage s runs on rank s % P, so a
microbatch crosses every rank V times. Each stage is 1/V of a rank's layers,
so the fill and drain of the pipeline shrink V-fold, at the cost of more
messages and more warm-up activations.

Microbatches go in rounds of at least P (Megatron's microbatch groups: P each
when P divides M; otherwise max(1, M // P) rounds whose sizes differ by one,
larger first; one round of all M when M < P). Each rank forwards a whole round
through local stage 0, then the same round through local stage 1, and so on;
backwards go through the local stages in reverse.

Phases on rank r of P, with n = V x M forwards (and as many backwards) per rank
and G the first round's size:
  1. warm-up: the first w forwards, w = min((V-1) x G + 2 x (P-1-r), n)
     (for V = 1, w = min(P-1-r, M): exactly 1F1B);
  2. steady: the next forward, then the next backward, while forwards remain;
  3. cool-down: the remaining backwards.

Idle fraction (P-1)/(V x M+P-1) when P divides M (uniform costs). Serves every
P >= 1, M >= 1 and V >= 1; the default is V = 2.

Programs of build("interleaved-1f1b", ranks=4, microbatches=8), V=2, one line per rank::

    rank 0: 0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0 4F7
            0B1 0B2 0B3 4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7
    rank 1: 1F0 1F1 1F2 1F3 5F0 5F1 5F2 5F3 1F4 5B0 1F5 5B1 1F6 5B2 1F7 5B3 5F4 1B0 5F5 1B1 5F6
            1B2 5F7 1B3 5B4 5B5 5B6 5B7 1B4 1B5 1B6 1B7
    rank 2: 2F0 2F1 2F2 2F3 6F0 6F1 6F2 6B0 6F3 6B1 2F4 6B2 2F5 6B3 2F6 2B0 2F7 2B1 6F4 2B2 6F5
            2B3 6F6 6B4 6F7 6B5 6B6 6B7 2B4 2B5 2B6 2B7
    rank 3: 3F0 3F1 3F2 3F3 7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 3F4 3B0 3F5 3B1 3F6 3B2 3F7 3B3 7F4
            7B4 7F5 7B5 7F6 7B6 7F7 7B7 3B4 3B5 3B6 3B7

Simulated with F=I=W=1 (so B=2), no latency: makespan 57, idle fraction 0.158,
peak live activations per rank [11, 9, 7, 5].
"""

from __future__ import annotations

from conveyor.schedule.builtin._program import looped_schedule
from conveyor.schedule.ir import Schedule
from conveyor.schedule.registry import register


def interleaved_1f1b(num_ranks: int, num_microbatches: int, virtual: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B with ``virtual`` stages per rank.

    Example:
        >>> sched = interleaved_1f1b(2, 2, virtual=2)
        >>> [str(a) for a in sched.programs[1]]
        ['1F0', '1F1', '3F0', '3B0', '3F1', '3B1', '1B0', '1B1']
    """
    # The last rank must hold a whole round of every local stage but the last before its
    # first backward; each rank before it, two more (a forward and a backward hop of the
    # first microbatch); with V = 1, one more (1F1B).
    warmup_per_hop = 1 if virtual == 1 else 2
    return looped_schedule("interleaved-1f1b", num_ranks, num_microbatches, virtual, warmup_per_hop=warmup_per_hop)


register(
    "interleaved-1f1b",
    interleaved_1f1b,
    description="Megatron's interleaved 1F1B, V stages per rank, looped (Narayanan et al. 2021)",
    default_virtual=2,
    virtual_choices=None,
)
