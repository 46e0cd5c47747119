"""``conveyor.plan.plan()``: unit costs (measured, or from the cost model on the meta device), then the search.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    >>> chosen = plan(model, torch.randn(2, 16), ranks=2, global_batch=8, memory_per_rank="1GiB",
    ...               schedules=["1f1b"], measure=Measurement(repeats=1))
    >>> chosen.schedule, chosen.ranks, len(chosen.split_points)
    ('1f1b', 2, 1)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from conveyor.errors import PlanError
from conveyor.plan import expert_search
from conveyor.plan.analytic import analytic_units
from conveyor.plan.calibration import calibration_of
from conveyor.plan.costs import CostTable, combine
from conveyor.plan.expert_search import ExpertParallelOption
from conveyor.plan.profile import (
    _batch_size,
    optimizer_seconds_per_parameter,
    profile_units,
    resize_batch,
)
from conveyor.plan.result import Plan, format_size, parse_size
from conveyor.plan.search import Candidate, SearchResult, microbatch_choices, search
from conveyor.plan.settings import Machine, Measurement, SearchSpace
from conveyor.plan.tensor_search import report_lines, search_tensor_parallel
from conveyor.runtime.stage.device import cpu_threads_per_rank, torch_threads


def plan(model: torch.nn.Module, example: Any = (), *, ranks: int, global_batch: int,
         memory_per_rank: str | float = math.inf, example_kwargs: Mapping[str, Any] | None = None,
         schedules: Sequence[str] | None = None, microbatches: Sequence[int] | None = None,
         space: SearchSpace = SearchSpace(), machine: Machine = Machine(),
         measure: Measurement = Measurement()) -> Plan:
    """The fastest plan (schedule, V, microbatches, split points) for ``ranks`` ranks whose predicted
    memory per rank (parameters, gradients, optimizer state, activations) fits ``memory_per_rank``
    (bytes, or a size such as ``"8GiB"``), trying ``schedules`` (default: every registered one) and
    ``microbatches`` (default: the divisors of ``global_batch`` of at least ``ranks``).

    ``example`` is ONE microbatch (a tensor, or a tuple of forward's positional arguments; batch first).
    The rest comes in records (:mod:`conveyor.plan.settings`): ``space`` (:class:`SearchSpace`:
    stages per rank, balance tolerance, how many plans to list), ``machine`` (:class:`Machine`:
    links, throughput, optimizer state, cores, threads, calibration) and ``measure``
    (:class:`Measurement`: device, repeats, given costs, unsplittable modules).

    The units are profiled on ``measure.device`` (default: the model's), at the example's size and at
    one more microbatch size the search may pick; a model on the meta device gets costs from the cost
    model (:mod:`conveyor.plan.analytic`, ``machine.flops_per_second``, ``seq_len`` from the example's
    second dimension). ``measure.costs`` skips both. Raises :class:`~conveyor.errors.PlanError` when
    nothing fits, naming the lightest candidate's peak.

    ``machine.calibration`` (a :class:`~conveyor.plan.calibration.Calibration` or its ``as_dict()``;
    measure one with :func:`conveyor.plan.calibration.calibrate`) makes each predicted step the one a
    real step is checked against (:func:`~conveyor.plan.predict.predict_split`): the runtime's
    per-action and per-receive time, message latency, the step's own time, and each rank's AdamW
    step (timed here on copies of the parameters). ``machine.cores``: the CPU cores the ranks share
    ("auto": the machine's when the model computes on the CPU; None: a device per rank, as for
    blocks that only wait). ``machine.threads``: the CPU threads each rank computes with, which a
    model on the CPU is profiled at ("auto": ``OMP_NUM_THREADS`` when set, else the machine's cores
    shared by ``ranks`` ranks, as ``conveyor train`` gives its local ranks; None: this process's
    torch setting).
    """
    for name, value, kind in (("space", space, SearchSpace), ("machine", machine, Machine),
                              ("measure", measure, Measurement)):
        if not isinstance(value, kind):
            raise PlanError(f"plan(): {name}= takes a conveyor.plan.{kind.__name__}; got {type(value).__name__}")
    limit = parse_size(memory_per_rank)
    calibration = calibration_of(machine.calibration, ranks)
    measured = not any(p.device.type == "meta" for p in model.parameters())
    first = next(model.parameters(), None)
    device = measure.device
    where = torch.device(device) if device is not None else (first.device if first is not None else torch.device("cpu"))
    threads, cores = machine.threads, machine.cores
    if threads == "auto":
        threads = cpu_threads_per_rank(ranks) if measured and where.type == "cpu" else None
    if cores == "auto":
        cores = os.cpu_count() if calibration is not None and measured and where.type == "cpu" else None
    rate = 0.0
    costs = measure.costs
    with torch_threads(threads):
        if calibration is not None and measured:
            rate = optimizer_seconds_per_parameter(model)
        args = example if isinstance(example, tuple) else (example,)
        if costs is None:
            costs = unit_costs(model, args, example_kwargs, global_batch=global_batch, ranks=ranks,
                               microbatches=microbatches, machine=machine, measure=measure)
    resolved = dataclasses.replace(machine, calibration=calibration, cores=cores, threads=threads)

    def search_one(table: CostTable, pipeline_ranks: int, option: Any) -> SearchResult:
        # option: a TensorParallelOption, an ExpertParallelOption, or a (tensor, expert) pair.
        tensor, experts = option if isinstance(option, tuple) else (
            (None, option) if isinstance(option, ExpertParallelOption) else (option, None))
        if calibration is not None and ((tensor is not None and tensor.tp > 1) or (experts is not None
                                                                                   and experts.ep > 1)):
            raise PlanError("a calibration predicts steps of whole stages only (tp=1, ep=1); plan without "
                            "--calibrate to compare tensor- or expert-parallel sizes")
        return search(table, ranks=pipeline_ranks, global_batch=global_batch, memory_per_rank=limit,
                      schedules=schedules, microbatches=microbatches, space=space, machine=resolved,
                      optimizer_s_per_parameter=rate, tensor_parallel=tensor, expert_parallel=experts)

    if not space.tensor_parallel and not space.expert_parallel:
        return choose(search_one(costs, ranks, None), costs, top=space.top)
    return _choose_parallel(costs, ranks, space, search_one, limit)


def _choose_parallel(costs: CostTable, ranks: int, space: SearchSpace, search_one, limit: float) -> Plan:
    """Search every size ``space`` lists, each with the pipeline search, and return the chosen size's plan with
    the sizes' table: every tp of ``space.tensor_parallel`` at pp = ranks / tp; every ep of
    ``space.expert_parallel`` at the same pipeline ranks (the replicas' count is the options' business: each ep
    was checked to divide it); with both, every (tp, ep) pair (each ep option with the tp option it is sized
    for) at pp = ranks / tp, its table as the ep report."""
    if space.expert_parallel and space.tensor_parallel:
        pairs = [(tensor, experts) for tensor in space.tensor_parallel for experts in space.expert_parallel
                 if experts.tp == tensor.tp]
        chosen, outcomes = expert_search.search_tensor_and_expert_parallel(costs, pairs, ranks=ranks,
                                                                           search_one=search_one, memory_per_rank=limit)
        report = expert_search.tensor_expert_report_lines(outcomes, ranks)
        sizes = "(tensor-parallel, expert-parallel) pair"
    elif space.expert_parallel:
        chosen, outcomes = expert_search.search_expert_parallel(costs, space.expert_parallel, ranks=ranks,
                                                                search_one=search_one, memory_per_rank=limit)
        report, sizes = expert_search.report_lines(outcomes), "expert-parallel size"
    else:
        chosen, outcomes = search_tensor_parallel(costs, space.tensor_parallel, ranks=ranks, search_one=search_one,
                                                  memory_per_rank=limit)
        report, sizes = report_lines(outcomes, ranks), "tensor-parallel size"
    if chosen is None:
        raise PlanError(f"no {sizes} gives a plan that fits:\n" + "\n".join(report))
    plan = choose(chosen.result, costs, top=space.top)
    plan.tensor_parallel, plan.expert_parallel = getattr(chosen, "tp", 1), getattr(chosen, "ep", 1)
    if space.expert_parallel:
        plan.expert_parallel_report = report
    else:
        plan.tensor_parallel_report = report
    return plan


def unit_costs(model: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any] | None, *, global_batch: int,
               ranks: int, microbatches: Sequence[int] | None = None, machine: Machine = Machine(),
               measure: Measurement = Measurement()) -> CostTable:
    """The units' costs: the cost model for a meta-device model, else measured at the example's
    microbatch size and (when the search may pick others) at a second one, the time's fixed part
    fitted through both.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        >>> unit_costs(model, (torch.randn(2, 8),), None, global_batch=8, ranks=2,
        ...            measure=Measurement(repeats=1)).microbatch_size
        2
    """
    size = _batch_size(args, kwargs)
    if any(p.device.type == "meta" for p in model.parameters()):
        leaf = next((t for t in pytree.tree_leaves((args, dict(kwargs or {}))) if isinstance(t, torch.Tensor)), None)
        seq_len = int(leaf.shape[1]) if leaf is not None and leaf.dim() >= 2 else 1
        return analytic_units(model, microbatch_size=size, seq_len=seq_len, flops_per_second=machine.flops_per_second,
                              bytes_per_second=machine.bytes_per_second)
    profile = functools.partial(profile_units, model, device=measure.device, repeats=measure.repeats,
                                unsplittable=measure.unsplittable)
    table = profile(args, kwargs)
    ms = list(microbatches) if microbatches is not None else microbatch_choices(global_batch, ranks)
    sizes = sorted({global_batch // m for m in ms} - {size})
    if not sizes:
        return table
    other = max((s for s in sizes if s <= 4 * size), default=sizes[0])
    second = profile(*resize_batch((args, dict(kwargs or {})), other))
    return combine(table, second) if other > size else combine(second, table)


def choose(result: SearchResult, costs: CostTable, *, top: int = 5) -> Plan:
    """The fastest fitting candidate of ``result`` as a :class:`Plan` (a PlanError if none fits)."""
    fitting = result.fitting
    settings = result.settings
    if not fitting:
        raise PlanError(_nothing_fits(result))
    best = fitting[0]
    over = result.best_over_memory()
    return Plan(best.schedule, settings["ranks"], best.virtual, best.microbatches, settings["global_batch"],
                best.split_points, best.step_time, best.bubble, best.memory_per_rank, best.stage_times,
                settings["memory_per_rank"], costs, [_cells(c, c.peak_memory) for c in fitting[1:top]],
                result.counts(), None if over is None else _line(over), settings, best.schedule_costs,
                recompute=best.recompute, expert_overlap=best.expert_overlap)


def _nothing_fits(result: SearchResult) -> str:
    simulated = [c for c in result.candidates if c.memory_per_rank]
    limit = format_size(result.settings["memory_per_rank"])
    if not simulated:
        reasons = sorted({c.verdict for c in result.candidates})
        return f"no candidate could be simulated: {'; '.join(reasons)}"
    lightest = min(simulated, key=lambda c: c.peak_memory)
    return (f"no plan fits {limit} per rank: the lightest of {len(simulated)} simulated candidates, "
            f"{_line(lightest)}, needs {format_size(lightest.peak_memory)} on its fullest rank; give more "
            f"memory per rank, more ranks, or a smaller global batch")


def _line(c: Candidate) -> str:
    points = c.split_points if len(c.split_points) <= 4 else (*c.split_points[:3], f"... ({len(c.split_points)})")
    return (f"{c.schedule} V={c.virtual} M={c.microbatches} split {','.join(points)}: step "
            f"{c.step_time:.4g} s, bubble {c.bubble:.1%}, peak {format_size(c.peak_memory)}/rank")


def format_plan(chosen: Plan, *, top: int = 5) -> str:
    """The table ``conveyor plan`` prints: the best plans, then why the others lost.

    Example:
        >>> chosen = Plan("1f1b", 2, 1, 4, 8, ("layers.2",), 1.5, 0.2, (1e9, 9e8), (0.3, 0.3), 4e9,
        ...               outcome={"fits": 3, "over memory": 2})
        >>> print(format_plan(chosen).splitlines()[2])
          1  1f1b              1    4  layers.2                                      1.5 s  20.0%     953.67 MiB
    """
    lines = []
    if chosen.expert_parallel_report:
        ep, tp = chosen.expert_parallel, chosen.tensor_parallel
        if tp > 1:  # the (tp, ep) table: the pair's choice says both
            shared = (f"each experts module's experts shared by {ep} of the replicas' TP ranks" if ep > 1
                      else "every rank keeps every expert")
            what = (f"tp={tp} x ep={ep}: {chosen.ranks} pipeline ranks x {tp} tensor-parallel ranks, {shared} "
                    f"(conveyor train parallel.pp={chosen.ranks} parallel.tp={tp} parallel.ep={ep})")
        else:
            shared = (f"each experts module's experts shared by {ep} replicas" if ep > 1
                      else "every replica keeps every expert")
            what = f"ep={ep}: {shared} (conveyor train parallel.ep={ep})"
        lines += [*chosen.expert_parallel_report, f"chosen {what}; its best plans (memory: one rank's):", ""]
    if chosen.tensor_parallel_report:
        lines += [*chosen.tensor_parallel_report,
                  f"chosen tp={chosen.tensor_parallel}: {chosen.ranks} pipeline ranks x {chosen.tensor_parallel} "
                  f"tensor-parallel ranks (conveyor train parallel.pp={chosen.ranks} parallel.tp="
                  f"{chosen.tensor_parallel}); its best plans (memory: one TP rank's):", ""]
    lines += [f"{'#':>3}  {'schedule':<16} {'V':>2} {'M':>4}  {'split points':<40} {'step':>8} {'bubble':>7} "
              f"{'peak/rank':>14}",
              "-" * 102,
              f"{1:>3}  " + _cells(chosen, max(chosen.memory_per_rank))]
    for index, line in enumerate(chosen.alternatives[: top - 1], start=2):
        lines.append(f"{index:>3}  {line}")
    outcome = chosen.outcome
    lost = [f"{outcome.get('fits', 1) - 1} fit but were slower"]
    for key, text in (("slower (bound)", "could not beat the best (lower bound, not simulated)"),
                      ("over memory", f"were over {format_size(chosen.memory_limit)} per rank"),
                      ("failed", "could not be built")):
        if outcome.get(key):
            lost.append(f"{outcome[key]} {text}")
    memory = chosen.memory_per_rank
    fullest = max(range(len(memory)), key=memory.__getitem__)
    per_rank = (", ".join(format_size(m) for m in memory) if len(memory) <= 8 else
                f"{format_size(min(memory))} to {format_size(memory[fullest])} (rank {fullest})")
    lines.append(f"chosen: {chosen.schedule} V={chosen.virtual} M={chosen.microbatches} (microbatch of "
                 f"{chosen.microbatch_size}); memory per rank: {per_rank}")
    lines.append(f"predicted step {chosen.step_time:.4g} s, {step_basis(chosen.settings)}")
    if chosen.recompute:  # what it needs to fit: stage.recompute, applied by the pipeline
        lines.append("recomputation to fit: " + "; ".join(
            f"stage {s}: {'none' if p is None else ', '.join(f'{k}={v}' for k, v in p.items())}"
            for s, p in enumerate(chosen.recompute)))
    if chosen.expert_overlap:  # what its step and memory assume: parallel.expert_overlap, applied by the trainer
        lines.append("all-to-alls overlapped: each forward runs with the backward next to it, their all-to-alls "
                     "hidden behind each other's compute (conveyor train parallel.expert_overlap=true; the peak "
                     "above counts what the forwards in segments keep)")
    lines.append(f"others: {'; '.join(lost)}")
    if chosen.best_over_memory:
        lines.append(f"fastest over memory: {chosen.best_over_memory}")
    if chosen.costs is not None:
        lines.append(f"costs: {len(chosen.costs.units)} units, {chosen.costs.source}")
    return "\n".join(lines)


UNCALIBRATED = ("uncalibrated: the simulated compute of the profiled units alone, without the runtime's "
                "per-action and per-message time or the optimizer step, so a real step takes longer (on ranks "
                "sharing a few CPU cores, several times longer); plan with `--calibrate` (in Python: "
                "conveyor.plan.Machine(calibration=conveyor.plan.calibration.calibrate(conveyor.Pipeline, "
                "ranks=P))) to predict the step a run takes")
CALIBRATED = ("calibrated on this machine: the runtime's per-action and per-message time, the step's own time "
              "and each rank's optimizer step are in it")


def step_basis(settings: Mapping[str, Any]) -> str:
    """What a plan's predicted step stands for: calibrated, or uncalibrated and how to calibrate.
    The bubble beside it is the idle share of the ranks' time in the simulated pipeline either way.

    Example:
        >>> step_basis({"calibration": None}).split(":")[0], step_basis({"calibration": {"step_s": 1e-3}})[:10]
        ('uncalibrated', 'calibrated')
    """
    return CALIBRATED if settings.get("calibration") is not None else UNCALIBRATED


def _cells(c: Candidate | Plan, peak: float) -> str:
    """A table row's cells for a candidate or a chosen plan, whose peak memory per rank is ``peak``."""
    points = ",".join(c.split_points)
    if len(points) > 40:
        points = points[:37] + "..."
    return (f"{c.schedule:<16} {c.virtual:>2} {c.microbatches:>4}  {points:<40} {c.step_time:>8.4g} s "
            f"{c.bubble:>6.1%} {format_size(peak):>14}")
