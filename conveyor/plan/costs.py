"""What each splittable unit costs: F, I and W time, activation and parameter bytes.

A :class:`CostTable` holds one :class:`UnitCost` per unit (the units of
:mod:`conveyor.frontend.units`: embedding, each repeated block, final norm, head), for a
microbatch of ``microbatch_size`` samples. :meth:`CostTable.at` rescales it to another
microbatch size: bytes in proportion, times as ``fixed + per-sample x size`` with the fixed
part (kernel launches, Python) found by profiling two sizes.

Two ways to fill one: :func:`profile_units` runs every unit on the device at hand (best of
a few repeats: other processes only ever add time), and :func:`analytic_units` counts FLOPs
and bytes from the parameter shapes of a model that may sit on the meta device (a 70B
config), at a given device throughput.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.errors import PlanError


@dataclass(frozen=True, slots=True)
class UnitCost:
    """One unit's cost for one microbatch: seconds of forward (F), input gradient (I) and weight
    gradient (W); ``activation_bytes`` kept from F to backward, ``weight_activation_bytes`` of them
    still held from I to W; ``parameter_bytes`` / ``parameters`` it holds; ``output_bytes`` sent on
    when a stage ends after it. I and W are what the runtime pays when it splits a backward (its I
    keeps the gradients at the weights' frontier, W re-enters there); ``backward``: one full backward
    run unsplit, which costs less than I + W (0: not measured, I + W stands for it). ``exchanges``: the
    all-to-alls each F makes (and each I, their gradients), ``exchange`` seconds each, already counted in
    F and I (expert parallelism's dispatch and combine: :func:`~conveyor.plan.expert_search.expert_units`);
    ``exchange_bytes``: what a forward run in segments, to overlap them, holds beyond ``activation_bytes``
    until its backward (what its all-to-alls sent and received, which the cuts keep).

    Example:
        >>> UnitCost("model.layers.0", 1.0, 1.0, 1.0, 4096, 2048, 1024, 256).full
        3.0
    """

    name: str
    forward: float
    backward_input: float
    backward_weight: float
    activation_bytes: float = 0.0
    weight_activation_bytes: float = 0.0
    parameter_bytes: float = 0.0
    parameters: float = 0.0
    output_bytes: float = 0.0
    is_block: bool = False
    backward: float = 0.0
    exchanges: int = 0
    exchange: float = 0.0
    exchange_bytes: float = 0.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if field.name in ("name", "is_block"):
                continue
            if field.name == "exchanges" and (not isinstance(self.exchanges, int) or isinstance(self.exchanges, bool)):
                raise PlanError(f"unit {self.name!r}: exchanges (all-to-alls per pass) must be an int >= 0, "
                                f"got {self.exchanges!r}")
            value = getattr(self, field.name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise PlanError(f"unit {self.name!r}: {field.name} must be a finite number >= 0, got {value!r}")

    @property
    def full(self) -> float:
        """F + I + W: the unit's compute per microbatch."""
        return self.forward + self.backward_input + self.backward_weight

    @property
    def merged_backward(self) -> float:
        """The backward's time where the runtime runs it unsplit: ``backward``, or I + W when not measured.

        Example:
            >>> UnitCost("u", 1.0, 2.0, 2.0, backward=3.0).merged_backward, UnitCost("u", 1.0, 2.0, 2.0).merged_backward
            (3.0, 4.0)
        """
        return self.backward or self.backward_input + self.backward_weight


@dataclass(frozen=True)
class CostTable:
    """Unit costs at ``microbatch_size`` samples per microbatch; ``fixed`` per unit: the part of
    (F, I, W) that does not grow with the microbatch (None: none of it); ``source`` says where the
    figures came from.

    Example:
        >>> table = CostTable((UnitCost("a", 2.0, 2.0, 2.0, 100.0),), 2, fixed=((1.0, 0.0, 0.0),))
        >>> unit = table.at(4)[0]
        >>> unit.forward, unit.backward_input, unit.activation_bytes
        (3.0, 4.0, 200.0)
    """

    units: tuple[UnitCost, ...]
    microbatch_size: int
    fixed: tuple[tuple[float, float, float], ...] | None = None
    source: str = "given"

    def __post_init__(self) -> None:
        if not self.units:
            raise PlanError("a cost table needs at least one unit")
        if self.fixed is not None and len(self.fixed) != len(self.units):
            raise PlanError(f"fixed costs for {len(self.fixed)} units but the table has {len(self.units)}")
        if not isinstance(self.microbatch_size, int) or self.microbatch_size < 1:
            raise PlanError(f"microbatch_size must be a positive int, got {self.microbatch_size!r}")

    @property
    def names(self) -> list[str]:
        return [unit.name for unit in self.units]

    def at(self, microbatch_size: int) -> tuple[UnitCost, ...]:
        """The units' costs for microbatches of ``microbatch_size`` samples."""
        if microbatch_size == self.microbatch_size:
            return self.units
        ratio = microbatch_size / self.microbatch_size
        fixed = self.fixed or [(0.0, 0.0, 0.0)] * len(self.units)
        out = []
        for unit, (f0, i0, w0) in zip(self.units, fixed):
            split = unit.backward_input + unit.backward_weight
            resized = i0 + (unit.backward_input - i0) * ratio + w0 + (unit.backward_weight - w0) * ratio
            out.append(dataclasses.replace(
                unit,
                forward=f0 + (unit.forward - f0) * ratio,
                backward_input=i0 + (unit.backward_input - i0) * ratio,
                backward_weight=w0 + (unit.backward_weight - w0) * ratio,
                # The unsplit backward keeps its ratio to I + W (the same work, walked once).
                backward=unit.backward * resized / split if split > 0 else unit.backward,
                activation_bytes=unit.activation_bytes * ratio,
                weight_activation_bytes=unit.weight_activation_bytes * ratio,
                output_bytes=unit.output_bytes * ratio,
                exchange=unit.exchange * ratio,  # the bytes each moves grow with the samples
                exchange_bytes=unit.exchange_bytes * ratio,
            ))
        return tuple(out)

    def to_json(self) -> dict:
        """A JSON-ready dict (what a plan file keeps as ``costs``)."""
        return {"microbatch_size": self.microbatch_size, "source": self.source,
                "units": [dataclasses.asdict(unit) for unit in self.units],
                "fixed": None if self.fixed is None else [list(f) for f in self.fixed]}

    @classmethod
    def from_json(cls, data: dict) -> CostTable:
        """The table :meth:`to_json` wrote.

        Example:
            >>> table = CostTable((UnitCost("a", 1.0, 1.0, 1.0),), 1)
            >>> CostTable.from_json(table.to_json()) == table
            True
        """
        fixed = data.get("fixed")
        return cls(tuple(UnitCost(**unit) for unit in data["units"]), int(data["microbatch_size"]),
                   None if fixed is None else tuple(tuple(f) for f in fixed), data.get("source", "given"))


def combine(small: CostTable, large: CostTable) -> CostTable:
    """One table from profiles at two microbatch sizes: ``small``'s figures, with each time's fixed
    part from the straight line through both (clipped to [0, the time at the small size]).

    Example:
        >>> a = CostTable((UnitCost("u", 2.0, 1.0, 1.0),), 1)
        >>> b = CostTable((UnitCost("u", 5.0, 4.0, 1.0),), 4)
        >>> combine(a, b).fixed
        ((1.0, 0.0, 1.0),)
    """
    if small.names != large.names or small.microbatch_size >= large.microbatch_size:
        raise PlanError("combine() takes two profiles of the same units, the first at the smaller microbatch size")
    span = large.microbatch_size - small.microbatch_size
    fixed = []
    for a, b in zip(small.units, large.units):
        parts = []
        for name in ("forward", "backward_input", "backward_weight"):
            ta, tb = getattr(a, name), getattr(b, name)
            slope = max(0.0, (tb - ta) / span)
            parts.append(min(ta, max(0.0, ta - slope * small.microbatch_size)))
        fixed.append(tuple(parts))
    return CostTable(small.units, small.microbatch_size, tuple(fixed), small.source)


def synthetic_table(entries: Sequence[Sequence], microbatch_size: int = 1) -> CostTable:
    """A table from rows ``(name, F, I, W, activation_bytes, parameter_bytes[, is_block])`` (tests,
    what-ifs); W keeps half the activations, parameters are fp32 (4 bytes each), every boundary sends
    as many bytes as one activation row.

    Example:
        >>> synthetic_table([("embed", 1, 0, 1, 10, 400), ("block", 1, 1, 1, 10, 40, True)]).units[1].parameters
        10.0
    """
    units = []
    for row in entries:
        name, forward, backward_input, backward_weight, act, param_bytes, *rest = row
        units.append(UnitCost(name, float(forward), float(backward_input), float(backward_weight), float(act),
                              float(act) / 2, float(param_bytes), float(param_bytes) / 4, float(act),
                              bool(rest[0]) if rest else False))
    return CostTable(tuple(units), microbatch_size, source="synthetic")
