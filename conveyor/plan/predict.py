"""A plan's step as the ranks run it: per-stage costs for the executed programs, simulated with
what a real step pays beyond compute (the :class:`~conveyor.plan.calibration.Calibration`).

The runtime splits a stage's backward into I and W only where the schedule's executed
programs (:func:`conveyor.schedule.executable`) keep a W on its own; elsewhere it runs one
full backward (B), which costs less than the split I + W. :func:`stage_costs` gives each
stage the one it pays. :func:`predict_step` simulates what the ranks run with the
calibration's overheads (:func:`with_overheads`: per action, per receive; latency and bytes
per message), the step's own time and each rank's optimizer step; :func:`predict_split` and
:func:`predict_plan` do it for a split of profiled units and for a chosen plan.

Example:
    >>> import conveyor.schedule as cs
    >>> sched = cs.build("1f1b", ranks=2, microbatches=4)
    >>> costs = cs.CostModel.uniform(2, 0.010, 0.010, 0.010)
    >>> from conveyor.plan.calibration import Calibration
    >>> cal = Calibration(receive_s=1e-4, latency_s=3e-4, step_s=1e-3)
    >>> round(predict_step(sched, costs, cal).step_s, 4)
    0.1527
    >>> from conveyor.plan.costs import UnitCost
    >>> from conveyor.plan.balance import StageSums
    >>> sums = StageSums([UnitCost("a", 1.0, 2.0, 2.0, backward=3.0)] * 2, optimizer_bytes=8)
    >>> model = stage_costs(cs.build("1f1b", ranks=2, microbatches=2), sums, [1], latency=0.0)
    >>> [(s.forward, s.backward_input, s.backward_weight) for s in model.stages]
    [(1.0, 2.0, 1.0), (1.0, 2.0, 1.0)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import conveyor.schedule as cs
from conveyor.plan.balance import StageSums, bounds_of
from conveyor.plan.result import Plan
from conveyor.schedule.cost import CostModel, StageCosts
from conveyor.schedule.ir import ActionKind, Schedule
from conveyor.schedule.simulate import simulate_shared_cores
from conveyor.schedule.timeline import Timeline

if TYPE_CHECKING:  # the record only: measuring one loads torch, predicting with it does not
    from conveyor.plan.calibration import Calibration


@dataclass(frozen=True)
class Prediction:
    """A plan's predicted step: ``step_s = makespan_s + step_s of the calibration + the ranks' extra``.

    The ranks' extra is the longest ``rank_extra_s``, or their sum over the cores when they share fewer.
    """

    step_s: float
    makespan_s: float
    timeline: Timeline
    rank_extra_s: tuple[float, ...]


def split_stages(schedule: Schedule) -> set[int]:
    """The stages whose W runs on its own in ``schedule``'s executed programs (the others run one B).

    Example:
        >>> import conveyor.schedule as cs
        >>> sorted(split_stages(cs.build("zb-h1", ranks=2, microbatches=4)))
        [1]
    """
    programs = cs.executable(schedule).compute.programs
    return {a.stage for program in programs for a in program if a.kind is ActionKind.W}


def with_overheads(schedule: Schedule, costs: CostModel, calibration: Calibration) -> CostModel:
    """``costs`` with what the runtime adds: ``action_s`` per compute action, ``receive_s`` per message taken.

    Every forward and input gradient gets ``action_s``; a weight gradient too on a stage whose W
    runs on its own in ``schedule``'s executed programs (elsewhere I + W run as one B, one action).
    ``receive_s`` goes to a forward of stage s > 0 whose stage s - 1 runs on another rank, and
    to an input gradient (so a full backward) of stage s < S - 1 whose stage s + 1 does.

    Example:
        >>> import conveyor.schedule as cs
        >>> sched = cs.build("1f1b", ranks=2, microbatches=2)
        >>> from conveyor.plan.calibration import Calibration
        >>> model = with_overheads(sched, CostModel.uniform(2), Calibration(action_s=0.25, receive_s=0.5))
        >>> [(s.forward, s.backward_input, s.backward_weight) for s in model.stages]
        [(1.25, 1.75, 1.0), (1.75, 1.25, 1.0)]
    """
    split = split_stages(schedule)
    rank_of = schedule.placement.rank_of
    last = len(costs.stages) - 1
    act, receive = calibration.action_s, calibration.receive_s
    stages = []
    for stage, c in enumerate(costs.stages):
        takes_input = stage > 0 and rank_of(stage - 1) != rank_of(stage)
        takes_grad = stage < last and rank_of(stage + 1) != rank_of(stage)
        stages.append(replace(
            c,
            forward=c.forward + act + (receive if takes_input else 0.0),
            backward_input=c.backward_input + act + (receive if takes_grad else 0.0),
            backward_weight=c.backward_weight + (act if stage in split else 0.0),
        ))
    return CostModel(tuple(stages), costs.latency)


def predict_step(
    schedule: Schedule,
    costs: CostModel | Sequence[StageCosts | Sequence[float]],
    calibration: Calibration,
    *,
    message_bytes: float = 0.0,
    rank_extra_s: Sequence[float] = (),
    cores: int | None = None,
) -> Prediction:
    """The step time of ``schedule`` on per-stage ``costs`` (seconds) on the calibrated machine.

    What is simulated is what the ranks run (:func:`conveyor.schedule.executable`), with
    :func:`with_overheads` costs and ``calibration.latency(message_bytes)`` per message;
    ``rank_extra_s`` is each rank's time after the schedule (its optimizer step). ``cores``:
    CPU cores the ranks share when fewer than the ranks and the stages compute on the CPU
    (:func:`conveyor.schedule.simulate.simulate_shared_cores`); None: one device per rank.

    Example:
        >>> import conveyor.schedule as cs
        >>> sched = cs.build("gpipe", ranks=2, microbatches=2)
        >>> from conveyor.plan.calibration import Calibration
        >>> p = predict_step(sched, [(0.01, 0.01, 0.01)] * 2, Calibration(), rank_extra_s=[0.002, 0.001])
        >>> round(p.makespan_s, 3), round(p.step_s, 3)
        (0.09, 0.092)
    """
    model = costs if isinstance(costs, CostModel) else CostModel.per_stage(costs)
    model = replace(with_overheads(schedule, model, calibration), latency=calibration.latency(message_bytes))
    if cores is not None and cores < schedule.num_ranks:
        timeline = simulate_shared_cores(schedule, model, cores)
    else:
        timeline = cs.simulate(cs.executable(schedule).compute, model, time_unit="s")
    extra = tuple(float(x) for x in rank_extra_s)
    after = max(extra, default=0.0)
    if cores is not None and cores < len(extra):
        after = max(after, sum(extra) / cores)  # every rank steps its optimizer at once
    step = timeline.makespan + calibration.step_s + after
    return Prediction(step, timeline.makespan, timeline, extra)


def stage_costs(schedule: Schedule, sums: StageSums, cuts: Sequence[int], *, latency: float,
                overlap: bool = False) -> cs.CostModel:
    """Per-stage costs of the split at ``cuts`` as ``schedule``'s ranks pay them: a split stage its
    I and W, another its full backward (as I, the rest as W, so that I + W = B).

    ``overlap``: as the ranks run with expert parallelism's all-to-alls overlapped (``expert_overlap``):
    each stage's all-to-alls apart from its compute (``StageCosts.exchange``, ``exchanges``; the
    simulator times the schedule's pairs from them) and, per microbatch, its activations plus what its
    forward in segments keeps (``StageSums.exchange_bytes``).

    Example:
        >>> import conveyor.schedule as cs
        >>> from conveyor.plan.costs import UnitCost
        >>> sums = StageSums([UnitCost("a", 3.0, 3.0, 1.0, 8.0, exchanges=2, exchange=1.0, exchange_bytes=2.0)] * 2,
        ...                  optimizer_bytes=0)
        >>> stage = stage_costs(cs.build("zbv", ranks=1, microbatches=2), sums, [1], latency=0.0,
        ...                     overlap=True).stages[0]
        >>> stage.forward, stage.exchanges, stage.exchange, stage.activation_bytes
        (1.0, 2, 1.0, 10.0)
    """
    split = split_stages(schedule)
    stages = []
    for stage, (i, j) in enumerate(bounds_of(cuts, len(sums.units))):
        backward_input, backward_weight = sums.backward_input(i, j), sums.backward_weight(i, j)
        if stage not in split:
            full = sums.backward(i, j)
            backward_input, backward_weight = min(backward_input, full), max(0.0, full - backward_input)
        forward, activations, exchanges = sums.forward(i, j), sums.activations(i, j), sums.exchanges(i, j)
        if not (overlap and exchanges):
            stages.append(cs.StageCosts(forward, backward_input, backward_weight, activations, sums.weight_kept(i, j)))
            continue
        exchanged = sums.exchange_time(i, j)  # counted in F and in I: the simulator adds each back where waited
        stages.append(cs.StageCosts(max(forward - exchanged, 0.0), max(backward_input - exchanged, 0.0),
                                    backward_weight, activations + sums.exchange_bytes(i, j), sums.weight_kept(i, j),
                                    exchange=exchanged / exchanges, exchanges=exchanges))
    return cs.CostModel(tuple(stages), latency)


def predict_split(schedule: Schedule, model: cs.CostModel, calibration: Calibration, sums: StageSums,
                  cuts: Sequence[int], *, optimizer_s_per_parameter: float, cores: int | None) -> Prediction:
    """The calibrated step of ``schedule`` on ``model`` (:func:`stage_costs` of ``sums`` cut at ``cuts``): the
    simulated executed programs with the calibration's overheads, each message as large as the largest
    boundary's, its per-step time, and each rank's optimizer step (``optimizer_s_per_parameter`` x the
    parameters it holds); ``cores``: CPU cores the ranks share (None: a device each).

    Example:
        >>> import conveyor.schedule as cs
        >>> from conveyor.plan.costs import UnitCost
        >>> sums = StageSums([UnitCost("a", 0.01, 0.01, 0.01, parameters=1e3),
        ...                   UnitCost("b", 0.01, 0.01, 0.01, parameters=2e3)], optimizer_bytes=8)
        >>> sched = cs.build("gpipe", ranks=2, microbatches=2)
        >>> from conveyor.plan.calibration import Calibration
        >>> p = predict_split(sched, cs.CostModel.uniform(2, 0.01, 0.01, 0.01), Calibration(step_s=0.001), sums, [1],
        ...                   optimizer_s_per_parameter=1e-6, cores=None)
        >>> round(p.step_s, 4)
        0.093
    """
    stages = bounds_of(cuts, len(sums.units))
    extra = [optimizer_s_per_parameter * sum(u.parameters for s in schedule.stages_of(rank)
                                             for u in sums.units[slice(*stages[s])])
             for rank in range(schedule.num_ranks)]
    return predict_step(schedule, model, calibration, message_bytes=sums.largest_message(cuts), rank_extra_s=extra,
                        cores=cores)


def predict_plan(plan: Plan, calibration: Calibration) -> Prediction:
    """The calibrated step of a chosen :class:`~conveyor.plan.result.Plan` from its own unit costs, with the
    optimizer rate and cores it was planned with (its ``settings``): what ``conveyor.plan.plan(...,
    machine=Machine(calibration=...))`` predicted, with the simulated timeline.

    Example:
        >>> import torch, conveyor
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(2)])
        >>> from conveyor.plan.calibration import Calibration
        >>> cal = Calibration(step_s=1e-3)
        >>> chosen = conveyor.plan.plan(model, torch.randn(2, 8), ranks=2, global_batch=4, schedules=["1f1b"],
        ...                             machine=conveyor.plan.Machine(calibration=cal),
        ...                             measure=conveyor.plan.Measurement(repeats=1))
        >>> abs(predict_plan(chosen, cal).step_s - chosen.step_time) < 1e-12
        True
    """
    if plan.costs is None:
        raise ValueError("predict_plan needs the plan's unit costs; this plan was saved without them")
    names = plan.costs.names
    cuts = [names.index(point) for point in plan.split_points]
    sums = StageSums(plan.costs.at(plan.microbatch_size),
                     optimizer_bytes=plan.settings.get("optimizer_bytes_per_parameter", 8.0))
    schedule = plan.schedule_spec()
    if isinstance(schedule, str):
        schedule = cs.build(schedule, ranks=plan.ranks, microbatches=plan.microbatches, virtual=plan.virtual)
    return predict_split(schedule, stage_costs(schedule, sums, cuts, latency=0.0), calibration, sums, cuts,
                         optimizer_s_per_parameter=plan.settings.get("optimizer_s_per_parameter", 0.0),
                         cores=plan.settings.get("cores"))


# What the planner may give a stage, lightest last: nothing, every other block, every block.
CHECKPOINT_CHOICES: tuple[dict[str, int] | None, ...] = (None, {"every": 2}, {"every": 1})


@dataclass(frozen=True)
class CheckpointFit:
    """A policy per stage (None: none) that brings every rank within the memory limit, with the
    memory per rank simulated under it, what the recomputations add to the simulated step, and the
    bubble of the step simulated under it (the idle share of the ranks' time)."""

    policies: tuple[dict[str, int] | None, ...]
    added_s: float
    memory_per_rank: tuple[float, ...]
    bubble: float


def recomputed_costs(schedule: Schedule, sums: StageSums, cuts: Sequence[int], policies: Sequence[dict | None],
                       *, latency: float) -> tuple[CostModel, list[float]]:
    """:func:`stage_costs` with each stage's blocks recomputed as ``policies`` say, and per stage
    the bytes one of its recomputed blocks rebuilds in backward (0: none).

    A recomputed block keeps only its input (the unit before it's output) from F to backward, and
    its I pays its forward again (the recomputation), as ``conveyor.runtime.stage.recompute`` runs it.

    Example:
        >>> from conveyor.plan.costs import UnitCost
        >>> units = [UnitCost(f"layers.{k}", 1.0, 1.0, 1.0, 100, output_bytes=10, is_block=True) for k in range(4)]
        >>> sums = StageSums(units, optimizer_bytes=8)
        >>> model, rebuilt = recomputed_costs(cs.build("1f1b", ranks=2, microbatches=2), sums, [2],
        ...                                     [{"every": 1}, None], latency=0.0)
        >>> [(s.backward_input, s.activation_bytes) for s in model.stages], rebuilt
        ([(4.0, 10.0), (2.0, 200.0)], [100.0, 0.0])
    """
    model = stage_costs(schedule, sums, cuts, latency=latency)
    stages, rebuilt = [], []
    for costs, (i, j), policy in zip(model.stages, bounds_of(cuts, len(sums.units)), policies):
        blocks = [k for k in range(i, j) if sums.units[k].is_block]
        chosen = blocks[::policy["every"]] if policy else []
        saved = sum(sums.units[k].activation_bytes - (sums.units[k - 1].output_bytes if k else 0.0) for k in chosen)
        activations = max(costs.activation_bytes - saved, 0.0)
        stages.append(replace(costs, backward_input=costs.backward_input + sum(sums.units[k].forward for k in chosen),
                              activation_bytes=activations,
                              weight_activation_bytes=min(costs.weight_activation_bytes, activations)))
        rebuilt.append(float(max((sums.units[k].activation_bytes for k in chosen), default=0.0)))
    return replace(model, stages=tuple(stages)), rebuilt


def fit_by_recomputing(schedule: Schedule, sums: StageSums, cuts: Sequence[int], *, ranks: int,
                         memory_limit: float, latency: float) -> CheckpointFit | None:
    """Policies per stage from :data:`CHECKPOINT_CHOICES` under which every rank fits ``memory_limit``
    (parameters, gradients, optimizer state, the simulated peak of activations and one rebuilt
    block), or None. Greedy: while a rank is over, its first stage that can recompute more does
    (the first stages hold the most microbatches under 1F1B), so the fewest blocks pay a recomputation.

    Example:
        >>> from conveyor.plan.costs import UnitCost
        >>> units = [UnitCost(f"layers.{k}", 1.0, 1.0, 1.0, 100, output_bytes=10, is_block=True) for k in range(4)]
        >>> fit = fit_by_recomputing(cs.build("1f1b", ranks=2, microbatches=4), StageSums(units, optimizer_bytes=8),
        ...                            [2], ranks=2, memory_limit=300, latency=0.0)
        >>> fit.policies, fit.memory_per_rank
        (({'every': 2}, None), (300.0, 200.0))
    """
    level = [0] * schedule.num_stages
    stages = bounds_of(cuts, len(sums.units))
    plain = None
    while True:
        policies = tuple(CHECKPOINT_CHOICES[k] for k in level)
        model, rebuilt = recomputed_costs(schedule, sums, cuts, policies, latency=latency)
        timeline = cs.simulate(cs.executable(schedule).compute, model, time_unit="s")
        peaks = timeline.peak_activation_bytes()
        memory = [sum(sums.static(*stages[s]) for s in schedule.stages_of(rank)) + peaks[rank]
                  + max((rebuilt[s] for s in schedule.stages_of(rank)), default=0.0) for rank in range(ranks)]
        makespan = timeline.end  # every span starts at 0 or later
        plain = makespan if plain is None else plain
        over = [rank for rank in range(ranks) if memory[rank] > memory_limit]
        if not over:
            return CheckpointFit(policies, makespan - plain, tuple(memory), timeline.bubble_ratio)
        rank = max(over, key=lambda r: memory[r])
        more = [s for s in sorted(schedule.stages_of(rank)) if level[s] + 1 < len(CHECKPOINT_CHOICES)]
        if not more:
            return None
        level[more[0]] += 1
