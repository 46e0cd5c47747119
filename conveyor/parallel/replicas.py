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

With tensor parallelism (a ("pp", "dp", "tp") mesh) the stages' parameters are DTensors over
"tp"; they are wrapped over the "dp" sub-mesh of the same mesh, as torchtitan composes FSDP2
with TP (``parallelize_module`` on "tp", then ``fully_shard`` on "dp"): each parameter becomes
a DTensor over ("dp", "tp"), and each TP shard's gradient is reduced over its own replicas.

Why not ``DistributedDataParallel``: its reducer starts from autograd hooks armed by the
forward, which in a pipeline runs many microbatches before their backwards, and it finishes
inside the autograd call that completes the last bucket, so it can neither follow the
zero-bubble weight pass nor let the reduction run behind the rest of the pipeline.

The mechanics (which flags, which FSDP internals, why each) are in :mod:`conveyor.parallel.fsdp`.

Example (what the distributed ranks backend does with ``data_parallel="ddp"``; a :class:`StagePart`)::

    replicas = Replicas("ddp", dp_size)
    replicas.agree(site); replicas.wrap()
    replicas.start_step(); ...; replicas.stage_done(stage); ...; replicas.finish_step()
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from conveyor.parallel import fsdp
from conveyor.parallel.clipping import combine_shard_norms
from conveyor.parallel.mesh import MeshLayout
from conveyor.parallel.part import PartSite, Span, StagePart, claimed_parameters
from conveyor.runtime.stage.runner import StageRunner
from conveyor.runtime.stage.timing import SpanTimer


class Replicas(StagePart):
    """This rank's stages across the data-parallel replicas: wrapping and per-step gradient sync.

    ``kind``: "ddp" or "fsdp"; ``dp_size``: the replica count. ``mesh``: the 1-D "dp" mesh to wrap
    over, where the stages are tensor parallel (the "dp" sub-mesh of the mesh whose "tp" sub-mesh
    holds their DTensors: FSDP2's 2-D composition); None: one over the replicas' group, which
    :meth:`agree` builds (the pipeline's own group over the ranks holding these stages in every
    replica, see :meth:`conveyor.runtime.lifecycle.rank.RankLifecycle.replica_group`). Each TP rank's
    replicas then reduce its own shard's gradient: FSDP2 first gives a gradient that DTensor's
    backward left ``Partial`` over "tp" its parameter's placement, then reduces the local tensor
    over "dp". Checkpoints are written by every replica together: DCP writes a replicated tensor
    once and each shard of a sharded one by its holder.
    """

    wants_checkpoint_group = True

    def __init__(self, kind: str, dp_size: int, mesh=None) -> None:
        self.kind = kind
        self.dp_size = dp_size
        self.mesh = mesh
        self.group = None
        self.runners: dict[int, StageRunner] = {}
        # The last step's reductions: per stage (started, and done where it ran), then the wait
        # for all of them at the step's end. What the rank spent waiting is the reduction's
        # exposed part; the rest ran behind its work. On a GPU timed with events (the host's
        # calls only queue the work), on the streams FSDP reduced on.
        self.timer = SpanTimer(torch.device("cpu"))

    def agree(self, site: PartSite) -> None:
        """The replicas' group, built alike in every replica: the same stages, schedule and model."""
        from torch.distributed.device_mesh import DeviceMesh

        fsdp.check_supported(site.schedule, self.kind, site.model.tied_parameters)
        self.group = site.life.groups.replica_group(replica_memberships(site.mesh_layout))
        site.life.groups.agree({**site.built, "data parallel": self.kind}, group=self.group, who="replicas")
        self.runners = dict(site.runners)
        # Named after the group, not just "dp": torch's DTensor caches (sharding propagation)
        # take two meshes over the same ranks and names for one, and would hand a later
        # pipeline's tensors the mesh, and so the destroyed group, of an earlier one. A "dp"
        # sub-mesh given (tensor parallelism) is the user's mesh, alive as long as the user keeps
        # it, so no cache can outlive its groups.
        if self.mesh is None:
            self.mesh = DeviceMesh.from_group(self.group, site.device.type,
                                              mesh_dim_names=(f"dp_{self.group.group_name}",))
        self.timer = SpanTimer(torch.device(site.device.type))

    def wrap(self) -> None:
        """Wrap every stage module (in place) over the "dp" group; the runners read its parameters."""
        wrap_stage = fsdp.shard_stage if self.kind == "fsdp" else fsdp.replicate_stage
        for runner in self.runners.values():
            # Parameters another part reduces over its own groups (expert shards) stay out.
            wrap_stage(runner.module, self.mesh, ignored_params=claimed_parameters(runner.module))
            runner.refresh_params()

    def start_step(self) -> None:
        """Before a step: parameters gathered once, no gradient sync until each stage's last backward."""
        self.timer.clear()
        fsdp.before_step(self.runners.values())

    def stage_done(self, stage: int) -> None:
        """After ``stage``'s last backward of the step: start reducing its gradients now."""
        started = self.timer.start()
        fsdp.after_last_backward(self.runners[stage])
        self.timer.end(str(stage), started, fsdp.reduction_streams(self.runners[stage]) if self.timer.on_device else ())

    def finish_step(self) -> None:
        """After the step: wait for every reduction; gradients then hold the replicas' mean."""
        started = self.timer.start()
        fsdp.after_step(self.runners.values())
        self.timer.end("wait", started)

    def spans(self) -> list[tuple[str, float, float]]:
        """The last step's reductions: (stage, start, end) each, then ("wait", start, end); on a GPU
        the first call after a step waits for the device."""
        spans = self.timer.spans()
        calls = sorted((span for span in spans if span[0] != "wait"), key=lambda span: int(span[0]))
        return calls + [span for span in spans if span[0] == "wait"]

    def step_loss(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` over the replicas (every replica gets the same result): the global
        minibatch's loss, the replicas' minibatches together."""
        total = value.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total / self.dp_size

    def flags(self, flags: torch.Tensor) -> torch.Tensor:
        """The flags' max over the replicas: a shard, or one replica's loss, may be the only bad one."""
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return flags

    def describe_spans(self, by_rank: list[list[Span]]) -> tuple[str, dict]:
        """The timeline's "data_parallel" entry: per rank, the (stage or "wait", start, end) of the calls
        that reduced gradients across replicas: what of the reduction the rank spent waiting."""
        return "data_parallel", {"kind": self.kind, "replicas": self.dp_size, "reductions": by_rank}

    def whole_norms(self, grads: Sequence[torch.Tensor], shard_norms: list[torch.Tensor],
                    norm_type: float) -> list[torch.Tensor]:
        """Each gradient's norm from this rank's part of it: as is when replicated ("ddp"), else
        combined over the replicas' shards ("fsdp": the p-th root of the summed p-th powers,
        or the max for the infinity norm). Every replica gets the same values."""
        if self.kind != "fsdp":
            return list(shard_norms)
        return combine_shard_norms(shard_norms, norm_type, self.group)



def replica_memberships(layout: MeshLayout) -> list[list[int]]:
    """The global ranks holding the same stages and the same TP shard in every replica: one list per
    (TP position, pipeline position), in the one order every rank builds their groups."""
    pipelines = layout.group_pipelines  # one per (replica, TP position), replica-major
    tp_size = len(pipelines) // layout.dp_size
    return [[pipeline[rank] for pipeline in pipelines[position::tp_size]]  # replica by replica
            for position in range(tp_size) for rank in range(layout.pp_size)]
