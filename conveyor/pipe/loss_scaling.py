"""A pipeline's loss scaling (fp16): each loss scaled before its backward, the step's gradients unscaled once.

:class:`StepLossScaling` is what a pipeline's gradient checks (:class:`~conveyor.pipe.gradients.GradientChecks`)
hold when ``StageOptions.loss_scaling`` is on (by default with ``autocast="fp16"`` or ``param_dtype="fp16"``).
It concerns every layout alike, so it sits with the gradient checks rather than in a stage part. A step:

1. the last stage's runner backpropagates ``loss / M * scale`` (``GradScaler.scale``); the loss the
   step returns stays unscaled;
2. once every part finished the step's gradients (replicas reduced, tied copies summed), each rank
   divides its gradients (``main_grad`` where a parameter has one; a DTensor's local part) by the
   scale with torch's ``_amp_foreach_non_finite_check_and_unscale_``, which flags a non-finite one;
3. the flags are combined over every rank of the job (the pipeline's group, then each part's:
   replicas, tensor-parallel ranks) with a MAX all-reduce, so every rank decides alike;
4. the scale backs off or grows (``torch._amp_update_scale_``) on every rank alike, and a step whose
   gradients overflowed is dropped as ``on_nonfinite="skip"`` drops one: gradients set to None,
   so ``optimizer.step()`` leaves parameters and state as they were (what ``GradScaler.step`` skips).

Clipping after the step (``pipe.clip_grad_norm_``) sees unscaled gradients, as after
``GradScaler.unscale_``. A scale that falls below its floor (``LossScaling.min_scale``) raises
:class:`~conveyor.errors.NonFiniteError` naming the cause, instead of skipping every step from then on.

Example:
    >>> import torch, conveyor
    >>> torch.manual_seed(0) and None
    >>> pipe = conveyor.Pipeline([torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)], "1f1b", microbatches=2,
    ...                               loss_fn=lambda y, t: (y.float() - t).pow(2).mean(),
    ...                               stage=conveyor.StageOptions(autocast="fp16"), layout=conveyor.InProcessLayout())
    >>> loss = pipe.step(torch.ones(4, 4), target=torch.full((4, 1), 100.0))  # x 65536: fp16 gradients overflow
    >>> pipe.loss_scale, pipe.skipped_steps, [p.grad for p in pipe.parameters()][0]   # skipped, the scale halved
    (32768.0, 1, None)
    >>> loss = pipe.step(torch.ones(4, 4), target=torch.zeros(4, 1))
    >>> pipe.loss_scale, pipe.skipped_steps, torch.isfinite(loss).item()
    (32768.0, 1, True)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from conveyor.errors import NonFiniteError
from conveyor.parallel.clipping import describe_nonfinite, local_part, nonfinite_flags
from conveyor.runtime.stage.loss_scale import LossScaler, LossScaling
from conveyor.runtime.stage.main_grad import gradient
from conveyor.runtime.stage.runner import StageRunner

if TYPE_CHECKING:
    from conveyor.pipe.gradients import GradientChecks  # which holds this


class StepLossScaling:
    """The scale of the runners of ``checks`` (the pipeline's gradient checks, which drop a skipped step: this
    process's runners of their schedule, over their ranks backend), stepped as ``scaling`` says."""

    def __init__(self, scaling: LossScaling, checks: GradientChecks) -> None:
        self.backend, self.runners, self.schedule, self.checks = checks.backend, checks.runners, checks.schedule, checks
        self.scaler = LossScaler(scaling, self.backend.device)
        self.consecutive_skips = 0  # overflowing steps in a row: the floor's message says how many
        for runner in self.runners.values():
            runner.loss_scale = self.scaler.scale  # updated in place; only a last stage multiplies by it

    @property
    def scale(self) -> float:
        """The scale the next step multiplies its losses by (a host read, as ``GradScaler.get_scale``)."""
        return self.scaler.scale.item()

    def finish_step(self, on_nonfinite: str | None) -> None:
        """After the step's gradients are complete: unscale them, agree on overflow with every rank, step
        the scale, and drop the step if its gradients overflowed. A non-finite loss whose gradients
        stayed finite is left to ``on_nonfinite``, as without scaling."""
        flags = self.backend.guarded(self._unscale_and_update)
        report = describe_nonfinite(flags)
        if not any(flags[:self.schedule.num_stages]):
            self.consecutive_skips = 0
            if report and on_nonfinite is not None:
                self.checks.after_nonfinite(report, on_nonfinite)
            return
        self.consecutive_skips += 1
        self.checks.after_nonfinite(report, "skip")  # the scaler's overflow: skipped whatever on_nonfinite says
        scale, floor = self.scale, self.scaler.scaling.min_scale
        if scale < floor:
            raise NonFiniteError(
                f"the loss scale fell to {scale:.3g}, below its floor min_scale={floor:.3g}, after "
                f"{self.consecutive_skips} steps in a row whose gradients overflowed (this one: {report}): the "
                "model overflows fp16 at every scale (in its forward or loss), so no step can train; check the "
                "inputs and learning rate, or train in bf16 (autocast='bf16'), whose range is fp32's")

    def _unscale_and_update(self) -> list[float]:
        """Unscale this rank's gradients; the combined flags (per stage: a gradient overflowed; last: 1 + the
        first microbatch whose loss is not finite), read once on the host; the scale stepped."""
        seen: set[int] = set()

        def unscaled(runner: StageRunner) -> torch.Tensor | None:  # main_grad where a parameter has one
            params = [p for p in runner.module.parameters() if gradient(p) is not None and id(p) not in seen]
            seen.update(map(id, params))  # a parameter two local stages share: unscaled once
            return self.scaler.unscale_([local_part(gradient(p)) for p in params]) if params else None

        num_stages = self.schedule.num_stages
        flags = nonfinite_flags(self.runners, num_stages, self.schedule.num_microbatches, self.backend.device,
                                unscaled)
        combined = self.backend.combine_flags(flags)
        self.scaler.update((combined[:num_stages].amax() > 0).to(torch.float32))  # alike on every rank
        return combined.tolist()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the scaler's scale and growth tracker, and the overflowing steps in a row."""
        return {**self.scaler.state_dict(), "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s ``state``."""
        self.scaler.load_state_dict(state)
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
