"""GPipe: every forward, then every backward (Huang et al., NeurIPS 2019).

Phases on each rank:
  1. forward all M microbatches in order;
  2. backward all M microbatches in order.
Idle fraction (P-1)/(M+P-1); peak live activations M on every rank.
"""

from __future__ import annotations

from conveyor.schedule.ir import B, F, Placement, Schedule
from conveyor.schedule.registry import register


def gpipe(num_ranks: int, num_microbatches: int, virtual: int = 1) -> Schedule:
    programs = []
    for rank in range(num_ranks):
        forwards = [F(rank, m) for m in range(num_microbatches)]
        backwards = [B(rank, m) for m in range(num_microbatches)]
        programs.append(forwards + backwards)
    return Schedule.from_programs("gpipe", Placement.looped(num_ranks, 1), num_microbatches, programs)


register("gpipe", gpipe, description="all forwards, then all backwards (Huang et al. 2019)")
