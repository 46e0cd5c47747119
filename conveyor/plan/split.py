"""Contiguous partitions of the units into stages: the fastest, and the lightest within a time bound.

Both are the classic min-max dynamic programme over (stages made, units covered); ties on
the largest stage are broken by the sum of squares, so the other stages come out even too.
Stages may hold any number of units: a heavy embedding or head gets a stage with fewer
blocks by itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import accumulate

from conveyor.errors import PlanError
from conveyor.plan.costs import UnitCost

INF = math.inf


def min_max_partition(count: int, stages: int, cost: Callable[[int, int, int], float]) -> list[int]:
    """Cuts ``[c1, ..., c_{S-1}]`` (stage s holds units ``[c_s, c_{s+1})``) minimising the largest
    ``cost(stage, first, end)``; ``inf`` marks a stage that is not allowed. Raises ``PlanError`` when
    no partition is allowed.

    Example:
        >>> weights = [4, 1, 1, 1, 1, 4]
        >>> min_max_partition(6, 3, lambda s, i, j: sum(weights[i:j]))
        [1, 5]
    """
    if not 1 <= stages <= count:
        raise PlanError(f"cannot cut {count} units into {stages} stages: each stage needs at least one unit")
    best: list[list[tuple[float, float]]] = [[(INF, INF)] * (count + 1) for _ in range(stages + 1)]
    back = [[0] * (count + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, stages + 1):
        row, previous = best[s], best[s - 1]
        for j in range(s, count - (stages - s) + 1):
            chosen, where = (INF, INF), 0
            for i in range(s - 1, j):
                worst, squares = previous[i]
                if worst == INF:
                    continue
                c = cost(s - 1, i, j)
                if c == INF:
                    continue
                value = (c if c > worst else worst, squares + c * c)
                if value < chosen:
                    chosen, where = value, i
            row[j], back[s][j] = chosen, where
    if best[stages][count][0] == INF:
        raise PlanError(f"no way to cut the {count} units into {stages} stages within the limits")
    cuts, j = [], count
    for s in range(stages, 0, -1):
        j = back[s][j]
        cuts.append(j)
    return cuts[::-1][1:]


class StageSums:
    """Prefix sums of the unit costs, so any stage's totals cost O(1).

    Example:
        >>> sums = StageSums([UnitCost("a", 1, 2, 3, 10), UnitCost("b", 1, 1, 1, 5)], optimizer_bytes=8)
        >>> sums.time(0, 2), sums.activations(0, 2)
        (9.0, 15.0)
    """

    def __init__(self, units: Sequence[UnitCost], *, optimizer_bytes: float) -> None:
        def prefix(values) -> list[float]:
            return [0.0, *accumulate(float(v) for v in values)]

        self.units = tuple(units)
        self._f = prefix(u.forward for u in units)
        self._i = prefix(u.backward_input for u in units)
        self._w = prefix(u.backward_weight for u in units)
        self._b = prefix(u.merged_backward for u in units)
        self._act = prefix(u.activation_bytes for u in units)
        self._kept = prefix(u.weight_activation_bytes for u in units)
        # Parameters, their gradients (same dtype), and the optimizer's state per parameter.
        self._static = prefix(2 * u.parameter_bytes + optimizer_bytes * u.parameters for u in units)

    def forward(self, i: int, j: int) -> float:
        return self._f[j] - self._f[i]

    def backward_input(self, i: int, j: int) -> float:
        return self._i[j] - self._i[i]

    def backward_weight(self, i: int, j: int) -> float:
        return self._w[j] - self._w[i]

    def backward(self, i: int, j: int) -> float:
        """The units' backward run unsplit (one B), where the runtime does not split it into I and W."""
        return self._b[j] - self._b[i]

    def time(self, i: int, j: int) -> float:
        return self.forward(i, j) + self.backward_input(i, j) + self.backward_weight(i, j)

    def activations(self, i: int, j: int) -> float:
        return self._act[j] - self._act[i]

    def weight_kept(self, i: int, j: int) -> float:
        return min(self._kept[j] - self._kept[i], self.activations(i, j))

    def static(self, i: int, j: int) -> float:
        return self._static[j] - self._static[i]


def bounds_of(cuts: Sequence[int], count: int) -> list[tuple[int, int]]:
    """``[(first, end), ...]`` of each stage.

    Example:
        >>> bounds_of([1, 5], 6)
        [(0, 1), (1, 5), (5, 6)]
    """
    edges = [0, *cuts, count]
    return list(zip(edges, edges[1:]))


def fastest_split(sums: StageSums, stages: int) -> list[int]:
    """The cuts whose slowest stage (F + I + W per microbatch) is fastest.

    Example:
        >>> sums = StageSums([UnitCost(n, 1, 1, 1, 0) for n in "abc"] + [UnitCost("d", 3, 3, 3, 0)], optimizer_bytes=8)
        >>> fastest_split(sums, 2)
        [3]
    """
    return min_max_partition(len(sums.units), stages, lambda s, i, j: sums.time(i, j))


def lightest_split(sums: StageSums, stages: int, in_flight: Sequence[float], time_limit: float) -> list[int]:
    """The cuts whose heaviest stage (parameters, gradients, optimizer state, and ``in_flight[s]``
    microbatches of activations) is lightest, among those whose stages all take at most ``time_limit``.

    Example:
        >>> sums = StageSums([UnitCost(n, 1, 1, 1, 10) for n in "abcd"], optimizer_bytes=8)
        >>> lightest_split(sums, 2, in_flight=[2, 1], time_limit=9.0)
        [1]
    """

    def memory(s: int, i: int, j: int) -> float:
        if sums.time(i, j) > time_limit:
            return INF
        return sums.static(i, j) + in_flight[s] * sums.activations(i, j)

    return min_max_partition(len(sums.units), stages, memory)
