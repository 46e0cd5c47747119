"""A split's step as the ranks run it: per-stage costs for the executed programs, and the
calibrated prediction a benchmark checks against a measured step.

The runtime splits a stage's backward into I and W only where the schedule's executed
programs (:func:`conveyor.schedule.executable`) keep a W on its own; elsewhere it runs one
full backward (B), which costs less than the split I + W. :func:`stage_costs` gives each
stage the one it pays. :func:`predict_split` adds what a real step pays beyond compute
(:mod:`conveyor.plan.calibrate`: per action, per receive, latency and bytes, the step's own
time) and each rank's optimizer step, when a calibration is given.

Example:
    >>> import conveyor.schedule as cs
    >>> from conveyor.plan.costs import UnitCost
    >>> from conveyor.plan.split import StageSums
    >>> sums = StageSums([UnitCost("a", 1.0, 2.0, 2.0, backward=3.0)] * 2, optimizer_bytes=8)
    >>> model = stage_costs(cs.build("1f1b", ranks=2, microbatches=2), sums, [1], latency=0.0)
    >>> [(s.forward, s.backward_input, s.backward_weight) for s in model.stages]
    [(1.0, 2.0, 1.0), (1.0, 2.0, 1.0)]
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import fields

import torch

import conveyor.schedule as cs
from conveyor.errors import PlanError
from conveyor.plan.calibrate import Calibration, Prediction, predict_step
from conveyor.plan.result import Plan
from conveyor.plan.split import StageSums, bounds_of
from conveyor.schedule.ir import ActionKind, Schedule


def split_stages(schedule: Schedule) -> set[int]:
    """The stages whose W runs on its own in ``schedule``'s executed programs (the others run one B).

    Example:
        >>> import conveyor.schedule as cs
        >>> sorted(split_stages(cs.build("zb-h1", ranks=2, microbatches=4)))
        [1]
    """
    programs = cs.executable(schedule).compute.programs
    return {a.stage for program in programs for a in program if a.kind is ActionKind.W}


def stage_costs(schedule: Schedule, sums: StageSums, cuts: Sequence[int], *, latency: float) -> cs.CostModel:
    """Per-stage costs of the split at ``cuts`` as ``schedule``'s ranks pay them: a split stage its
    I and W, another its full backward (as I, the rest as W, so that I + W = B)."""
    split = split_stages(schedule)
    stages = []
    for stage, (i, j) in enumerate(bounds_of(cuts, len(sums.units))):
        backward_input, backward_weight = sums.backward_input(i, j), sums.backward_weight(i, j)
        if stage not in split:
            full = sums.backward(i, j)
            backward_input, backward_weight = min(backward_input, full), max(0.0, full - backward_input)
        stages.append(cs.StageCosts(sums.forward(i, j), backward_input, backward_weight, sums.activations(i, j),
                                    sums.weight_kept(i, j)))
    return cs.CostModel(tuple(stages), latency)


def predict_split(schedule: Schedule, model: cs.CostModel, calibration: Calibration, *, message_bytes: float,
                  rank_parameters: Sequence[float], optimizer_s_per_parameter: float,
                  cores: int | None) -> Prediction:
    """The calibrated step of ``schedule`` on ``model`` (from :func:`stage_costs`): the simulated
    executed programs with the calibration's overheads, its per-step time, and each rank's optimizer
    step (``optimizer_s_per_parameter`` x the parameters it holds); ``cores``: CPU cores the ranks
    share (None: a device each).

    Example:
        >>> import conveyor.schedule as cs
        >>> sched = cs.build("gpipe", ranks=2, microbatches=2)
        >>> model = cs.CostModel.uniform(2, 0.01, 0.01, 0.01)
        >>> p = predict_split(sched, model, Calibration(step_s=0.001), message_bytes=0, rank_parameters=[1e3, 2e3],
        ...                   optimizer_s_per_parameter=1e-6, cores=None)
        >>> round(p.step_s, 4)
        0.093
    """
    extra = [optimizer_s_per_parameter * n for n in rank_parameters]
    return predict_step(schedule, model, calibration, message_bytes=message_bytes, rank_extra_s=extra, cores=cores)


def calibration_of(value: Calibration | dict | None, ranks: int) -> Calibration | None:
    """A :class:`Calibration` from one or from its ``as_dict()``; None stays None.

    Example:
        >>> calibration_of({"receive_s": 1e-4, "transport": "x", "samples": {}}, 2).receive_s
        0.0001
    """
    if value is None or value is False:
        return None
    if value is True:
        # Measuring starts real pipelines, a layer above the planner.
        raise PlanError(
            f"calibration=True: the planner does not start pipelines; measure this machine with "
            f"conveyor.calibration.calibrate(ranks={ranks}) (a few seconds) and pass the result, or its as_dict() "
            "from an earlier run (`conveyor plan --calibrate` does this)")
    if isinstance(value, dict):
        names = {f.name for f in fields(Calibration)}
        return Calibration(**{k: v for k, v in value.items() if k in names})
    return value


def optimizer_seconds_per_parameter(model: torch.nn.Module, repeats: int = 5) -> float:
    """Seconds an AdamW step takes per parameter of ``model``, timed on copies (the model is untouched).

    Example:
        >>> optimizer_seconds_per_parameter(torch.nn.Linear(64, 64), repeats=1) > 0
        True
    """
    copies = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in copies)
    if not count:
        return 0.0
    optimizer = torch.optim.AdamW(copies, lr=1e-4)
    times = []
    for index in range(repeats + 2):  # the first steps allocate AdamW's state
        for p in copies:
            p.grad = torch.zeros_like(p)
        start = time.perf_counter()
        optimizer.step()
        if copies[0].device.type == "cuda":
            torch.cuda.synchronize(copies[0].device)
        if index >= 2:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] / count


def predict_plan(plan: Plan, calibration: Calibration) -> Prediction:
    """The calibrated step of a chosen :class:`~conveyor.plan.result.Plan` from its own unit costs, with the
    optimizer rate and cores it was planned with (its ``settings``): what ``conveyor.plan.plan(...,
    calibration=...)`` predicted, with the simulated timeline.

    Example:
        >>> import torch, conveyor
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(2)])
        >>> cal = Calibration(step_s=1e-3)
        >>> chosen = conveyor.plan.plan(model, torch.randn(2, 8), ranks=2, global_batch=4, schedules=["1f1b"],
        ...                             repeats=1, calibration=cal)
        >>> abs(predict_plan(chosen, cal).step_s - chosen.step_time) < 1e-12
        True
    """
    if plan.costs is None:
        raise ValueError("predict_plan needs the plan's unit costs; this plan was saved without them")
    names = plan.costs.names
    cuts = [names.index(point) for point in plan.split_points]
    sums = StageSums(plan.costs.at(plan.microbatch_size),
                     optimizer_bytes=plan.settings.get("optimizer_bytes_per_parameter", 8.0))
    stages = bounds_of(cuts, len(sums.units))
    schedule = plan.schedule_spec()
    if isinstance(schedule, str):
        schedule = cs.build(schedule, ranks=plan.ranks, microbatches=plan.microbatches, virtual=plan.virtual)
    sent = max((sums.units[j - 1].output_bytes for _, j in stages[:-1]), default=0.0)
    model = stage_costs(schedule, sums, cuts, latency=0.0)
    parameters = [sum(u.parameters for s in schedule.stages_of(rank) for u in sums.units[slice(*stages[s])])
                  for rank in range(plan.ranks)]
    return predict_split(schedule, model, calibration, message_bytes=sent, rank_parameters=parameters,
                         optimizer_s_per_parameter=plan.settings.get("optimizer_s_per_parameter", 0.0),
                         cores=plan.settings.get("cores"))
