"""Looped breadth-first pipeline (Lamy-Poirier, "Breadth-First Pipeline Parallelism",
MLSys 2023, Section 3, Figure 2).

V stages per rank on a looped placement (stage s on rank s % P), like
interleaved 1F1B, but breadth first: a rank runs every microbatch through its
earlier local stage before the next one, so all ready microbatches of the
earlier stage go first. Fewer switches between stages (which suits sharded
data parallelism, the paper's point) and GPipe-like memory: V x M
activations per rank.

Phases on every rank r:
  1. forward: for each local stage v = 0..V-1 (stage v x P + r), microbatches 0..M-1;
  2. backward: for each local stage v = V-1..0, microbatches 0..M-1 (in order, so
     weight gradients accumulate as in a single-device loop; torch runs them in
     reverse).

Idle fraction (P-1)/(V x M+P-1) when M >= P (uniform costs); for V = 1 it is
GPipe. Serves every P >= 1, M >= 1 and V >= 1; the default is V = 2.

Programs of build("looped-bfs", ranks=4, microbatches=8), V=2, one line per rank::

    rank 0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 0F7 4F0 4F1 4F2 4F3 4F4 4F5 4F6 4F7 4B0 4B1 4B2 4B3 4B4
            4B5 4B6 4B7 0B0 0B1 0B2 0B3 0B4 0B5 0B6 0B7
    rank 1: 1F0 1F1 1F2 1F3 1F4 1F5 1F6 1F7 5F0 5F1 5F2 5F3 5F4 5F5 5F6 5F7 5B0 5B1 5B2 5B3 5B4
            5B5 5B6 5B7 1B0 1B1 1B2 1B3 1B4 1B5 1B6 1B7
    rank 2: 2F0 2F1 2F2 2F3 2F4 2F5 2F6 2F7 6F0 6F1 6F2 6F3 6F4 6F5 6F6 6F7 6B0 6B1 6B2 6B3 6B4
            6B5 6B6 6B7 2B0 2B1 2B2 2B3 2B4 2B5 2B6 2B7
    rank 3: 3F0 3F1 3F2 3F3 3F4 3F5 3F6 3F7 7F0 7F1 7F2 7F3 7F4 7F5 7F6 7F7 7B0 7B1 7B2 7B3 7B4
            7B5 7B6 7B7 3B0 3B1 3B2 3B3 3B4 3B5 3B6 3B7

Simulated with F=I=W=1 (so B=2), no latency: makespan 57, idle fraction 0.158,
peak live activations per rank [16, 16, 16, 16].
"""

from __future__ import annotations

from conveyor.schedule.builtin._program import breadth_first
from conveyor.schedule.ir import Schedule
from conveyor.schedule.registry import register


def looped_bfs(num_ranks: int, num_microbatches: int, virtual: int = 2) -> Schedule:
    """Breadth-first looping with ``virtual`` stages per rank.

    Example:
        >>> [str(a) for a in looped_bfs(2, 2, virtual=2).programs[0]]
        ['0F0', '0F1', '2F0', '2F1', '2B0', '2B1', '0B0', '0B1']
    """
    return breadth_first("looped-bfs", num_ranks, num_microbatches, virtual)


register(
    "looped-bfs",
    looped_bfs,
    description="breadth-first looping, V stages per rank, memory V x M (Lamy-Poirier 2023)",
    default_virtual=2,
    virtual_choices=None,
)
