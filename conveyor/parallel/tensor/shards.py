"""A traced stage of a meta-device model, materialized shard by shard: no TP rank allocates a whole sharded tensor.

``conveyor.pipeline`` on a model built on the meta device, with tensor parallelism, builds each
stage with its tensors left on the meta device (:func:`defer_materialization`); they are then
distributed as meta DTensors (nothing allocated), and :func:`materialize_stage_shards` gives each
its storage on the stage's device, owning module by owning module:

- a module whose parameters the plan shards (a q/k/v/o or MLP projection, the LM head): a meta
  copy of the module takes the meta DTensors, ``to_empty`` allocates this rank's local shards only,
  and the module's own init (``reset_parameters``, a Hugging Face ``_init_weights``, as
  :mod:`conveyor.frontend.materialize` runs them) fills them through DTensor. On the CPU DTensor has
  no random-number tracker, so each TP rank seeds from ``(seed, module path, TP rank)``: its shard
  is its own draw of the module's init (bounds and std from the global shape), not a slice of the
  tp=1 values. The module's replicated parameters (a row-parallel bias) are then broadcast from TP
  rank 0, so that every rank holds the same;
- any other module (norms, a whole embedding, rotary buffers): materialized whole, exactly as
  without tensor parallelism (the same values for every tp), then distributed without a copy.

So a stage's peak is its local shards plus the replicated modules; a checkpoint or
``from_pretrained`` weights are loaded into the shards afterwards.

Example (what ``conveyor.pipeline`` does on each rank of a ("pp", "tp") mesh)::

    stage = defer_materialization(split.stage_module(stage_index, device, keep_meta=True),
                                  ShardSource(model, split.seed, device, materialize, initialise))
    parallelize_traced_stage(stage, tp_mesh, placements)    # materializes the shards
"""

from __future__ import annotations

import copy
import warnings
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor


@dataclass(frozen=True)
class ShardSource:
    """Where a meta stage's tensors come from, as the frontend gives them (this layer does not import it).

    ``materialize(names)``: those tensors of the unchanged meta model, whole and initialised on the
    stage's device; ``initialise(module, path, seed)``: the model's own init run on ``module`` (a copy
    of the model's module at ``path``) seeded from ``seed``; ``seed``: the split's init seed.
    """

    model: nn.Module
    seed: int
    device: torch.device
    materialize: Callable[[list[str]], dict[str, torch.Tensor]]
    initialise: Callable[[nn.Module, str, int], None]


def defer_materialization(stage: nn.Module, source: ShardSource) -> nn.Module:
    """Mark a stage whose tensors are on the meta device to be materialized shard by shard when parallelized.

    Example::

        stage = split.stage_module(1, "cpu", keep_meta=True)
        defer_materialization(stage, ShardSource(model, split.seed, torch.device("cpu"), materialize, initialise))
    """
    stage._conveyor_shard_source = source
    return stage


def shard_source(stage: nn.Module) -> ShardSource | None:
    return getattr(stage, "_conveyor_shard_source", None)


def materialize_stage_shards(stage: nn.Module, tp_mesh, source: ShardSource) -> None:
    """Give every meta tensor of ``stage`` (its parameters already meta DTensors) its storage on
    ``source.device``: sharded modules as local shards only, the rest whole (see the module docstring)."""
    # A tied parameter is drawn by the module that owns its first name in the model (GPT-2's
    # lm_head.weight by transformer.wte), on every stage holding a copy: equal shards at both ends.
    first_names = {id(param): name for name, param in source.model.named_parameters()}
    model_names: dict[str, str] = {}
    by_owner: dict[str, list[str]] = {}
    for name, tensor in [*stage.named_parameters(), *stage.named_buffers()]:
        if tensor.is_meta or (isinstance(tensor, DTensor) and tensor.to_local().is_meta):
            model_names[name] = first_names.get(id(_model_tensor(source.model, name)), name)
            by_owner.setdefault(model_names[name].rpartition(".")[0], []).append(name)
    for owner, names in by_owner.items():
        if any(_is_sharded(stage.get_parameter(n)) for n in names if _is_parameter(stage, n)):
            _sharded_owner(stage, owner, {n: model_names[n] for n in names}, tp_mesh, source)
        else:
            _whole_owner(stage, names, tp_mesh, source)


def _model_tensor(model: nn.Module, name: str) -> torch.Tensor | None:
    owner, _, attribute = name.rpartition(".")
    module = model.get_submodule(owner)
    return module._parameters.get(attribute)


def _is_parameter(stage: nn.Module, name: str) -> bool:
    owner, _, attribute = name.rpartition(".")
    return attribute in stage.get_submodule(owner)._parameters


def _is_sharded(param: torch.Tensor) -> bool:
    return isinstance(param, DTensor) and any(not p.is_replicate() for p in param.placements)


def _set(stage: nn.Module, name: str, value: torch.Tensor, requires_grad: bool) -> None:
    owner, _, attribute = name.rpartition(".")
    module = stage.get_submodule(owner)
    if attribute in module._parameters:
        module.register_parameter(attribute, nn.Parameter(value, requires_grad=requires_grad))
    else:
        module._buffers[attribute] = value


def _whole_owner(stage: nn.Module, names: list[str], tp_mesh, source: ShardSource) -> None:
    made = source.materialize(names)
    for name in names:
        if _is_parameter(stage, name):
            current = stage.get_parameter(name)
            value = distribute_tensor(made[name].detach(), tp_mesh, [Replicate()], src_data_rank=None)
            _set(stage, name, value, current.requires_grad)
        else:
            _set(stage, name, made[name], False)


def _sharded_owner(stage: nn.Module, owner: str, names: Mapping[str, str], tp_mesh, source: ShardSource) -> None:
    """``names``: the stage's names of the owner's tensors, each to its name in the model."""
    fresh = copy.deepcopy(source.model.get_submodule(owner))  # on meta: costs nothing
    own = {name: stage.get_parameter(name) for name in names if _is_parameter(stage, name)}
    for name, param in own.items():
        fresh.register_parameter(names[name].rpartition(".")[2], nn.Parameter(param.detach(), requires_grad=False))
    fresh.to_empty(device=source.device)  # a DTensor's empty_like allocates its local shard only
    rank_tag = f"tensor parallel rank {tp_mesh.get_local_rank()}".encode()
    rank_seed = (source.seed * 1_000_003 + zlib.crc32(rank_tag)) % 2**63  # each TP rank its own draw
    with warnings.catch_warnings():  # DTensor on a CPU mesh draws each shard locally: the rank seed is meant so
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        source.initialise(fresh, owner, rank_seed)
    _broadcast_replicated(fresh, tp_mesh)
    for name, param in own.items():
        _set(stage, name, fresh.get_parameter(names[name].rpartition(".")[2]).detach(), param.requires_grad)
    for name in names:
        if name not in own:
            _set(stage, name, fresh.get_buffer(names[name].rpartition(".")[2]), False)


def _broadcast_replicated(module: nn.Module, tp_mesh) -> None:
    """The module's replicated parameters as TP rank 0 drew them (the others drew their own)."""
    import torch.distributed as dist

    group = tp_mesh.get_group()
    source = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for param in module.parameters(recurse=False):
            if isinstance(param, DTensor) and not _is_sharded(param):
                dist.broadcast(param.to_local(), src=source, group=group)


def stage_local_bytes(stage: nn.Module) -> int:
    """The bytes this rank holds for ``stage``'s parameters and buffers (local shards of DTensors).

    Example::

        stage_local_bytes(stage)    # about half of the stage's whole bytes at tp=2, for its sharded part
    """
    total = 0
    for tensor in [*stage.parameters(), *stage.buffers()]:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


def whole_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """The bytes of ``tensors`` at their global shapes."""
    return sum(t.numel() * t.element_size() for t in tensors.values())
