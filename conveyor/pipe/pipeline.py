"""Pipeline: run a verified schedule over real stages as if on one device, in one process or many.

The same script runs on every rank::

    sched = conveyor.schedule.build("1f1b", ranks=4, microbatches=8)
    pipe = conveyor.Pipeline([build_stage(s) for s in sched.stages_of(rank)],
                             schedule=sched, loss_fn=loss_fn)
    loss = pipe.step(x, target=y)          # the whole minibatch; loss on every rank
    optimizer = torch.optim.AdamW(pipe.parameters()); optimizer.step()

Results are bitwise identical to one device running, for each microbatch i in order,
``(loss_fn(model(x_i), y_i) / M).backward()``. Every rank in one process:
``layout=Layout(in_process=True)`` with one module per stage (:func:`conveyor.LocalPipeline`);
several replicas on a ("pp", "dp") mesh: ``mesh=`` and :mod:`conveyor.parallel`. The ranks
backend (:mod:`conveyor.pipe.ranks`) is all that differs: every method below is the same on both.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any, Self

import torch

from conveyor.errors import PipelineConfigError
from conveyor.options import Layout, StageOptions, TransferOptions, WholeModel, check_together
from conveyor.parallel.clipping import check_nonfinite_mode
from conveyor.parallel.tied import share_tied_locally, tied_copies_outside_their_first_stage
from conveyor.pipe.distributed import DistributedRanks
from conveyor.pipe.ranks import InProcessRanks
from conveyor.pipe.steps import forward_only, presplit, train_step
from conveyor.pipe_grads import GradientChecks
from conveyor.runtime.stage.memory import MemoryReport
from conveyor.runtime.stage.runner import LossFn, StageRunner, build_runners, named_unique
from conveyor.schedule.ir import Schedule
from conveyor.schedule.timeline import Timeline

log = logging.getLogger("conveyor.pipe")


class Pipeline(GradientChecks):
    """This process's part of a pipeline: one rank's stages over torch.distributed, or every rank's.

    ``modules``: the stages this rank runs, in ``schedule.stages_of(rank)`` order (in process: one
    per stage, by stage). ``schedule``: a :class:`~conveyor.schedule.Schedule` or a name (then
    ``microbatches=`` and, for some schedules, ``virtual=``). ``mesh`` (a ("pp", "dp") DeviceMesh)
    and ``data_parallel`` ("ddp" by default, or "fsdp") run ``dp`` replicas; a ("pp", "dp", "tp") mesh
    and ``tensor_parallel`` ("auto", or {module-name pattern: torch ParallelStyle}) parallelize
    each stage over its TP ranks with torch's ``parallelize_module``; they are the everyday
    fields of ``layout`` (:class:`~conveyor.options.Layout`: the process group, the
    device, or every rank in this process). ``stage`` (:class:`~conveyor.options.StageOptions`):
    what each stage does (activation recomputation, autocast, bf16 parameters, compile, random
    streams, memory measurement). ``transfer`` (:class:`~conveyor.options.TransferOptions`): how
    bytes move (transport, timeout, fixed shapes). ``model`` (:class:`~conveyor.options.WholeModel`,
    which :func:`conveyor.pipeline` fills): tied parameters, whose copies on several ranks have
    their gradients summed after every step (equal to rounding); the model's parameter order, for
    :meth:`clip_grad_norm_`; its signature, compared across ranks.

    When a distributed pipeline is built, the ranks compare the schedule (name, P, V, M and every
    rank's actions), the model and every record's ``describe()``: ranks built differently raise
    :class:`PipelineConfigError` saying what differs, before any step. It communicates on process
    groups of its own; a failure on any rank stops it on every rank (the failing rank's message,
    :class:`PeerFailure` on the others, then :class:`PipelineStopped`); your groups stay usable.
    ``close()`` (or leaving ``with conveyor.Pipeline(...) as pipe:``) releases what it holds; a
    closed pipeline raises :class:`PipelineClosed`.

    Example:
        >>> import torch, conveyor
        >>> from conveyor.options import Layout, StageOptions
        >>> pipe = conveyor.Pipeline([torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)], "gpipe",
        ...                          lambda y, t: (y - t).sum(), microbatches=2,
        ...                          layout=Layout(in_process=True), stage=StageOptions(measure_memory=True))
        >>> loss = pipe.step(torch.ones(8, 4), target=torch.zeros(8, 1))
        >>> [(r.peak_bytes, r.stage_bytes) for r in pipe.memory(all_ranks=True)]   # each Linear saves its input
        [(128, {0: 64}), (128, {1: 64})]
    """

    _warned_target = False  # told once that target= is read on the last stage's rank only

    def __init__(
        self,
        modules: Sequence[torch.nn.Module] | torch.nn.Module,
        schedule: Schedule | str,
        loss_fn: LossFn | None = None,
        *,
        microbatches: int | None = None,
        virtual: int | None = None,
        mesh: Any = None,
        data_parallel: str | None = None,
        tensor_parallel: Any = None,
        layout: Layout = Layout(),
        stage: StageOptions = StageOptions(),
        transfer: TransferOptions = TransferOptions(),
        model: WholeModel = WholeModel(),
    ) -> None:
        for name, value, kind in (("layout", layout, Layout), ("stage", stage, StageOptions),
                                  ("transfer", transfer, TransferOptions), ("model", model, WholeModel)):
            if not isinstance(value, kind):
                raise PipelineConfigError(f"{name}= takes a conveyor.options.{kind.__name__}; got "
                                          f"{type(value).__name__}")
        self.layout = layout.with_shortcuts(mesh, data_parallel, tensor_parallel)
        self.stage, self.transfer, self.model = stage, transfer, model
        backend = InProcessRanks if self.layout.in_process else DistributedRanks
        self.ranks: InProcessRanks | DistributedRanks = backend(self.layout, transfer)
        check_together(stage, getattr(self.ranks, "data_parallel", None))  # the kind its replicas resolved to
        if self.layout.in_process:
            modules = list(modules)
        self.schedule = self.ranks.resolve(schedule, microbatches, virtual, modules)
        self.device, by_rank = self.ranks.place(modules)
        # Tensor parallelism inside each stage (a mesh's "tp" dim), before runners read the parameters.
        self.tensor_parallel = self.ranks.parallelize(by_rank, model)
        self.runners: dict[int, StageRunner] = {}
        for rank, mine in by_rank.items():
            self.runners.update(build_runners(self.schedule, rank, mine, loss_fn, stage))
        if self.tensor_parallel is not None:
            for runner in self.runners.values():
                runner.context = self.tensor_parallel.context(runner.stage)
        self._tie(model)
        self.ranks.connect(self, self._what_was_built())

    def _tie(self, model: WholeModel) -> None:
        """Share tied copies within this process; remember what clipping and checkpoints need of the model."""
        self.tied_parameters = model.tied_parameters  # checkpoints save a tied tensor once, under its first name
        share_tied_locally(self.runners, model.tied_parameters)
        self._tied_copies = tied_copies_outside_their_first_stage(self.runners, model.tied_parameters)
        self._parameter_order = dict(model.parameter_order) if model.parameter_order is not None else None
        self.model_info = model.info  # the unsplit model's class, names, config

    def _what_was_built(self) -> dict[str, str]:
        """What every rank must agree on, as short strings (see RankLifecycle.agree)."""
        sched = self.schedule
        programs = hashlib.sha1(repr(sched.programs).encode()).hexdigest()[:12]
        return {
            "schedule": f"{sched.name} P={sched.num_ranks} V={sched.virtual} M={sched.num_microbatches} "
                        f"programs {programs}",
            "model": self.model.describe(),
            "stage options": self.stage.describe(),
            "transfer options": self.transfer.describe(),
            "layout": self.layout.describe(),
        }

    # --- steps ---------------------------------------------------------------------------
    def step(self, *args: Any, target: Any = None, return_outputs: bool = False,
             on_nonfinite: str | None = None, normalize_by: float | torch.Tensor | None = None, **kwargs: Any):
        """One training step on the whole minibatch; returns the minibatch loss on every rank.

        ``args`` / ``kwargs`` are the model's inputs (read where stage 0 runs), ``target`` the loss's
        (read where the last stage runs). Gradients accumulate in the parameters' ``.grad``; call
        your optimizer after. With ``return_outputs=True`` returns ``(loss, outputs)``: the merged
        last-stage outputs where the last stage runs, None elsewhere. ``on_nonfinite`` (the same on
        every rank): ``"raise"`` raises :class:`NonFiniteError` naming the first microbatch whose
        loss and the stages whose gradients are not finite (the pipeline stays usable); ``"skip"``
        drops this step's gradients instead (``optimizer.step()`` then leaves parameters and state
        as they were), logs a warning and counts it in ``skipped_steps``; None: no check.
        ``normalize_by`` (read where the last stage runs): None divides each microbatch's loss by M;
        N, the global minibatch's token count (:func:`conveyor.parallel.count_tokens`), divides
        ``loss_fn``'s per-microbatch SUM by N (:mod:`conveyor.parallel.loss`).
        ``microbatches=[...]``, ``targets=[...]``: M microbatches of their own shapes (``steps.presplit``).

        Example:
            >>> loss = pipe.step(x, target=y, on_nonfinite="skip")   # doctest: +SKIP
        """
        check_nonfinite_mode(on_nonfinite)
        result, report = self.ranks.guarded(train_step, self, args, kwargs, target, return_outputs, on_nonfinite,
                                            normalize_by, presplit(kwargs))
        if report:
            self._after_nonfinite(report, on_nonfinite)
        return result

    def forward(self, *args: Any, **kwargs: Any):
        """Forward only (evaluation, no autograd state): the merged model outputs where the last
        stage runs, None elsewhere."""
        return self.ranks.guarded(forward_only, self, args, kwargs)

    __call__ = forward

    # --- what the step measured ----------------------------------------------------------
    def memory(self, all_ranks: bool = False) -> MemoryReport | list[MemoryReport]:
        """Peak bytes of activations autograd held in the last step, and one stage-microbatch's bytes
        (``StageOptions(measure_memory=True)``): this rank's :class:`~conveyor.runtime.stage.memory.MemoryReport`
        (in process: rank 0's), or with ``all_ranks=True`` every rank's, by rank (a collective).

        Example:
            >>> [report.peak_bytes for report in pipe.memory(all_ranks=True)]   # doctest: +SKIP
        """
        return self.ranks.guarded(self.ranks.memory, all_ranks)

    def timeline(self) -> Timeline:
        """The measured Timeline of the last step (a collective: call it on every rank)."""
        return self.ranks.guarded(self.ranks.timeline)

    # --- what this process holds ---------------------------------------------------------
    @property
    def needs_inputs(self) -> bool:
        """Whether this process runs stage 0: the one that reads the minibatch's inputs."""
        return 0 in self.runners

    @property
    def needs_target(self) -> bool:
        """Whether this process runs the last stage: the one that reads the targets."""
        return self.schedule.num_stages - 1 in self.runners

    @property
    def dp_rank(self) -> int:
        """This rank's replica (0 without data parallelism)."""
        return self.ranks.dp_rank

    @property
    def dp_size(self) -> int:
        """How many replicas of the pipeline train together (1 without data parallelism)."""
        return self.ranks.dp_size

    @property
    def replicas(self) -> Any:
        """The data-parallel replicas of this rank's stages (None: one replica)."""
        return self.ranks.replicas

    @property
    def checkpoint_group(self) -> Any:
        """With replicas or TP: the group over every rank of the job, that writes checkpoints (else None)."""
        return self.ranks.checkpoint_group

    @property
    def modules(self) -> list[torch.nn.Module]:
        """This process's stage modules, by stage."""
        return [r.module for r in self.runners.values()]

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

        self.pretrained_report = load_pretrained(path, self.modules,
                                                 [t.names for t in self.tied_parameters if hasattr(t, "names")])
        return self.pretrained_report

    def train(self, mode: bool = True) -> Self:
        """Put every stage in training (or, ``mode=False``, evaluation) mode."""
        for runner in self.runners.values():
            runner.module.train(mode)
        return self

    def eval(self) -> Self:
        """Put every stage in evaluation mode."""
        return self.train(False)

    # --- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        """Release this process's rings, sockets, pending work and process groups (idempotent).

        Call it on every rank after the last step, or build the pipeline in a ``with``
        block. It never communicates. Later calls raise :class:`PipelineClosed`.

        Example:
            >>> with conveyor.Pipeline(stages, schedule=sched, loss_fn=loss_fn) as pipe:  # doctest: +SKIP
            ...     loss = pipe.step(x, target=y)
        """
        self.ranks.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (a pipeline stopped by a failure is not closed until then)."""
        return self.ranks.closed

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
