"""Gradient clipping over a whole pipeline, bit for bit as ``clip_grad_norm_`` on the unsplit model.

``torch.nn.utils.clip_grad_norm_`` takes the norm of each gradient, stacks those norms
(gradients grouped by device and dtype by torch's own grouping function, the groups in that
function's order, parameter order within a group) and takes the norm of that vector. Clipping
each rank by its own parameters' norm would scale every rank by a different factor: training
would silently leave single-device results. Here each rank computes its parameters' norms
exactly as torch does (:func:`parameter_norms`); :class:`conveyor.parallel.norm_exchange.NormExchange`
gathers every rank's norms, each with its place in the unsplit model's parameter order, and
every rank stacks them as torch would for the unsplit model, with the same grouping function.
So every rank finds the same total norm, equal to what one device finds, and scales its
gradients by the same factor (:func:`scale_local_grads`).

Example (one process, one dtype: the stacked norms in parameter order are torch's vector):
    >>> import torch
    >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    >>> for p in [*a.parameters(), *b.parameters()]:
    ...     p.grad = torch.ones_like(p)
    >>> grads = [p.grad for m in (a, b) for p in m.parameters()]
    >>> total = torch.linalg.vector_norm(torch.stack(parameter_norms(grads, 2.0)), 2.0)
    >>> torch.equal(total, torch.nn.utils.get_total_norm(grads))
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)


def parameter_norms(grads: Sequence[torch.Tensor], norm_type: float,
                    foreach: bool | None = None) -> list[torch.Tensor]:
    """Each gradient's norm, computed as ``torch.nn.utils.get_total_norm`` computes it.

    ``foreach`` as in torch: ``None`` uses the foreach kernels where torch would, ``True``
    insists on them (an error on a device that has none), ``False`` never uses them.
    """
    if not grads:
        return []  # a stage without parameters, or whose parameters are all frozen
    norms: list[torch.Tensor | None] = [None] * len(grads)
    grouped = _group_tensors_by_device_and_dtype([list(grads)], with_indices=True)
    for (device, _), ([tensors], indices) in grouped.items():
        if (foreach is None and _has_foreach_support(tensors, device)) or (
            foreach and _device_has_foreach_support(device)
        ):
            values = torch._foreach_norm(tensors, norm_type)
        elif foreach:
            raise RuntimeError(
                f"foreach=True was passed, but there are no foreach kernels for {device.type} tensors; "
                "pass foreach=None (torch picks) or foreach=False"
            )
        else:
            values = [torch.linalg.vector_norm(t, norm_type) for t in tensors]
        for i, value in zip(indices, values):
            norms[i] = value
    return norms  # type: ignore[return-value]


def scale_local_grads(grads: Sequence[torch.Tensor], max_norm: float, total: torch.Tensor,
                      foreach: bool | None = None) -> None:
    """Scale gradients in place as ``torch.nn.utils.clip_grads_with_norm_`` scales parameters' ones.

    For gradients that are not any parameter's ``.grad`` as torch would find it: the local
    tensors of data-parallel DTensor gradients, whose shards each rank scales by the same
    factor (torch's function reads ``p.grad`` and would mix DTensors with a plain total).
    """
    if not grads:
        return
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's formula, to the bit
    grouped = _group_tensors_by_device_and_dtype([list(grads)])
    for (device, _), ([tensors], _) in grouped.items():
        if (foreach is None and _has_foreach_support(tensors, device)) or (
            foreach and _device_has_foreach_support(device)
        ):
            torch._foreach_mul_(tensors, coefficient.to(device))
        elif foreach:
            raise RuntimeError(f"foreach=True was passed, but there are no foreach kernels for {device.type} tensors")
        else:
            for tensor in tensors:
                tensor.mul_(coefficient.to(device))


def check_finite(total: torch.Tensor, norm_type: float) -> None:
    """Raise as torch does when the total norm is NaN or infinite (every rank finds the same total)."""
    if torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the pipeline's gradients is non-finite ({total.item()}), "
            "so it cannot be clipped; to scale the gradients by it anyway pass error_if_nonfinite=False"
        )
