"""Cut a row of weighted segments into contiguous, balanced parts (pure Python).

The splitter reduces every balancing method (count of blocks, parameters, measured
time, count of matching module types) to one row of segment weights; this module
picks where to cut it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def partition(weights: Sequence[float], num_parts: int, cut_allowed: Sequence[bool]) -> list[int]:
    """Indices of the segments that start parts 1..num_parts-1.

    Minimises the heaviest part first, then (among cuts with that heaviest part) the
    sum of squared part weights, so that the parts which are not the bottleneck are
    balanced too. ``cut_allowed[j]`` says whether a part may start at segment ``j``
    (``cut_allowed[0]`` is ignored: the first part always starts there).

    Example:
        >>> partition([1, 1, 1, 1], 2, [True] * 4)
        [2]
        >>> partition([0, 2, 1, 1, 0], 2, [True, True, True, True, False])
        [2]
    """
    num_segments = len(weights)
    starts = [j for j in range(1, num_segments) if cut_allowed[j]]
    if num_parts < 1 or num_parts - 1 > len(starts):
        raise ValueError(
            f"cannot cut {num_segments} segments with {len(starts)} allowed cuts into {num_parts} parts"
        )
    prefix = [0.0]
    for weight in weights:
        prefix.append(prefix[-1] + float(weight))

    def part_weight(begin: int, end: int) -> float:
        return prefix[end] - prefix[begin]

    boundaries = [0, *starts]  # where a part may begin
    bound = _min_max(boundaries, num_segments, num_parts, part_weight)
    # Round-off in prefix sums must not make the optimum look infeasible.
    tolerance = bound * 1e-9 + 1e-12
    return _min_squares(boundaries, num_segments, num_parts, part_weight, bound + tolerance)


def _min_max(boundaries, num_segments, num_parts, part_weight) -> float:
    # best[p][b]: the smallest heaviest part when parts p.. start at boundaries[b].
    num_boundaries = len(boundaries)
    infinity = math.inf
    best = [[infinity] * num_boundaries for _ in range(num_parts + 1)]
    for b in range(num_boundaries):
        best[num_parts - 1][b] = part_weight(boundaries[b], num_segments)
    for part in range(num_parts - 2, -1, -1):
        for b in range(num_boundaries):
            for nxt in range(b + 1, num_boundaries):
                here = part_weight(boundaries[b], boundaries[nxt])
                candidate = max(here, best[part + 1][nxt])
                if candidate < best[part][b]:
                    best[part][b] = candidate
    return best[0][0]


def _min_squares(boundaries, num_segments, num_parts, part_weight, bound) -> list[int]:
    num_boundaries = len(boundaries)
    infinity = math.inf
    cost = [[infinity] * num_boundaries for _ in range(num_parts)]
    choice = [[-1] * num_boundaries for _ in range(num_parts)]
    for b in range(num_boundaries):
        weight = part_weight(boundaries[b], num_segments)
        if weight <= bound:
            cost[num_parts - 1][b] = weight * weight
    for part in range(num_parts - 2, -1, -1):
        for b in range(num_boundaries):
            for nxt in range(b + 1, num_boundaries):
                weight = part_weight(boundaries[b], boundaries[nxt])
                if weight > bound or cost[part + 1][nxt] == infinity:
                    continue
                candidate = weight * weight + cost[part + 1][nxt]
                if candidate < cost[part][b]:
                    cost[part][b] = candidate
                    choice[part][b] = nxt
    assert cost[0][0] < infinity, "the min-max bound must be reachable"
    cuts = []
    b = 0
    for part in range(num_parts - 1):
        b = choice[part][b]
        cuts.append(boundaries[b])
    return cuts
