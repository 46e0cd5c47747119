"""DTensor shards in a checkpoint: what DCP writes for each, and how a packed shard comes back.

Tensor-parallel stages hold DTensors (sharded on the mesh's "tp" dim, and on "dp" under FSDP).
DCP writes a DTensor as it is: each rank its one chunk, under the tensor's model-wide name and
global shape, so that a checkpoint saved at tp=2 loads into tp=1 (whole tensors), tp=2 or any
other layout by DCP's own resharding, parameters and optimizer state alike.

One placement has no single chunk: torch's ``_StridedShard`` of a packed projection (GPT-2's
fused ``c_attn`` holds ``[q_r | k_r | v_r]`` on TP rank r, three slices of the global tensor).
DCP's planner refuses it (the ranks' chunks overlap). Such a tensor goes through DCP as a
replicated DTensor (DTensor's ``redistribute``: the same global value in the original ``q|k|v``
order, written once), and is loaded into a replicated stand-in that is cut back into this rank's
packed shard.

Under FSDP2 over "dp" the packed bias is strided twice, ``(_StridedShard(0, sf=2),
_StridedShard(0, sf=3))``: FSDP2 chunks each TP rank's ``[q_r | k_r | v_r]`` over the replicas.
torch 2.13 gets such a tensor wrong in one step: ``full_tensor()`` (a redistribute of both mesh
dims at once) duplicates some elements and drops others, and ``distribute_tensor`` cuts the whole
tensor into other shards than the ones FSDP2 holds. So a packed tensor is gathered one mesh dim
at a time, the outermost first (FSDP2's own all-gather over "dp", which gives back the TP rank's
packed shard, then the TP gather), and a tensor strided over several mesh dims is cut back by the
positions that gather gives each of this rank's elements (:func:`_local_positions`), so the cut is
the gather's exact inverse.

Example (on each TP rank)::

    to_write = {"model.attn.c_attn.weight": storable(c_attn.weight)}
    landing = Landing()
    to_read = {"model.attn.c_attn.weight": landing.receive(c_attn.weight)}
    dcp.load(to_read, ...)
    landing.settle()        # c_attn.weight's local shard now holds the loaded value
"""

from __future__ import annotations

import sys

import torch

from conveyor.pipe.weights import replicated


def is_packed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor with a strided (packed) shard, which DCP cannot write as one chunk."""
    loaded = sys.modules.get("torch.distributed.tensor")  # no DTensor can exist before it is imported
    if loaded is None or not isinstance(tensor, loaded.DTensor):
        return False
    # Imported only where a checkpoint holds a DTensor, here and below (torch.distributed.tensor is heavy).
    from torch.distributed.tensor.placement_types import _StridedShard

    return any(isinstance(placement, _StridedShard) for placement in tensor.placements)


def _local_positions(tensor: torch.Tensor) -> torch.Tensor:
    """Where each element of this rank's local shard of ``tensor`` sits in the whole tensor (flat indices, in the
    local shard's order), as :func:`~conveyor.pipe.weights.replicated` gathers it: a collective over ``tensor``'s mesh.

    Each rank numbers its local elements with codes no other rank uses (its coordinate in the
    mesh, then the element), the codes are gathered exactly as the values are, and each rank
    finds its own codes in the whole.
    """
    from torch.distributed.tensor import DTensor

    mesh, local = tensor.device_mesh, tensor.to_local()
    coordinate = 0
    for size, index in zip(mesh.shape, mesh.get_coordinate()):
        coordinate = coordinate * size + index
    span = max(local.numel(), 1)
    codes = torch.arange(local.numel(), dtype=torch.int64, device=local.device).reshape(local.shape)
    codes = DTensor.from_local(codes + coordinate * span, mesh, tensor.placements, run_check=False,
                               shape=tensor.shape, stride=tensor.stride())
    whole = replicated(codes).to_local().flatten()
    mine = torch.nonzero(whole // span == coordinate).flatten()
    return mine[torch.argsort(whole[mine] % span)]


def storable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached as DCP writes it: a packed DTensor replicated (a collective over its mesh), any other as is.

    Example:
        >>> storable(torch.ones(2)).requires_grad
        False
    """
    tensor = tensor.detach()
    return replicated(tensor) if is_packed(tensor) else tensor


class Landing:
    """Where DCP loads each tensor: in place, or (packed DTensors) into a stand-in cut back by :meth:`settle`.

    Example:
        >>> landing = Landing(); weight = torch.zeros(2)
        >>> landing.receive(weight).data_ptr() == weight.data_ptr()
        True
    """

    def __init__(self) -> None:
        self._stand_ins: list[tuple[torch.Tensor, torch.Tensor]] = []

    def receive(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor DCP should load into for ``tensor`` (``tensor`` itself, detached, unless it is packed)."""
        tensor = tensor.detach()
        if not is_packed(tensor):
            return tensor
        from torch.distributed.tensor import DTensor, Replicate

        local = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.to_local().device)
        # The global shape, replicated, in its own storage: made here, without a collective (a peer
        # that failed while preparing must not leave this rank waiting).
        stand_in = DTensor.from_local(local, tensor.device_mesh, [Replicate()] * tensor.device_mesh.ndim,
                                      run_check=False)
        self._stand_ins.append((tensor, stand_in))
        return stand_in

    def settle(self) -> None:
        """Cut every loaded stand-in into its tensor's shard: local slicing, except that a tensor strided over
        several mesh dims (packed over "tp" and sharded by FSDP2 over "dp") asks the mesh where its
        elements sit (:func:`_local_positions`, a collective, in the same order on every rank)."""
        from torch.distributed.tensor import distribute_tensor

        with torch.no_grad():
            for tensor, stand_in in self._stand_ins:
                local = tensor.to_local()
                if sum(not placement.is_replicate() for placement in tensor.placements) > 1:
                    positions = _local_positions(tensor)
                    local.copy_(stand_in.to_local().flatten()[positions].reshape(local.shape))
                else:
                    shard = distribute_tensor(stand_in.to_local(), tensor.device_mesh, tensor.placements,
                                              src_data_rank=None)
                    local.copy_(shard.to_local())
        self._stand_ins.clear()
