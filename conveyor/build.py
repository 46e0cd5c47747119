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
from conveyor.runtime.device import resolve_device
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
    Each rank materialises only its own stages (a meta-device model works) on ``device`` (default
    ``cuda:<LOCAL_RANK>`` when CUDA is available, else the CPU; "time" profiles there too); parameters
    keep their original names, and tied parameters (GPT-2's ``wte`` and ``lm_head``) stay equal after every optimizer step. ``mesh`` (a ("dp", "pp") DeviceMesh)
    and ``data_parallel=`` run ``dp`` replicas of the pipeline, as :class:`Pipeline` does.
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
    resolved = resolve_schedule(schedule, microbatches, virtual, world)
    split_kwargs = dict(example_args=tuple(example_args), example_kwargs=example_kwargs,
                        unsplittable=unsplittable, device=resolve_device(device))
    if split_points is None and split_method == "time" and world > 1:
        # Timings differ from rank to rank: one rank decides, so that every rank cuts alike.
        chosen: list = [None]
        if dist.get_rank(group) == 0:  # with a mesh, the job's rank 0: every replica cuts alike
            chosen[0] = list(split_model(model, resolved.num_stages, split_method="time", **split_kwargs).split_points)
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast_object_list(chosen, src=src, group=group)
        split_points = chosen[0]
    split = split_model(model, resolved.num_stages, split_points=split_points, split_method=split_method,
                       **split_kwargs)
    device = split_kwargs["device"]
    modules = [split.stage_module(stage, device, both_modes=both_modes) for stage in resolved.stages_of(rank)]
    # Stage modules keep the model's parameter names, so the model's order can be looked up. A
    # tied parameter may sit in a stage under any of its names (torch.export picks one): each
    # name gets the place of the tensor's first name, where torch's clipping counts it.
    order: dict[str, int] = {}
    first_place: dict[int, int] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        order[name] = first_place.setdefault(id(param), len(first_place))
    pipe = Pipeline(modules, resolved, loss_fn, group=group, mesh=mesh, tied_parameters=split.tied_groups, device=device,
                    parameter_order=order, model_signature=model_signature(model, split.split_points),
                    **pipeline_kwargs)
    pipe.model_info = model_info(model)  # what checkpoints record, and export writes back (config.json)
    return pipe


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
