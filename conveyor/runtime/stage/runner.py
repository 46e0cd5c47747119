"""One stage on one rank: forward, full backward, and the I / W halves, per microbatch.

The runner keeps, per microbatch in flight, only what backward needs: the
stage's gradient-carrying inputs, the gradient edges of its outputs (not the
outputs themselves: once sent, their storage can go, Megatron's "deallocate
output" idea) and, on the last stage, the loss (divided by M, times the loss scale if any). Everything is dropped
as soon as the last backward pass of that microbatch is done.

Example:
    >>> import torch
    >>> runner = StageRunner(0, 1, torch.nn.Linear(2, 1), loss_fn=lambda y, t: (y - t).pow(2).mean(),
    ...                      num_microbatches=1)
    >>> _ = runner.forward(0, ((torch.ones(1, 2),), {}), target=torch.zeros(1, 1))
    >>> _ = runner.backward_full(0, None)
    >>> runner.module.weight.grad is not None
    True
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils import _pytree as pytree

from conveyor.errors import PipelineConfigError, StageExecutionError
from conveyor.runtime.stage.backward import (
    GraphAnalysisCache,
    PendingWeightGrad,
    backward_full,
    backward_input,
)
from conveyor.runtime.stage.compile import compile_options, compile_stage
from conveyor.runtime.stage.main_grad import ParamPrecision, apply_param_precision
from conveyor.runtime.stage.memory import MemoryMeter
from conveyor.runtime.stage.precision import autocast_region
from conveyor.runtime.stage.recompute import StageRecompute
from conveyor.runtime.stage.rng import StepRandomness
from conveyor.runtime.stage.segments import SegmentedPass, run_to_end, segmented_backward, within

if TYPE_CHECKING:
    from conveyor.options import StageOptions

LossFn = Callable[[Any, Any], torch.Tensor]
log = logging.getLogger(__name__)


@dataclass
class _InFlight:
    inputs: list[torch.Tensor]  # gradient-carrying inputs (leaves), in flatten order
    roots: list = field(default_factory=list)  # gradient edges of outputs that carry gradients
    loss: torch.Tensor | None = None
    pending: PendingWeightGrad | None = None
    passes: SegmentedPass | None = None  # the forward ran in segments (see forward_steps)


def grad_leaves(value: Any) -> list[torch.Tensor]:
    """Tensors in ``value`` that carry a gradient, in flatten order (the order gradients travel in)."""
    found: list[torch.Tensor] = []
    if _collect_plain(value, found):
        return found
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.requires_grad]


_PLAIN_LEAVES = (type(None), bool, int, float, str)


def _collect_plain(value: Any, found: list[torch.Tensor]) -> bool:
    """grad_leaves for tensors in plain tuples, lists and dicts, in pytree's order; False for anything else.

    Every stage call and output goes through grad_leaves; pytree's generic walk costs
    15-20 µs even for one tensor, a tenth of a tiny stage's forward.
    """
    kind = type(value)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        if value.requires_grad:
            found.append(value)
        return True
    if kind is tuple or kind is list or kind is dict:
        return all(_collect_plain(item, found) for item in (value.values() if kind is dict else value))
    return kind in _PLAIN_LEAVES


class StageRunner:
    """Runs ``module`` as stage ``stage`` of ``num_stages``, as ``options`` (a
    :class:`~conveyor.options.StageOptions`, whole; None: its defaults) say."""

    def __init__(
        self,
        stage: int,
        num_stages: int,
        module: torch.nn.Module,
        *,
        loss_fn: LossFn | None,
        num_microbatches: int,
        rank: int = 0,
        options: StageOptions | None = None,
    ) -> None:
        if options is None:
            from conveyor.options import StageOptions

            options = StageOptions()
        self.options = options
        # Cast before anything reads the parameters or compiles the forward (the objects stay).
        self.param_precision: ParamPrecision | None = options.param_precision()
        apply_param_precision(module, self.param_precision)
        self.stage = stage
        self.num_stages = num_stages
        self.module = module
        self.loss_fn = loss_fn
        self.num_microbatches = num_microbatches
        # What each microbatch's loss is divided by: M (the mean over microbatches) unless the
        # step normalizes by a token count (see conveyor.parallel.loss.set_loss_divisor).
        self.loss_divisor: int | float = num_microbatches
        # What the loss it backpropagates is multiplied by (fp16's loss scale, a tensor the pipeline updates
        # in place: conveyor.runtime.stage.loss_scale); None: unscaled. The loss it reports stays unscaled.
        self.loss_scale: torch.Tensor | None = None
        self.rank = rank
        # Forward and loss run under this autocast dtype (None: as the parameters are).
        self.autocast = options.autocast_dtype
        self.params: list[torch.nn.Parameter] = []
        self.refresh_params()
        self.weight_grad_analyses = GraphAnalysisCache()  # the I/W graph analysis, once per graph shape
        self.in_flight: dict[int, _InFlight] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, Any] = {}
        self.randomness: StepRandomness | None = None  # set by the pipeline for each step
        self.memory_meter: MemoryMeter | None = None  # set by the executor with measure_memory
        # What this stage recomputes in backward (None: nothing); per block, it wraps the blocks now.
        policy = options.recompute_policy(stage, num_stages)
        self.recompute = (None if policy is None else
                          StageRecompute(module, policy, hold=self._memory_hold, stage=stage))
        # torch.compile options (None: eager); the module stays as given, its calls go through `call`.
        compile = self.compile = compile_options(options.compile)
        self.call = module if compile is None else compile_stage(module, stage, compile)
        if self.recompute is not None and self.recompute.whole_stage:
            self.call = self.recompute.checkpointed(self.call)
        self.fused_backward = False  # a compiled region made I run the full backward (logged once)
        # What F, B, I and W run under, besides autocast: a tensor-parallel stage's DTensor contexts
        # (implicit replication, loss_parallel), set by the pipeline that parallelized it.
        self.context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        # A part that exchanges tensors inside the stage (expert parallelism's all-to-alls) may run its forward in
        # steps that yield while each exchange is in flight: stepped(args, kwargs, passes) -> a generator
        # returning the output (conveyor.runtime.stage.segments). Used only by forward_steps, in overlapped pairs.
        self.stepped: Callable[[tuple, dict, SegmentedPass], Generator[None, None, Any]] | None = None

    def refresh_params(self) -> None:
        """Read the module's gradient-carrying parameters again (I hands them to W as its targets).

        Call it after something put other Parameter objects in the module: FSDP's unshard puts
        the gathered parameters, whose ``.grad`` its reduce-scatter reads, in place of the
        sharded ones (see :mod:`conveyor.parallel.fsdp`). Cached rather than read per
        microbatch: the walk over the module costs a little on every I.
        """
        self.params = [p for p in self.module.parameters() if p.requires_grad]

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def _where(self, microbatch: int) -> str:
        return f"rank {self.rank}, stage {self.stage}, microbatch {microbatch}"

    def _memory_hold(self) -> Any:
        """What counts the tensors a selective checkpoint or a cut keeps outside autograd (None: not measuring)."""
        meter = self.memory_meter
        return None if meter is None else meter.count_kept

    def forward(self, microbatch: int, inputs: tuple[tuple, dict], target: Any = None,
                *, keep_output: bool = False) -> Any:
        """Run F; returns the output to hand to the next stage (None on the last stage)."""
        args, kwargs = inputs
        if self.randomness is not None:
            self.randomness.seed_for(self.stage, microbatch)
        with self._forward_context(microbatch):
            try:
                output = self.call(*args, **kwargs)
            except Exception as exc:
                raise StageExecutionError(
                    f"forward failed on {self._where(microbatch)}: {type(exc).__name__}: {exc}"
                ) from exc
            return self._forward_done(microbatch, args, kwargs, output, target, keep_output)

    def forward_steps(self, microbatch: int, inputs: tuple[tuple, dict], target: Any = None,
                      *, keep_output: bool = False) -> Generator[None, None, Any]:
        """F in steps: with :attr:`stepped` set (a part that exchanges tensors inside the stage), it yields while
        each exchange is in flight, and so will its backward; else the plain :meth:`forward`. The same output."""
        stepped = self.stepped
        if stepped is None or not torch.is_grad_enabled():
            return self.forward(microbatch, inputs, target, keep_output=keep_output)
        if self.randomness is not None:
            self.randomness.seed_for(self.stage, microbatch)
        steps = self._stepped_forward(stepped, microbatch, *inputs, target, keep_output)
        return (yield from within(steps, functools.partial(self._forward_context, microbatch)))

    def _forward_context(self, microbatch: int) -> contextlib.ExitStack:
        """What F runs in: the stage's context, autocast, and (training, measured) the memory meter's count."""
        stack, meter = contextlib.ExitStack(), self.memory_meter
        stack.enter_context(self.context())
        stack.enter_context(autocast_region(self.module, self.autocast))
        if meter is not None and torch.is_grad_enabled():
            stack.enter_context(meter.saving(self.stage, microbatch))
        return stack

    def _stepped_forward(self, stepped: Callable, microbatch: int, args: tuple, kwargs: dict, target: Any,
                         keep_output: bool) -> Generator[None, None, Any]:
        passes = SegmentedPass(hold=self._memory_hold())  # measured: what the cuts keep counts too
        try:
            output = yield from stepped(args, kwargs, passes)
        except Exception as exc:
            where = self._where(microbatch)
            raise StageExecutionError(f"forward failed on {where}: {type(exc).__name__}: {exc}") from exc
        return self._forward_done(microbatch, args, kwargs, output, target, keep_output, passes)

    def _forward_done(self, microbatch: int, args: tuple, kwargs: dict, output: Any, target: Any,
                      keep_output: bool, passes: SegmentedPass | None = None) -> Any:
        if not torch.is_grad_enabled():
            if self.is_last:
                self.outputs[microbatch] = output
                return None
            return output
        record = _InFlight(inputs=grad_leaves((args, kwargs)), passes=passes)
        if self.is_last:
            if keep_output:
                self.outputs[microbatch] = pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), output)
            loss = checked_loss(self.loss_fn, output, target, self._where(microbatch)) / self.loss_divisor
            record.loss = loss if self.loss_scale is None else loss * self.loss_scale  # as GradScaler.scale
            self.losses[microbatch] = loss.detach()
            self.in_flight[microbatch] = record
            return None
        record.roots = [get_gradient_edge(t) for t in grad_leaves(output)]
        self.in_flight[microbatch] = record
        return output

    def _roots(self, record: _InFlight, output_grads: list | None):
        if self.is_last:
            return [record.loss], [None]
        grads = list(output_grads or [])
        if len(grads) != len(record.roots):
            raise StageExecutionError(
                f"{len(grads)} output gradients arrived on {self._where(-1)} for "
                f"{len(record.roots)} gradient-carrying outputs; the next stage's inputs do not "
                "match this stage's outputs"
            )
        return record.roots, grads

    def backward_full(self, microbatch: int, output_grads: list | None) -> list:
        """Run B; returns the gradients of this stage's gradient-carrying inputs (None where unused)."""
        if getattr(self.in_flight.get(microbatch), "passes", None) is not None:  # its forward ran in segments
            return run_to_end(self.backward_steps(microbatch, output_grads))
        record = self._take(microbatch, "B")
        roots, grads = self._roots(record, output_grads)
        try:
            with self.context():
                return backward_full(roots, grads, record.inputs)
        except Exception as exc:
            raise StageExecutionError(f"backward failed on {self._where(microbatch)}: {exc}") from exc

    def backward_steps(self, microbatch: int, output_grads: list | None, *, split: bool = False
                       ) -> Generator[None, None, list]:
        """B (or I, with ``split``) in steps: a forward that ran in segments (:meth:`forward_steps`) is
        backpropagated segment by segment, yielding while each reverse exchange is in flight (an I keeps each
        segment's weight gradients for W); any other at once. Returns the input gradients."""
        record = self.in_flight.get(microbatch)
        if record is None or record.passes is None:
            return (self.backward_input if split else self.backward_full)(microbatch, output_grads)
        roots, grads = self._roots(record, output_grads)
        weights = (self.params, self.weight_grad_analyses) if split else None
        try:
            input_grads, pending = yield from within(segmented_backward(record.passes, roots, grads, record.inputs,
                                                                         weights), self.context)
        except Exception as exc:
            raise StageExecutionError(f"backward failed on {self._where(microbatch)}: {exc}") from exc
        if split:  # W: every segment's weight gradients, the last segment's first
            record.roots, record.loss, record.passes = [], None, None
            record.pending = PendingWeightGrad(input_grads, [group for p in pending for group in p.groups])
        else:
            self.in_flight.pop(microbatch)
        return input_grads

    def backward_input(self, microbatch: int, output_grads: list | None) -> list:
        """Run I; keeps what W needs. Returns the input gradients."""
        record = self.in_flight.get(microbatch)
        if record is None:
            raise StageExecutionError(f"I on {self._where(microbatch)} without a forward before it")
        if record.passes is not None:  # its forward ran in segments
            return run_to_end(self.backward_steps(microbatch, output_grads, split=True))
        roots, grads = self._roots(record, output_grads)
        try:
            with self.context():
                record.pending = backward_input(roots, grads, record.inputs, self.params, self.weight_grad_analyses)
        except Exception as exc:
            raise StageExecutionError(f"input-gradient backward failed on {self._where(microbatch)}: {exc}") from exc
        record.roots, record.loss = [], None
        if record.pending.fused and not self.fused_backward:
            self.fused_backward = True
            log.warning("conveyor: stage %d (rank %d) holds a compiled region (torch.compile) whose one backward "
                        "graph computes its input and weight gradients together: its I runs the full backward and "
                        "its W has nothing left to do (no I/W split on this stage)", self.stage, self.rank)
        return record.pending.input_grads

    def backward_weight(self, microbatch: int) -> None:
        """Run W after I: accumulate the parameter gradients, then free the microbatch."""
        record = self._take(microbatch, "W")
        if record.pending is None:
            raise StageExecutionError(f"W on {self._where(microbatch)} before its I")
        try:
            with self.context():
                record.pending.backward_weight()
        except Exception as exc:
            raise StageExecutionError(f"weight-gradient backward failed on {self._where(microbatch)}: {exc}") from exc

    def _take(self, microbatch: int, what: str) -> _InFlight:
        record = self.in_flight.pop(microbatch, None)
        if record is None:
            raise StageExecutionError(f"{what} on {self._where(microbatch)} without a forward before it")
        return record

    def reset(self) -> None:
        self.in_flight.clear()
        self.losses.clear()
        self.outputs.clear()


def checked_loss(loss_fn: LossFn | None, output: Any, target: Any, where: str) -> torch.Tensor:
    """``loss_fn(output, target)`` as a 0-d tensor that requires grad, or an error naming ``where`` and the fix."""
    if loss_fn is None:
        raise PipelineConfigError(
            "the last stage needs a loss_fn(output, target) -> scalar tensor to train; "
            "pass loss_fn= to Pipeline (use pipe.forward(...) for inference)"
        )
    try:
        loss = loss_fn(output, target)
    except Exception as exc:
        hint = ("; the target was None here: pass target= to pipe.step on the rank that runs the last stage"
                if target is None else "")
        raise StageExecutionError(f"loss_fn failed on {where}: {type(exc).__name__}: {exc}{hint}") from exc
    # One look at the shape (each call into torch costs tens of µs on a core that idled).
    shape = loss.shape if isinstance(loss, torch.Tensor) else None
    if shape is None or len(shape) > 1 or (shape and shape[0] != 1):
        got = f"a tensor of shape {tuple(shape)}" if shape is not None else type(loss).__name__
        raise PipelineConfigError(f"loss_fn must return a scalar tensor; it returned {got} on {where} (reduce it, "
                                  "e.g. with .mean() or .sum())")
    if not loss.requires_grad:
        raise PipelineConfigError(
            f"the loss on {where} does not require grad: it does not depend on any "
            "parameter or gradient-carrying input; check loss_fn and the model's output"
        )
    return loss.reshape(()) if shape else loss


def build_runners(schedule: Any, rank: int, modules: Sequence[torch.nn.Module] | torch.nn.Module,
                  loss_fn: LossFn | None, options: StageOptions | None = None) -> dict[int, StageRunner]:
    """A :class:`StageRunner` for each stage ``schedule`` places on ``rank``, over ``modules`` in that order,
    each doing what ``options`` (a :class:`~conveyor.options.StageOptions`, passed whole) says.

    Example:
        >>> import conveyor.schedule as cs
        >>> runners = build_runners(cs.build("gpipe", ranks=1, microbatches=2), 0, [torch.nn.Linear(2, 2)], None)
        >>> list(runners), runners[0].num_microbatches
        ([0], 2)
    """
    stages = schedule.stages_of(rank)
    modules = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
    if len(modules) != len(stages):
        raise PipelineConfigError(
            f"schedule {schedule.name!r} places stages {list(stages)} on rank {rank}, so pass "
            f"{len(stages)} module(s) in that order; got {len(modules)}"
        )
    for i, module in enumerate(modules):
        if not isinstance(module, torch.nn.Module):
            raise PipelineConfigError(
                f"module {i} for stage {stages[i]} on rank {rank} is a {type(module).__name__}, not an nn.Module"
            )
    return {
        s: StageRunner(s, schedule.num_stages, m, loss_fn=loss_fn, num_microbatches=schedule.num_microbatches,
                       rank=rank, options=options)
        for s, m in zip(stages, modules)
    }


def named_unique(runners: dict[int, StageRunner], items) -> Iterator[tuple[str, Any]]:
    """``items(module)`` of every runner's module, each object once; a name two hand-built stages
    both use gets its stage as prefix for the later one (``stage1.weight``)."""
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
