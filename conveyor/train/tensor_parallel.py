"""``parallel.tp`` in ``conveyor train``: the model's sizes checked before any rank starts, the shards.

The ranks lie on a ("pp", "dp", "tp") mesh, tp innermost (:func:`conveyor.parallel.mesh.pipeline_mesh`,
built by the pipeline from the layout's sizes): with ``tp`` dividing ``--nproc-per-node`` every TP group
stays inside one node, while the pipeline's sends and the replicas' reductions cross nodes.

The stages are parallelized by ``tensor_parallel="auto"`` (:mod:`conveyor.parallel.tensor`): the
plan found from the modules' structure. :func:`tensor_parallel_problems` runs that plan on the
model built on the meta device, so that a size ``tp`` does not divide (heads, key/value heads, the
MLP's width, the vocabulary) is a config error naming the key, before any rank starts, and
:func:`parameter_shards` gives each parameter's placement and local shape (``--dry-run`` and
``python -m benchmarks --tp`` print them).

Example:
    >>> from conveyor.train.config import load_config
    >>> tensor_parallel_problems(load_config(None, ["parallel.tp=2"]))
    []
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from conveyor.errors import PipelineConfigError
from conveyor.train.config import TrainConfig


def model_placements_for(cfg: TrainConfig, model: torch.nn.Module, tied_groups: Any = ()) -> dict[str, Any]:
    """Each planned parameter's placement (by original name) at ``parallel.tp``, as the pipeline will place
    it; raises PipelineConfigError where tp does not fit the model (the same check the ranks make)."""
    from conveyor.parallel.tensor.stages import model_placements

    distributed = replace(cfg.parallel, in_process=False)  # the pipeline's record: TP ranks are processes
    return model_placements(model, distributed.layout(), cfg.parallel.tp, tied_groups)


def tensor_parallel_problems(cfg: TrainConfig) -> list[str]:
    """Why ``parallel.tp`` / ``parallel.sequence_parallel`` cannot train ``cfg.model`` (empty: they can).

    The model is built on the meta device (nothing allocated) and given the plan the ranks will
    make; a refusal becomes one line naming the key, with the tp values that would fit.

    Example:
        >>> from conveyor.train.config import TrainConfig
        >>> cfg = TrainConfig()
        >>> cfg.model.heads, cfg.parallel.tp = 2, 4
        >>> print(tensor_parallel_problems(cfg)[0])  # doctest: +NORMALIZE_WHITESPACE
        parallel.tp=4: tensor parallel size tp=4 does not divide the number of attention heads of
        transformer.h.0.attn (GPT2Attention): 2 is not a multiple of 4; choose a tp that divides 2
        (tp values that fit this model up to 8: 1, 2)
    """
    from conveyor.train.models import meta_model

    if cfg.parallel.tp <= 1:
        return []
    model = meta_model(cfg)
    try:
        model_placements_for(cfg, model)
    except PipelineConfigError as error:
        if cfg.parallel.sequence_parallel and "sequence_parallel" in str(error):
            return [f"parallel.sequence_parallel=true: {error}"]
        fits = fitting_tp_sizes(model, up_to=max(8, cfg.parallel.tp))
        return [f"parallel.tp={cfg.parallel.tp}: {error} (tp values that fit this model up to "
                f"{max(8, cfg.parallel.tp)}: {', '.join(map(str, fits))})"]
    return []


def fitting_tp_sizes(model: torch.nn.Module, up_to: int) -> list[int]:
    """The tp sizes from 1 to ``up_to`` whose "auto" plan ``model`` takes (sizes and structure alike)."""
    from conveyor.parallel.tensor.style_map import tensor_parallel_plan

    fits = [1]
    for tp in range(2, up_to + 1):
        try:
            tensor_parallel_plan(model, tp)
        except PipelineConfigError:
            continue
        fits.append(tp)
    return fits


@dataclass(frozen=True)
class Shard:
    """One parameter on one TP rank: its name, whole shape, placement (``"Shard(0)"``, ``"Replicate()"``), local
    shape and bytes."""

    name: str
    shape: tuple[int, ...]
    placement: str
    local_shape: tuple[int, ...]
    local_bytes: int


def parameter_shards(named_parameters: Any, placements: dict[str, Any], tp: int) -> list[Shard]:
    """Each parameter's shard on a TP rank of ``tp``: placed as ``placements`` says (unnamed: replicated).

    ``named_parameters``: (name, tensor) pairs, meta tensors welcome. A dim that tp does not divide
    evenly gives its first ranks the larger part, as DTensor does; the first rank's is reported.

    Example:
        >>> from torch.distributed.tensor import Shard as Split
        >>> [s.local_shape for s in parameter_shards([("w", torch.empty(8, 4, device="meta"))], {"w": Split(0)}, 2)]
        [(4, 4)]
    """
    shards = []
    for name, tensor in named_parameters:
        placement = placements.get(name)
        shape = tuple(tensor.shape)
        local = list(shape)
        dim = getattr(placement, "dim", None) if placement is not None and placement.is_shard() else None
        if dim is not None:
            local[dim] = -(-shape[dim] // tp)
        shards.append(Shard(name, shape, "Replicate()" if dim is None else f"Shard({dim})", tuple(local),
                            math.prod(local) * tensor.element_size()))
    return shards


def tensor_parallel_option(model: torch.nn.Module, tp: int, seq_len: int) -> Any:
    """What tp does to ``model``, for the planner (:class:`conveyor.plan.tensor_search.TensorParallelOption`): per
    planned module, the parameters tp shards (as a traced stage places them) and, per sample of ``seq_len``
    tokens, the bytes of its collectives: a row-parallel projection all-reduces its output in the forward, a
    column-parallel one its input's gradient in the backward, the LM head gathers its logits; or, where the
    "auto" plan refuses this tp, why.

    Example:
        >>> from conveyor.train.config import load_config
        >>> from conveyor.train.models import meta_model
        >>> model = meta_model(load_config(None, ["model.name=llama", "model.kv_heads=2"]))
        >>> tensor_parallel_option(model, 4, 128).refused  # doctest: +ELLIPSIS
        'tensor parallel size tp=4 does not divide the number of key/value heads of model.layers.0.self_attn...'
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from conveyor.parallel.tensor.discover import discover, projection_of
    from conveyor.parallel.tensor.style_map import matching_modules, tensor_parallel_plan
    from conveyor.parallel.tensor.traced import parameter_placements
    from conveyor.plan.tensor_search import ModuleSplit, TensorParallelOption

    if tp == 1:
        return TensorParallelOption(1)
    try:
        plan = tensor_parallel_plan(model, tp)
    except PipelineConfigError as error:
        return TensorParallelOption(tp, refused=str(error))
    placements = parameter_placements(model, plan)
    head = discover(model).head
    element = next(model.parameters()).element_size()
    splits = []
    for pattern, style in plan.items():
        for name in matching_modules(model, pattern):
            module = model.get_submodule(name)
            sharded = sum(p.numel() for key, p in module.named_parameters(prefix=name)
                          if key in placements and placements[key].is_shard())
            projection = projection_of(name, module)
            if not sharded or projection is None:
                continue  # a block's head counts, a traced stage's whole embedding: nothing split, nothing sent
            tokens = seq_len * element
            rowwise, colwise = isinstance(style, RowwiseParallel), isinstance(style, ColwiseParallel)
            gathered = head is not None and name == head.name
            splits.append(ModuleSplit(name, float(sharded),
                                      forward_bytes=float(projection.out_features * tokens) if rowwise or gathered
                                      else 0.0,
                                      backward_bytes=float(projection.in_features * tokens) if colwise else 0.0,
                                      forward_collectives=int(rowwise or gathered), backward_collectives=int(colwise)))
    return TensorParallelOption(tp, tuple(splits))
