"""The torch.distributed ranks backend: this process runs one rank of the pipeline.

It holds what only ranks in separate processes need: the pipeline's own process groups and
their lifecycle (:mod:`conveyor.runtime.lifecycle.rank`: agreement at construction, failure, close),
the transport between stages, the step's loss broadcast, the gathers behind
``memory(all_ranks=True)``, ``timeline()`` and clipping, and the stage parts that wrap this
rank's stages (data-parallel replicas, tensor parallelism, tied copies, yours:
:mod:`conveyor.parallel.part`), which it calls at each hook in the order
:func:`conveyor.parallel.parts.parts_for` gives them, naming none of them.
:class:`conveyor.Pipeline` does the rest, as for the in-process backend.

Example (every rank, under torchrun)::

    pipe = conveyor.Pipeline(stages, "1f1b", loss_fn, microbatches=8)
    pipe.ranks.transport        # the transport it chose ("auto")
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from conveyor.errors import PipelineConfigError
from conveyor.layout import DistributedLayout
from conveyor.options import StageOptions, TransferOptions, WholeModel
from conveyor.parallel.clipping import NormExchange
from conveyor.parallel.loss import LossBroadcast
from conveyor.parallel.mesh import layout_of, pipeline_ranks
from conveyor.parallel.part import PartSite, StagePart
from conveyor.parallel.parts import parts_for
from conveyor.pipe.backend import RanksBackend
from conveyor.pipe.broadcast import broadcast_tensors
from conveyor.runtime.executor import RankExecutor
from conveyor.runtime.lifecycle.rank import RankLifecycle
from conveyor.runtime.stage.device import group_device, make_current, place_modules, resolve_device
from conveyor.runtime.stage.memory import MemoryReport, memory_report
from conveyor.runtime.stage.runner import StageRunner
from conveyor.runtime.stage.timing import EventRecorder, StepRecorder, make_recorder
from conveyor.runtime.transport.choice import build_transport, seed_shapes
from conveyor.runtime.transport.transport import Transport
from conveyor.schedule.grid import render_positions
from conveyor.schedule.ir import Schedule
from conveyor.schedule.overlap import pairs_of
from conveyor.schedule.passes import Executable, executable
from conveyor.schedule.registry import resolve_schedule
from conveyor.schedule.timeline import Timeline, measured_timeline


class DistributedRanks(RanksBackend):
    """This process's rank of a pipeline over ``layout``'s group (or mesh), moving bytes as ``transfer`` says."""

    in_process = False
    _recorder: StepRecorder | EventRecorder | None = None  # the last step's, when recorded
    # Built by connect(): the pipeline's groups, its programs, the transport and the executor.
    life: RankLifecycle
    runs: Executable
    transport: Transport
    executor: RankExecutor

    def __init__(self, layout: DistributedLayout, transfer: TransferOptions) -> None:
        self.group, self.size, self.rank = pipeline_ranks(  # the group: never used itself
            layout, "pass layout=conveyor.InProcessLayout() to run every rank in one process")
        self.layout, self.transfer = layout, transfer
        self.mesh_layout = None if layout.mesh is None else layout_of(layout.mesh)
        self.local_ranks = [self.rank]
        self.dp_rank = self.mesh_layout.dp_rank if self.mesh_layout is not None else 0
        self.dp_size = self.mesh_layout.dp_size if self.mesh_layout is not None else 1
        self.parts: list[StagePart] = parts_for(layout, self.mesh_layout)

    def resolve(self, schedule: Schedule | str, microbatches: int | None, virtual: int | None,
                modules: Sequence[torch.nn.Module] | torch.nn.Module) -> Schedule:
        """The schedule, for as many ranks as the group has."""
        resolved = resolve_schedule(schedule, microbatches, virtual, self.size)
        if resolved.num_ranks != self.size:
            raise PipelineConfigError(
                f"schedule {resolved.name!r} has {resolved.num_ranks} ranks but the process group "
                f"has {self.size}; build the schedule with ranks={self.size}, launch {resolved.num_ranks} "
                f"processes, or give each pipeline its own ranks with DistributedLayout(group=...) (several "
                f"pipelines in one job)"
            )
        for part in self.parts:
            resolved = part.program(resolved)
        self.schedule = resolved
        return resolved

    def place(self, modules: Sequence[torch.nn.Module] | torch.nn.Module,
              model: WholeModel) -> dict[int, list[torch.nn.Module]]:
        """This rank's device (its modules moved there, a GPU made current), and its modules, wrapped by
        the parts (tensor parallelism: parallelized over the mesh's "tp" dim)."""
        stages = self.schedule.stages_of(self.rank)
        listed = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
        # A meta-device model's traced stages under tensor parallelism are materialized shard by
        # shard when parallelized (conveyor.parallel.tensor.shards), on this device.
        placed = [(m, s) for m, s in zip(listed, stages) if getattr(m, "_conveyor_shard_source", None) is None]
        self.device = make_current(place_modules([m for m, _ in placed], [s for _, s in placed],
                                                 resolve_device(self.layout.device)))
        self.comm_device = group_device(self.device, self.group)  # NCCL: the stage's GPU; gloo: the CPU
        if self.parts:
            by_stage = dict(zip(stages, listed))  # a wrong count is refused when runners are built
            for part in self.parts:
                part.wrap_stages(by_stage, self.schedule, model)
        return {self.rank: listed}

    def connect(self, runners: dict[int, StageRunner], stage: StageOptions, model: WholeModel,
                built: dict[str, str], owner: object) -> None:
        """Own groups, agreement with every rank on ``built``, the parts, transport, executor."""
        for runner in runners.values():
            contexts = [c for c in (part.runner_context(runner.stage) for part in self.parts) if c is not None]
            assert len(contexts) < 2, "one part at most gives a stage's passes their context"
            if contexts:
                runner.context = contexts[0]
        # Every check that needs no peer is done: from here on this rank holds process groups.
        self.life = RankLifecycle(self.group, self.transfer.timeout_s,
                                  getattr(self.mesh_layout, "group_pipelines", None), device=self.comm_device)
        try:
            self.life.groups.agree(built)
            site = PartSite(self.schedule, self.rank, runners, self.life, self.layout, self.mesh_layout,
                            self.device, model, built)
            for part in self.parts:
                part.agree(site)
            for part in self.parts:
                part.wrap()
            if any(part.wants_checkpoint_group for part in self.parts):
                # Checkpoints are written by every rank of the job together (replicas, TP positions); else None.
                self.checkpoint_group = self.life.groups.job_group()
            self._build_communication(runners, stage)
        except BaseException:
            # Disagreement: every rank raises alike. A transport that could not be built: the
            # peers waiting for this rank time out naming it, as for any absent peer.
            self.life.close()
            raise
        # After a failure nothing may keep work on the pipeline's groups alive. The callbacks
        # hold no reference to the owner (the Pipeline), so the finalizer below can run when it is dropped.
        self.life.attach(self.transport, on_release=[
            self.executor.forget_receives, *(part.release for part in self.parts),
            *(runner.reset for runner in runners.values()),
        ], position=self.executor.position, render=functools.partial(render_positions, self.runs.train.programs,
                                                                      self.runs.eval.programs))
        self._finalizer = weakref.finalize(owner, self.life.close)  # also runs at interpreter exit

    def _build_communication(self, runners: dict[int, StageRunner], stage: StageOptions) -> None:
        transfer, schedule = self.transfer, self.schedule
        self.runs = executable(schedule)
        self.transport = build_transport(transfer.transport, self.rank, schedule, self.life,
                                         timeout_s=transfer.timeout_s, fixed_shapes=transfer.fixed_shapes,
                                         device=self.device, variable_shapes=transfer.variable_shapes,
                                         in_order_channels=self.runs.in_order_channels(self.rank))
        if transfer.shapes:
            shapes = transfer.shapes
            for part in self.parts:
                shapes = part.boundary_examples(shapes)
            seed_shapes(self.transport, shapes, schedule.num_stages)
        self.last_rank = schedule.placement.rank_of(schedule.num_stages - 1)
        self._broadcast_loss = LossBroadcast(self.life.global_ranks[self.last_rank], schedule.num_ranks,
                                             self.device, self.comm_device)
        self.executor = RankExecutor(self.rank, schedule.placement, runners, self.transport,
                                     measure_memory=stage.measure_memory, device=self.device)
        self.pairs = pairs_of(self.runs.train, self.rank)  # the forwards run with a backward (a part's program)

    # --- a step ----------------------------------------------------------------------------
    def start(self, train: bool, record: bool) -> None:
        if not train:
            return
        self._recorder = make_recorder(self.device) if record else None
        for part in self.parts:
            part.start_step()

    def run(self, train: bool, first: list | None, targets: list | None, keep_outputs: bool) -> None:
        if train:
            posts = self.runs.train_posts(self.rank, self.transport.discipline)
            steps = self.executor.run(self.runs.train_program(self.rank), posts, first, targets, self._recorder,
                                      keep_outputs=keep_outputs, gradients_final=self.runs.gradients_final(self.rank),
                                      on_gradients_final=self._stage_done, pairs=self.pairs)
        else:
            posts = self.runs.eval_posts(self.rank, self.transport.discipline)
            steps = self.executor.run(self.runs.eval_program(self.rank), posts, first, None, None)
        for _ in steps:
            raise AssertionError("a blocking transport never yields")

    def _stage_done(self, stage: int) -> None:
        for part in self.parts:
            part.stage_done(stage)

    def finish_step(self, runners: dict[int, StageRunner]) -> torch.Tensor:
        """The parts' end of step (in order: replicas' reductions, TP gradients settled, tied copies'
        sums), the loss broadcast to every rank, then each part's view of it (the replicas' mean)."""
        for part in self.parts:
            part.finish_step()
        loss = self._broadcast_loss(runners.get(self.schedule.num_stages - 1), self.life.group)
        for part in self.parts:
            loss = part.step_loss(loss)
        self.transport.end_step()
        return loss

    def finish_forward(self) -> None:
        self.transport.end_step()

    # --- across ranks ----------------------------------------------------------------------
    def guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        # A rank that fails on its way to a collective takes the pipeline down with its message,
        # and a peer that failed is named.
        return self.life.guarded(fn, *args)

    def _gather_objects(self, mine: Any) -> list:
        import torch.distributed as dist

        gathered: list = [None] * self.schedule.num_ranks
        dist.all_gather_object(gathered, mine, group=self.life.group)
        return gathered

    def combine_flags(self, flags: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        flags = flags.to(self.comm_device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.life.group)
        for part in self.parts:
            flags = part.flags(flags)
        return flags

    def norm_exchange(self) -> NormExchange:
        import torch.distributed as dist

        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.12

        def gather_tensor(vector: torch.Tensor) -> torch.Tensor:
            out = vector.new_empty(vector.numel() * self.schedule.num_ranks)
            gather(out, vector, group=self.life.group)
            return out

        return NormExchange(self._gather_objects, gather_tensor, self.device, self.comm_device)

    def memory(self, all_ranks: bool) -> MemoryReport | list[MemoryReport]:
        mine = memory_report(self.executor.memory_meter, "pipeline")  # refuses before any collective
        return self.guarded(self._gather_objects, mine) if all_ranks else mine

    def timeline(self) -> Timeline:
        """Every rank's actions of the last step; each part's spans (the replicas' reductions) in its
        metadata, on the timeline's clock."""
        events = [] if self._recorder is None else self._recorder.events
        mine = [(str(a), start, end) for a, start, end in events]
        exchanged = [part.exchanges() for part in self.parts]
        exchanges = ([span for spans, _ in exchanged for span in spans], sum(waited for _, waited in exchanged))
        gathered = self.guarded(self._gather_objects, (mine, [part.spans() for part in self.parts], exchanges))
        comm = [(rank, label, start, end) for rank, (_, _, (spans, _)) in enumerate(gathered)
                for label, start, end in spans]
        timeline = measured_timeline(self.schedule, [events for events, _, _ in gathered], comm_events=comm,
                                     exposed_comm=[waited for _, _, (_, waited) in gathered] if comm else None)
        origin = min((start for events, _, _ in gathered for _, start, _ in events), default=0.0)
        for index, part in enumerate(self.parts):
            by_rank = [[(what, start - origin, end - origin) for what, start, end in spans[index]]
                       for _, spans, _ in gathered]
            entry = part.describe_spans(by_rank)
            if entry is not None:
                timeline.metadata[entry[0]] = entry[1]
        return timeline

    def from_last_stage(self, tensors: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """Broadcast from the last stage's rank over the pipeline's group (see :func:`broadcast_tensors`)."""
        return broadcast_tensors(tensors, self.life.global_ranks[self.last_rank], self.life.group,
                                 self.device, self.comm_device)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self._finalizer()
