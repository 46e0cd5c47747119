"""Pipeline: run a verified schedule over real stages as if on one device.

The same script runs on every rank::

    sched = conveyor.schedule.build("1f1b", ranks=4, microbatches=8)
    pipe = conveyor.Pipeline([build_stage(s) for s in sched.stages_of(rank)],
                             schedule=sched, loss_fn=loss_fn)
    loss = pipe.step(x, target=y)          # the whole minibatch; loss on every rank
    optimizer = torch.optim.AdamW(pipe.parameters()); optimizer.step()

Results are bitwise identical to one device running, for each microbatch i
in order, ``(loss_fn(model(x_i), y_i) / M).backward()``. Every rank in one process:
:class:`conveyor.local.LocalPipeline`; several replicas on a ("dp", "pp") mesh:
``mesh=`` and :mod:`conveyor.parallel`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Self

import torch

from conveyor.errors import PipelineConfigError
from conveyor.microbatch import merge_outputs, split_microbatches, split_value
from conveyor.parallel import fsdp
from conveyor.parallel.clipping import NormExchange, check_nonfinite_mode
from conveyor.parallel.loss import LossBroadcast, set_loss_divisor
from conveyor.parallel.mesh import layout_of
from conveyor.parallel.replicas import Replicas, check_data_parallel
from conveyor.parallel.tied import (
    TiedGradients,
    share_tied_locally,
    tied_copies_outside_their_first_stage,
)
from conveyor.pipe_grads import GradientChecks
from conveyor.runtime.compile import CompileSpec, describe_compile
from conveyor.runtime.device import (
    group_device,
    make_current,
    place_modules,
    resolve_device,
    to_device,
)
from conveyor.runtime.executor import RankExecutor
from conveyor.runtime.lifecycle import RankLifecycle
from conveyor.runtime.main_grad import describe_params, param_precision
from conveyor.runtime.memory import MemoryReport, memory_report
from conveyor.runtime.precision import autocast_dtype
from conveyor.runtime.rng import step_random_streams
from conveyor.runtime.runner import LossFn, StageRunner, build_runners, named_unique
from conveyor.runtime.timing import EventRecorder, StepRecorder, make_recorder, replica_timeline
from conveyor.runtime.transports import (
    build_transport,
    check_transport_name,
    seed_shapes,
    wire_channels,
)
from conveyor.schedule.grid import render_positions
from conveyor.schedule.ir import Schedule
from conveyor.schedule.passes import executable
from conveyor.schedule.registry import resolve_schedule
from conveyor.schedule.timeline import Timeline

log = logging.getLogger(__name__)


class _PipelineBase(GradientChecks):
    """What the distributed and the in-process pipelines share: stages, programs, checks."""

    schedule: Schedule
    runners: dict[int, StageRunner]
    _tied_copies: set[int]
    _parameter_order: dict[str, int] | None
    random_streams: bool = True
    replicas: Replicas | None = None  # data parallelism over a mesh's "dp" dim
    checkpoint_group = None  # with replicas: a group over every rank of every replica
    tied_parameters: tuple = ()  # as given: checkpoints save a tied tensor once, under its first name
    model_info: dict | None = None  # the unsplit model's class, names, config (set by pipeline())

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The parameters of this process's stages (shared ones once)."""
        for _, p in self.named_parameters():
            yield p

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This process's parameters (shared ones once), under the names their modules give them."""
        yield from named_unique(self.runners, lambda m: m.named_parameters())

    def state_dict(self) -> dict[str, Any]:
        """This process's parameters and buffers under their modules' names."""
        state = {}
        for runner in self.runners.values():
            state.update(runner.module.state_dict())
        return state

    def load_pretrained(self, path: str) -> Any:
        """Fill this process's stages from a Hugging Face safetensors directory (see
        :mod:`conveyor.frontend.pretrained`): each rank reads only the files and tensors of its
        own stages. Returns what was read (files, tensors, bytes); kept as ``pretrained_report``.

        Example:
            >>> pipe.load_pretrained("gpt2-dir").bytes_read     # doctest: +SKIP
        """
        from conveyor.frontend.pretrained import load_pretrained

        self.pretrained_report = load_pretrained(path, [r.module for r in self.runners.values()],
                                                 [t.names for t in self.tied_parameters if hasattr(t, "names")])
        return self.pretrained_report

    def train(self, mode: bool = True) -> Self:
        for runner in self.runners.values():
            runner.module.train(mode)
        return self

    def eval(self) -> Self:
        return self.train(False)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()  # type: ignore[attr-defined]  # each pipeline knows what it holds

    def _tie(self, tied_parameters, parameter_order: Mapping[str, int] | None) -> None:
        """Share tied copies within this process and remember what clipping needs to know of the model."""
        self.tied_parameters = tuple(tied_parameters)
        share_tied_locally(self.runners, tied_parameters)
        self._tied_copies = tied_copies_outside_their_first_stage(self.runners, tied_parameters)
        self._parameter_order = dict(parameter_order) if parameter_order is not None else None

    def _split_inputs(self, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
        if all(a is None for a in args) and not kwargs:
            raise PipelineConfigError(
                "inputs are missing on the rank that runs stage 0: pass the minibatch to pipe.step(...) there"
            )
        if self.device.type != "cpu":  # the minibatch may come from a CPU data loader
            args, kwargs = to_device((args, kwargs), self.device)
        return split_microbatches(args, kwargs, self.schedule.num_microbatches)

    def _split_target(self, target: Any) -> list[Any]:
        if target is None:
            return [None] * self.schedule.num_microbatches
        if self.device.type != "cpu":
            target = to_device(target, self.device)
        return split_value(target, self.schedule.num_microbatches, "target")


class Pipeline(_PipelineBase):
    """This rank's part of a pipeline, over torch.distributed.

    ``modules`` are the stages this rank runs, in ``schedule.stages_of(rank)``
    order. ``schedule`` is a :class:`~conveyor.schedule.Schedule` or a name
    (then give ``microbatches=`` and, for some schedules, ``virtual=``).
    ``group`` defaults to the default process group; its size must equal the
    schedule's ranks. ``timeout_s`` bounds every blocking receive.
    ``tied_parameters`` (records with ``uses``: ``(stage, name)`` pairs, as
    ``conveyor.frontend`` finds them) are parameters several stages hold a
    copy of: copies on one rank become one Parameter; copies on several ranks
    have their gradients summed across those ranks at the end of every step,
    so they stay identical after each optimizer step (the summation order
    differs from one device: equal to rounding, not bitwise).
    ``fixed_shapes=True`` promises that what crosses each stage boundary keeps
    the shapes, dtypes and structure of the first step: later steps then send
    data only (no metadata), and a stage output that breaks the promise is an
    error naming rank, stage, microbatch and tensor. Each tensor then also keeps
    the memory layout (strides) it had in the first step: a later one laid out
    otherwise is copied into that layout (same values). By default shapes may
    change between microbatches and steps (variable sequence length), and each
    tensor arrives in its own dense layout (a transpose stays a transpose), as on
    one device.
    ``shapes`` ({stage: an example of that stage's output for ONE microbatch,
    tensors that carry a gradient marked ``requires_grad=True``}, the same on
    every rank) skips even the first step's exchange: with ``fixed_shapes=True``
    only data ever travels, and the first output that differs is an error.
    ``transport``: ``"shared_memory"`` (rings in shared memory: every rank on this host, CPU
    tensors, x86-64 Linux; a hop costs microseconds, a gloo message 0.1-0.3 ms),
    ``"process_group"`` (the group's point-to-point calls: gloo, NCCL), ``"hybrid"`` (shared
    memory to the peers on this host, the process group to the others) or ``"auto"``
    (default): with gloo, shared memory where every pair of ranks that talk shares a host
    (``LOCAL_WORLD_SIZE == WORLD_SIZE``, else the ranks compare hosts through the store within
    ``timeout_s``); with NCCL, ``"ordered"`` (:mod:`conveyor.runtime.ordered`; gloo runs it too).
    ``parameter_order`` ({name: index in the unsplit model's ``parameters()``}, which
    :func:`pipeline` passes) tells :meth:`clip_grad_norm_` the model's order.
    ``random_streams`` (default True): random ops (dropout) draw, in the forward of each
    stage and microbatch, from generators seeded for that (stage, microbatch) from one draw
    of the global CPU generator per step, not from each rank's global stream, whose numbers
    repeat on every rank seeded alike (see :mod:`conveyor.runtime.rng`). False leaves the
    generators to the user.
    ``model_signature`` (what :func:`pipeline` passes: :func:`model_signature` of the unsplit
    model and its cut) is compared across ranks when the pipeline is built, with the schedule
    (name, P, V, M and every rank's actions), the tied parameters and the options: ranks
    built differently raise :class:`PipelineConfigError` saying what differs, before any step.
    ``autocast`` (``"bf16"`` or ``torch.bfloat16``; fp16 is refused: it needs loss scaling, which
    cannot reach a backward run inside ``step()``): each stage's forward and loss run under the
    ``torch.autocast`` region of a single-device run, bitwise equal to it; activations cross in
    their op's dtype (:mod:`conveyor.runtime.precision`). ``measure_memory=True`` counts the bytes
    autograd saves for backward, read by :meth:`memory` (a few percent of a small step: off by
    default). ``compile`` (True, or ``torch.compile`` keywords): each stage's forward compiled
    (:mod:`conveyor.runtime.compile`: shapes, autocast, checkpointing, the I/W split).
    ``param_dtype="bf16"`` casts the stages to bf16; their gradients then accumulate over the
    microbatches in an fp32 ``param.main_grad`` (``grad_accum_dtype``), for :class:`conveyor.MasterWeights`
    (:mod:`conveyor.runtime.main_grad`: bitwise equal to one device doing the same).
    ``device`` (default: this process's GPU when CUDA is available, ``cuda:<LOCAL_RANK>`` among
    the GPUs it sees, else the CPU; ``"cuda"`` means the same GPU): where this rank's stages, what
    they receive, the loss, norms and every buffer live; CPU modules are moved there and a GPU is
    made the current CUDA device, whatever the backend (:mod:`conveyor.runtime.device`); messages
    travel on the backend's device.

    The pipeline communicates on process groups of its own, built over ``group``'s ranks
    (see :mod:`conveyor.runtime.lifecycle`); ``group`` itself is never used or closed.
    A failure on any rank stops the pipeline on every rank: the failing rank publishes
    its message, closes the pipeline's own groups (so that no peer waits on its
    connections), and raises; peers raise :class:`PeerFailure` with that message. The
    stopped pipeline then raises :class:`PipelineStopped`; your process groups stay usable.

    ``close()`` (or leaving ``with conveyor.Pipeline(...) as pipe:``) releases its rings,
    sockets, pending work and process groups on this rank; it also happens when the
    pipeline is garbage collected and at interpreter exit. Call it on every rank after the
    last step; a closed pipeline raises :class:`PipelineClosed`.
    """

    _recorder: StepRecorder | EventRecorder | None = None  # the last step's, when recorded
    _warned_target = False  # told once that target= is read on the last stage's rank only

    def __init__(
        self,
        modules: Sequence[torch.nn.Module] | torch.nn.Module,
        schedule: Schedule | str,
        loss_fn: LossFn | None = None,
        *,
        microbatches: int | None = None,
        virtual: int | None = None,
        group=None,
        timeout_s: float = 300.0,
        checkpoint_activations: bool = False,
        record_timeline: bool = True,
        fixed_shapes: bool = False,
        shapes: Mapping[int, Any] | None = None,
        tied_parameters: Sequence = (),
        transport: str = "auto",
        parameter_order: Mapping[str, int] | None = None,
        random_streams: bool = True,
        model_signature: str | None = None,
        mesh=None, data_parallel: str | None = None,
        autocast: str | torch.dtype | None = None,
        param_dtype: str | torch.dtype | None = None, grad_accum_dtype: str | torch.dtype | None = None,
        measure_memory: bool = False,
        compile: CompileSpec = False,
        device: torch.device | str | None = None,
    ) -> None:
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise PipelineConfigError(
                "torch.distributed is not initialised: launch with torchrun and call "
                "torch.distributed.init_process_group() first, or use conveyor.LocalPipeline to run "
                "every rank in one process"
            )
        self.layout = None if mesh is None else layout_of(mesh)
        if self.layout is not None:
            if group is not None:
                raise PipelineConfigError("give the pipeline mesh= or group=, not both (mesh['pp'] is its group)")
            group = self.layout.pp_group
        data_parallel = check_data_parallel(data_parallel, self.layout.dp_size if self.layout else 1)
        self.group = group  # the user's: the pipeline communicates on groups of its own
        world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.schedule = resolve_schedule(schedule, microbatches, virtual, world)
        if self.schedule.num_ranks != world:
            raise PipelineConfigError(
                f"schedule {self.schedule.name!r} has {self.schedule.num_ranks} ranks but the process group "
                f"has {world}; build the schedule with ranks={world}, launch {self.schedule.num_ranks} processes, "
                f"or give each pipeline its own ranks with group= (several pipelines in one job)"
            )
        check_transport_name(transport)
        self.stages = self.schedule.stages_of(self.rank)
        self.device = make_current(place_modules(modules, self.stages, resolve_device(device)))  # any backend
        self._comm_device = group_device(self.device, group)  # NCCL: the stage's GPU; gloo: the CPU
        self.runners = build_runners(self.schedule, self.rank, modules, loss_fn, checkpoint_activations, autocast,
                                     compile, param_precision(param_dtype, grad_accum_dtype, data_parallel))
        self.measure_memory, self.random_streams = measure_memory, random_streams
        self._tie(tied_parameters, parameter_order)
        # Every check that needs no peer is above: from here on this rank holds process groups.
        self._life = RankLifecycle(group, timeout_s, getattr(self.layout, "pipelines", None), device=self._comm_device)
        try:
            built = self._what_was_built(transport, fixed_shapes, shapes, tied_parameters, model_signature, autocast)
            self._life.agree(built)
            self.replicas = self._build_replicas(data_parallel, built)
            self._build_communication(transport, timeout_s, fixed_shapes, shapes, tied_parameters)
        except BaseException:
            # Disagreement: every rank raises alike. A transport that could not be built: the
            # peers waiting for this rank time out naming it, as for any absent peer.
            self._life.close()
            raise
        self.record_timeline = record_timeline
        self._last_rank = self.schedule.placement.rank_of(self.schedule.num_stages - 1)
        self._global_ranks = self._life.global_ranks
        # After a failure nothing may keep work on the pipeline's groups alive. The callbacks
        # hold no reference to this Pipeline, so the finalizer below can run when it is dropped.
        self._life.attach(self.transport, on_release=[
            self.executor.forget_receives, self._tied_gradients.clear,
            *(runner.reset for runner in self.runners.values()),
        ], position=self.executor.position, render=functools.partial(render_positions, self.runs.train.programs,
                                                                      self.runs.eval.programs))
        self._finalizer = weakref.finalize(self, self._life.close)  # also runs at interpreter exit

    def _what_was_built(self, transport: str, fixed_shapes: bool, shapes, tied_parameters,
                        model_signature: str | None, autocast) -> dict[str, str]:
        """What every rank must agree on, as short strings (see RankLifecycle.agree)."""
        sched = self.schedule
        programs = hashlib.sha1(repr(sched.programs).encode()).hexdigest()[:12]
        return {
            "schedule": f"{sched.name} P={sched.num_ranks} V={sched.virtual} M={sched.num_microbatches} "
                        f"programs {programs}",
            "model": model_signature or "stages built by hand",
            "tied parameters": repr([tuple(t.uses) for t in tied_parameters]),
            "options": f"transport={transport!r} fixed_shapes={fixed_shapes} "
                       f"shapes given for stages {sorted(shapes) if shapes else []} "
                       f"autocast={autocast_dtype(autocast)} measure_memory={self.measure_memory} "
                       f"compile={describe_compile(self.runners[self.stages[0]].compile)} "
                       f"parameters={describe_params(self.runners[self.stages[0]].param_precision)}",
        }

    def _build_replicas(self, data_parallel: str | None, built: dict[str, str]) -> Replicas | None:
        """The data-parallel side: this rank's stages wrapped over their replicas' group."""
        if data_parallel is None:
            return None
        fsdp.check_supported(self.schedule, data_parallel, self.tied_parameters)
        group = self._life.replica_group()
        # Replicas built alike: the same stages, schedule and model in every replica.
        self._life.agree({**built, "data parallel": data_parallel}, group=group, who="replicas")
        replicas = Replicas(data_parallel, group, self.layout.dp_size, self.runners, self.device.type)
        replicas.wrap()
        # Checkpoints are written by every replica together: DCP writes a replicated tensor
        # once and each shard of a sharded one by its holder.
        self.checkpoint_group = self._life.job_group()
        return replicas

    def _build_communication(self, transport: str, timeout_s: float, fixed_shapes: bool, shapes,
                             tied_parameters) -> None:
        self._tied_gradients = TiedGradients(self.runners, tied_parameters, self.schedule.placement, self._life,
                                             self.layout)
        self.runs = executable(self.schedule)
        self.transport = build_transport(transport, self.rank, self.schedule, self._life, timeout_s=timeout_s,
                                         fixed_shapes=fixed_shapes, device=self.device,
                                         in_order_channels=wire_channels(self.runs.train_in_order,
                                                                         self.runs.eval_in_order))
        if shapes:
            seed_shapes(self.transport, shapes, self.schedule.num_stages)
        last_rank = self._life.global_ranks[self.schedule.placement.rank_of(self.schedule.num_stages - 1)]
        self._broadcast_loss = LossBroadcast(last_rank, self.schedule.num_ranks, self.device, self._comm_device)
        self.executor = RankExecutor(self.rank, self.schedule.placement, self.runners, self.transport,
                                     measure_memory=self.measure_memory, device=self.device)

    # --- user API -----------------------------------------------------------------------
    def step(self, *args: Any, target: Any = None, return_outputs: bool = False,
             on_nonfinite: str | None = None, normalize_by: float | torch.Tensor | None = None, **kwargs: Any):
        """One training step on the whole minibatch; returns the minibatch loss on every rank.

        Gradients accumulate in the parameters' ``.grad``; call your optimizer after.
        With ``return_outputs=True`` returns ``(loss, outputs)``; outputs are the
        merged last-stage outputs on the rank that runs the last stage, None elsewhere.
        ``on_nonfinite`` (the same on every rank): ``"raise"`` raises :class:`NonFiniteError`
        naming the first microbatch whose loss and the stages whose gradients are not finite
        (the pipeline stays usable); ``"skip"`` drops this step's gradients instead (set
        them to None, so ``optimizer.step()`` leaves parameters and optimizer state as they
        were), logs a warning and counts it in ``skipped_steps``. None (default): no check.
        ``normalize_by`` (read where the last stage runs): None divides each microbatch's loss
        by M; N, the global minibatch's token count (:func:`conveyor.parallel.count_tokens`),
        divides ``loss_fn``'s per-microbatch SUM by N, per token (:mod:`conveyor.parallel.loss`).

        Example:
            >>> loss = pipe.step(x, target=y, on_nonfinite="skip")   # doctest: +SKIP
        """
        check_nonfinite_mode(on_nonfinite)
        result, report = self._life.guarded(self._step, args, kwargs, target, return_outputs, on_nonfinite,
                                            normalize_by)
        if report:
            self._after_nonfinite(report, on_nonfinite)
        return result

    def forward(self, *args: Any, **kwargs: Any):
        """Forward only (evaluation, no autograd state): the merged model outputs on the
        rank that runs the last stage, None on the others."""
        return self._life.guarded(self._forward, args, kwargs)

    __call__ = forward

    def memory(self, all_ranks: bool = False) -> MemoryReport | list[MemoryReport]:
        """Peak bytes of activations autograd held in the last step, and one stage-microbatch's bytes
        (``measure_memory=True``): this rank's :class:`~conveyor.runtime.memory.MemoryReport`, or with
        ``all_ranks=True`` every rank's, by rank (a collective: call it on every rank).

        Example:
            >>> [report.peak_bytes for report in pipe.memory(all_ranks=True)]   # doctest: +SKIP
        """
        mine = memory_report(self.executor.memory_meter, "Pipeline")  # refuses before any collective
        if not all_ranks:
            return mine
        return self._collective(lambda: self._gather_objects(mine))

    def timeline(self) -> Timeline:
        """The measured Timeline of the last step (a collective: call it on every rank)."""
        events = [] if self._recorder is None else self._recorder.events
        mine = [(str(a), start, end) for a, start, end in events]
        reductions = self.replicas.spans() if self.replicas is not None else []
        gathered = self._collective(self._gather_objects, (mine, reductions))
        return replica_timeline(self.schedule, gathered, self.replicas)

    def close(self) -> None:
        """Release this rank's rings, sockets, pending work and process groups (idempotent).

        Call it on every rank after the last step, or build the pipeline in a ``with``
        block. It never communicates. Later calls raise :class:`PipelineClosed`.

        Example:
            >>> with conveyor.Pipeline(stages, schedule=sched, loss_fn=loss_fn) as pipe:  # doctest: +SKIP
            ...     loss = pipe.step(x, target=y)
        """
        self._finalizer()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (a pipeline stopped by a failure is not closed until then)."""
        return not self._finalizer.alive

    def _gather_objects(self, mine: Any) -> list:
        import torch.distributed as dist

        gathered: list = [None] * self.schedule.num_ranks
        dist.all_gather_object(gathered, mine, group=self._life.group)
        return gathered

    def _make_norm_exchange(self) -> NormExchange:
        import torch.distributed as dist

        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.12

        def gather_tensor(vector: torch.Tensor) -> torch.Tensor:
            out = vector.new_empty(vector.numel() * self.schedule.num_ranks)
            gather(out, vector, group=self._life.group)
            return out

        return NormExchange(self._gather_objects, gather_tensor, self.device, self._comm_device)

    def _collective(self, fn, *args):
        # Guarded like a step: a rank that fails on its way to the exchange takes the
        # pipeline down with its message, and a peer that failed is named.
        return self._life.guarded(fn, *args)

    @property
    def needs_inputs(self) -> bool:
        """Whether this rank runs stage 0: the one that reads the minibatch's inputs."""
        return 0 in self.runners

    @property
    def needs_target(self) -> bool:
        """Whether this rank runs the last stage: the one that reads the targets."""
        return self.schedule.num_stages - 1 in self.runners

    @property
    def dp_rank(self) -> int:
        """This rank's replica (0 without data parallelism)."""
        return self.layout.dp_rank if self.layout is not None else 0

    @property
    def dp_size(self) -> int:
        """How many replicas of the pipeline train together (1 without data parallelism)."""
        return self.layout.dp_size if self.layout is not None else 1

    @property
    def modules(self) -> list[torch.nn.Module]:
        return [r.module for r in self.runners.values()]

    # --- internals -----------------------------------------------------------------------
    def _inputs_for_step(self, args, kwargs, target):
        first = self._split_inputs(args, kwargs) if 0 in self.runners else None
        runs_last = (self.schedule.num_stages - 1) in self.runners
        if target is not None and not runs_last and not self._warned_target:
            self._warned_target = True
            log.warning("conveyor: rank %d was given target=, but the last stage runs on rank %d: "
                        "ignored here (pass target= there; None elsewhere)", self.rank, self._last_rank)
        targets = self._split_target(target) if runs_last else None
        return first, targets

    def _step(self, args, kwargs, target, return_outputs, on_nonfinite, normalize_by):
        first, targets = self._inputs_for_step(args, kwargs, target)
        set_loss_divisor(self.runners, self.schedule.num_stages, normalize_by, self.dp_size)
        self._recorder = make_recorder(self.device) if self.record_timeline else None
        for runner in self.runners.values():
            runner.reset()
        held = self._tied_gradients.set_aside()
        replicas = self.replicas
        if replicas is not None:
            replicas.start_step()
        with torch.enable_grad(), step_random_streams(self.runners.values(), self.random_streams):
            for _ in self.executor.run(self.runs.train_program(self.rank), first, targets, self._recorder,
                                       keep_outputs=return_outputs,
                                       gradients_final=self.runs.gradients_final(self.rank),
                                       on_gradients_final=replicas.stage_done if replicas else None):
                raise AssertionError("a blocking transport never yields")
        if replicas is not None:
            replicas.finish_step()
        self._tied_gradients.sum(held)
        loss = self._broadcast_loss(self.runners.get(self.schedule.num_stages - 1), self._life.group)
        if replicas is not None:
            loss = replicas.mean(loss)  # the global minibatch's loss: the replicas' minibatches together
        self.transport.end_step()
        report = self._nonfinite_report() if on_nonfinite else ""
        if return_outputs:
            last = self.runners.get(self.schedule.num_stages - 1)
            outputs = merge_outputs([last.outputs[m] for m in range(self.schedule.num_microbatches)]) if last else None
            return (loss, outputs), report
        return loss, report

    def _max_across_ranks(self, flags: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        flags = flags.to(self._comm_device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._life.group)
        if self.replicas is not None:  # a shard, or one replica's loss, may be the only bad one
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.replicas.group)
        return flags

    def _forward(self, args, kwargs):
        first = self._split_inputs(args, kwargs) if 0 in self.runners else None
        for runner in self.runners.values():
            runner.reset()
        with torch.no_grad(), step_random_streams(self.runners.values(), self.random_streams):
            for _ in self.executor.run(self.runs.eval_program(self.rank), first, None, None):
                raise AssertionError("a blocking transport never yields")
        self.transport.end_step()
        last = self.runners.get(self.schedule.num_stages - 1)
        if last is None:
            return None
        outputs = merge_outputs([last.outputs[m] for m in range(self.schedule.num_microbatches)])
        last.outputs.clear()
        return outputs

