"""A traced stage of a meta-device model, materialized owning module by owning module: no TP rank keeps a whole
sharded tensor.

``conveyor.pipeline`` on a model built on the meta device, with tensor parallelism, builds each
stage with its tensors left on the meta device (:func:`defer_materialization`); they are then
distributed as meta DTensors (nothing allocated), and :func:`materialize_stage_shards` gives each
its storage on the stage's device, one owning module at a time (a projection, a norm, the
embedding): the module's tensors are made whole and initialised exactly as without tensor
parallelism (:mod:`conveyor.frontend.materialize`: seeded from the seed and the module's path), then
each TP rank keeps its slice (a copy, so the whole is freed before the next module). Every TP rank
draws the same whole, so a shard is the tp=1 value's slice and a replicated tensor is equal on every
rank without a broadcast: the same seed gives the same starting model at every tp (and every pp).

So a stage's peak is its local shards plus one owning module whole; a checkpoint or
``from_pretrained`` weights are loaded into the shards afterwards.

Example (what ``conveyor.pipeline`` does on each rank of a ("pp", "tp") mesh)::

    stage = defer_materialization(split.stage_module(stage_index, device, keep_meta=True),
                                  ShardSource(model, split.seed, device, materialize))
    parallelize_traced_stage(stage, tp_mesh, placements)    # materializes the shards
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from conveyor.errors import SplitError


@dataclass(frozen=True)
class ShardSource:
    """Where a meta stage's tensors come from, as the frontend gives them (this layer does not import it).

    ``materialize(names)``: those tensors of the unchanged meta model, whole and initialised on the
    stage's device; ``seed``: the split's init seed.
    """

    model: nn.Module
    seed: int
    device: torch.device
    materialize: Callable[[list[str]], dict[str, torch.Tensor]]


def defer_materialization(stage: nn.Module, source: ShardSource) -> nn.Module:
    """Mark a stage whose tensors are on the meta device to be materialized shard by shard when parallelized.

    Example::

        stage = split.stage_module(1, "cpu", keep_meta=True)
        defer_materialization(stage, ShardSource(model, split.seed, torch.device("cpu"), materialize))
    """
    stage._conveyor_shard_source = source
    return stage


def shard_source(stage: nn.Module) -> ShardSource | None:
    return getattr(stage, "_conveyor_shard_source", None)


def materialize_stage_shards(stage: nn.Module, tp_mesh, source: ShardSource) -> None:
    """Give every meta tensor of ``stage`` (its parameters already meta DTensors) its storage on
    ``source.device``: each drawn whole as without tensor parallelism, then sliced to this rank's shard
    (see the module docstring)."""
    # A tensor tied within the stage (GPT-2's wte and lm_head on one stage) is one Parameter under two
    # names: it is made once and registered under every name, so none is left on meta.
    tensors = dict(_every_tensor(stage))
    aliases: dict[int, list[str]] = {}
    for name, tensor in tensors.items():
        if _on_meta(tensor):
            aliases.setdefault(id(tensor), []).append(name)
    # A tied parameter is drawn by the module that owns its first name in the model (GPT-2's
    # lm_head.weight by transformer.wte), on every stage holding a copy: equal shards at both ends.
    first_names = {id(param): name for name, param in source.model.named_parameters()}
    model_parameters = dict(source.model.named_parameters(remove_duplicate=False))
    by_owner: dict[str, list[tuple[str, str]]] = {}
    for names in aliases.values():
        model_name = first_names.get(id(model_parameters.get(names[0])), names[0])
        by_owner.setdefault(model_name.rpartition(".")[0], []).append((names[0], model_name))
    for pairs in by_owner.values():  # one owning module whole at a time: the peak
        made = source.materialize([model_name for _, model_name in pairs])
        for name, model_name in pairs:
            current = tensors[name]
            value = made[model_name].detach()
            if isinstance(current, nn.Parameter):
                value = nn.Parameter(_slice(value, tp_mesh, current.placements), requires_grad=current.requires_grad)
            for alias in aliases[id(current)]:  # setattr fills a parameter's slot or a buffer's alike
                owner, _, attribute = alias.rpartition(".")
                setattr(stage.get_submodule(owner), attribute, value)
        del made
    left = [name for name, tensor in _every_tensor(stage) if _on_meta(tensor)]
    if left:  # it would fail a checkpoint's save much later, as "Cannot copy out of meta tensor"
        raise SplitError(f"tensor parallel rank {tp_mesh.get_local_rank()}: {', '.join(left)} of this stage "
                         f"stayed on the meta device after materialization (internal error: each meta tensor "
                         f"of a stage, every name of a tied one included, should get its storage here)")


def _every_tensor(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


def _on_meta(tensor: torch.Tensor) -> bool:
    return tensor.is_meta or (isinstance(tensor, DTensor) and tensor.to_local().is_meta)


def _slice(whole: torch.Tensor, tp_mesh, placements) -> DTensor:
    """This TP rank's part of ``whole`` (every TP rank holds the same whole), in storage of its own: the
    whole is freed once the owning module's tensors are sliced."""
    shared = distribute_tensor(whole, tp_mesh, placements, src_data_rank=None)
    if all(p.is_replicate() for p in placements):
        return shared
    return DTensor.from_local(shared.to_local().clone(), tp_mesh, placements, run_check=False,
                              shape=shared.shape, stride=shared.stride())
