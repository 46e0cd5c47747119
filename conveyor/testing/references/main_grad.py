"""The single-device reference for ``param_dtype="bf16"``: bf16 parameters, fp32 ``main_grad``, fp32 masters.

What a pipeline built with ``param_dtype="bf16"`` and trained with :class:`conveyor.MasterWeights`
must equal bit for bit (tests and docs share it). One step, on one device:

1. for each microbatch ``i`` in order: ``(loss_fn(model(x_i), y_i) / M).backward()`` on the bf16
   model, then for each parameter ``main_grad += p.grad.float()`` (fp32) and ``p.grad = None``;
2. optionally ``clip_grad_norm_`` over the main grads (as gradients of the fp32 masters);
3. the optimizer steps the fp32 masters with the main grads as their gradients, and each bf16
   parameter becomes its master rounded (``p.copy_(master)``).

Example:
    >>> import torch
    >>> torch.manual_seed(0) and None
    >>> ref = MainGradReference(torch.nn.Linear(4, 1), torch.optim.SGD, lr=0.1)
    >>> x, y = torch.ones(4, 4, dtype=torch.bfloat16), torch.zeros(4, 1)
    >>> loss = ref.accumulate(x, y, num_microbatches=2, loss_fn=lambda out, t: (out.float() - t).pow(2).mean())
    >>> [g.dtype for g in ref.main_grads], ref.model.weight.dtype
    ([torch.float32, torch.float32], torch.bfloat16)
    >>> ref.optimizer_step()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class MainGradReference:
    """One device training ``model`` (cast to bf16 here) with fp32 main grads and fp32 masters."""

    def __init__(self, model: torch.nn.Module, optimizer_cls: Callable[..., torch.optim.Optimizer],
                 dtype: torch.dtype = torch.bfloat16, **kwargs: Any) -> None:
        self.model = model.to(dtype)
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.main_grads: list[torch.Tensor | None] = [None] * len(self.params)
        self.masters = [torch.nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in self.params]
        self.optimizer = optimizer_cls(self.masters, **kwargs)

    def accumulate(self, inputs: torch.Tensor, targets: Any, num_microbatches: int,
                   loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """Forward and backward of every microbatch in order; returns the summed loss (each / M)."""
        total = None
        split_targets = torch.tensor_split(targets, num_microbatches) if targets is not None \
            else [None] * num_microbatches
        for x, y in zip(torch.tensor_split(inputs, num_microbatches), split_targets):
            loss = loss_fn(self.model(x), y) / num_microbatches
            loss.backward()
            for i, param in enumerate(self.params):
                if param.grad is None:
                    continue  # no gradient from this microbatch: nothing to add
                if self.main_grads[i] is None:
                    self.main_grads[i] = torch.zeros_like(param, dtype=torch.float32)
                self.main_grads[i] += param.grad.float()
                param.grad = None
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None
        return total

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the main grads, in model order (scaled in place)."""
        self._hand_over()
        return torch.nn.utils.clip_grad_norm_(self.masters, max_norm, norm_type)

    @torch.no_grad()
    def optimizer_step(self) -> None:
        """The optimizer on the fp32 masters; each bf16 parameter becomes its master rounded; grads cleared."""
        self._hand_over()
        self.optimizer.step()
        for param, master in zip(self.params, self.masters):
            param.copy_(master)
            master.grad = None
        self.main_grads = [None] * len(self.params)

    def _hand_over(self) -> None:
        for master, grad in zip(self.masters, self.main_grads):
            master.grad = grad  # shared: clipping scales the main grad itself
