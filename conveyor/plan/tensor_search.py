"""Tensor parallelism in the plan: what tp does to each unit's costs, and the search over tp x pp.

Ranks ``R`` can run as ``pp = R / tp`` pipeline ranks of ``tp`` tensor-parallel ranks each (tp
innermost: a TP group inside one node). What a tp does to the model is found above this layer (the
plan of :mod:`conveyor.parallel.tensor`, which this layer does not import) and comes as a
:class:`TensorParallelOption`: per module, the parameters it shards and the bytes its collectives
move, or why that tp cannot run (a size it does not divide). :func:`shard_units` turns the units'
tp=1 costs into one TP rank's:

* parameters (and with them gradients and optimizer state): the sharded ones divided by tp;
* F, I and W: the sharded share of the unit's compute (its sharded share of parameters) divided by
  tp, plus the collectives: each an all-reduce of its tensor (ring: ``2 (tp-1)/tp`` of its bytes
  over ``Machine.tensor_bandwidth``, plus ``Machine.latency``), the forward's in F, the input
  gradients' in I;
* activations of a block: the share inside attention and the MLP divided by tp, the rest (the
  residual stream, the norms' inputs) whole: ``(10 + 24 / tp) / 34`` of them, as Korthikanti et
  al. (2022) count a transformer layer's without sequence parallelism (flash attention: no score
  matrix); other units keep theirs;
* what a stage sends on: unchanged (each TP rank sends its whole tensor to its peer).

:func:`search_tensor_parallel` searches every option with the pipeline search and keeps, per tp,
its best plan or why it has none; the fastest that fits wins (ties: the smaller tp).

Example:
    >>> from conveyor.plan.costs import synthetic_table
    >>> table = synthetic_table([("embed", 1, 0, 1, 8, 64)] + [(f"b{i}", 2, 2, 2, 34, 64, True) for i in range(2)])
    >>> option = TensorParallelOption(2, (ModuleSplit("b0.mlp", sharded_parameters=16),))
    >>> [round(u.forward, 3) for u in shard_units(table.units, option, 1, bandwidth=1e9, latency=0.0)]
    [1.0, 1.0, 2.0]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from conveyor.errors import PlanError, positive_int
from conveyor.plan.costs import UnitCost
from conveyor.plan.result import format_size

# Of a transformer layer's activations without sequence parallelism, the share tp splits: 24 of 34
# (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022).
BLOCK_SHARDED_ACTIVATIONS = 24 / 34


@dataclass(frozen=True)
class ModuleSplit:
    """What tp does to one module (by its name in the model): ``sharded_parameters`` split over tp, and per
    sample, the bytes of the tensors its collectives reduce in the forward and in the input gradient."""

    name: str
    sharded_parameters: float = 0.0
    forward_bytes: float = 0.0
    backward_bytes: float = 0.0
    forward_collectives: int = 0
    backward_collectives: int = 0


@dataclass(frozen=True)
class TensorParallelOption:
    """One tensor-parallel size to try: its modules' splits, or ``refused``: why this tp cannot run."""

    tp: int
    modules: tuple[ModuleSplit, ...] = ()
    refused: str | None = None

    def __post_init__(self) -> None:
        if not positive_int(self.tp):
            raise PlanError(f"TensorParallelOption.tp must be a positive int, got {self.tp!r}")


def modules_by_unit(modules: Sequence[ModuleSplit], units: Sequence[UnitCost]) -> dict[str, list[ModuleSplit]]:
    """``modules`` grouped by the unit each belongs to (the unit itself, or a module inside it); others left out."""
    names = [unit.name for unit in units]
    per_unit: dict[str, list[ModuleSplit]] = {}
    for module in modules:
        owner = next((unit for unit in names if module.name == unit or module.name.startswith(unit + ".")), None)
        if owner is not None:
            per_unit.setdefault(owner, []).append(module)
    return per_unit


def rescaled_unit(unit: UnitCost, compute: float, forward: float, backward: float, held: float,
                  kept: float = 1.0) -> UnitCost:
    """``unit`` as one rank of a group runs it: ``compute`` of its F, I, W and B, plus ``forward`` seconds of
    collectives in F and ``backward`` in I (and in B), holding ``held`` of its parameters and ``kept`` of its
    activations."""
    bytes_per_parameter = unit.parameter_bytes / unit.parameters if unit.parameters else 0.0
    return dataclasses.replace(
        unit, forward=unit.forward * compute + forward, backward_input=unit.backward_input * compute + backward,
        backward_weight=unit.backward_weight * compute,
        backward=unit.backward * compute + backward if unit.backward else 0.0,
        activation_bytes=unit.activation_bytes * kept, weight_activation_bytes=unit.weight_activation_bytes * kept,
        parameters=held, parameter_bytes=held * bytes_per_parameter)


def shard_units(units: Sequence[UnitCost], option: TensorParallelOption, microbatch_size: int, *,
                bandwidth: float, latency: float) -> tuple[UnitCost, ...]:
    """One TP rank's costs of ``units`` (for microbatches of ``microbatch_size`` samples) under ``option``."""
    tp = option.tp
    if tp == 1:
        return tuple(units)
    per_unit = modules_by_unit(option.modules, units)
    ring = 2 * (tp - 1) / tp
    out = []
    for unit in units:
        mine = per_unit.get(unit.name, [])
        sharded = min(unit.parameters, sum(m.sharded_parameters for m in mine))
        share = sharded / unit.parameters if unit.parameters else 0.0
        forward = sum(m.forward_collectives * latency + ring * m.forward_bytes * microbatch_size / bandwidth
                      for m in mine)
        backward = sum(m.backward_collectives * latency + ring * m.backward_bytes * microbatch_size / bandwidth
                       for m in mine)
        kept = 1 - BLOCK_SHARDED_ACTIVATIONS + BLOCK_SHARDED_ACTIVATIONS / tp if unit.is_block and share else 1.0
        held = unit.parameters - sharded + sharded / tp
        out.append(rescaled_unit(unit, 1 - share + share / tp, forward, backward, held, kept))
    return tuple(out)


@dataclass
class Outcome:
    """What the search found at one size (a tp, an ep, a (tp, ep) pair): its best candidate (None: none) and the
    reason it won or lost."""

    best: Any = field(default=None, kw_only=True)  # a conveyor.plan.search.Candidate
    result: Any = field(default=None, kw_only=True)  # its conveyor.plan.search.SearchResult
    reason: str = field(default="", kw_only=True)

    def cells(self) -> str:
        """A report row after its sizes: the best plan's schedule, V, M, step and peak, and the reason."""
        if self.best is None:
            return f"{'-':<16} {'-':>2} {'-':>4} {'-':>10} {'-':>12}  {self.reason}"
        c = self.best
        return (f"{c.schedule:<16} {c.virtual:>2} {c.microbatches:>4} "
                f"{c.step_time:>8.4g} s {format_size(c.peak_memory):>12}  {self.reason}")


@dataclass
class TensorParallelOutcome(Outcome):
    """What the search found at one tp, at ``pp = ranks / tp``."""

    tp: int
    pp: int

    def line(self) -> str:
        """One row of the report: tp, pp, then :meth:`~Outcome.cells`."""
        return f"{self.tp:>4} {self.pp:>4}  " + self.cells()


def tp_sizes(ranks: int) -> list[int]:
    """The tensor-parallel sizes ``ranks`` ranks can take: its divisors.

    Example:
        >>> tp_sizes(8), tp_sizes(6)
        ([1, 2, 4, 8], [1, 2, 3, 6])
    """
    return [tp for tp in range(1, ranks + 1) if ranks % tp == 0]


def search_tensor_parallel(table, options: Sequence[TensorParallelOption], *, ranks: int, search_one,
                           memory_per_rank: float) -> tuple[TensorParallelOutcome | None, list[TensorParallelOutcome]]:
    """Search each option at ``pp = ranks / tp`` with ``search_one(table, pp, option)`` (the pipeline search,
    returning a SearchResult); returns (the chosen outcome or None, every outcome with its reason)."""
    outcomes = [TensorParallelOutcome(option.tp, ranks // option.tp) for option in options]
    for outcome, option in zip(outcomes, options):
        evaluate(outcome, search_one, (table, outcome.pp, option), memory_per_rank,
                 refusal(ranks, option.tp, len(table.units), option.refused))
    return choose_fastest(outcomes, "tp"), outcomes


def refusal(ranks: int, tp: int, units: int, *refused: str | None) -> str | None:
    """Why ``ranks`` ranks cannot run as pp x ``tp``: tp does not divide them, an option refuses (the first of
    ``refused`` that does), or the pp stages need more than the model's ``units``; None when they can."""
    pp = ranks // tp
    if ranks % tp:
        return f"tp={tp} does not divide the {ranks} ranks"
    return next(filter(None, refused), None) or (
        f"pp={pp} stages need {pp} units, the model has {units}" if pp > units else None)


def evaluate(outcome: Outcome, search_one: Any, args: tuple, memory_per_rank: float,
             refused: str | None = None) -> None:
    """Fill ``outcome`` from ``search_one(*args)``, the pipeline search at that size: its result, its best
    candidate (the fastest that fits, else the best over memory) and, when none fits or the search refuses the
    size, why; ``refused``: why the size cannot run, without searching."""
    if refused:
        outcome.reason = f"refused: {refused}"
        return
    try:
        outcome.result = search_one(*args)
    except PlanError as error:
        outcome.reason = f"refused: {str(error).splitlines()[0]}"
        return
    fitting = outcome.result.fitting
    outcome.best = fitting[0] if fitting else outcome.result.best_over_memory()
    if not fitting:
        lightest = min((c.peak_memory for c in outcome.result.candidates if c.memory_per_rank), default=math.nan)
        outcome.reason = (f"over memory: its lightest plan needs {format_size(lightest)} per rank, "
                          f"over {format_size(memory_per_rank)}")


def choose_fastest(outcomes: Sequence[Outcome], name: str) -> Any:
    """The outcome whose best plan fits and is fastest (ties: the smaller size, ``getattr(outcome, name)``), or
    None; every fitting outcome's reason then says why it won or by how much it lost."""
    fits = [o for o in outcomes if o.best is not None and o.best.verdict == "fits"]
    chosen = min(fits, key=lambda o: (o.best.step_time, getattr(o, name)), default=None)
    for o in fits:
        if o is chosen:
            o.reason = "chosen: the fastest plan that fits" + (f" ({len(fits) - 1} other {name} fit)"
                                                               if len(fits) > 1 else "")
        else:
            slower = o.best.step_time / chosen.best.step_time - 1
            named = chosen.label() if hasattr(chosen, "label") else f"{name}={getattr(chosen, name)}"
            o.reason = f"fits, {slower:.0%} slower than {named}"
    return chosen


def report_lines(outcomes: Sequence[TensorParallelOutcome], ranks: int) -> list[str]:
    """The tp table ``conveyor plan`` prints above the chosen tp's plans: one line per tp, with why."""
    head = (f"tensor parallel: {ranks} ranks as pp x tp (tp innermost, inside a node); per tp, its best plan "
            f"(step and peak memory of one rank)")
    return [head, f"{'tp':>4} {'pp':>4}  {'schedule':<16} {'V':>2} {'M':>4} {'step':>10} {'peak/rank':>12}  why",
            *(o.line() for o in outcomes)]
