"""Expert parallelism in the plan: what ep does to each unit's costs, and the search over ep.

Expert parallelism borrows its ranks from the replicas: each of ``dp`` replicas of the pipeline
keeps ``1 / ep`` of every experts module's experts (ep divides dp and the expert count), and a
microbatch's tokens travel to the ranks holding their experts and back. What an ep does to the
model is found above this layer (the experts modules of :mod:`conveyor.parallel.experts`, which
this layer does not import) and comes as an :class:`ExpertParallelOption`: per experts module its
parameters and the bytes per sample it dispatches, or why that ep cannot run.
:func:`expert_units` turns the units' costs at ep=1 into one EP rank's:

* parameters (and with them gradients and optimizer state): the experts' divided by ep;
* F and I: the experts' compute unchanged (balanced routing: each rank runs ``1 / ep`` of the
  experts on ``ep`` times the tokens), plus two all-to-alls each (dispatch and combine in F; their
  gradients in I), each moving ``(ep - 1) / ep`` of the dispatched bytes (the tokens bound for
  other ranks) over ``Machine.bandwidth``, plus ``Machine.latency``; W unchanged;
* activations and what a stage sends on: unchanged; the unit's all-to-alls are noted (``UnitCost.exchanges``,
  ``exchange``: the forward's, the I's taken alike), so that the search can overlap them, and so are the bytes
  a forward run in segments for that keeps (``UnitCost.exchange_bytes``: what its all-to-alls sent and received).

With tensor parallelism (an option sized for ``tp > 1``: ep then divides ``dp x tp``, the units arrive
already sharded by :func:`~conveyor.plan.tensor_search.shard_units`, which leaves the experts whole),
each TP rank takes its ``1 / tp`` of the tokens into the experts, as the runtime's expert-parallel
part does: the experts' compute and the all-to-alls' bytes are divided by tp, and each experts
module's output rows are all-gathered over the TP ranks (in F; the input gradients' rows in I). The
experts' share of a unit's compute is estimated by the parameters a token uses: ``top_k / experts``
of the experts' (``ExpertParallelOption.active``) beside the unit's other parameters, as
:func:`~conveyor.plan.tensor_search.shard_units` estimates the sharded share by parameters.

:func:`search_expert_parallel` searches every option with the pipeline search at the same pipeline
ranks, and keeps, per ep, its best plan or why it has none; the fastest that fits wins (ties: the
smaller ep, which moves fewer tokens). :func:`search_tensor_and_expert_parallel` searches (tp, ep)
pairs, each at ``pp = ranks / tp``.

Example:
    >>> from conveyor.plan.costs import synthetic_table
    >>> from conveyor.plan.tensor_search import ModuleSplit, choose_fastest, evaluate
    >>> table = synthetic_table([("embed", 1, 0, 1, 8, 64)] + [(f"b{i}", 2, 2, 2, 34, 64, True) for i in range(2)])
    >>> option = ExpertParallelOption(2, (ModuleSplit("b0.experts", 8, 1e6, 1e6, 2, 2),))
    >>> [(u.parameters, u.forward) for u in expert_units(table.units, option, 1, bandwidth=1e9, latency=0.0)]
    [(16.0, 1.0), (12.0, 2.001), (16.0, 2.0)]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.errors import PlanError, positive_int
from conveyor.plan.costs import UnitCost
from conveyor.plan.tensor_search import (
    ModuleSplit,
    Outcome,
    choose_fastest,
    evaluate,
    modules_by_unit,
    refusal,
    rescaled_unit,
)


@dataclass(frozen=True)
class ExpertParallelOption:
    """One expert-parallel size to try: per experts module (a :class:`~conveyor.plan.tensor_search.ModuleSplit`:
    ``sharded_parameters`` its experts' parameters, ``forward_bytes`` / ``backward_bytes`` the bytes per sample
    one all-to-all moves at ep=1 (one TP rank's rows under ``tp``), ``forward_collectives`` /
    ``backward_collectives`` how many), or ``refused``.

    ``tp``: the tensor-parallel size the option is sized for (1: none); ``active``: the share of an experts
    module's parameters one token uses (top-k / experts); ``gather_bytes``: per sample, the bytes of one experts
    module's output, which its TP ranks all-gather by rows (0 without TP)."""

    ep: int
    modules: tuple[ModuleSplit, ...] = ()
    refused: str | None = None
    tp: int = 1
    active: float = 1.0
    gather_bytes: float = 0.0

    def __post_init__(self) -> None:
        for name in ("ep", "tp"):
            value = getattr(self, name)
            if not positive_int(value):
                raise PlanError(f"ExpertParallelOption.{name} must be a positive int, got {value!r}")
        if not 0.0 < self.active <= 1.0:
            raise PlanError(f"ExpertParallelOption.active is top-k / experts, in (0, 1]; got {self.active!r}")


def expert_units(units: Sequence[UnitCost], option: ExpertParallelOption, microbatch_size: int, *,
                 bandwidth: float, latency: float, tensor_bandwidth: float | None = None) -> tuple[UnitCost, ...]:
    """One EP rank's costs of ``units`` (for microbatches of ``microbatch_size`` samples) under ``option``;
    ``tensor_bandwidth``: the TP ranks' link, for the gather of the experts' output rows (default ``bandwidth``)."""
    ep, tp = option.ep, option.tp
    if ep == 1 and tp == 1:
        return tuple(units)
    per_unit = modules_by_unit(option.modules, units)
    away = (ep - 1) / ep  # the share of a rank's tokens whose experts another rank holds
    out = []
    for unit in units:
        mine = per_unit.get(unit.name, [])
        if not mine:
            out.append(unit)
            continue
        experts = min(unit.parameters, sum(m.sharded_parameters for m in mine))
        forward = sum(m.forward_collectives * (latency + away * m.forward_bytes * microbatch_size / bandwidth)
                      for m in mine)
        backward = sum(m.backward_collectives * (latency + away * m.backward_bytes * microbatch_size / bandwidth)
                       for m in mine)
        count = sum(m.forward_collectives for m in mine) if ep > 1 else 0
        exchange = forward / count if count else 0.0  # one all-to-all's seconds (the TP gather is no all-to-all)
        held = unit.parameters - experts + experts / ep
        compute = 1.0  # the unit's compute kept on this rank: all of it, unless TP ranks split the experts' tokens
        if tp > 1:
            used = experts * option.active  # the experts' parameters a token uses, beside the unit's others
            share = used / (unit.parameters - experts + used) if unit.parameters else 0.0
            compute = 1 - share + share / tp
            gather = len(mine) * (latency + (tp - 1) / tp * option.gather_bytes * microbatch_size
                                  / (tensor_bandwidth or bandwidth))
            forward, backward = forward + gather, backward + gather
        out.append(dataclasses.replace(
            rescaled_unit(unit, compute, forward, backward, held), exchanges=count, exchange=exchange,
            # A forward run in segments (to overlap its all-to-alls) keeps what it sent and what arrived (as many
            # bytes, routing balanced) until its backward: an upper bound (what arrived may be saved anyway, in the
            # same storage); with what was sent alone, the MoE recipe's measured rise at zbv is above the estimate.
            exchange_bytes=2 * sum(m.forward_collectives * m.forward_bytes * microbatch_size for m in mine) if count
            else 0.0))
    return tuple(out)


@dataclass
class ExpertParallelOutcome(Outcome):
    """What the search found at one ep."""

    ep: int

    def line(self) -> str:
        """One row of the report: ep, then :meth:`~conveyor.plan.tensor_search.Outcome.cells`."""
        return f"{self.ep:>4}  " + self.cells()


def search_expert_parallel(table, options: Sequence[ExpertParallelOption], *, ranks: int, search_one,
                           memory_per_rank: float) -> tuple[ExpertParallelOutcome | None, list[ExpertParallelOutcome]]:
    """Search each option with ``search_one(table, ranks, option)`` (the pipeline search at the same pipeline
    ranks, returning a SearchResult); returns (the chosen outcome or None, every outcome with its reason)."""
    outcomes = [ExpertParallelOutcome(option.ep) for option in options]
    for outcome, option in zip(outcomes, options):
        evaluate(outcome, search_one, (table, ranks, option), memory_per_rank, option.refused)
    return choose_fastest(outcomes, "ep"), outcomes


@dataclass
class TensorExpertOutcome(Outcome):
    """What the search found at one (tp, ep) pair, at ``pp = ranks / tp``."""

    tp: int
    pp: int
    ep: int

    @property
    def sizes(self) -> tuple[int, int]:
        """(tp, ep): ties between pairs go to the smaller tp, then the smaller ep."""
        return self.tp, self.ep

    def label(self) -> str:
        return f"tp={self.tp} x ep={self.ep}"

    def line(self) -> str:
        """One row of the report: tp, pp, ep, then :meth:`~conveyor.plan.tensor_search.Outcome.cells`."""
        return f"{self.tp:>4} {self.pp:>4} {self.ep:>4}  " + self.cells()


def search_tensor_and_expert_parallel(table, pairs: Sequence[tuple], *, ranks: int, search_one,
                                      memory_per_rank: float) -> tuple[TensorExpertOutcome | None,
                                                                       list[TensorExpertOutcome]]:
    """Search each (``TensorParallelOption``, :class:`ExpertParallelOption` sized for its tp) pair at ``pp = ranks
    / tp`` with ``search_one(table, pp, pair)``; returns (the chosen outcome or None, every outcome with its reason).

    Example:
        >>> from conveyor.plan.costs import synthetic_table
        >>> from conveyor.plan.tensor_search import TensorParallelOption
        >>> table = synthetic_table([("a", 1, 1, 1, 8, 64), ("b", 1, 1, 1, 8, 64)])
        >>> pairs = [(TensorParallelOption(2), ExpertParallelOption(4, refused="ep=4 does not divide dp x tp = 2",
        ...                                                            tp=2))]
        >>> search_tensor_and_expert_parallel(table, pairs, ranks=2, search_one=None, memory_per_rank=1e9)[1][0].reason
        'refused: ep=4 does not divide dp x tp = 2'
    """
    outcomes = []
    for tensor, experts in pairs:
        if experts.tp != tensor.tp:
            raise PlanError(f"an ExpertParallelOption sized for tp={experts.tp} was paired with tp={tensor.tp}")
        outcome = TensorExpertOutcome(tensor.tp, ranks // tensor.tp, experts.ep)
        outcomes.append(outcome)
        evaluate(outcome, search_one, (table, outcome.pp, (tensor, experts)), memory_per_rank,
                 refusal(ranks, tensor.tp, len(table.units), tensor.refused, experts.refused))
    return choose_fastest(outcomes, "sizes"), outcomes


def tensor_expert_report_lines(outcomes: Sequence[TensorExpertOutcome], ranks: int) -> list[str]:
    """The (tp, ep) table ``conveyor plan --tp --ep`` prints above the chosen pair's plans: one line per pair."""
    head = (f"tensor x expert parallel: {ranks} ranks as pp x tp, each experts module's experts shared by ep of the "
            "replicas' TP ranks (ep divides dp x tp), each TP rank's tokens moved all-to-all; per pair, its best "
            "plan (step and peak memory of one rank)")
    columns = f"{'tp':>4} {'pp':>4} {'ep':>4}  {'schedule':<16} {'V':>2} {'M':>4} {'step':>10} {'peak/rank':>12}  why"
    return [head, columns, *(o.line() for o in outcomes)]


def report_lines(outcomes: Sequence[ExpertParallelOutcome]) -> list[str]:
    """The ep table ``conveyor plan --ep`` prints above the chosen ep's plans: one line per ep, with why."""
    head = ("expert parallel: each experts module's experts shared by ep replicas, their tokens moved all-to-all; "
            "per ep, its best plan (step and peak memory of one rank)")
    return [head, f"{'ep':>4}  {'schedule':<16} {'V':>2} {'M':>4} {'step':>10} {'peak/rank':>12}  why",
            *(o.line() for o in outcomes)]
