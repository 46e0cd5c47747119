"""conveyor.pipeline(): trace and split an unchanged model, and build this rank's Pipeline.

Example (on each of 2 ranks)::

    pipe = conveyor.pipeline(model, example_args=(ids[:2],), split_points=["model.layers.4"],
                             schedule="1f1b", microbatches=8, loss_fn=lambda out, y: out.loss)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from conveyor.errors import PipelineConfigError
from conveyor.layout import DistributedLayout, InProcessLayout, Layout
from conveyor.options import PipelineOptions, WholeModel, _plan_recompute
from conveyor.parallel.mesh import pipeline_ranks, with_mesh
from conveyor.pipe import Pipeline
from conveyor.runtime.stage.device import make_current, resolve_device
from conveyor.runtime.stage.runner import LossFn
from conveyor.schedule.ir import Schedule
from conveyor.schedule.registry import resolve_schedule


def pipeline(
    model: torch.nn.Module,
    *,
    example_args: tuple = (),
    example_kwargs: dict | None = None,
    split_points: Sequence[str] | None = None,
    schedule: Schedule | str = "1f1b",
    microbatches: int | None = None,
    loss_fn: LossFn | None = None,
    layout: Layout = DistributedLayout(),
    plan: Any = None,
    options: PipelineOptions = PipelineOptions(),
) -> Pipeline:
    """Trace and split an unchanged ``model``; return this process's :class:`Pipeline`.

    The same call on every rank. ``example_args`` / ``example_kwargs`` are ONE microbatch. Without
    ``split_points`` the model is cut into P x V stages balanced by ``options.split.method``
    ("uniform", "parameters", "time", "type:<regex>"); with "time", rank 0's measurement decides
    for every rank. Each rank materialises only its own stages (a meta-device model works) on
    ``layout.device`` (default: this process's GPU when CUDA is available, else the CPU);
    parameters keep their original names, and tied parameters (GPT-2's ``wte`` and ``lm_head``)
    stay equal after every optimizer step. ``layout``, as for :class:`Pipeline`: ``InProcessLayout(ranks=P)``
    runs every stage here, no launcher; a ``DistributedLayout`` with ``tp`` > 1 parallelizes each traced
    stage by the unchanged model's plan (names kept; each TP rank holds its shards). ``plan`` (a
    :class:`~conveyor.plan.Plan` or its file) sets schedule, microbatches, virtual and split points;
    ``schedule="auto"``: rank 0 plans (``conveyor.plan.plan()`` with ``options.plan_options``, a
    :class:`~conveyor.plan.PlanOptions`), every rank follows. ``options``
    (:class:`~conveyor.options.PipelineOptions`) holds the rest, as records: ``virtual``, ``split``
    (method, unsplittable modules, ``both_modes``), ``stage`` (``StageOptions(compile=True)``
    compiles each traced stage, ``autocast="bf16"``, ...) and ``transfer``.

    Example (on each of 2 ranks)::

        pipe = conveyor.pipeline(model, example_args=(ids[:2],), split_points=["model.layers.4"],
                                 schedule="1f1b", microbatches=8, loss_fn=lambda out, y: out.loss)
        loss = pipe.step(ids, labels=labels)
    """
    from conveyor.frontend import split_model
    from conveyor.frontend.leaves import experts_as_leaves
    from conveyor.frontend.pretrained import model_info
    from conveyor.parallel.parts import part_classes
    from conveyor.plan import as_plan

    if not isinstance(layout, Layout):
        raise PipelineConfigError(f"layout= takes a conveyor.InProcessLayout or conveyor.DistributedLayout; got "
                                  f"{type(layout).__name__}")
    in_process = isinstance(layout, InProcessLayout)
    layout = layout if in_process else with_mesh(layout)  # the mesh of the sizes given, built by every rank
    world, rank = _ranks_of(layout, schedule, split_points, options.virtual, plan)
    # This process's GPU, current before the first collective (the plan's and the cut's broadcasts).
    device = resolve_device(layout.device) if in_process else make_current(resolve_device(layout.device))
    precision = options.stage.param_precision()
    if precision is not None:  # the model itself, in place, then planned and traced: stages check dtypes
        model.to(precision.param_dtype)
    virtual, stage_options = options.virtual, options.stage
    if plan is not None or schedule == "auto":  # the example is resized to the plan's microbatch
        plan = as_plan(plan or _auto_plan(model, example_args, example_kwargs, world, microbatches, layout, options))
        schedule, microbatches, virtual, split_points, (example_args, example_kwargs) = _from_plan(
            plan, world, example_args, example_kwargs, 1 if in_process else layout.tp)
        stage_options = _plan_recompute(plan, stage_options)
    resolved = resolve_schedule(schedule, microbatches, virtual, world)
    split_kwargs = dict(example_args=tuple(example_args), example_kwargs=example_kwargs,
                        unsplittable=options.split.unsplittable, device=device,
                        dynamic_shapes=options.split.dynamic_shapes)
    method = options.split.method
    if split_points is None and method == "time":
        split_points, method = _time_split_points(model, resolved.num_stages, layout, split_kwargs), "parameters"
    # Modules the layout's parts need whole in their stage (expert parallelism: each experts module a leaf).
    parts = [] if in_process else part_classes(layout)  # what the layout's parts ask of the trace and the cut
    with experts_as_leaves(model, [name for part in parts for name in part.trace_leaves(model)]):
        split = split_model(model, resolved.num_stages, split_points=split_points, split_method=method,
                            **split_kwargs)
        stages = range(resolved.num_stages) if in_process else resolved.stages_of(rank)
        modules = _stage_modules(split, stages, model, parts, device, options.split.both_modes)
    whole = WholeModel(split.tied_groups, _parameter_order(model), model_signature(model, split.split_points),
                       model_info(model),  # model_info: what checkpoints record, and export writes back
                       parameter_placements=_parameter_placements(model, layout, parts, split.tied_groups))
    return Pipeline(modules, resolved, loss_fn, layout=dataclasses.replace(layout, device=device),
                    stage=stage_options, transfer=options.transfer, model=whole)


def _stage_modules(split, stages, model: torch.nn.Module, parts: Sequence[type], device, both_modes: bool) -> list:
    """This rank's stage modules. A meta-device model's stay on meta where a part materializes them itself,
    each rank only what it holds (:attr:`~conveyor.parallel.part.StagePart.materializes_meta_stages`)."""
    materializer = next((part for part in parts if part.materializes_meta_stages), None)
    on_meta = materializer is not None and any(p.is_meta for p in model.parameters())
    modules = [split.stage_module(stage, device, both_modes=both_modes, keep_meta=on_meta) for stage in stages]
    if on_meta:
        from conveyor.frontend.materialize import materialize

        device = torch.device(device)
        modules = materializer.materialize_stages(modules, model, split.seed, device,
                                                  functools.partial(materialize, model, device=device, seed=split.seed))
    return modules


def _parameter_placements(model: torch.nn.Module, layout: Layout, parts: Sequence[type], tied_groups) -> dict | None:
    """The unchanged model's parameters placed over a part's ranks by name (None: no part places any), the same
    on every rank: each rank's traced stages are parallelized by them in the pipeline."""
    found = [placed for part in parts if (placed := part.parameter_placements(model, layout, tied_groups)) is not None]
    if len(found) > 1:
        raise PipelineConfigError(f"{len(found)} stage parts each place the model's parameters; one may")
    return found[0] if found else None


def _ranks_of(layout: Layout, schedule: Any, split_points: Sequence[str] | None, virtual: int | None,
              plan: Any) -> tuple[int, int]:
    """(pipeline ranks, this process's rank) of ``layout``."""
    if isinstance(layout, InProcessLayout):
        if layout.ranks is not None:
            return layout.ranks, 0
        if isinstance(schedule, Schedule):
            return schedule.num_ranks, 0
        if plan is not None:
            from conveyor.plan import as_plan

            return as_plan(plan).ranks, 0
        if split_points is not None:
            return max(1, (len(split_points) + 1) // (virtual or 1)), 0
        raise PipelineConfigError("an in-process pipeline of a schedule given by name needs its rank count: "
                                  "layout=InProcessLayout(ranks=P), split_points=, or a Schedule")

    return pipeline_ranks(layout, "build every stage in this process with "
                                  "layout=conveyor.InProcessLayout(ranks=P)")[1:]


def _parameter_order(model: torch.nn.Module) -> dict[str, int]:
    """Each parameter name's place in the model's order. Stage modules keep the model's names, so
    the order can be looked up; a tied parameter may sit in a stage under any of its names
    (torch.export picks one): each name gets the place of the tensor's first name, where torch's
    clipping counts it."""
    order: dict[str, int] = {}
    first_place: dict[int, int] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        order[name] = first_place.setdefault(id(param), len(first_place))
    return order


def _by_rank_zero(layout: Layout, decide: Any) -> Any:
    """Rank 0's ``decide()``, broadcast: timings differ from rank to rank, so one rank decides and
    every rank cuts alike (with a mesh, the job's rank 0: every replica cuts alike). In one process,
    rank 0 is here."""
    if isinstance(layout, InProcessLayout):
        return decide()
    group = layout.group
    chosen: list = [None]
    if dist.get_rank(group) == 0:
        chosen[0] = decide()
    dist.broadcast_object_list(chosen, group=group, group_src=0)
    return chosen[0]


def _time_split_points(model, num_stages: int, layout: Layout, split_kwargs: dict) -> list[str]:
    """``split_method="time"``: the planner measures the units and stages on rank 0 and chooses the split
    points (:func:`conveyor.plan.time_split.time_split`); every rank cuts at them (timings differ from
    rank to rank)."""
    from conveyor.plan import time_split

    given = dict(split_kwargs, unsplittable=tuple(split_kwargs["unsplittable"] or ()))
    given.pop("dynamic_shapes")  # timed on the example's shapes
    return _by_rank_zero(layout, lambda: list(time_split.time_split(model, num_stages, **given).split_points))


def _auto_plan(model, example_args, example_kwargs, world, microbatches, layout, options):
    """Rank 0's plan, broadcast: timings differ from rank to rank, and every rank must cut alike.
    ``global_batch`` defaults to ``microbatches`` (or 2 x ranks) x the example's batch; the microbatch
    counts tried to ``microbatches`` when given; threads "auto" to the threads rank 0 trains with."""
    from conveyor.plan.planner import plan as make_plan
    from conveyor.plan.profile import _batch_size
    from conveyor.plan.settings import PlanOptions

    chosen = options.plan_options if options.plan_options is not None else PlanOptions()
    if not isinstance(chosen, PlanOptions):
        raise PipelineConfigError(f"PipelineOptions.plan_options takes a conveyor.plan.PlanOptions; got "
                                  f"{type(chosen).__name__}")
    size = _batch_size(tuple(example_args), example_kwargs)
    global_batch = chosen.global_batch or (microbatches or 2 * world) * size
    counts = chosen.microbatches or (None if microbatches is None else [microbatches])
    machine = chosen.machine
    if machine.threads == "auto":  # this process already computes with the threads it trains with
        machine = dataclasses.replace(machine, threads=None)
    return _by_rank_zero(layout, lambda: make_plan(
        model, tuple(example_args), example_kwargs=example_kwargs, ranks=world, global_batch=global_batch,
        memory_per_rank=chosen.memory_per_rank, schedules=chosen.schedules, microbatches=counts,
        space=chosen.space, machine=machine, measure=chosen.measure))


def _from_plan(plan, world: int, example_args, example_kwargs, tp_size: int):
    """(schedule, microbatches, virtual, split_points, (example_args, example_kwargs)) of a plan, checked
    against the group and the mesh's "tp" size; the example is resized to the plan's microbatch."""
    from conveyor.plan.profile import _batch_size, resize_batch

    if plan.ranks != world:
        raise PipelineConfigError(
            f"the plan is for {plan.ranks} pipeline ranks but the group has {world}; plan again with "
            f"--ranks {world} (or launch {plan.ranks} ranks)")
    if plan.tensor_parallel != tp_size:
        raise PipelineConfigError(
            f"the plan is for pipeline ranks of {plan.tensor_parallel} tensor-parallel ranks but the mesh's \"tp\" "
            f"size is {tp_size}; build the pipeline on a mesh with tp={plan.tensor_parallel} (and "
            f"tensor_parallel=\"auto\"), or plan again with --tp {tp_size}")
    example = (tuple(example_args), example_kwargs)
    if _batch_size(*example) != plan.microbatch_size:
        example = resize_batch(example, plan.microbatch_size)
    return plan.schedule_spec(), plan.microbatches, plan.virtual, list(plan.split_points), example


def model_signature(model: torch.nn.Module, split_points: Sequence[str]) -> str:
    """A short digest of a model's parameter and buffer names, shapes and dtypes and where it is cut.

    Ranks whose digests differ were given different models (or cuts): the pipeline refuses to
    start rather than hang or train garbage.

    Example:
        >>> model_signature(torch.nn.Linear(2, 3), []) == model_signature(torch.nn.Linear(2, 3), [])
        True
    """
    entries = [(name, tuple(t.shape), str(t.dtype))
               for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]]
    digest = hashlib.sha1(repr((type(model).__name__, entries, list(split_points))).encode()).hexdigest()[:12]
    return f"{type(model).__name__} with {len(entries)} tensors cut at {list(split_points)} ({digest})"
