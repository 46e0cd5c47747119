"""DTensor shards in a checkpoint: what DCP writes for each, and how a packed shard comes back.

Tensor-parallel stages hold DTensors (sharded on the mesh's "tp" dim, and on "dp" under FSDP).
DCP writes a DTensor as it is: each rank its one chunk, under the tensor's model-wide name and
global shape, so that a checkpoint saved at tp=2 loads into tp=1 (whole tensors), tp=2 or any
other layout by DCP's own resharding, parameters and optimizer state alike.

One placement has no single chunk: torch's ``_StridedShard`` of a packed projection (GPT-2's
fused ``c_attn`` holds ``[q_r | k_r | v_r]`` on TP rank r, three slices of the global tensor).
DCP's planner refuses it (the ranks' chunks overlap). Such a tensor goes through DCP as a
replicated DTensor (DTensor's ``redistribute``: the same global value in the original ``q|k|v``
order, written once), and is loaded into a replicated stand-in that ``distribute_tensor`` cuts
back into this rank's packed shard.

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


def _dtensor_types():
    # DTensor is imported only where a checkpoint holds one (torch.distributed.tensor is heavy).
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.placement_types import _StridedShard

    return DTensor, Replicate, _StridedShard


def is_packed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor with a strided (packed) shard, which DCP cannot write as one chunk."""
    loaded = sys.modules.get("torch.distributed.tensor")  # no DTensor can exist before it is imported
    if loaded is None or not isinstance(tensor, loaded.DTensor):
        return False
    _, _, strided = _dtensor_types()
    return any(isinstance(placement, strided) for placement in tensor.placements)


def _replicated(tensor: torch.Tensor) -> torch.Tensor:
    _, replicate, _ = _dtensor_types()
    return tensor.redistribute(placements=[replicate()] * tensor.device_mesh.ndim)


def storable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached as DCP writes it: a packed DTensor replicated (a collective over its mesh), any other as is.

    Example:
        >>> storable(torch.ones(2)).requires_grad
        False
    """
    tensor = tensor.detach()
    return _replicated(tensor) if is_packed(tensor) else tensor


class Landing:
    """Where DCP loads each tensor: in place, or (packed DTensors) into a stand-in cut back by :meth:`settle`.

    Example:
        >>> landing = Landing(); weight = torch.zeros(2)
        >>> landing.receive(weight) is not None and landing.pending
        0
    """

    def __init__(self) -> None:
        self._stand_ins: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def pending(self) -> int:
        """How many packed tensors wait for :meth:`settle`."""
        return len(self._stand_ins)

    def receive(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor DCP should load into for ``tensor`` (``tensor`` itself, detached, unless it is packed)."""
        tensor = tensor.detach()
        if not is_packed(tensor):
            return tensor
        dtensor, replicate, _ = _dtensor_types()
        local = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.to_local().device)
        # The global shape, replicated, in its own storage: made here, without a collective (a peer
        # that failed while preparing must not leave this rank waiting).
        stand_in = dtensor.from_local(local, tensor.device_mesh, [replicate()] * tensor.device_mesh.ndim,
                                      run_check=False)
        self._stand_ins.append((tensor, stand_in))
        return stand_in

    def settle(self) -> None:
        """Cut every loaded stand-in into its tensor's shard (local slicing, no communication)."""
        from torch.distributed.tensor import distribute_tensor

        with torch.no_grad():
            for tensor, stand_in in self._stand_ins:
                shard = distribute_tensor(stand_in.to_local(), tensor.device_mesh, tensor.placements,
                                          src_data_rank=None)
                tensor.to_local().copy_(shard.to_local())
        self._stand_ins.clear()
