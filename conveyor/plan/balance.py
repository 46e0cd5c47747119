"""The planner's balance: contiguous partitions of the units into stages, the fastest, and the
lightest within a time bound, on prefix sums of the profiled unit costs (:class:`StageSums`).

Both are conveyor's one min-max partition (:func:`conveyor.frontend.balance.min_max_partition`,
which ``split_method="time"`` uses too): the largest stage first, ties broken by the sum of
squares, so the other stages come out even too. Stages may hold any number of units: a heavy
embedding or head gets a stage with fewer blocks by itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import accumulate

from conveyor.errors import PlanError
from conveyor.frontend.balance import min_max_partition
from conveyor.plan.costs import UnitCost


def cut_units(count: int, stages: int, cost: Callable[[int, int, int], float]) -> list[int]:
    """:func:`~conveyor.frontend.balance.min_max_partition` of ``count`` units into ``stages``, each stage
    costing ``cost(stage, first, end)`` (``inf``: not allowed); a :class:`PlanError` when none is allowed.

    Example:
        >>> weights = [4, 1, 1, 1, 1, 4]
        >>> cut_units(6, 3, lambda s, i, j: sum(weights[i:j]))
        [1, 5]
    """
    if not 1 <= stages <= count:
        raise PlanError(f"cannot cut {count} units into {stages} stages: each stage needs at least one unit")
    try:
        return min_max_partition(count, stages, cost)
    except ValueError:
        raise PlanError(f"no way to cut the {count} units into {stages} stages within the limits") from None


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
        self._exchanges = prefix(u.exchanges for u in units)
        self._exchange_time = prefix(u.exchanges * u.exchange for u in units)
        self._exchange_bytes = prefix(u.exchange_bytes for u in units)
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

    def exchanges(self, i: int, j: int) -> int:
        """The all-to-alls one F (and one I) of the units makes."""
        return round(self._exchanges[j] - self._exchanges[i])

    def exchange_time(self, i: int, j: int) -> float:
        """Their seconds, counted in the units' F and in their I."""
        return self._exchange_time[j] - self._exchange_time[i]

    def exchange_bytes(self, i: int, j: int) -> float:
        """What a forward of the units run in segments holds beyond their activations (see ``UnitCost``)."""
        return self._exchange_bytes[j] - self._exchange_bytes[i]

    def static(self, i: int, j: int) -> float:
        return self._static[j] - self._static[i]

    def largest_message(self, cuts: Sequence[int]) -> float:
        """The bytes of the largest message between stages cut at ``cuts``: what the unit before a cut sends on."""
        return max((self.units[j - 1].output_bytes for j in cuts), default=0.0)


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
    return cut_units(len(sums.units), stages, lambda s, i, j: sums.time(i, j))


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
            return math.inf
        return sums.static(i, j) + in_flight[s] * sums.activations(i, j)

    return cut_units(len(sums.units), stages, memory)
