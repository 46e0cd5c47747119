"""What one call of :meth:`Pipeline.step` or :meth:`Pipeline.forward` does, on either ranks backend.

The minibatch is cut into the schedule's microbatches exactly as a one-device loop would cut it
(:mod:`conveyor.microbatch`), or taken as the caller cut it (:class:`~conveyor.microbatch.Microbatches`),
moved to the stage device where it came from a CPU loader (:class:`StepInputs`), and handed to the
ranks backend, which runs every program this process holds (:class:`PipelineSteps`); the loss (on
every rank) and the last stage's outputs come back.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from conveyor.errors import PipelineConfigError
from conveyor.microbatch import (
    Microbatches,
    check_given_microbatches,
    merge_outputs,
    split_microbatches,
    split_value,
)
from conveyor.options import StageOptions
from conveyor.parallel.loss import set_loss_divisor
from conveyor.pipe.backend import RanksBackend
from conveyor.runtime.device import to_device
from conveyor.runtime.rng import step_random_streams
from conveyor.runtime.runner import StageRunner
from conveyor.schedule.ir import Schedule

log = logging.getLogger("conveyor.pipe")

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
        """The minibatch cut into microbatches as a one-device loop cuts it."""
        first = self._split_inputs(args, kwargs) if self.needs_inputs else None
        if target is not None and not self.needs_target and not self.warned_target:
            self.warned_target = True
            log.warning("conveyor: rank %d was given target=, but the last stage runs on rank %d: ignored here "
                        "(pass target= there; None elsewhere)", self.rank, self.last_rank)
        targets = self._split_target(target) if self.needs_target else None
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

    def _split_inputs(self, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
        if all(a is None for a in args) and not kwargs:
            raise PipelineConfigError(
                "inputs are missing on the rank that runs stage 0: pass the minibatch to pipe.step(...) there"
            )
        args, kwargs = self._on_device((args, kwargs))  # the minibatch may come from a CPU data loader
        return split_microbatches(args, kwargs, self.num_microbatches)

    def _split_target(self, target: Any) -> list[Any]:
        if target is None:
            return [None] * self.num_microbatches
        return split_value(self._on_device(target), self.num_microbatches, "target")

    def _on_device(self, value: Any) -> Any:
        return value if self.device.type == "cpu" else to_device(value, self.device)


class PipelineSteps:
    """Training and forward-only steps of one process's ``runners`` over its ranks ``backend``.

    Example:
        >>> import torch, conveyor
        >>> pipe = conveyor.LocalPipeline([torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)], "1f1b", microbatches=2)
        >>> type(pipe.steps).__name__, pipe.steps.forward((torch.ones(4, 2),), {}).shape
        ('PipelineSteps', torch.Size([4, 1]))
    """

    def __init__(self, backend: RanksBackend, runners: dict[int, StageRunner], schedule: Schedule,
                 stage: StageOptions, inputs: StepInputs) -> None:
        self.backend, self.runners, self.schedule, self.stage = backend, runners, schedule, stage
        self.inputs = inputs

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
        for runner in self.runners.values():
            runner.reset()
        self.backend.start(True, self.stage.record_timeline)
        with torch.enable_grad(), step_random_streams(self.runners.values(), self.stage.random_streams):
            self.backend.run(True, first, targets, return_outputs)
        loss = self.backend.finish_step(self.runners)
        if return_outputs:  # microbatches given one by one come back so
            return loss, self.last_outputs(merged=given is None, clear=False)
        return loss

    def forward(self, args: tuple, kwargs: dict) -> Any:
        """Forward of every microbatch without autograd state: the merged outputs where the last stage
        runs, None elsewhere."""
        first = self.inputs.split(args, kwargs, None)[0]
        for runner in self.runners.values():
            runner.reset()
        self.backend.start(False, False)
        with torch.no_grad(), step_random_streams(self.runners.values(), self.stage.random_streams):
            self.backend.run(False, first, None, False)
        self.backend.finish_forward()
        return self.last_outputs(merged=True, clear=True)

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
