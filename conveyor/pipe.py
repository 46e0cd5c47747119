"""Pipeline: run a verified schedule over real stages as if on one device.

The same script runs on every rank::

    sched = conveyor.schedule.build("1f1b", ranks=4, microbatches=8)
    pipe = conveyor.Pipeline([build_stage(s) for s in sched.stages_of(rank)],
                             schedule=sched, loss_fn=loss_fn)
    loss = pipe.step(x, target=y)          # the whole minibatch; loss on every rank
    optimizer = torch.optim.AdamW(pipe.parameters()); optimizer.step()

Results are bitwise identical to one device running, for each microbatch i
in order, ``(loss_fn(model(x_i), y_i) / M).backward()``.

Example (every rank in one process):
    >>> import torch, conveyor
    >>> stages = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)]
    >>> pipe = conveyor.LocalPipeline(stages, schedule="1f1b", microbatches=2,
    ...                               loss_fn=lambda y, t: (y - t).pow(2).mean())
    >>> loss = pipe.step(torch.ones(4, 4), target=torch.zeros(4, 1))
    >>> loss.shape
    torch.Size([])
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Self

import torch
from torch.utils import _pytree as pytree

from conveyor.errors import NonFiniteError, PipelineClosed, PipelineConfigError
from conveyor.microbatch import merge_outputs, split_microbatches, split_value
from conveyor.parallel import fsdp
from conveyor.parallel.mesh import layout_of
from conveyor.parallel.replicas import Replicas, check_data_parallel
from conveyor.runtime.clip import (
    EncodedNorms,
    check_finite,
    encode_norms,
    parameter_norms,
    scale_local_grads,
    total_norm,
)
from conveyor.runtime.executor import RankExecutor, StepRecorder, run_local
from conveyor.runtime.lifecycle import RankLifecycle
from conveyor.runtime.rng import StepRandomness
from conveyor.runtime.runner import LossFn, StageRunner
from conveyor.runtime.transport import LocalMailbox, LocalTransport, Transport
from conveyor.runtime.transports import build_transport, check_transport_name, wire_channels
from conveyor.runtime.wire import BACKWARD, EVAL_FORWARD, FORWARD, flatten_payload
from conveyor.schedule import available
from conveyor.schedule import build as build_schedule
from conveyor.schedule.grid import STUCK, render_grid
from conveyor.schedule.ir import Action, Schedule
from conveyor.schedule.passes import Executable, executable
from conveyor.schedule.timeline import Span, Timeline
from conveyor.schedule.verify import verify

log = logging.getLogger(__name__)

_FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def resolve_schedule(schedule: Schedule | str, microbatches: int | None, virtual: int | None,
                     num_ranks: int) -> Schedule:
    """A Schedule object as given, or built by name for ``num_ranks`` ranks."""
    if isinstance(schedule, Schedule):
        if microbatches is not None and microbatches != schedule.num_microbatches:
            raise PipelineConfigError(
                f"microbatches={microbatches} disagrees with the schedule's {schedule.num_microbatches}; "
                "leave microbatches out when passing a Schedule"
            )
        verify(schedule)  # a schedule of the user's own: a deadlock or a missing action fails here, not in a step
        return schedule
    if not isinstance(schedule, str):
        raise PipelineConfigError(f"schedule must be a Schedule or a schedule name, got {type(schedule).__name__}")
    if microbatches is None:
        raise PipelineConfigError(f"schedule={schedule!r} is a name: also pass microbatches=M")
    return build_schedule(schedule, ranks=num_ranks, microbatches=microbatches, virtual=virtual)


def _set_parameter(module: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    setattr(owner, leaf, param)


def share_tied_locally(runners: dict[int, StageRunner], tied_parameters) -> None:
    """Stages of one rank that use the same tied parameter get one Parameter object."""
    for tied in tied_parameters:
        local = [(stage, name) for stage, name in tied.uses if stage in runners]
        if len(local) < 2:
            continue
        first_stage, first_name = local[0]
        shared = runners[first_stage].module.get_parameter(first_name)
        for stage, name in local[1:]:
            _set_parameter(runners[stage].module, name, shared)
            runners[stage].params = [p for p in runners[stage].module.parameters() if p.requires_grad]


def tied_copies_outside_their_first_stage(runners: dict[int, StageRunner], tied_parameters) -> set[int]:
    """Ids of this rank's copies of tied parameters that the unsplit model counts elsewhere.

    The unsplit model lists a tied parameter once, where its first stage uses it; the
    copies on later stages (on other ranks: distinct objects) must not count again.
    """
    skip: set[int] = set()
    for tied in tied_parameters:
        first = min(stage for stage, _ in tied.uses)
        kept = runners[first].module.get_parameter(dict(tied.uses)[first]) if first in runners else None
        for stage, name in tied.uses:
            if stage != first and stage in runners:
                copy = runners[stage].module.get_parameter(name)
                if copy is not kept:
                    skip.add(id(copy))
    return skip


class _PipelineBase:
    """What the distributed and the in-process pipelines share: stages, programs, checks."""

    schedule: Schedule
    runners: dict[int, StageRunner]
    _tied_copies: set[int]
    _parameter_order: dict[str, int] | None
    random_streams: bool = True
    skipped_steps: int = 0  # steps dropped by on_nonfinite="skip"
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
        yield from _named_unique(self.runners, lambda m: m.named_parameters())

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

    @contextlib.contextmanager
    def _random_streams(self) -> Iterator[None]:
        """One step's random streams for every stage of this process (see conveyor.runtime.rng)."""
        if not self.random_streams:
            yield
            return
        with StepRandomness() as streams:
            for runner in self.runners.values():
                runner.randomness = streams
            try:
                yield
            finally:
                for runner in self.runners.values():
                    runner.randomness = None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
        """Clip the whole pipeline's gradients by their total norm; returns that norm on every rank.

        Equal, bit for bit, to ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``
        on the unsplit model: every rank computes the same total norm from all ranks'
        gradients and scales its own by the same factor. The model's parameter order, which
        the norm's rounding depends on, is ``parameter_order`` (name -> index, which
        :func:`pipeline` passes) or else stage by stage; a tied parameter counts once. Clipping
        with ``torch.nn.utils.clip_grad_norm_(pipe.parameters())`` instead would scale each
        rank by its own norm. A collective on a distributed pipeline: call it on every rank.
        ``foreach`` means what it means to torch and, like the other arguments, must be the
        same on every rank.

        Example:
            >>> loss = pipe.step(x, target=y)                  # doctest: +SKIP
            >>> norm = pipe.clip_grad_norm_(1.0)               # doctest: +SKIP
            >>> optimizer.step(); optimizer.zero_grad()        # doctest: +SKIP
        """
        norm_type = float(norm_type)
        total = self._collective(self._total_norm, norm_type, foreach)
        if error_if_nonfinite:
            check_finite(total, norm_type)  # the same total on every rank: all raise, none waits
        with_grads = [p for p in self.parameters() if p.grad is not None]  # type: ignore[attr-defined]
        if self.replicas is not None:
            scale_local_grads([_local(p.grad) for p in with_grads], max_norm, total, foreach)
        elif with_grads:
            torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, total, foreach=foreach)
        return total

    def _total_norm(self, norm_type: float, foreach: bool | None) -> torch.Tensor:
        order = self._parameter_order
        places, grads = [], []
        seen: set[int] = set(self._tied_copies)
        for stage in sorted(self.runners):
            for position, (name, param) in enumerate(self.runners[stage].module.named_parameters()):
                if id(param) not in seen and param.grad is not None:
                    # The unsplit model's order where it is known, else stage by stage after it.
                    known = order is not None and name in order
                    places.append((order[name],) if known else (len(order or ()), stage, position))
                    grads.append(_local(param.grad))
                seen.add(id(param))
        norms = parameter_norms(grads, norm_type, foreach)
        if self.replicas is not None:
            norms = self.replicas.whole_norms(norms, norm_type)  # a sharded gradient's norm from its shards
        mine = encode_norms(places, grads, norms)
        device = grads[0].device if grads else torch.device("cpu")
        return total_norm(self._all_norms(mine), norm_type, device)

    def _collective(self, fn, *args):
        return fn(*args)  # one process: nobody to tell (overridden where there is)

    def _max_across_ranks(self, flags: torch.Tensor) -> torch.Tensor:
        return flags  # every stage is in this process (overridden where they are not)

    def _nonfinite_report(self) -> str:
        """Empty, or where this step's loss or gradients stopped being finite (on every rank alike).

        One small all-reduce: per stage, whether any of its gradients is non-finite, and the
        first microbatch whose loss is; every rank then tells the same story.
        """
        num_stages = self.schedule.num_stages
        flags = torch.zeros(num_stages + 1, dtype=torch.float64)
        for stage, runner in self.runners.items():
            grads = [_local(p.grad) for p in runner.module.parameters() if p.grad is not None]
            if grads and not bool(torch.stack([g.detach().float().norm() for g in grads]).isfinite().all()):
                flags[stage] = 1
        last = self.runners.get(num_stages - 1)
        if last is not None:
            bad = [m for m in range(self.schedule.num_microbatches) if not bool(last.losses[m].isfinite().all())]
            flags[num_stages] = bad[0] + 1 if bad else 0
        flags = self._max_across_ranks(flags)
        stages = [s for s in range(num_stages) if flags[s]]
        microbatch = int(flags[num_stages]) - 1
        parts = []
        if microbatch >= 0:
            parts.append(f"the loss of microbatch {microbatch} (stage {num_stages - 1}, the first such microbatch)")
        if stages:
            parts.append(f"the gradients of stage(s) {stages}")
        return " and ".join(parts) + " are not finite" if parts else ""

    def _after_nonfinite(self, report: str, on_nonfinite: str) -> None:
        if on_nonfinite == "raise":
            raise NonFiniteError(f"this step's {report}; pass on_nonfinite='skip' to drop such steps")
        for param in self.parameters():
            param.grad = None  # the optimizer then leaves every parameter and its state as they are
        self.skipped_steps += 1
        log.warning("conveyor: skipped a step: its %s; gradients dropped (%d step(s) skipped so far)",
                    report, self.skipped_steps)

    def _all_norms(self, mine: EncodedNorms) -> list[EncodedNorms]:
        return [mine]  # every stage is in this process (overridden where they are not)

    def _tie(self, tied_parameters, parameter_order: Mapping[str, int] | None) -> None:
        """Share tied copies within this process and remember what clipping needs to know of the model."""
        self.tied_parameters = tuple(tied_parameters)
        share_tied_locally(self.runners, tied_parameters)
        self._tied_copies = tied_copies_outside_their_first_stage(self.runners, tied_parameters)
        self._parameter_order = dict(parameter_order) if parameter_order is not None else None

    def _make_runners(self, rank: int, stages: Sequence[int], modules: Sequence[torch.nn.Module],
                      loss_fn: LossFn | None, checkpoint_activations: bool) -> dict[int, StageRunner]:
        if isinstance(modules, torch.nn.Module):
            modules = [modules]
        modules = list(modules)
        if len(modules) != len(stages):
            raise PipelineConfigError(
                f"schedule {self.schedule.name!r} places stages {list(stages)} on rank {rank}, so pass "
                f"{len(stages)} module(s) in that order; got {len(modules)}"
            )
        for i, module in enumerate(modules):
            if not isinstance(module, torch.nn.Module):
                raise PipelineConfigError(
                    f"module {i} for stage {stages[i]} on rank {rank} is a {type(module).__name__}, not an nn.Module"
                )
        return {
            s: StageRunner(s, self.schedule.num_stages, m, loss_fn=loss_fn,
                           num_microbatches=self.schedule.num_microbatches,
                           checkpoint_activations=checkpoint_activations, rank=rank)
            for s, m in zip(stages, modules)
        }

    def _split_inputs(self, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
        if all(a is None for a in args) and not kwargs:
            raise PipelineConfigError(
                "inputs are missing on the rank that runs stage 0: pass the minibatch to pipe.step(...) there"
            )
        return split_microbatches(args, kwargs, self.schedule.num_microbatches)

    def _split_target(self, target: Any) -> list[Any]:
        if target is None:
            return [None] * self.schedule.num_microbatches
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
    ``transport``: ``"shared_memory"`` moves payloads through rings in shared
    memory (every rank on this host, CPU tensors, x86-64 Linux; a hop costs
    microseconds instead of gloo's 0.1-0.3 ms of calls), ``"process_group"``
    through the group's point-to-point calls (gloo, NCCL), ``"hybrid"`` shared
    memory to the peers on this host and the process group to the others.
    ``"auto"`` (default), when the group's backend is gloo: shared memory when the
    launcher says every rank is on this host (``LOCAL_WORLD_SIZE == WORLD_SIZE``, as
    torchrun sets them); else the ranks tell each other their hosts (through the
    store, waiting at most ``timeout_s``) and every pair of ranks that talk uses shared memory
    where they share a host: shared memory, hybrid or the process group. Other
    backends (NCCL): the process group.
    ``parameter_order`` ({parameter name: index in the unsplit model's
    ``parameters()``}) tells :meth:`clip_grad_norm_` the model's order when it is
    not stage by stage; :func:`pipeline` passes it.
    ``random_streams`` (default True): random ops (dropout) draw, in the forward of each
    stage and microbatch, from generators seeded for that (stage, microbatch) from one draw
    of the global CPU generator per step, not from each rank's global stream, whose numbers
    repeat on every rank seeded alike (see :mod:`conveyor.runtime.rng`). False leaves the
    generators to the user.
    ``model_signature`` (what :func:`pipeline` passes: :func:`model_signature` of the unsplit
    model and its cut) is compared across ranks when the pipeline is built, with the schedule
    (name, P, V, M and every rank's actions), the tied parameters and the options: ranks
    built differently raise :class:`PipelineConfigError` saying what differs, before any step.

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
        mesh=None,
        data_parallel: str | None = None,
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
        self.runners = self._make_runners(self.rank, self.stages, modules, loss_fn, checkpoint_activations)
        self._tie(tied_parameters, parameter_order)
        # Every check that needs no peer is above: from here on this rank holds process groups.
        self._life = RankLifecycle(group, timeout_s, self.layout.pipelines if self.layout is not None else None)
        try:
            built = self._what_was_built(transport, fixed_shapes, shapes, tied_parameters, model_signature)
            self._life.agree(built)
            self.replicas = self._build_replicas(data_parallel, built)
            self._build_communication(transport, timeout_s, fixed_shapes, shapes, tied_parameters)
        except BaseException:
            # Disagreement: every rank raises alike. A transport that could not be built: the
            # peers waiting for this rank time out naming it, as for any absent peer.
            self._life.close()
            raise
        self.random_streams = random_streams
        self.record_timeline = record_timeline
        self._recorder: StepRecorder | None = None
        self._last_rank = self.schedule.placement.rank_of(self.schedule.num_stages - 1)
        self._global_ranks = self._life.global_ranks
        self._warned_target = False
        # After a failure nothing may keep work on the pipeline's groups alive. The callbacks
        # hold no reference to this Pipeline, so the finalizer below can run when it is dropped.
        self._life.attach(self.transport, on_release=[
            self.executor.forget_receives, self._tied_groups.clear,
            *(runner.reset for runner in self.runners.values()),
        ], position=self.executor.position, render=functools.partial(render_positions, self.runs))
        self._finalizer = weakref.finalize(self, self._life.close)  # also runs at interpreter exit

    def _what_was_built(self, transport: str, fixed_shapes: bool, shapes, tied_parameters,
                        model_signature: str | None) -> dict[str, str]:
        """What every rank must agree on, as short strings (see RankLifecycle.agree)."""
        sched = self.schedule
        programs = hashlib.sha1(repr(sched.programs).encode()).hexdigest()[:12]
        return {
            "schedule": f"{sched.name} P={sched.num_ranks} V={sched.virtual} M={sched.num_microbatches} "
                        f"programs {programs}",
            "model": model_signature or "stages built by hand",
            "tied parameters": repr([tuple(t.uses) for t in tied_parameters]),
            "options": f"transport={transport!r} fixed_shapes={fixed_shapes} "
                       f"shapes given for stages {sorted(shapes) if shapes else []}",
        }

    def _build_replicas(self, data_parallel: str | None, built: dict[str, str]) -> Replicas | None:
        """The data-parallel side: this rank's stages wrapped over their replicas' group."""
        if data_parallel is None:
            return None
        fsdp.check_supported(self.schedule, data_parallel, self.tied_parameters)
        group = self._life.replica_group()
        # Replicas built alike: the same stages, schedule and model in every replica.
        self._life.agree({**built, "data parallel": data_parallel}, group=group, who="replicas")
        replicas = Replicas(data_parallel, group, self.layout.dp_size, self.runners)
        replicas.wrap()
        # Checkpoints are written by every replica together: DCP writes a replicated tensor
        # once and each shard of a sharded one by its holder.
        self.checkpoint_group = self._life.job_group()
        return replicas

    def _build_communication(self, transport: str, timeout_s: float, fixed_shapes: bool, shapes,
                             tied_parameters) -> None:
        self._tied_groups = self._tied_process_groups(tied_parameters)
        self.runs = executable(self.schedule)
        self.transport = build_transport(transport, self.rank, self.schedule, self._life, timeout_s=timeout_s,
                                         fixed_shapes=fixed_shapes,
                                         in_order_channels=wire_channels(self.runs.train_in_order,
                                                                         self.runs.eval_in_order))
        if shapes:
            self._seed_shapes(shapes)
        self.executor = RankExecutor(self.rank, self.schedule.placement, self.runners, self.transport)

    # --- user API -----------------------------------------------------------------------
    def step(self, *args: Any, target: Any = None, return_outputs: bool = False,
             on_nonfinite: str | None = None, **kwargs: Any):
        """One training step on the whole minibatch; returns the minibatch loss on every rank.

        Gradients accumulate in the parameters' ``.grad``; call your optimizer after.
        With ``return_outputs=True`` returns ``(loss, outputs)``; outputs are the
        merged last-stage outputs on the rank that runs the last stage, None elsewhere.
        ``on_nonfinite`` (the same on every rank): ``"raise"`` raises :class:`NonFiniteError`
        naming the first microbatch whose loss and the stages whose gradients are not finite
        (the pipeline stays usable); ``"skip"`` drops this step's gradients instead (set
        them to None, so ``optimizer.step()`` leaves parameters and optimizer state as they
        were), logs a warning and counts it in ``skipped_steps``. None (default): no check.

        Example:
            >>> loss = pipe.step(x, target=y, on_nonfinite="skip")   # doctest: +SKIP
        """
        _check_nonfinite_mode(on_nonfinite)
        result, report = self._life.guarded(self._step, args, kwargs, target, return_outputs, on_nonfinite)
        if report:
            self._after_nonfinite(report, on_nonfinite)
        return result

    def forward(self, *args: Any, **kwargs: Any):
        """Forward only (evaluation, no autograd state): the merged model outputs on the
        rank that runs the last stage, None on the others."""
        return self._life.guarded(self._forward, args, kwargs)

    __call__ = forward

    def timeline(self) -> Timeline:
        """The measured Timeline of the last step (a collective: call it on every rank)."""
        events = [] if self._recorder is None else self._recorder.events
        mine = [(str(a), start, end) for a, start, end in events]
        reductions = self.replicas.spans() if self.replicas is not None else []
        gathered = self._collective(self._gather_objects, (mine, reductions))
        timeline = measured_timeline(self.schedule, [events for events, _ in gathered])
        if self.replicas is not None:
            # Per rank: (stage or "wait", start, end) of the calls that reduced gradients across
            # replicas, on the timeline's clock: what of the reduction the rank spent waiting.
            origin = min((start for events, _ in gathered for _, start, _ in events), default=0.0)
            timeline.metadata["data_parallel"] = {
                "kind": self.replicas.kind, "replicas": self.replicas.dp_size,
                "reductions": [[(what, start - origin, end - origin) for what, start, end in spans]
                               for _, spans in gathered],
            }
        return timeline

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

    def _all_norms(self, mine: EncodedNorms) -> list[EncodedNorms]:
        return self._gather_objects(mine)

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
    def _seed_shapes(self, shapes: Mapping[int, Any]) -> None:
        """Tell both ends of each boundary what will cross it, so no step has to exchange it."""
        last = self.schedule.num_stages - 1
        for stage, example in shapes.items():
            if not isinstance(stage, int) or not 0 <= stage < last:
                raise PipelineConfigError(
                    f"shapes= names stage {stage!r}, but only the outputs of stages 0..{last - 1} cross "
                    "a stage boundary; key each example by the stage that outputs it"
                )
            meta, tensors = flatten_payload(example)
            self.transport.seed((FORWARD, stage), meta)
            detached = pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), example)
            self.transport.seed((EVAL_FORWARD, stage), flatten_payload(detached)[0])
            # What comes back: one gradient per gradient-carrying output, in flatten order.
            grads = tuple(torch.empty(t.shape, dtype=t.dtype) for t in tensors if t.requires_grad)
            self.transport.seed((BACKWARD, stage + 1), flatten_payload(grads)[0])

    def _tied_process_groups(self, tied_parameters) -> list:
        """(parameter, subgroup) for each tied parameter whose copies live on several ranks.

        new_group is collective over the whole group, so every rank creates every subgroup,
        in the same order, whether it holds a copy or not.
        """
        placement = self.schedule.placement
        subgroups: dict[tuple[int, ...], Any] = {}
        mine = []
        for tied in tied_parameters:
            owners = tuple(sorted({placement.rank_of(stage) for stage, _ in tied.uses}))
            if len(owners) < 2:
                continue
            if owners not in subgroups:
                replicas = self.layout.replica_ranks(list(owners)) if self.layout is not None else None
                subgroups[owners] = self._life.subgroup(owners, replicas)
            if self.rank in owners:
                stage, name = next((s, n) for s, n in tied.uses if s in self.runners)
                mine.append((self.runners[stage].module.get_parameter(name), subgroups[owners]))
        return mine

    def _set_tied_gradients_aside(self) -> list[torch.Tensor | None]:
        """Take the tied copies' gradients of earlier steps out of the way: only this step's
        share is summed across ranks (summing the whole .grad would count the earlier steps'
        summed gradient again on every copy when the user accumulates over steps)."""
        held = []
        for param, _ in self._tied_groups:
            held.append(param.grad)
            param.grad = None
        return held

    def _sum_tied_gradients(self, held: list[torch.Tensor | None]) -> None:
        import torch.distributed as dist

        for (param, subgroup), earlier in zip(self._tied_groups, held, strict=True):
            # A frozen parameter (frozen on every rank: one model) gets no gradient, as on one
            # device. A copy that got none this step adds nothing; if none did, the parameter
            # keeps what it had, so that the optimizer skips a parameter nothing used.
            if param.requires_grad:
                got_one = torch.tensor([param.grad is not None], dtype=torch.int32, device=param.device)
                dist.all_reduce(got_one, op=dist.ReduceOp.MAX, group=subgroup)
                if got_one.item():
                    if param.grad is None:
                        param.grad = torch.zeros_like(param)
                    dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=subgroup)
            if earlier is not None:
                param.grad = earlier if param.grad is None else earlier.add_(param.grad)

    def _inputs_for_step(self, args, kwargs, target):
        first = self._split_inputs(args, kwargs) if 0 in self.runners else None
        runs_last = (self.schedule.num_stages - 1) in self.runners
        if target is not None and not runs_last and not self._warned_target:
            self._warned_target = True
            log.warning("conveyor: rank %d was given target=, but the last stage runs on rank %d: "
                        "ignored here (pass target= there; None elsewhere)", self.rank, self._last_rank)
        targets = self._split_target(target) if runs_last else None
        return first, targets

    def _step(self, args, kwargs, target, return_outputs, on_nonfinite):
        first, targets = self._inputs_for_step(args, kwargs, target)
        self._recorder = StepRecorder() if self.record_timeline else None
        for runner in self.runners.values():
            runner.reset()
        held = self._set_tied_gradients_aside()
        replicas = self.replicas
        if replicas is not None:
            replicas.start_step()
        with torch.enable_grad(), self._random_streams():
            for _ in self.executor.run(self.runs.train_program(self.rank), first, targets, self._recorder,
                                       keep_outputs=return_outputs,
                                       gradients_final=self.runs.gradients_final(self.rank),
                                       on_gradients_final=replicas.stage_done if replicas else None):
                raise AssertionError("a blocking transport never yields")
        if replicas is not None:
            replicas.finish_step()
        self._sum_tied_gradients(held)
        loss = self._broadcast_loss()
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

        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._life.group)
        if self.replicas is not None:  # a shard, or one replica's loss, may be the only bad one
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.replicas.group)
        return flags

    def _forward(self, args, kwargs):
        first = self._split_inputs(args, kwargs) if 0 in self.runners else None
        for runner in self.runners.values():
            runner.reset()
        with torch.no_grad(), self._random_streams():
            for _ in self.executor.run(self.runs.eval_program(self.rank), first, None, None):
                raise AssertionError("a blocking transport never yields")
        self.transport.end_step()
        last = self.runners.get(self.schedule.num_stages - 1)
        if last is None:
            return None
        outputs = merge_outputs([last.outputs[m] for m in range(self.schedule.num_microbatches)])
        last.outputs.clear()
        return outputs

    def _broadcast_loss(self) -> torch.Tensor:
        import torch.distributed as dist

        last = self.runners.get(self.schedule.num_stages - 1)
        packet = torch.zeros(2, dtype=torch.float64)
        if last is not None:
            total = summed_loss(last)
            packet[0] = total.double()
            packet[1] = _FLOAT_DTYPES.index(total.dtype) if total.dtype in _FLOAT_DTYPES else 0
        if self.schedule.num_ranks > 1:
            dist.broadcast(packet, src=self._global_ranks[self._last_rank], group=self._life.group)
        if last is not None:
            return total
        return packet[0].to(_FLOAT_DTYPES[int(packet[1])])


def render_positions(runs: Executable, positions: list[dict | None]) -> str:
    """Every rank's position (see :mod:`conveyor.runtime.positions`) on the step x rank grid.

    A line per rank says what it runs or waits for; the grid marks each rank's current action
    ``>like this<`` in the programs the ranks run (training or evaluation, whichever they are in).
    """
    train = runs.train.programs
    programs, marks, lines = train, {}, []
    for rank, where in enumerate(positions):
        if where is None:
            lines.append(f"rank {rank}: no answer (its process is gone, or it cannot reach the store)")
            continue
        if not where["running"]:
            lines.append(f"rank {rank}: between steps ({where['runs']} run(s) started)")
            continue
        index, action = where["index"], where["action"]
        if index < len(train[rank]) and str(train[rank][index]) != action:
            programs = runs.eval.programs  # it is evaluating
        doing = "waits for" if "RECV" in action else "runs"
        lines.append(f"rank {rank}: action {index} of {where['length']} in run {where['runs']}: {doing} {action}")
        if index < where["length"]:
            marks[(rank, index)] = STUCK
    return "\n".join(lines) + "\n" + render_grid(programs, marks)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a gradient: itself, or a data-parallel DTensor's local tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def _check_nonfinite_mode(on_nonfinite: str | None) -> None:
    if on_nonfinite not in (None, "raise", "skip"):
        raise PipelineConfigError(f"on_nonfinite must be None, 'raise' or 'skip'; got {on_nonfinite!r}")


def summed_loss(last: StageRunner) -> torch.Tensor:
    """Sum of the microbatch losses (each already divided by M), in microbatch order."""
    losses = [last.losses[m] for m in range(last.num_microbatches)]
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss
    return total


def measured_timeline(schedule: Schedule, per_rank_events: list) -> Timeline:
    """Build a Timeline (seconds from the earliest start) from each rank's (action, start, end)."""
    starts = [start for events in per_rank_events for _, start, _ in events]
    origin = min(starts, default=0.0)
    spans = [
        Span(rank, Action.parse(a) if isinstance(a, str) else a, start - origin, end - origin)
        for rank, events in enumerate(per_rank_events)
        for a, start, end in events
    ]
    return Timeline.from_spans(
        schedule.num_ranks, spans,
        title=f"{schedule.name} P={schedule.num_ranks} V={schedule.virtual} M={schedule.num_microbatches}",
        source="measured", time_unit="s",
        metadata={"schedule": schedule.name, "ranks": schedule.num_ranks, "virtual": schedule.virtual,
                  "microbatches": schedule.num_microbatches},
    )


def _named_unique(runners: dict[int, StageRunner], items) -> Iterator[tuple[str, Any]]:
    seen_ids: set[int] = set()
    seen_names: set[str] = set()
    for stage, runner in runners.items():
        for name, value in items(runner.module):
            if id(value) in seen_ids:
                continue
            seen_ids.add(id(value))
            if name in seen_names:
                name = f"stage{stage}.{name}"  # two hand-built stages may reuse a local name
            seen_names.add(name)
            yield name, value


class LocalPipeline(_PipelineBase):
    """Every rank of a schedule in one process and one thread, with the numerics of :class:`Pipeline`.

    ``modules`` holds one module per stage, indexed by stage. For debugging and fast tests.
    The keywords mean what they mean to :class:`Pipeline` (``random_streams`` included).
    """

    def __init__(
        self,
        modules: Sequence[torch.nn.Module],
        schedule: Schedule | str,
        loss_fn: LossFn | None = None,
        *,
        microbatches: int | None = None,
        virtual: int | None = None,
        ranks: int | None = None,
        checkpoint_activations: bool = False,
        tied_parameters: Sequence = (),
        parameter_order: Mapping[str, int] | None = None,
        random_streams: bool = True,
    ) -> None:
        modules = list(modules)
        self.random_streams = random_streams
        if isinstance(schedule, str) and ranks is None:
            # One module per stage: the rank count follows from the schedule's stages per rank.
            info = available().get(schedule)
            stages_per_rank = virtual or (info.default_virtual if info is not None else 1)
            ranks = max(1, len(modules) // stages_per_rank)
        self.schedule = resolve_schedule(schedule, microbatches, virtual, ranks or 1)
        if len(modules) != self.schedule.num_stages:
            raise PipelineConfigError(
                f"schedule {self.schedule.name!r} has {self.schedule.num_stages} stages; pass one module per "
                f"stage (got {len(modules)})"
            )
        self.mailbox = LocalMailbox()
        self.runs = executable(self.schedule)
        self.executors: list[RankExecutor] = []
        self.runners: dict[int, StageRunner] = {}
        for rank in range(self.schedule.num_ranks):
            stages = self.schedule.stages_of(rank)
            runners = self._make_runners(rank, stages, [modules[s] for s in stages], loss_fn,
                                         checkpoint_activations)
            self.runners.update(runners)
            transport: Transport = LocalTransport(self.mailbox, rank)
            self.executors.append(RankExecutor(rank, self.schedule.placement, runners, transport))
        # In one process every copy of a tied parameter can simply be the same Parameter.
        self._tie(tied_parameters, parameter_order)
        self._recorders: list[StepRecorder] = []
        self.closed = False

    def close(self) -> None:
        """Refuse later calls (one process holds nothing else to release); as :meth:`Pipeline.close`."""
        self.closed = True
        self.mailbox.messages.clear()

    def _check_open(self) -> None:
        if self.closed:
            raise PipelineClosed("this pipeline was closed (close() or the end of its `with` block); "
                                 "build a new LocalPipeline to go on")

    def step(self, *args: Any, target: Any = None, return_outputs: bool = False,
             on_nonfinite: str | None = None, **kwargs: Any):
        self._check_open()
        _check_nonfinite_mode(on_nonfinite)
        first = self._split_inputs(args, kwargs)
        targets = self._split_target(target)
        for runner in self.runners.values():
            runner.reset()
        self.mailbox.messages.clear()  # a step that raised may have left messages behind
        self._recorders = [StepRecorder() for _ in self.executors]
        with torch.enable_grad(), self._random_streams():
            run_local(self.executors, [
                ex.run(self.runs.train_program(r), first if r == self.schedule.placement.rank_of(0) else None,
                       targets, self._recorders[r], keep_outputs=return_outputs)
                for r, ex in enumerate(self.executors)
            ])
        last = self.runners[self.schedule.num_stages - 1]
        loss = summed_loss(last)
        result = (loss, merge_outputs([last.outputs[m] for m in range(self.schedule.num_microbatches)])
                  ) if return_outputs else loss
        report = self._nonfinite_report() if on_nonfinite else ""
        if report:
            self._after_nonfinite(report, on_nonfinite)
        return result

    def forward(self, *args: Any, **kwargs: Any):
        self._check_open()
        first = self._split_inputs(args, kwargs)
        for runner in self.runners.values():
            runner.reset()
        self.mailbox.messages.clear()
        with torch.no_grad(), self._random_streams():
            run_local(self.executors, [
                ex.run(self.runs.eval_program(r), first if r == self.schedule.placement.rank_of(0) else None,
                       None, None)
                for r, ex in enumerate(self.executors)
            ])
        last = self.runners[self.schedule.num_stages - 1]
        outputs = merge_outputs([last.outputs[m] for m in range(self.schedule.num_microbatches)])
        last.outputs.clear()
        return outputs

    __call__ = forward

    def timeline(self) -> Timeline:
        return measured_timeline(self.schedule, [[(str(a), s, e) for a, s, e in r.events] for r in self._recorders])



def pipeline(
    model: torch.nn.Module,
    *,
    example_args: tuple = (),
    example_kwargs: dict | None = None,
    split_points: Sequence[str] | None = None,
    schedule: Schedule | str = "1f1b",
    microbatches: int | None = None,
    virtual: int | None = None,
    loss_fn: LossFn | None = None,
    split_method: str = "parameters",
    unsplittable: Sequence[str] | None = None,
    group=None,
    mesh=None,
    device: torch.device | str | None = None,
    both_modes: bool = False,
    **pipeline_kwargs: Any,
) -> Pipeline:
    """Trace and split an unchanged ``model``; return this rank's :class:`Pipeline`.

    The same call on every rank. ``example_args`` / ``example_kwargs`` are ONE
    microbatch. Without ``split_points`` the model is cut into P x V stages
    balanced by ``split_method`` ("uniform", "parameters", "time",
    "type:<regex>"); with "time", rank 0's measurement decides for every rank.
    ``both_modes=True`` traces the model in train and in eval mode, so that
    ``pipe.eval()`` / ``pipe.train()`` switch dropout and BatchNorm as on the model
    (one trace, in the model's current mode, otherwise; the other mode then raises).
    Each rank materialises only its own stages (a meta-device model works);
    parameters keep their original names, and tied parameters (GPT-2's ``wte`` and
    ``lm_head``) stay equal after every optimizer step. ``mesh`` (a ("dp", "pp") DeviceMesh)
    and ``data_parallel=`` run ``dp`` replicas of the pipeline, as :class:`Pipeline` does.

    Example (on each of 2 ranks)::

        pipe = conveyor.pipeline(model, example_args=(ids[:2],), split_points=["model.layers.4"],
                                 schedule="1f1b", microbatches=8, loss_fn=lambda out, y: out.loss)
        loss = pipe.step(ids, labels=labels)
    """
    import torch.distributed as dist

    from conveyor.frontend import split_model
    from conveyor.frontend.pretrained import model_info

    if not dist.is_available() or not dist.is_initialized():
        raise PipelineConfigError(
            "torch.distributed is not initialised: launch with torchrun and call "
            "torch.distributed.init_process_group() first"
        )
    pp_group = group if mesh is None else layout_of(mesh).pp_group
    world = dist.get_world_size(pp_group)
    rank = dist.get_rank(pp_group)
    resolved = resolve_schedule(schedule, microbatches, virtual, world)
    split_kwargs = dict(example_args=tuple(example_args), example_kwargs=example_kwargs,
                        unsplittable=unsplittable, device=device)
    if split_points is None and split_method == "time" and world > 1:
        # Timings differ from rank to rank: one rank decides, so that every rank cuts alike.
        chosen: list = [None]
        if dist.get_rank(group) == 0:  # with a mesh, the job's rank 0: every replica cuts alike
            chosen[0] = list(split_model(model, resolved.num_stages, split_method="time", **split_kwargs).split_points)
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast_object_list(chosen, src=src, group=group)
        split_points = chosen[0]
    split = split_model(model, resolved.num_stages, split_points=split_points, split_method=split_method,
                       **split_kwargs)
    modules = [split.stage_module(stage, device, both_modes=both_modes) for stage in resolved.stages_of(rank)]
    # Stage modules keep the model's parameter names, so the model's order can be looked up. A
    # tied parameter may sit in a stage under any of its names (torch.export picks one): each
    # name gets the place of the tensor's first name, where torch's clipping counts it.
    order: dict[str, int] = {}
    first_place: dict[int, int] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        order[name] = first_place.setdefault(id(param), len(first_place))
    pipe = Pipeline(modules, resolved, loss_fn, group=group, mesh=mesh, tied_parameters=split.tied_groups,
                    parameter_order=order, model_signature=model_signature(model, split.split_points),
                    **pipeline_kwargs)
    pipe.model_info = model_info(model)  # what checkpoints record, and export writes back (config.json)
    return pipe


def model_signature(model: torch.nn.Module, split_points: Sequence[str]) -> str:
    """A short digest of a model's parameter and buffer names, shapes and dtypes and where it is cut.

    Ranks whose digests differ were given different models (or cuts): the pipeline refuses to
    start rather than hang or train garbage.

    Example:
        >>> model_signature(torch.nn.Linear(2, 3), []) == model_signature(torch.nn.Linear(2, 3), [])
        True
    """
    entries = [(name, tuple(t.shape), str(t.dtype))
               for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]]
    digest = hashlib.sha1(repr((type(model).__name__, entries, list(split_points))).encode()).hexdigest()[:12]
    return f"{type(model).__name__} with {len(entries)} tensors cut at {list(split_points)} ({digest})"
