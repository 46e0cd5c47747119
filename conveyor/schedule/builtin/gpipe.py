"""GPipe: every forward, then every backward (Huang et al., "GPipe: Efficient Training of
Giant Neural Networks using Pipeline Parallelism", NeurIPS 2019, Section 2.2).

One stage per rank (stage r on rank r). Simple and the most memory-hungry:
every rank holds the activations of all M microbatches before the first
backward starts.

Phases on every rank:
  1. forward microbatches 0..M-1;
  2. backward microbatches 0..M-1 (in order, so weight gradients accumulate
     as in a single-device loop).

Idle fraction (P-1)/(M+P-1); peak live activations M on every rank.
Serves every P >= 1 and M >= 1.

Programs of build("gpipe", ranks=4, microbatches=8), V=1, one line per rank::

    rank 0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 0F7 0B0 0B1 0B2 0B3 0B4 0B5 0B6 0B7
    rank 1: 1F0 1F1 1F2 1F3 1F4 1F5 1F6 1F7 1B0 1B1 1B2 1B3 1B4 1B5 1B6 1B7
    rank 2: 2F0 2F1 2F2 2F3 2F4 2F5 2F6 2F7 2B0 2B1 2B2 2B3 2B4 2B5 2B6 2B7
    rank 3: 3F0 3F1 3F2 3F3 3F4 3F5 3F6 3F7 3B0 3B1 3B2 3B3 3B4 3B5 3B6 3B7

Simulated with F=I=W=1 (so B=2), no latency: makespan 33, idle fraction 0.273,
peak live activations per rank [8, 8, 8, 8].
"""

from __future__ import annotations

from conveyor.schedule.builtin._program import breadth_first
from conveyor.schedule.ir import Schedule
from conveyor.schedule.registry import register


def gpipe(num_ranks: int, num_microbatches: int, virtual: int = 1) -> Schedule:
    """All forwards, then all backwards, on ``num_ranks`` ranks.

    Example:
        >>> [str(a) for a in gpipe(2, 2).programs[1]]
        ['1F0', '1F1', '1B0', '1B1']
    """
    return breadth_first("gpipe", num_ranks, num_microbatches, virtual, only_virtual=1)


register(
    "gpipe",
    gpipe,
    description="all forwards, then all backwards; memory M per rank (Huang et al. 2019)",
    default_virtual=1,
    virtual_choices=(1,),
)
