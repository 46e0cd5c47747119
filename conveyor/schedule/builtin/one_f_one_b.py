"""1F1B, PipeDream-Flush (Narayanan et al., ICML 2021).

Phases on rank r of P, M microbatches:
  1. warm-up: min(P-1-r, M) forwards;
  2. steady: one forward, one backward, while forwards remain;
  3. cool-down: the remaining backwards.
Idle fraction as GPipe, (P-1)/(M+P-1); peak live activations min(P-r, M) on rank r.
"""

from __future__ import annotations

from conveyor.schedule.ir import B, F, Placement, Schedule
from conveyor.schedule.registry import register


def one_f_one_b(num_ranks: int, num_microbatches: int, virtual: int = 1) -> Schedule:
    programs = []
    for rank in range(num_ranks):
        warmup = min(num_ranks - 1 - rank, num_microbatches)
        program = [F(rank, m) for m in range(warmup)]
        next_backward = 0
        for m in range(warmup, num_microbatches):
            program += [F(rank, m), B(rank, next_backward)]
            next_backward += 1
        program += [B(rank, m) for m in range(next_backward, num_microbatches)]
        programs.append(program)
    return Schedule.from_programs("1f1b", Placement.looped(num_ranks, 1), num_microbatches, programs)


register("1f1b", one_f_one_b, description="one forward one backward, memory min(P-r, M) (Narayanan et al. 2021)")
