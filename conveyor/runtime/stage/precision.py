"""Mixed precision for stages: each stage's forward (and loss) under the autocast region one device would use.

``torch.autocast`` decides per operation which dtype to compute in, so running every stage
of a model under the same region as the whole model gives the same operations in the same
dtypes: the pipeline stays bitwise equal to a single-device run under
``torch.autocast(device_type, dtype)``. What crosses stages keeps the dtype its op produced
(a bf16 matmul's output crosses as bf16: half the bytes of fp32).

Example:
    >>> autocast_dtype("bf16"), autocast_dtype("fp16"), autocast_dtype(None)
    (torch.bfloat16, torch.float16, None)
    >>> region = autocast_region(torch.nn.Linear(2, 2), torch.bfloat16)
    >>> with region:
    ...     torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype
    torch.bfloat16
"""

from __future__ import annotations

import contextlib
import itertools
from types import MappingProxyType

import torch

from conveyor.errors import PipelineConfigError

# The floating-point dtypes conveyor knows by name (param_dtype=, grad_accum_dtype=).
DTYPE_NAMES = MappingProxyType({
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32,
})
_NAMES = MappingProxyType({**DTYPE_NAMES, "fp32": None, "float32": None, "no": None})  # autocast=: fp32 is none


def refuse_fp16(what: str, spec: object, reason: str, fix: str) -> None:
    """Raise :class:`PipelineConfigError` for an fp16 setting the pipeline cannot serve, saying why and the fix.

    fp16 trains only with its loss scaled (:mod:`conveyor.runtime.stage.loss_scale`, on by default
    for fp16): what keeps the scaler from reaching every gradient is refused here.

    Example:
        >>> refuse_fp16("param_dtype", "fp16", "its gradients would sum in fp16", "use grad_accum_dtype='fp32'")
        Traceback (most recent call last):
        ...
        conveyor.errors.PipelineConfigError: param_dtype='fp16': its gradients would sum in fp16; use ...
    """
    raise PipelineConfigError(f"{what}={spec!r}: {reason}; {fix}, or use 'bf16' (fp32's range, no scaling needed)")


def autocast_dtype(spec: str | torch.dtype | None) -> torch.dtype | None:
    """The dtype an ``autocast=`` argument asks for, or None for no autocast.

    Accepts ``"bf16"``, ``"fp16"`` (trained with loss scaling: :mod:`conveyor.runtime.stage.loss_scale`),
    ``"fp32"`` (none), their long names, ``torch.bfloat16`` / ``torch.float16``, or None.

    Example:
        >>> autocast_dtype(torch.bfloat16), autocast_dtype("fp32")
        (torch.bfloat16, None)
    """
    if spec is None or isinstance(spec, torch.dtype) and spec in (torch.bfloat16, torch.float16):
        return spec
    if isinstance(spec, str) and spec.lower() in _NAMES:
        return _NAMES[spec.lower()]
    raise PipelineConfigError(
        f"autocast={spec!r} is not a mixed precision conveyor knows; use 'bf16', 'fp16', a torch dtype, "
        "or None (full precision)"
    )


def autocast_region(module: torch.nn.Module, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """A fresh context to run ``module``'s forward in: ``torch.autocast`` on its device, or nothing.

    Example:
        >>> with autocast_region(torch.nn.Linear(2, 2), None):
        ...     torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype
        torch.float32
    """
    if dtype is None:
        return contextlib.nullcontext()
    first = next(itertools.chain(module.parameters(), module.buffers()), None)  # a module with neither: the CPU
    return torch.autocast("cpu" if first is None else first.device.type, dtype=dtype)
