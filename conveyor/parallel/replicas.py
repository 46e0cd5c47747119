"""Data parallelism across pipeline replicas: each stage's gradients reduced over "dp".

Each stage module is wrapped with torch's FSDP2 machinery over this rank's "dp" group:
``replicate`` (``data_parallel="ddp"``: every replica holds all of the stage's parameters,
gradients are all-reduced and averaged) or ``fully_shard`` (``"fsdp"``: parameters sharded
over the replicas and gathered once per step, gradients reduce-scattered and averaged).
Both would sync gradients after every backward run; a pipeline runs many per step (one or
two per microbatch) and some outside autograd's ``.backward()`` (the zero-bubble weight
pass), so, as torch's own pipelining does (``perform_reduce_grad``), the sync is off during
the step and each stage's reduction is started by hand right after its last backward of the
step (the executor says when), and waited for when the step ends: the reduction overlaps
whatever the rank still runs.

Why not ``DistributedDataParallel``: its reducer starts from autograd hooks armed by the
forward, which in a pipeline runs many microbatches before their backwards, and it finishes
inside the autograd call that completes the last bucket, so it can neither follow the
zero-bubble weight pass nor let the reduction run behind the rest of the pipeline.

Example (what :class:`conveyor.Pipeline` does with ``data_parallel="ddp"``)::

    replicas = Replicas("ddp", dp_group, dp_size)
    replicas.wrap(stage_module)
    replicas.start_step(); ...; replicas.stage_done(stage); ...; replicas.finish_step()
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from conveyor.errors import PipelineConfigError

KINDS = ("ddp", "fsdp")


def check_data_parallel(kind: str | None, dp_size: int) -> str | None:
    """The data-parallel kind to use: None for one replica, else ``kind`` ("ddp" by default)."""
    if kind is not None and kind not in KINDS:
        raise PipelineConfigError(f"data_parallel must be 'ddp', 'fsdp' or None; got {kind!r}")
    if dp_size == 1:
        return None
    return kind or "ddp"


class Replicas:
    """This rank's stages across the data-parallel replicas: wrapping and per-step gradient sync.

    ``group`` is the pipeline's own group over the ranks holding these stages in every
    replica (see :meth:`conveyor.runtime.lifecycle.RankLifecycle.replica_group`).
    """

    def __init__(self, kind: str, group, dp_size: int, device_type: str = "cpu") -> None:
        from torch.distributed.device_mesh import DeviceMesh

        self.kind = kind
        self.group = group
        self.dp_size = dp_size
        self.mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=("dp",))
        self.modules: dict[int, torch.nn.Module] = {}
        # Per stage of the last step: (started, finished) perf_counter seconds of its reduction,
        # and when the step began waiting for it: the share hidden behind pipeline work.
        self.reductions: dict[int, tuple[float, float]] = {}
        self.wait_started = 0.0

    def wrap(self, stage: int, module: torch.nn.Module) -> torch.nn.Module:
        """Wrap ``module`` (in place) for data parallelism over the "dp" group; returns it."""
        from torch.distributed._composable.replicate_with_fsdp import replicate
        from torch.distributed.fsdp import fully_shard

        if self.kind == "fsdp":
            # Gathered once per step and kept until the step's last backward (torchtitan's choice
            # for pipelines): resharding after each microbatch's forward would gather again.
            fully_shard(module, mesh=self.mesh, reshard_after_forward=False)
        else:
            replicate(module, mesh=self.mesh)
        self.modules[stage] = module
        return module

    def start_step(self) -> None:
        """Before a step: no gradient sync and no resharding until each stage's last backward."""
        self.reductions = {}
        for module in self.modules.values():
            module.set_is_last_backward(False)
            module.set_reshard_after_backward(False)
            module.set_requires_gradient_sync(False)

    def stage_done(self, stage: int) -> None:
        """After ``stage``'s last backward of the step: start reducing its gradients now."""
        module = self.modules[stage]
        start = time.perf_counter()
        module.set_is_last_backward(True)
        module.set_reshard_after_backward(True)
        module.set_requires_gradient_sync(True)
        for state in _state_of(module)._state_ctx.all_states:
            for param_group in state._fsdp_param_groups:
                param_group.post_backward()
        self.reductions[stage] = (start, time.perf_counter())

    def finish_step(self) -> None:
        """After the step: wait for every reduction; gradients then hold the replicas' mean."""
        self.wait_started = time.perf_counter()
        for stage, module in self.modules.items():
            _state_of(module)._root_post_backward_final_callback()
            started, _ = self.reductions.get(stage, (self.wait_started, 0.0))
            self.reductions[stage] = (started, time.perf_counter())

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` over the replicas (every replica gets the same result)."""
        import torch.distributed as dist

        total = value.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total / self.dp_size

    def whole_norms(self, shard_norms: Sequence[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
        """Each gradient's norm from this rank's part of it: as is when replicated ("ddp"), else
        combined over the replicas' shards ("fsdp": the p-th root of the summed p-th powers,
        or the max for the infinity norm). Every replica gets the same values."""
        import torch.distributed as dist

        if self.kind != "fsdp" or not shard_norms:
            return list(shard_norms)
        stacked = torch.stack([n.to(torch.float64) for n in shard_norms])
        if norm_type == float("inf"):
            dist.all_reduce(stacked, op=dist.ReduceOp.MAX, group=self.group)
        else:
            stacked = stacked.pow(norm_type)
            dist.all_reduce(stacked, group=self.group)
            stacked = stacked.pow(1.0 / norm_type)
        return [value.to(n.dtype) for value, n in zip(stacked, shard_norms)]


def _state_of(module: torch.nn.Module):
    from torch.distributed._composable.replicate_with_fsdp import ReplicateModule, replicate
    from torch.distributed.fsdp import fully_shard

    return replicate.state(module) if isinstance(module, ReplicateModule) else fully_shard.state(module)
