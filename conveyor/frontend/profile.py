"""Measure each stage's forward + backward time on a real device (for ``split_method="time"``).

Stages run one after another on the example microbatch, each timed on its own:
forward, then backward with ones as the gradients of its outputs. The best of a
few repeats is kept (other processes on the machine only ever add time). The
model is left as it was: gradients, buffers (BatchNorm statistics) and the random
generator state are restored.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from conveyor.frontend.errors import SplitError

if TYPE_CHECKING:
    from conveyor.frontend.plan import SplitPlan


def profile_stages(
    plan: SplitPlan,
    example_args: Sequence[Any],
    example_kwargs: Mapping[str, Any] | None,
    device: torch.device,
    repeats: int = 3,
) -> list[float]:
    """Seconds of forward + backward of each stage of ``plan`` on ``device``.

    Example:
        >>> import conveyor.frontend as frontend
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        >>> x = torch.randn(4, 8)
        >>> plan = frontend.split_model(model, 2, example_args=(x,))
        >>> len(profile_stages(plan, (x,), None, torch.device("cpu")))
        2
    """
    leaves = pytree.tree_leaves((tuple(example_args), dict(example_kwargs or {})))
    if any(isinstance(leaf, torch.Tensor) and leaf.device.type == "meta" for leaf in leaves):
        raise SplitError(
            "split_method='time' runs the model, so example inputs must hold real values "
            "(got meta tensors); pass real example tensors (the model itself may stay on meta)."
        )
    args, kwargs = pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(device), (tuple(example_args), dict(example_kwargs or {}))
    )
    devices = [device] if device.type == "cuda" else []
    costs = []
    with torch.random.fork_rng(devices=devices):
        inputs: Any = None
        for stage in range(plan.num_stages):
            module = plan.stage_module(stage, device)
            saved = _save_state(module)
            best = float("inf")
            outputs: Any = None
            for _ in range(repeats + 1):  # the first run warms up (allocations, lazy init)
                stage_inputs = None if stage == 0 else tuple(_as_received(v) for v in inputs)
                _synchronize(device)
                start = time.perf_counter()
                if stage == 0:
                    outputs = module(*args, **kwargs)
                else:
                    outputs = module(*stage_inputs)
                _synchronize(device)
                forward_s = time.perf_counter() - start
                tensors = [
                    value
                    for value in pytree.tree_leaves(outputs)
                    if isinstance(value, torch.Tensor) and value.requires_grad
                ]
                grads = [torch.ones_like(tensor) for tensor in tensors]
                start = time.perf_counter()
                if tensors:
                    torch.autograd.backward(tensors, grads)
                _synchronize(device)
                backward_s = time.perf_counter() - start
                best = min(best, forward_s + backward_s)
                _restore_state(module, saved)
            costs.append(best)
            del module
            if stage == plan.num_stages - 1:
                break
            inputs = outputs if isinstance(outputs, tuple) else (outputs,)
            inputs = tuple(
                value.detach() if isinstance(value, torch.Tensor) else value for value in inputs
            )
            # Keep the flag: the next stage must see which values carry gradients.
            inputs = tuple(
                value.requires_grad_(spec.requires_grad)
                if isinstance(value, torch.Tensor)
                else value
                for value, spec in zip(inputs, plan.stage_output_specs(stage))
            )
    return costs


def _as_received(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    return value


def _save_state(module: torch.nn.Module) -> tuple[list[Any], list[torch.Tensor]]:
    grads = [parameter.grad for parameter in module.parameters()]
    buffers = [buffer.detach().clone() for buffer in module.buffers()]
    return grads, buffers


def _restore_state(module: torch.nn.Module, saved: tuple[list[Any], list[torch.Tensor]]) -> None:
    grads, buffers = saved
    for parameter, grad in zip(module.parameters(), grads):
        parameter.grad = grad
    with torch.no_grad():
        for buffer, value in zip(module.buffers(), buffers):
            buffer.copy_(value)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
