"""The torch.distributed ranks backend: this process runs one rank of the pipeline.

It holds what only ranks in separate processes need: the pipeline's own process groups and
their lifecycle (:mod:`conveyor.runtime.lifecycle.rank`: agreement at construction, failure, close),
the transport between stages, the data-parallel replicas, tied copies summed across ranks, the
step's loss broadcast, and the gathers behind ``memory(all_ranks=True)``, ``timeline()`` and
clipping. :class:`conveyor.Pipeline` does the rest, as for the in-process backend.

Example (every rank, under torchrun)::

    pipe = conveyor.Pipeline(stages, "1f1b", loss_fn, microbatches=8)
    pipe.ranks.transport        # the transport it chose ("auto")
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from conveyor.errors import PipelineConfigError
from conveyor.options import Layout, TransferOptions, WholeModel
from conveyor.parallel import fsdp
from conveyor.parallel.clipping import NormExchange
from conveyor.parallel.loss import LossBroadcast
from conveyor.parallel.mesh import layout_of
from conveyor.parallel.replicas import Replicas, check_data_parallel
from conveyor.parallel.tied import TiedGradients, tied_copies_outside_their_first_stage
from conveyor.runtime.executor import RankExecutor
from conveyor.runtime.lifecycle.rank import RankLifecycle
from conveyor.runtime.stage.device import group_device, make_current, place_modules, resolve_device
from conveyor.runtime.stage.memory import MemoryReport, memory_report
from conveyor.runtime.stage.timing import EventRecorder, StepRecorder, make_recorder, replica_timeline
from conveyor.runtime.transport.choice import build_transport, seed_shapes
from conveyor.schedule.grid import render_positions
from conveyor.schedule.ir import Schedule
from conveyor.schedule.passes import executable
from conveyor.schedule.registry import resolve_schedule
from conveyor.schedule.timeline import Timeline

if TYPE_CHECKING:
    from conveyor.parallel.tensor.stages import TensorParallelStages
    from conveyor.pipe.pipeline import Pipeline


class DistributedRanks:
    """This process's rank of a pipeline over ``layout``'s group (or mesh), moving bytes as ``transfer`` says."""

    in_process = False
    replicas: Replicas | None = None  # data parallelism over a mesh's "dp" dim
    checkpoint_group = None  # with replicas or TP: a group over every rank of the job
    _recorder: StepRecorder | EventRecorder | None = None  # the last step's, when recorded

    def __init__(self, layout: Layout, transfer: TransferOptions) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise PipelineConfigError(
                "torch.distributed is not initialised: launch with torchrun and call "
                "torch.distributed.init_process_group() first, or pass layout=Layout(in_process=True) "
                "(conveyor.LocalPipeline) to run every rank in one process"
            )
        self.layout, self.transfer = layout, transfer
        self.mesh_layout = None if layout.mesh is None else layout_of(layout.mesh)
        self.group = layout.group if self.mesh_layout is None else self.mesh_layout.pp_group  # never used itself
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.local_ranks = [self.rank]
        self.dp_rank = self.mesh_layout.dp_rank if self.mesh_layout is not None else 0
        self.dp_size = self.mesh_layout.dp_size if self.mesh_layout is not None else 1
        self.data_parallel = check_data_parallel(layout.data_parallel, self.dp_size)
        self.tensor_parallel: TensorParallelStages | None = None

    def parallelize(self, by_rank: dict[int, list], model: WholeModel) -> TensorParallelStages | None:
        """This rank's stages parallelized over the mesh's "tp" dim (Layout.tensor_parallel; None: off)."""
        if self.layout.tensor_parallel is None:
            return None
        # DTensor is loaded for tensor parallelism only.
        from conveyor.parallel.tensor.stages import parallelize_pipeline_stages

        stages = dict(zip(self.schedule.stages_of(self.rank), by_rank[self.rank], strict=True))
        self.tensor_parallel = parallelize_pipeline_stages(stages, self.layout, self.mesh_layout.tp_mesh,
                                                           self.schedule.num_stages - 1, model.parameter_placements)
        self._tp_stages = stages
        return self.tensor_parallel

    def resolve(self, schedule: Schedule | str, microbatches: int | None, virtual: int | None,
                modules: Sequence[torch.nn.Module]) -> Schedule:
        """The schedule, for as many ranks as the group has."""
        resolved = resolve_schedule(schedule, microbatches, virtual, self.size)
        if resolved.num_ranks != self.size:
            raise PipelineConfigError(
                f"schedule {resolved.name!r} has {resolved.num_ranks} ranks but the process group "
                f"has {self.size}; build the schedule with ranks={self.size}, launch {resolved.num_ranks} "
                f"processes, or give each pipeline its own ranks with Layout(group=...) (several pipelines in "
                f"one job)"
            )
        self.schedule = resolved
        return resolved

    def place(self, modules: Sequence[torch.nn.Module]) -> tuple[torch.device, dict[int, list]]:
        """This rank's device (its modules moved there, a GPU made current), and its modules."""
        stages = self.schedule.stages_of(self.rank)
        listed = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
        # A meta-device model's traced stages under tensor parallelism are materialized shard by
        # shard when parallelized (conveyor.parallel.tensor.shards), on this device.
        placed = [(m, s) for m, s in zip(listed, stages) if getattr(m, "_conveyor_shard_source", None) is None]
        self.device = make_current(place_modules([m for m, _ in placed], [s for _, s in placed],
                                                 resolve_device(self.layout.device)))
        self.comm_device = group_device(self.device, self.group)  # NCCL: the stage's GPU; gloo: the CPU
        return self.device, {self.rank: modules if isinstance(modules, torch.nn.Module) else list(modules)}

    def connect(self, pipe: Pipeline, built: dict[str, str]) -> None:
        """Own groups, agreement with every rank on ``built``, replicas, transport, executor."""
        # Every check that needs no peer is done: from here on this rank holds process groups.
        self.life = RankLifecycle(self.group, self.transfer.timeout_s,
                                  getattr(self.mesh_layout, "group_pipelines", None), device=self.comm_device)
        try:
            self.life.groups.agree(built)
            if self.tensor_parallel is not None:  # the TP ranks of this rank's stages hold alike shards
                self.life.groups.agree({**built, **self.tensor_parallel.stage_fields(self._tp_stages)},
                                group=self.tensor_parallel.tp_group, who="tensor-parallel ranks")
            self.replicas = self._build_replicas(pipe, built)
            if self.tensor_parallel is not None and self.checkpoint_group is None:
                # Every TP position's pipeline writes its shards into the same checkpoint.
                self.checkpoint_group = self.life.groups.job_group()
            self._build_communication(pipe)
        except BaseException:
            # Disagreement: every rank raises alike. A transport that could not be built: the
            # peers waiting for this rank time out naming it, as for any absent peer.
            self.life.close()
            raise
        self.global_ranks = self.life.global_ranks
        # After a failure nothing may keep work on the pipeline's groups alive. The callbacks
        # hold no reference to the Pipeline, so the finalizer below can run when it is dropped.
        self.life.attach(self.transport, on_release=[
            self.executor.forget_receives, self.tied_gradients.clear,
            *(runner.reset for runner in pipe.runners.values()),
        ], position=self.executor.position, render=functools.partial(render_positions, self.runs.train.programs,
                                                                      self.runs.eval.programs))
        self._finalizer = weakref.finalize(pipe, self.life.close)  # also runs at interpreter exit

    def _build_replicas(self, pipe: Pipeline, built: dict[str, str]) -> Replicas | None:
        """The data-parallel side: this rank's stages wrapped over their replicas' group."""
        if self.data_parallel is None:
            return None
        fsdp.check_supported(self.schedule, self.data_parallel, pipe.tied_parameters)
        group = self.life.groups.replica_group(self._replica_memberships())
        # Replicas built alike: the same stages, schedule and model in every replica.
        self.life.groups.agree({**built, "data parallel": self.data_parallel}, group=group, who="replicas")
        # With TP the stages' parameters are DTensors on the mesh's "tp" sub-mesh: torch's 2-D
        # composition (FSDP2 on TP-sharded parameters) needs the "dp" sub-mesh of that same mesh.
        dp_mesh = self.layout.mesh["dp"] if self.tensor_parallel is not None else None
        replicas = Replicas(self.data_parallel, group, self.dp_size, pipe.runners, self.device.type, mesh=dp_mesh)
        replicas.wrap()
        # Wrapping swapped the stages' Parameters for FSDP2's: clipping must skip the new copies.
        pipe._tied_copies = tied_copies_outside_their_first_stage(pipe.runners, pipe.tied_parameters)
        # Checkpoints are written by every replica together: DCP writes a replicated tensor
        # once and each shard of a sharded one by its holder.
        self.checkpoint_group = self.life.groups.job_group()
        return replicas

    def _replica_memberships(self) -> list[list[int]]:
        """The global ranks holding the same stages and the same TP shard in every replica: one list
        per (TP position, pipeline position), in the one order every rank builds their groups."""
        layout = self.mesh_layout
        pipelines = layout.group_pipelines  # one per (replica, TP position), replica-major
        tp_size = len(pipelines) // layout.dp_size
        return [[pipelines[replica * tp_size + position][rank] for replica in range(layout.dp_size)]
                for position in range(tp_size) for rank in range(layout.pp_size)]

    def _build_communication(self, pipe: Pipeline) -> None:
        transfer, schedule = self.transfer, self.schedule
        self.tied_gradients = TiedGradients(pipe.runners, pipe.tied_parameters, schedule.placement, self.life,
                                            self.mesh_layout)
        self.runs = executable(schedule)
        self.transport = build_transport(transfer.transport, self.rank, schedule, self.life,
                                         timeout_s=transfer.timeout_s, fixed_shapes=transfer.fixed_shapes,
                                         device=self.device, variable_shapes=transfer.variable_shapes,
                                         in_order_channels=self.runs.in_order_channels(self.rank))
        if transfer.shapes:
            shapes = transfer.shapes
            if self.tensor_parallel is not None:  # what crosses is each TP rank's local part
                shapes = self.tensor_parallel.local_examples(shapes)
            seed_shapes(self.transport, shapes, schedule.num_stages)
        self.last_rank = schedule.placement.rank_of(schedule.num_stages - 1)
        self._broadcast_loss = LossBroadcast(self.life.global_ranks[self.last_rank], schedule.num_ranks,
                                             self.device, self.comm_device)
        self.executor = RankExecutor(self.rank, schedule.placement, pipe.runners, self.transport,
                                     measure_memory=pipe.stage.measure_memory, device=self.device)

    # --- a step ----------------------------------------------------------------------------
    def start(self, train: bool, record: bool) -> None:
        if not train:
            return
        self._recorder = make_recorder(self.device) if record else None
        self._held = self.tied_gradients.set_aside()
        if self.replicas is not None:
            self.replicas.start_step()

    def run(self, train: bool, first: list | None, targets: list | None, keep_outputs: bool) -> None:
        if train:
            replicas = self.replicas
            posts = self.runs.train_posts(self.rank, self.transport.discipline)
            steps = self.executor.run(self.runs.train_program(self.rank), posts, first, targets,
                                      self._recorder,
                                      keep_outputs=keep_outputs, gradients_final=self.runs.gradients_final(self.rank),
                                      on_gradients_final=replicas.stage_done if replicas else None)
        else:
            posts = self.runs.eval_posts(self.rank, self.transport.discipline)
            steps = self.executor.run(self.runs.eval_program(self.rank), posts, first, None, None)
        for _ in steps:
            raise AssertionError("a blocking transport never yields")

    def finish_step(self, runners: dict) -> torch.Tensor:
        """Replicas' reductions, tied copies' sums, and the loss on every rank."""
        if self.replicas is not None:
            self.replicas.finish_step()
        if self.tensor_parallel is not None:
            self.tensor_parallel.settle_gradients(runner.module for runner in runners.values())
        self.tied_gradients.sum(self._held)
        loss = self._broadcast_loss(runners.get(self.schedule.num_stages - 1), self.life.group)
        if self.replicas is not None:
            loss = self.replicas.mean(loss)  # the global minibatch's loss: the replicas' minibatches together
        self.transport.end_step()
        return loss

    def finish_forward(self) -> None:
        self.transport.end_step()

    # --- across ranks ----------------------------------------------------------------------
    def guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        # A rank that fails on its way to a collective takes the pipeline down with its message,
        # and a peer that failed is named.
        return self.life.guarded(fn, *args)

    def gather_objects(self, mine: Any) -> list:
        import torch.distributed as dist

        gathered: list = [None] * self.schedule.num_ranks
        dist.all_gather_object(gathered, mine, group=self.life.group)
        return gathered

    def max_across_ranks(self, flags: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        flags = flags.to(self.comm_device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.life.group)
        if self.replicas is not None:  # a shard, or one replica's loss, may be the only bad one
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.replicas.group)
        return flags

    def norm_exchange(self) -> NormExchange:
        import torch.distributed as dist

        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.12

        def gather_tensor(vector: torch.Tensor) -> torch.Tensor:
            out = vector.new_empty(vector.numel() * self.schedule.num_ranks)
            gather(out, vector, group=self.life.group)
            return out

        return NormExchange(self.gather_objects, gather_tensor, self.device, self.comm_device)

    def memory(self, all_ranks: bool) -> MemoryReport | list[MemoryReport]:
        mine = memory_report(self.executor.memory_meter, "pipeline")  # refuses before any collective
        return self.guarded(self.gather_objects, mine) if all_ranks else mine

    def timeline(self) -> Timeline:
        events = [] if self._recorder is None else self._recorder.events
        mine = [(str(a), start, end) for a, start, end in events]
        reductions = self.replicas.spans() if self.replicas is not None else []
        gathered = self.guarded(self.gather_objects, (mine, reductions))
        return replica_timeline(self.schedule, gathered, self.replicas)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self._finalizer()
