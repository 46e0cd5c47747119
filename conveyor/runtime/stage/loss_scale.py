"""Dynamic loss scaling for fp16: torch's ``GradScaler`` rules, for a backward that runs inside a step.

fp16 has a small range: gradients below 2**-24 round to zero, so the loss is multiplied by a
large scale before backward and the gradients divided by it after. A pipeline runs every
backward inside ``pipe.step``, where no ``torch.amp.GradScaler`` can reach the loss, so the
pipeline scales each microbatch's loss itself (:attr:`LossScaler.scale` multiplies the loss its
last stage backpropagates) and, once the step's gradients are complete, unscales them and
updates the scale with torch's own kernels (``torch._amp_foreach_non_finite_check_and_unscale_``,
``torch._amp_update_scale_``), so the sequence of scales and the unscaled gradients are
``GradScaler``'s bit for bit. :class:`LossScaling` holds ``GradScaler``'s knobs with its
defaults, and a floor: a scale below ``min_scale`` means the loss or gradients overflow at
every scale, and the run stops saying so instead of skipping every step from then on.

Example:
    >>> scaler = LossScaler(LossScaling(init_scale=4.0, growth_interval=1), torch.device("cpu"))
    >>> grads = [torch.tensor([8.0, 4.0])]
    >>> found = scaler.unscale_(grads); grads[0].tolist(), found.item()
    ([2.0, 1.0], 0.0)
    >>> scaler.update(found); scaler.scale.item()            # grows after growth_interval good steps
    8.0
    >>> scaler.update(torch.tensor(1.0)); scaler.scale.item()   # backs off after an overflow
    4.0
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from conveyor.errors import PipelineConfigError, positive_int


@dataclass(frozen=True, slots=True)
class LossScaling:
    """How the loss scale starts, grows and backs off: ``torch.amp.GradScaler``'s arguments and defaults.

    ``min_scale``: the floor. Below 2**-24, fp16's smallest subnormal, even a loss gradient of 1
    scaled by it rounds to zero in fp16: no step can be trained any more, so a scale that falls
    below the floor stops the run naming the cause (:class:`~conveyor.errors.NonFiniteError`).
    From the default ``init_scale`` that takes 41 overflowing steps in a row.

    Example:
        >>> LossScaling().describe()
        'init_scale=65536.0 growth_factor=2.0 backoff_factor=0.5 growth_interval=2000 min_scale=5.96e-08'
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 2.0**-24

    def __post_init__(self) -> None:
        for name in ("init_scale", "growth_factor", "backoff_factor", "min_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise PipelineConfigError(f"LossScaling.{name} takes a positive finite number; got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.growth_factor <= 1.0 or self.backoff_factor >= 1.0:
            raise PipelineConfigError(
                f"LossScaling needs growth_factor > 1 and backoff_factor < 1 (as torch.amp.GradScaler); got "
                f"growth_factor={self.growth_factor}, backoff_factor={self.backoff_factor}")
        if not positive_int(self.growth_interval):
            raise PipelineConfigError(f"LossScaling.growth_interval takes a whole number of steps >= 1; got "
                                      f"{self.growth_interval!r}")
        if self.min_scale >= self.init_scale:
            raise PipelineConfigError(f"LossScaling.min_scale ({self.min_scale}) must be below init_scale "
                                      f"({self.init_scale}): the floor the scale may not fall under")

    def describe(self) -> str:
        """``name=value`` for each knob, the text ranks compare."""
        return " ".join(f"{f.name}={getattr(self, f.name):.3g}" if f.name == "min_scale" else
                        f"{f.name}={getattr(self, f.name)}" for f in fields(self))


def loss_scaling(spec: Any, fp16: bool) -> LossScaling | None:
    """What ``StageOptions(loss_scaling=...)`` asks for: None (the default: on where the stages compute
    in fp16), True, False, a :class:`LossScaling` or its fields as a mapping. Refuses fp16 without it.

    Example:
        >>> loss_scaling(None, fp16=True).init_scale, loss_scaling(None, fp16=False)
        (65536.0, None)
        >>> loss_scaling({"growth_interval": 10}, fp16=False).growth_interval
        10
    """
    if spec is None:
        scaling = LossScaling() if fp16 else None
    elif spec is True:
        scaling = LossScaling()
    elif spec is False:
        scaling = None
    elif isinstance(spec, LossScaling):
        scaling = spec
    elif isinstance(spec, Mapping):
        known = {f.name for f in fields(LossScaling)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise PipelineConfigError(f"loss_scaling does not know {unknown}; its fields are {sorted(known)}")
        scaling = LossScaling(**dict(spec))
    else:
        raise PipelineConfigError(f"loss_scaling={spec!r}: use None (on for fp16), True, False, "
                                  "conveyor.LossScaling(...) or a mapping of its fields")
    if fp16 and scaling is None:
        raise PipelineConfigError(
            f"loss_scaling={spec!r}: fp16 needs loss scaling (its small gradients underflow to zero without it): "
            "leave loss_scaling unset or True (torch.amp.GradScaler's rules, inside the pipeline's step), or use "
            "'bf16', which has fp32's range and needs none")
    return scaling


class LossScaler:
    """The scale and its growth tracker on ``device``, stepped by ``GradScaler``'s kernels as ``scaling`` says.

    :attr:`scale` is a float32 tensor updated in place, so whoever holds it (a last stage's runner)
    always multiplies by the current one.
    """

    def __init__(self, scaling: LossScaling, device: torch.device) -> None:
        self.scaling = scaling
        self.scale = torch.full((), scaling.init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.full((), 0, dtype=torch.int32, device=device)

    def unscale_(self, grads: Iterable[torch.Tensor]) -> torch.Tensor:
        """Divide ``grads`` by the scale in place (GradScaler's fp64 reciprocal); return a float32
        flag, 1 where one of them is not finite (0 else), on the scale's device."""
        inv_scale = self.scale.double().reciprocal().float()  # as GradScaler.unscale_: exact for powers of 2
        found_inf = torch.zeros((), dtype=torch.float32, device=self.scale.device)
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for grad in grads:
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
        with torch.no_grad():
            for (device, _), group in groups.items():
                found_here = found_inf.to(device)
                torch._amp_foreach_non_finite_check_and_unscale_(group, found_here, inv_scale.to(device))
                if found_here is not found_inf:
                    found_inf += found_here.to(found_inf.device)
        return found_inf

    def update(self, found_inf: torch.Tensor) -> None:
        """Back off the scale if ``found_inf`` is not 0 (and restart the growth count), else count a good
        step and grow it after ``growth_interval`` of them: ``torch._amp_update_scale_``, in place."""
        scaling = self.scaling
        found = found_inf.to(self.scale.device, torch.float32)
        torch._amp_update_scale_(self.scale, self.growth_tracker, found, scaling.growth_factor,
                                 scaling.backoff_factor, scaling.growth_interval)

    def state_dict(self) -> dict[str, Any]:
        """The scale and growth tracker as Python numbers (exact: a float32 fits a float), with the knobs.

        Example:
            >>> LossScaler(LossScaling(), torch.device("cpu")).state_dict()["scale"]
            65536.0
        """
        return {"scale": self.scale.item(), "growth_tracker": int(self.growth_tracker.item()),
                "scaling": asdict(self.scaling)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (what :meth:`state_dict` returned): the scale and growth tracker."""
        self.scale.fill_(float(state["scale"]))
        self.growth_tracker.fill_(int(state["growth_tracker"]))
