"""Pipeline: run a verified schedule over real stages as if on one device, in one process or many.

The same script runs on every rank::

    sched = conveyor.schedule.build("1f1b", ranks=4, microbatches=8)
    pipe = conveyor.Pipeline([build_stage(s) for s in sched.stages_of(rank)],
                             schedule=sched, loss_fn=loss_fn)
    loss = pipe.step(x, target=y)          # the whole minibatch; loss on every rank
    optimizer = torch.optim.AdamW(pipe.parameters()); optimizer.step()

Results are bitwise identical to one device running, for each microbatch i in order,
``(loss_fn(model(x_i), y_i) / M).backward()``. Every rank in one process:
``layout=InProcessLayout()`` with one module per stage; several replicas or tensor-parallel ranks
per stage on a ("pp", "dp", "tp") mesh: ``layout=DistributedLayout(dp=..., tp=...)``. The ranks
backend (:mod:`conveyor.pipe.backend`'s contract) is all that differs: every method below is the same on both.

A step: the minibatch is cut into the schedule's microbatches exactly as a one-device loop would
cut it (:mod:`conveyor.microbatch`), or taken as the caller cut it (:class:`~conveyor.microbatch.Microbatches`),
and moved to the stage device where it came from a CPU loader (:class:`StepInputs`); the steps
(:class:`PipelineSteps`) hand it to the ranks backend, which runs every program this process
holds; the loss (on every rank) and the last stage's outputs come back.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any, Self

import torch

from conveyor.errors import PipelineConfigError
from conveyor.layout import DistributedLayout, InProcessLayout, Layout
from conveyor.microbatch import (
    Microbatches,
    check_given_microbatches,
    merge_outputs,
    split_microbatches,
    split_value,
)
from conveyor.options import StageOptions, TransferOptions, WholeModel, check_together
from conveyor.parallel.clipping import check_nonfinite_mode
from conveyor.parallel.loss import set_loss_divisor
from conveyor.parallel.mesh import with_mesh
from conveyor.parallel.replicas import Replicas
from conveyor.parallel.tied import share_tied_locally
from conveyor.pipe.backend import RanksBackend
from conveyor.pipe.distributed import DistributedRanks
from conveyor.pipe.generation import Generation, Sampling, generate
from conveyor.pipe.gradients import GradientChecks
from conveyor.pipe.logprobs import pipeline_logprobs
from conveyor.pipe.ranks import InProcessRanks
from conveyor.pipe.weights import named_weights
from conveyor.runtime.stage.device import to_device
from conveyor.runtime.stage.memory import MemoryReport
from conveyor.runtime.stage.rng import step_random_streams
from conveyor.runtime.stage.runner import LossFn, StageRunner, build_runners, named_unique
from conveyor.schedule.ir import Schedule
from conveyor.schedule.timeline import Timeline

log = logging.getLogger("conveyor.pipe")


class Pipeline:
    """This process's part of a pipeline: one rank's stages over torch.distributed, or every rank's.

    ``modules``: the stages this rank runs, in ``schedule.stages_of(rank)`` order (in process: one
    per stage, by stage). ``schedule``: a :class:`~conveyor.schedule.Schedule` or a name (then
    ``microbatches=`` and, for some schedules, ``virtual=``). ``layout``: where the ranks are,
    :class:`~conveyor.layout.DistributedLayout` (the default: this process is one rank; ``dp`` replicas
    sharing gradients the ``data_parallel`` way, "ddp" or "fsdp"; ``tp`` ranks per stage split the
    ``tensor_parallel`` way by torch's ``parallelize_module``; a group or mesh of your own; stage parts
    of your own; the device) or :class:`~conveyor.layout.InProcessLayout` (every rank in this process).
    ``stage``: what each stage does (activation recomputation, autocast, bf16 parameters, compile, random
    streams, memory measurement; :class:`~conveyor.options.StageOptions`). ``transfer``: how bytes move
    (transport, timeout, fixed shapes; :class:`~conveyor.options.TransferOptions`). ``model``: what
    :func:`conveyor.pipeline` learned of the whole model (:class:`~conveyor.options.WholeModel`): tied
    parameters, whose copies on several ranks have their gradients summed after every step (equal to
    rounding); the parameter order, for :meth:`clip_grad_norm_`; its signature, compared across ranks.

    When a distributed pipeline is built, the ranks compare the schedule (name, P, V, M and every
    rank's actions), the model and every record's ``describe()``: ranks built differently raise
    :class:`PipelineConfigError` saying what differs, before any step. It communicates on process
    groups of its own; a failure on any rank stops it on every rank (the failing rank's message,
    :class:`PeerFailure` on the others, then :class:`PipelineStopped`); your groups stay usable.
    ``close()`` (or leaving ``with conveyor.Pipeline(...) as pipe:``) releases what it holds; a
    closed pipeline raises :class:`PipelineClosed`.

    Example:
        >>> import torch, conveyor
        >>> from conveyor.options import StageOptions
        >>> pipe = conveyor.Pipeline([torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)], "gpipe",
        ...                          lambda y, t: (y - t).sum(), microbatches=2,
        ...                          layout=conveyor.InProcessLayout(), stage=StageOptions(measure_memory=True))
        >>> loss = pipe.step(torch.ones(8, 4), target=torch.zeros(8, 1))
        >>> [(r.peak_bytes, r.stage_bytes) for r in pipe.memory(all_ranks=True)]   # each Linear saves its input
        [(128, {0: 64}), (128, {1: 64})]
    """

    def __init__(
        self,
        modules: Sequence[torch.nn.Module] | torch.nn.Module,
        schedule: Schedule | str,
        loss_fn: LossFn | None = None,
        *,
        microbatches: int | None = None,
        virtual: int | None = None,
        layout: Layout = DistributedLayout(),
        stage: StageOptions = StageOptions(),
        transfer: TransferOptions = TransferOptions(),
        model: WholeModel = WholeModel(),
    ) -> None:
        _check_records(layout=layout, stage=stage, transfer=transfer, model=model)
        # The record's type chooses the backend; a distributed one's mesh is built from its sizes (a collective).
        self.layout = layout if isinstance(layout, InProcessLayout) else with_mesh(layout)
        self.stage, self.transfer, self.model = stage, transfer, model
        self.ranks: RanksBackend = _backend(self.layout, transfer, stage)
        self.schedule = self.ranks.resolve(schedule, microbatches, virtual, modules)
        self.runners = _stage_runners(self.ranks, self.schedule, modules, loss_fn, stage, model)
        self.device = self.ranks.device
        self.tied_parameters = model.tied_parameters  # checkpoints save a tied tensor once, under its first name
        self.model_info = model.info  # the unsplit model's class, names, config
        self.ranks.connect(self.runners, stage, model, built_fields(self.schedule, self.layout, stage, transfer, model),
                           owner=self)
        self.gradient_checks = GradientChecks(self.ranks, self.runners, self.schedule, model, stage.loss_scaling)
        self.steps = PipelineSteps(self.ranks, self.runners, self.schedule, stage)

    # --- steps ---------------------------------------------------------------------------
    def step(self, *args: Any, target: Any = None, return_outputs: bool = False,
             on_nonfinite: str | None = None, normalize_by: float | torch.Tensor | None = None, **kwargs: Any):
        """One training step on the whole minibatch; returns the minibatch loss on every rank.

        ``args`` / ``kwargs`` are the model's inputs (read where stage 0 runs), ``target`` the loss's
        (read where the last stage runs). Gradients accumulate in the parameters' ``.grad``; call
        your optimizer after. With ``return_outputs=True`` returns ``(loss, outputs)``: the merged
        last-stage outputs where the last stage runs, None elsewhere. ``on_nonfinite`` (None, ``"raise"``
        or ``"skip"``, the same on every rank) and fp16's loss scaling act on the step's finished
        gradients as :meth:`~conveyor.pipe.gradients.GradientChecks.finish_step` says.
        ``normalize_by`` (read where the last stage runs): None divides each microbatch's loss by M;
        N, the global minibatch's token count (:func:`conveyor.parallel.count_tokens`), divides
        ``loss_fn``'s per-microbatch SUM by N (:mod:`conveyor.parallel.loss`).
        ``pipe.step(conveyor.Microbatches(inputs=[...], targets=[...]))``: M microbatches of their own
        shapes, split by the caller (:class:`~conveyor.microbatch.Microbatches`); outputs come back as a list.

        Example:
            >>> loss = pipe.step(x, target=y, on_nonfinite="skip")   # doctest: +SKIP
        """
        check_nonfinite_mode(on_nonfinite)
        result = self.ranks.guarded(self.steps.train, args, kwargs, target, return_outputs, normalize_by)
        self.gradient_checks.finish_step(on_nonfinite)
        return result

    def forward(self, *args: Any, **kwargs: Any):
        """Forward only (evaluation, no autograd state): the merged model outputs where the last
        stage runs, None elsewhere."""
        return self.ranks.guarded(self.steps.forward, args, kwargs)

    __call__ = forward

    def logprobs(self, *args: Any, **kwargs: Any) -> torch.Tensor | list[torch.Tensor]:
        """Forward only: each next token's log-prob, [batch, sequence - 1] float32, on every rank; the model's
        inputs as :meth:`forward` takes them, the ids its ``input_ids`` or first positional one (read where stage
        0 and the last stage run; ``torch.equal`` to the unsplit model's: :mod:`conveyor.pipe.logprobs`).

        Example:
            >>> old = pipe.logprobs(input_ids=ids, attention_mask=mask)   # doctest: +SKIP
        """
        return self.ranks.guarded(pipeline_logprobs, self.steps, args, kwargs)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, *, sampling: Sampling | None = None,
                 generator: torch.Generator | None = None, attention_mask: torch.Tensor | None = None,
                 return_logprobs: bool = False, length: int | None = None, kv_cache: bool | None = None) -> Generation:
        """Continue each prompt by up to ``max_new_tokens`` tokens (a collective: every rank, the same arguments;
        each replica its own prompts), through key/value caches where the stages allow (``kv_cache``):
        :mod:`conveyor.pipe.generation`.

        Example:
            >>> out = pipe.generate(ids, 32, sampling=Sampling(do_sample=True, top_p=0.9))   # doctest: +SKIP
        """
        return generate(self, input_ids, max_new_tokens, sampling or Sampling(), generator, attention_mask,
                        return_logprobs, length, kv_cache)

    # --- the step's gradients --------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
        """Clip the whole pipeline's gradients by their total norm; returns that norm on every rank.

        Equal, bit for bit, to ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` on the
        unsplit model (how: :meth:`conveyor.pipe.gradients.GradientChecks.clip_grad_norm_`). A
        collective on a distributed pipeline: call it on every rank, with the same arguments.

        Example:
            >>> loss = pipe.step(x, target=y)                  # doctest: +SKIP
            >>> norm = pipe.clip_grad_norm_(1.0)               # doctest: +SKIP
            >>> optimizer.step(); optimizer.zero_grad()        # doctest: +SKIP
        """
        return self.gradient_checks.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, foreach)

    def forget_norm_layout(self) -> None:
        """Make the next :meth:`clip_grad_norm_` exchange again which parameters have gradients: call it on
        every rank after changing which parameters train (:meth:`GradientChecks.forget_norm_layout` says why).

        Example:
            >>> pipe.forget_norm_layout()   # doctest: +SKIP
        """
        self.gradient_checks.forget_norm_layout()

    @property
    def skipped_steps(self) -> int:
        """Steps dropped by ``on_nonfinite="skip"`` or by loss scaling (their gradients overflowed)."""
        return self.gradient_checks.skipped_steps

    @property
    def loss_scale(self) -> float | None:
        """fp16's loss scale for the next step (None: no loss scaling); a host read, as ``GradScaler.get_scale()``."""
        return self.gradient_checks.loss_scale

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
    def checkpoint_group(self) -> Any:
        """With replicas or TP: the group over every rank of the job, that writes checkpoints (else None)."""
        return self.ranks.checkpoint_group

    @property
    def replicas(self) -> Replicas | None:
        """The data-parallel replicas of this rank's stages (None: one replica)."""
        return self.ranks.find_part(Replicas)

    @property
    def modules(self) -> list[torch.nn.Module]:
        """This process's stage modules, by stage."""
        return [r.module for r in self.runners.values()]

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The parameters of this process's stages (shared ones once)."""
        return (p for _, p in self.named_parameters())

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This process's parameters (shared ones once), under the names their modules give them."""
        yield from named_unique(self.runners, lambda m: m.named_parameters())

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(the unsplit model's name, the whole tensor) of every tensor of this process's stages, TP and FSDP
        shards gathered (a collective over them: iterate to the end on every rank): :mod:`conveyor.pipe.weights`.

        Example:
            >>> engine.load_weights(pipe.named_weights())   # doctest: +SKIP
        """
        return named_weights(self.runners)

    def state_dict(self) -> dict[str, Any]:
        """This process's parameters and buffers under their modules' names."""
        return {name: value for runner in self.runners.values() for name, value in runner.module.state_dict().items()}

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


Split = tuple[list[tuple[tuple, dict]] | None, list[Any] | None]  # (stage 0's microbatches, the last stage's targets)


class StepInputs:
    """A step's inputs as this process's stages read them: the microbatches where stage 0 runs, the
    targets where the last stage runs, on the stage device.

    Example:
        >>> import conveyor.schedule as cs
        >>> inputs = StepInputs(cs.build("gpipe", ranks=1, microbatches=2), {0}, 0, torch.device("cpu"))
        >>> first, targets = inputs.split((torch.arange(4),), {}, None)
        >>> [args[0].tolist() for args, _ in first], targets
        ([[0, 1], [2, 3]], [None, None])
    """

    def __init__(self, schedule: Schedule, stages: set[int], rank: int, device: torch.device) -> None:
        self.num_microbatches = schedule.num_microbatches
        self.needs_inputs = 0 in stages
        self.needs_target = schedule.num_stages - 1 in stages
        self.rank, self.device = rank, device
        self.last_rank = schedule.placement.rank_of(schedule.num_stages - 1)
        self.warned_target = False  # told once that target= is read on the last stage's rank only

    def split(self, args: tuple, kwargs: dict, target: Any) -> Split:
        """The minibatch cut into microbatches as a one-device loop cuts it (on the stage device first: it may
        come from a CPU data loader)."""
        first = targets = None
        if self.needs_inputs:
            if all(a is None for a in args) and not kwargs:
                raise PipelineConfigError(
                    "inputs are missing on the rank that runs stage 0: pass the minibatch to pipe.step(...) there"
                )
            first = split_microbatches(*self._on_device((args, kwargs)), self.num_microbatches)
        if target is not None and not self.needs_target and not self.warned_target:
            self.warned_target = True
            log.warning("conveyor: rank %d was given target=, but the last stage runs on rank %d: ignored here "
                        "(pass target= there; None elsewhere)", self.rank, self.last_rank)
        if self.needs_target:
            targets = [None] * self.num_microbatches if target is None else \
                split_value(self._on_device(target), self.num_microbatches, "target")
        return first, targets

    def given(self, microbatches: Microbatches, args: tuple, kwargs: dict, target: Any) -> Split:
        """The caller's own microbatches, each with its own shapes (nothing else may come beside them)."""
        if args or kwargs or target is not None:
            raise PipelineConfigError(
                "pipe.step(Microbatches(...)) takes the microbatches already split: pass no other positional "
                f"inputs, keyword inputs or target= beside it (got {len(args)} more positional, keywords "
                f"{sorted(kwargs)}, target {'given' if target is not None else 'None'})"
            )
        num = self.num_microbatches
        first = None
        if self.needs_inputs:
            if microbatches.inputs is None:
                raise PipelineConfigError(
                    f"rank {self.rank} runs stage 0 and was given Microbatches(inputs=None): pass the {num} "
                    "microbatches there"
                )
            first = self._on_device(check_given_microbatches(microbatches.inputs, num))
        targets = None
        if self.needs_target:
            targets = [None] * num if microbatches.targets is None else list(microbatches.targets)
            if len(targets) != num:
                raise PipelineConfigError(
                    f"Microbatches(targets=...) holds {len(targets)} targets, but the schedule runs {num} "
                    "microbatches: pass one target per microbatch (or None)"
                )
            targets = self._on_device(targets)
        return first, targets

    def _on_device(self, value: Any) -> Any:
        return value if self.device.type == "cpu" else to_device(value, self.device)


class PipelineSteps:
    """Training and forward-only steps of one process's ``runners`` over its ranks ``backend``.

    Example:
        >>> import torch, conveyor
        >>> pipe = conveyor.Pipeline([torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)], "1f1b", microbatches=2,
        ...                          layout=conveyor.InProcessLayout())
        >>> type(pipe.steps).__name__, pipe.steps.forward((torch.ones(4, 2),), {}).shape
        ('PipelineSteps', torch.Size([4, 1]))
    """

    def __init__(self, backend: RanksBackend, runners: dict[int, StageRunner], schedule: Schedule,
                 stage: StageOptions) -> None:
        self.backend, self.runners, self.schedule, self.stage = backend, runners, schedule, stage
        self.inputs = StepInputs(schedule, set(runners), backend.rank, backend.device)
        # Generation's decode stages of these runners, by (rows a lane, cache length, prompt length): traced once.
        self.decoders: dict[tuple[int, int, int], list[torch.nn.Module]] = {}

    def train(self, args: tuple, kwargs: dict, target: Any, return_outputs: bool,
              normalize_by: float | torch.Tensor | None) -> Any:
        """One training step: the loss on every rank, or ``(loss, outputs)`` with ``return_outputs``.
        ``args[0]`` may be the caller's :class:`~conveyor.microbatch.Microbatches`."""
        given = args[0] if args and isinstance(args[0], Microbatches) else None
        if given is not None:
            first, targets = self.inputs.given(given, args[1:], kwargs, target)
        else:
            first, targets = self.inputs.split(args, kwargs, target)
        set_loss_divisor(self.runners, self.schedule.num_stages, normalize_by, self.backend.dp_size)
        self._run(True, first, targets, return_outputs)
        loss = self.backend.finish_step(self.runners)
        if return_outputs:  # microbatches given one by one come back so
            return loss, self.last_outputs(merged=given is None, clear=False)
        return loss

    def forward(self, args: tuple, kwargs: dict) -> Any:
        """Forward of every microbatch without autograd state: the merged outputs where the last stage
        runs, None elsewhere."""
        outputs = self.forward_each(self.inputs.split(args, kwargs, None)[0])
        return None if outputs is None else merge_outputs(outputs)

    def forward_each(self, first: list[tuple[tuple, dict]] | None) -> list[Any] | None:
        """Forward of the microbatches ``first`` (None where stage 0 does not run) without autograd
        state: the last stage's output of each, by microbatch, where it runs; None elsewhere."""
        self._run(False, first, None, False)
        self.backend.finish_forward()
        return self.last_outputs(merged=False, clear=True)

    def _run(self, train: bool, first: list | None, targets: list | None, keep_outputs: bool) -> None:
        """The backend's run of a training step (``train``: with autograd, timed if the stage options say so) or a
        forward-only one, the runners reset first and the stages' random streams stepped."""
        for runner in self.runners.values():
            runner.reset()
        self.backend.start(train, train and self.stage.record_timeline)
        with torch.set_grad_enabled(train), step_random_streams(self.runners.values(), self.stage.random_streams):
            self.backend.run(train, first, targets, keep_outputs)

    def last_outputs(self, merged: bool, clear: bool) -> Any:
        """The last stage's outputs of every microbatch (None where the last stage does not run):
        ``merged`` as the model would return them for the whole minibatch, else a list."""
        last = self.runners.get(self.schedule.num_stages - 1)
        if last is None:
            return None
        outputs = [last.outputs[m] for m in range(self.schedule.num_microbatches)]
        if merged:
            outputs = merge_outputs(outputs)
        if clear:
            last.outputs.clear()
        return outputs


def _check_records(**records: Any) -> None:
    """Each option record is of its type (a dict or another record passed by mistake is named)."""
    for name, value in records.items():
        if name == "layout" and not isinstance(value, Layout):
            raise PipelineConfigError(f"layout= takes a conveyor.InProcessLayout or conveyor.DistributedLayout; got "
                                      f"{type(value).__name__}")
        kind = {"stage": StageOptions, "transfer": TransferOptions, "model": WholeModel}.get(name)
        if kind is not None and not isinstance(value, kind):
            raise PipelineConfigError(f"{name}= takes a conveyor.options.{kind.__name__}; got {type(value).__name__}")


def _backend(layout: Layout, transfer: TransferOptions, stage: StageOptions) -> RanksBackend:
    """The ranks backend the layout asks for, checked against the stage options it must work with."""
    backend = (InProcessRanks if isinstance(layout, InProcessLayout) else DistributedRanks)(layout, transfer)
    replicas = backend.find_part(Replicas)
    check_together(stage, replicas.kind if replicas is not None else None)  # the kind the layout resolved to
    return backend


def _stage_runners(backend: RanksBackend, schedule: Schedule, modules: Sequence[torch.nn.Module] | torch.nn.Module,
                   loss_fn: LossFn | None, stage: StageOptions, model: WholeModel) -> dict[int, StageRunner]:
    """A runner per stage this process runs, over its modules placed (and wrapped by the backend's parts)."""
    runners: dict[int, StageRunner] = {}
    for rank, mine in backend.place(modules, model).items():
        runners.update(build_runners(schedule, rank, mine, loss_fn, stage))
    share_tied_locally(runners, model.tied_parameters)  # one Parameter per tied parameter within a process
    return runners


def built_fields(schedule: Schedule, layout: Layout, stage: StageOptions, transfer: TransferOptions,
                 model: WholeModel) -> dict[str, str]:
    """What every rank must agree on, as short strings (see RankLifecycle.agree).

    Example:
        >>> import conveyor.schedule as cs
        >>> built_fields(cs.build("gpipe", ranks=2, microbatches=2), DistributedLayout(), StageOptions(),
        ...              TransferOptions(), WholeModel())["schedule"][:18]
        'gpipe P=2 V=1 M=2 '
    """
    programs = hashlib.sha1(repr(schedule.programs).encode()).hexdigest()[:12]
    return {
        "schedule": f"{schedule.name} P={schedule.num_ranks} V={schedule.virtual} M={schedule.num_microbatches} "
                    f"programs {programs}",
        "model": model.describe(),
        "stage options": stage.describe(),
        "transfer options": transfer.describe(),
        "layout": layout.describe(),
    }
