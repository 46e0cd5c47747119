"""conveyor.pipeline(): trace and split an unchanged model, and build this rank's Pipeline.

Example (on each of 2 ranks)::

    pipe = conveyor.pipeline(model, example_args=(ids[:2],), split_points=["model.layers.4"],
                             schedule="1f1b", microbatches=8, loss_fn=lambda out, y: out.loss)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from conveyor.errors import PipelineConfigError
from conveyor.parallel.mesh import layout_of
from conveyor.pipe import Pipeline
from conveyor.runtime.device import make_current, resolve_device
from conveyor.runtime.main_grad import cast_for_tracing
from conveyor.runtime.runner import LossFn
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
    virtual: int | None = None,
    loss_fn: LossFn | None = None,
    split_method: str = "parameters",
    unsplittable: Sequence[str] | None = None,
    group=None,
    mesh=None,
    device: torch.device | str | None = None,
    both_modes: bool = False,
    plan: Any = None, plan_options: dict | None = None,
    **pipeline_kwargs: Any,
) -> Pipeline:
    """Trace and split an unchanged ``model``; return this rank's :class:`Pipeline`.

    The same call on every rank. ``example_args`` / ``example_kwargs`` are ONE
    microbatch. Without ``split_points`` the model is cut into P x V stages
    balanced by ``split_method`` ("uniform", "parameters", "time",
    "type:<regex>"); with "time", rank 0's measurement decides for every rank.
    ``both_modes=True`` traces the model in train and in eval mode, so that
    ``pipe.eval()`` / ``pipe.train()`` switch dropout and BatchNorm as on the model
    (one trace, in the model's current mode, otherwise; the other mode then raises).
    Each rank materialises only its own stages (a meta-device model works) on ``device`` (default and
    ``"cuda"``: this process's GPU when CUDA is available, else the CPU; "time" profiles there too); parameters
    keep their original names, and tied parameters (GPT-2's ``wte`` and ``lm_head``) stay equal after every optimizer step. ``mesh`` (a ("dp", "pp") DeviceMesh)
    and ``data_parallel=`` run ``dp`` replicas of the pipeline, as :class:`Pipeline` does.
    ``plan`` (a :class:`~conveyor.plan.Plan` or its file) sets schedule, microbatches, virtual and split
    points; ``schedule="auto"``: rank 0 plans (``conveyor.plan.plan(..., **plan_options)``), every rank follows.
    Other keywords go to :class:`Pipeline`: ``compile=True`` compiles each traced stage
    (a GraphModule with its own code, so each counts its own recompiles), ``autocast=``, ...

    Example (on each of 2 ranks)::

        pipe = conveyor.pipeline(model, example_args=(ids[:2],), split_points=["model.layers.4"],
                                 schedule="1f1b", microbatches=8, loss_fn=lambda out, y: out.loss)
        loss = pipe.step(ids, labels=labels)
    """
    import torch.distributed as dist

    from conveyor.frontend import split_model
    from conveyor.frontend.pretrained import model_info

    if not dist.is_available() or not dist.is_initialized():
        raise PipelineConfigError(
            "torch.distributed is not initialised: launch with torchrun and call "
            "torch.distributed.init_process_group() first"
        )
    pp_group = group if mesh is None else layout_of(mesh).pp_group
    world = dist.get_world_size(pp_group)
    rank = dist.get_rank(pp_group)
    # This process's GPU, current before the first collective (the plan's and the cut's broadcasts).
    device = make_current(resolve_device(device))
    cast_for_tracing(model, pipeline_kwargs)  # param_dtype=: the model itself, in place, then planned and traced
    if plan is not None or schedule == "auto":  # the example is resized to the plan's microbatch
        plan = plan or _auto_plan(model, example_args, example_kwargs, world, microbatches, group, plan_options)
        schedule, microbatches, virtual, split_points, (example_args, example_kwargs) = _from_plan(
            plan, world, example_args, example_kwargs)
    resolved = resolve_schedule(schedule, microbatches, virtual, world)
    split_kwargs = dict(example_args=tuple(example_args), example_kwargs=example_kwargs,
                        unsplittable=unsplittable, device=device)
    if split_points is None and split_method == "time" and world > 1:
        split_points = _time_split_points(model, resolved.num_stages, group, split_kwargs)
    split = split_model(model, resolved.num_stages, split_points=split_points, split_method=split_method,
                       **split_kwargs)
    modules = [split.stage_module(stage, device, both_modes=both_modes) for stage in resolved.stages_of(rank)]
    pipe = Pipeline(modules, resolved, loss_fn, group=group, mesh=mesh, tied_parameters=split.tied_groups,
                    device=device, parameter_order=_parameter_order(model),
                    model_signature=model_signature(model, split.split_points), **pipeline_kwargs)
    pipe.model_info = model_info(model)  # what checkpoints record, and export writes back (config.json)
    return pipe


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


def _time_split_points(model, num_stages: int, group, split_kwargs: dict) -> list:
    """Rank 0's time-balanced cut, broadcast: timings differ from rank to rank, so one rank decides
    and every rank cuts alike (with a mesh, the job's rank 0: every replica cuts alike)."""
    import torch.distributed as dist

    from conveyor.frontend import split_model

    chosen: list = [None]
    if dist.get_rank(group) == 0:
        chosen[0] = list(split_model(model, num_stages, split_method="time", **split_kwargs).split_points)
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(chosen, src=src, group=group)
    return chosen[0]


def _auto_plan(model, example_args, example_kwargs, world, microbatches, group, options):
    """Rank 0's plan, broadcast: timings differ from rank to rank, and every rank must cut alike.
    ``global_batch`` defaults to ``microbatches`` (or 2 x ranks) x the example's batch."""
    import torch.distributed as dist

    from conveyor.plan.planner import plan as make_plan
    from conveyor.plan.profile import _batch_size

    options = dict(options or {})
    size = _batch_size(tuple(example_args), example_kwargs)
    options.setdefault("global_batch", (microbatches or 2 * world) * size)
    if microbatches is not None:
        options.setdefault("microbatches", [microbatches])
    options.setdefault("threads", None)  # rank 0 profiles with the threads it trains with
    chosen: list = [None]
    if dist.get_rank(group) == 0:
        chosen[0] = make_plan(model, tuple(example_args), example_kwargs=example_kwargs, ranks=world, **options)
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(chosen, src=src, group=group)
    return chosen[0]


def _from_plan(plan, world: int, example_args, example_kwargs):
    """(schedule, microbatches, virtual, split_points, (example_args, example_kwargs)) of a plan, checked
    against the group; the example is resized to the plan's microbatch."""
    from conveyor.plan import as_plan
    from conveyor.plan.profile import _batch_size, resize_batch

    plan = as_plan(plan)
    if plan.ranks != world:
        raise PipelineConfigError(
            f"the plan is for {plan.ranks} pipeline ranks but the group has {world}; plan again with "
            f"--ranks {world} (or launch {plan.ranks} ranks)")
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
