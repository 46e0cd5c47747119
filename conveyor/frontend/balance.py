"""Cut a row of segments into contiguous parts whose heaviest part is lightest (pure Python).

The one min-max partition of conveyor: the frontend's splitter reduces every balancing method
(count of blocks, parameters, count of matching module types) to one row of segment weights and
cuts it with :func:`partition`; so does the planner's cut by measured time
(:mod:`conveyor.plan.time_split`, ``split_method="time"``), and the planner's search
(:mod:`conveyor.plan.balance`) cuts its profiled units with :func:`min_max_partition`, whose
cost of a part may depend on the part (memory with its in-flight activations) and may forbid it.

It lives in the frontend, the lowest layer that cuts models: the frontend may not import the
planner (``conveyor.plan`` imports the frontend to split and profile), and the splitter needs
a partition for every method, not only for measured times.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

INF = math.inf


def partition(weights: Sequence[float], num_parts: int, cut_allowed: Sequence[bool]) -> list[int]:
    """Indices of the segments that start parts 1..num_parts-1, each part weighing the sum of its segments.

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
    prefix = list(itertools.accumulate(map(float, weights), initial=0.0))
    return min_max_partition(len(weights), num_parts, lambda part, begin, end: prefix[end] - prefix[begin],
                             cut_allowed)


def min_max_partition(count: int, num_parts: int, cost: Callable[[int, int, int], float],
                      cut_allowed: Sequence[bool] | None = None) -> list[int]:
    """Cuts ``[c1, ..., c_{P-1}]`` (part p holds segments ``[c_p, c_{p+1})``) minimising the largest
    ``cost(part, first, end)``, then the sum of squared costs; ``inf`` marks a part that is not allowed.

    ``cut_allowed[j]``: whether a part may start at segment ``j`` (default: everywhere). Raises
    ValueError when there are too few places to cut, or when every partition has a part not allowed.

    Example:
        >>> weights = [4, 1, 1, 1, 1, 4]
        >>> min_max_partition(6, 3, lambda part, i, j: sum(weights[i:j]))
        [1, 5]
    """
    starts = [j for j in range(1, count) if cut_allowed is None or cut_allowed[j]]
    if num_parts < 1 or num_parts - 1 > len(starts):
        raise ValueError(f"cannot cut {count} segments with {len(starts)} allowed cuts into {num_parts} parts")
    boundaries = [0, *starts]  # where a part may begin
    bound = _min_max(boundaries, count, num_parts, cost)
    if bound == INF:
        raise ValueError(f"no way to cut the {count} segments into {num_parts} parts within the limits")
    # Round-off in sums must not make the optimum look infeasible.
    tolerance = bound * 1e-9 + 1e-12
    return _min_squares(boundaries, count, num_parts, cost, bound + tolerance)


def _min_max(boundaries: list[int], count: int, num_parts: int, cost: Callable[[int, int, int], float]) -> float:
    # best[p][b]: the smallest heaviest part when parts p.. start at boundaries[b].
    num_boundaries = len(boundaries)
    best = [[INF] * num_boundaries for _ in range(num_parts + 1)]
    for b in range(num_boundaries):
        best[num_parts - 1][b] = cost(num_parts - 1, boundaries[b], count)
    for part in range(num_parts - 2, -1, -1):
        row, after = best[part], best[part + 1]
        for b in range(num_boundaries):
            for nxt in range(b + 1, num_boundaries):
                if after[nxt] >= row[b]:
                    continue  # cannot beat what this start already has (and saves the cost call)
                here = cost(part, boundaries[b], boundaries[nxt])
                candidate = max(here, after[nxt])
                if candidate < row[b]:
                    row[b] = candidate
    return best[0][0]


def _min_squares(boundaries: list[int], count: int, num_parts: int, cost: Callable[[int, int, int], float],
                 bound: float) -> list[int]:
    num_boundaries = len(boundaries)
    squares = [[INF] * num_boundaries for _ in range(num_parts)]
    choice = [[-1] * num_boundaries for _ in range(num_parts)]
    for b in range(num_boundaries):
        weight = cost(num_parts - 1, boundaries[b], count)
        if weight <= bound:
            squares[num_parts - 1][b] = weight * weight
    for part in range(num_parts - 2, -1, -1):
        for b in range(num_boundaries):
            for nxt in range(b + 1, num_boundaries):
                if squares[part + 1][nxt] == INF:
                    continue
                weight = cost(part, boundaries[b], boundaries[nxt])
                if weight > bound:
                    continue
                candidate = weight * weight + squares[part + 1][nxt]
                if candidate < squares[part][b]:
                    squares[part][b] = candidate
                    choice[part][b] = nxt
    assert squares[0][0] < INF, "the min-max bound must be reachable"
    cuts = []
    b = 0
    for part in range(num_parts - 1):
        b = choice[part][b]
        cuts.append(boundaries[b])
    return cuts
