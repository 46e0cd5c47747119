"""Gradient clipping over a whole pipeline, bit for bit as ``clip_grad_norm_`` on the unsplit model.

``torch.nn.utils.clip_grad_norm_`` takes the norm of each gradient, stacks those norms
(gradients grouped by device and dtype by torch's own grouping function, the groups in that
function's order, parameter order within a group) and takes the norm of that vector. Clipping
each rank by its own parameters' norm would scale every rank by a different factor: training
would silently leave single-device results. Here each rank computes its parameters' norms
exactly as torch does; the norms travel to every rank exactly (as float64, which holds any
float16, bfloat16 or float32 value), each with its place in the unsplit model's parameter
order; and every rank stacks them as torch would for the unsplit model, with the same grouping
function. So every rank finds the same total norm, equal to what one device finds, and scales
its gradients by the same factor.

Example (one process, the whole model's norms at hand):
    >>> import torch
    >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    >>> for p in [*a.parameters(), *b.parameters()]:
    ...     p.grad = torch.ones_like(p)
    >>> grads = [[p.grad for p in m.parameters()] for m in (a, b)]
    >>> places = [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]  # (stage, position): the model's order here
    >>> encoded = [encode_norms(k, g, parameter_norms(g, 2.0)) for k, g in zip(places, grads)]
    >>> total = total_norm(encoded, 2.0, torch.device("cpu"))
    >>> torch.equal(total, torch.nn.utils.get_total_norm([p.grad for m in (a, b) for p in m.parameters()]))
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

# Per parameter: (its place in the unsplit model's parameter order, gradient dtype, norm dtype,
# norm value). The place and the gradient's dtype decide where torch puts the norm in the
# stacked vector; the norm's dtype (real for a complex gradient) is what the value is rebuilt as.
EncodedNorms = list[tuple[tuple[int, ...], str, str, float]]


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


def encode_norms(places: Sequence[tuple[int, ...]], grads: Sequence[torch.Tensor],
                 norms: Sequence[torch.Tensor]) -> EncodedNorms:
    """Norms as plain values, to send to other ranks without losing a bit (float64 holds every float16,
    bfloat16 and float32 value); one device-to-host copy for all of them.

    ``places``: each parameter's sort key in the unsplit model's parameter order.
    """
    if not norms:
        return []
    values = torch.stack([n.to(torch.float64) for n in norms]).tolist()
    return [(place, _name(g.dtype), _name(n.dtype), v) for place, g, n, v in zip(places, grads, norms, values)]


def total_norm(norms: Sequence[EncodedNorms], norm_type: float, device: torch.device) -> torch.Tensor:
    """The norm of the per-parameter norms, stacked as torch stacks them for the unsplit model.

    ``norms``: every rank's encoded norms, in any order; each carries its place in the model.
    torch groups the gradients by (device, dtype), in the order of its own grouping function,
    and stacks the norms group by group, in parameter order within a group; on one device that
    is a grouping by the gradients' dtypes, reproduced here with the same function.
    """
    flat = sorted((entry for part in norms for entry in part), key=lambda entry: entry[0])
    if not flat:
        return torch.tensor(0.0, device=device)
    placeholders = [torch.empty(0, dtype=getattr(torch, grad_dtype), device=device) for _, grad_dtype, _, _ in flat]
    grouped = _group_tensors_by_device_and_dtype([placeholders], with_indices=True)
    order = [i for _, indices in grouped.values() for i in indices]
    stacked = torch.stack([
        torch.tensor(flat[i][3], dtype=getattr(torch, flat[i][2]), device=device) for i in order
    ])
    return torch.linalg.vector_norm(stacked, norm_type)


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


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_finite(total: torch.Tensor, norm_type: float) -> None:
    """Raise as torch does when the total norm is NaN or infinite (every rank finds the same total)."""
    if torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the pipeline's gradients is non-finite ({total.item()}), "
            "so it cannot be clipped; to scale the gradients by it anyway pass error_if_nonfinite=False"
        )
