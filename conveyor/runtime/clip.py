"""Gradient clipping over a whole pipeline, bit for bit as ``clip_grad_norm_`` on the unsplit model.

``torch.nn.utils.clip_grad_norm_`` takes the norm of each gradient, stacks those norms in
parameter order (grouped by dtype, groups in order of first appearance) and takes the norm
of that vector. Clipping each rank by its own parameters' norm would scale every rank by a
different factor: training would silently leave single-device results. Here each rank
computes its parameters' norms exactly as torch does, the norms travel to every rank
(exactly: as float64, which holds any float16, bfloat16 or float32 value), and every rank
stacks them in the unsplit model's order, so every rank finds the same total norm, equal to
what one device finds, and scales its gradients by the same factor.

Example (one process, the whole model's norms at hand):
    >>> import torch
    >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    >>> for p in [*a.parameters(), *b.parameters()]:
    ...     p.grad = torch.ones_like(p)
    >>> norms = [parameter_norms([p.grad for p in m.parameters()], 2.0) for m in (a, b)]
    >>> total = total_norm([encode_norms(n) for n in norms], 2.0, torch.device("cpu"))
    >>> torch.equal(total, torch.nn.utils.get_total_norm([p.grad for m in (a, b) for p in m.parameters()]))
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

EncodedNorms = list[tuple[str, float]]  # (dtype name, value) per parameter, in parameter order


def parameter_norms(grads: Sequence[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Each gradient's norm, computed as ``torch.nn.utils.get_total_norm`` computes it (foreach where it can)."""
    norms: list[torch.Tensor | None] = [None] * len(grads)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, grad in enumerate(grads):
        groups.setdefault((grad.device, grad.dtype), []).append(index)
    for (device, _), indices in groups.items():
        tensors = [grads[i] for i in indices]
        if device.type in ("cpu", "cuda"):
            values = torch._foreach_norm(tensors, norm_type)
        else:
            values = [torch.linalg.vector_norm(t, norm_type) for t in tensors]
        for i, value in zip(indices, values):
            norms[i] = value
    return norms  # type: ignore[return-value]


def encode_norms(norms: Sequence[torch.Tensor]) -> EncodedNorms:
    """Norms as plain (dtype, float) pairs, to send to other ranks without losing a bit."""
    return [(str(n.dtype).removeprefix("torch."), n.item()) for n in norms]


def total_norm(norms_in_model_order: Sequence[EncodedNorms], norm_type: float,
               device: torch.device) -> torch.Tensor:
    """The norm of the per-parameter norms, stacked as torch stacks them for the unsplit model.

    ``norms_in_model_order``: one list per stage, stages in order.
    """
    flat = [(getattr(torch, dtype), value) for stage in norms_in_model_order for dtype, value in stage]
    if not flat:
        return torch.tensor(0.0, device=device)
    # One device holds every parameter of the unsplit model, so torch's grouping by (device,
    # dtype) is a grouping by dtype, groups in order of first appearance.
    order: dict[torch.dtype, list[torch.Tensor]] = {}
    for dtype, value in flat:
        order.setdefault(dtype, []).append(torch.tensor(value, dtype=dtype, device=device))
    stacked = torch.stack([norm for norms in order.values() for norm in norms])
    return torch.linalg.vector_norm(stacked, norm_type)


def check_finite(total: torch.Tensor, norm_type: float) -> None:
    """Raise as torch does when the total norm is NaN or infinite (every rank finds the same total)."""
    if torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the pipeline's gradients is non-finite ({total.item()}), "
            "so it cannot be clipped; to scale the gradients by it anyway pass error_if_nonfinite=False"
        )
