"""Measure each stage's forward + backward time on a real device (for ``split_method="time"``).

Stages run one after another on the example microbatch, each timed on its own:
forward, then backward with ones as the gradients of its outputs (the ones are
made inside the timed span, as a real output gradient would arrive). The best of
a few rounds is kept: other processes on the machine only ever add time. The model
is left as it was: gradients, buffers (BatchNorm statistics) and the random
generator state are restored.

Profiling's home is :mod:`conveyor.plan.profile` (each unit's F, I, W and bytes, for the
planner). This stage timer stays in the frontend because ``split_method="time"`` is a
frontend option (``split_model`` balances by it, whatever pipeline calls it) and the frontend
may not import the planner, which imports the frontend; the timing rules both follow
(:func:`synchronize`, :func:`save_module_state` / :func:`restore_module_state`) are defined here
once and used there.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from conveyor.errors import SplitError
from conveyor.frontend.stage import as_received

if TYPE_CHECKING:
    from conveyor.frontend.split import ModelSplit


def profile_stages(
    split: ModelSplit,
    example_args: Sequence[Any],
    example_kwargs: Mapping[str, Any] | None,
    device: torch.device,
    repeats: int = 3,
) -> list[float]:
    """Seconds of forward + backward of each stage of ``split`` on ``device``.

    Each of ``repeats`` rounds runs every stage once (after one warm-up pass), and a
    stage keeps its best time over the rounds: a burst of load from other processes
    then spoils one round of a stage, not all its measurements.

    Example:
        >>> import conveyor.frontend as frontend
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        >>> x = torch.randn(4, 8)
        >>> split = frontend.split_model(model, 2, example_args=(x,))
        >>> len(profile_stages(split, (x,), None, torch.device("cpu")))
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
    # Stages of a real model share its tensors, so all can be kept at once; stages of a
    # meta model allocate their tensors, so each is built, timed and freed in turn.
    on_meta = any(t.device.type == "meta" for t in split.model.parameters())
    kept = (
        None if on_meta else [split.stage_module(stage, device) for stage in range(split.num_stages)]
    )
    devices = [device] if device.type == "cuda" else []
    best = [float("inf")] * split.num_stages
    with torch.random.fork_rng(devices=devices):
        for round_index in range(1 if on_meta else repeats):
            inputs: tuple[Any, ...] = ()
            for stage in range(split.num_stages):
                module = split.stage_module(stage, device) if kept is None else kept[stage]
                saved = save_module_state(module)
                warm_up = 1 if round_index == 0 else 0
                timed = repeats if on_meta else 1
                for run in range(warm_up + timed):
                    seconds, outputs = _time_once(module, stage, args, kwargs, inputs, device)
                    if run >= warm_up:
                        best[stage] = min(best[stage], seconds)
                    restore_module_state(module, saved)
                del module
                if stage < split.num_stages - 1:
                    specs = split.stage_output_specs(stage)
                    inputs = tuple(
                        value.detach().requires_grad_(spec.requires_grad)
                        if isinstance(value, torch.Tensor)
                        else value
                        for value, spec in zip(outputs, specs)
                    )
    return best


def _time_once(module, stage, args, kwargs, inputs, device) -> tuple[float, Any]:
    """Forward, then backward with ones as output gradients; seconds of both."""
    received = tuple(as_received(value) for value in inputs)
    synchronize(device)
    start = time.perf_counter()
    outputs = module(*args, **kwargs) if stage == 0 else module(*received)
    tensors = [
        value
        for value in pytree.tree_leaves(outputs)
        if isinstance(value, torch.Tensor) and value.requires_grad
    ]
    if tensors:
        torch.autograd.backward(tensors, [torch.ones_like(tensor) for tensor in tensors])
    synchronize(device)
    return time.perf_counter() - start, outputs


def save_module_state(module: torch.nn.Module) -> tuple[list[Any], list[torch.Tensor]]:
    """A module's gradients and a copy of its buffers, for :func:`restore_module_state` after a timed run.

    Example:
        >>> bn = torch.nn.BatchNorm1d(2); saved = save_module_state(bn); _ = bn(torch.randn(4, 2))
        >>> restore_module_state(bn, saved); bn.running_mean.tolist()
        [0.0, 0.0]
    """
    grads = [parameter.grad for parameter in module.parameters()]
    buffers = [buffer.detach().clone() for buffer in module.buffers()]
    return grads, buffers


def restore_module_state(module: torch.nn.Module, saved: tuple[list[Any], list[torch.Tensor]]) -> None:
    """Put back what :func:`save_module_state` saved: timing leaves no trace on the model."""
    grads, buffers = saved
    for parameter, grad in zip(module.parameters(), grads):
        parameter.grad = grad
    with torch.no_grad():
        for buffer, value in zip(module.buffers(), buffers):
            buffer.copy_(value)


def synchronize(device: torch.device) -> None:
    """Wait for a GPU's queued work, so that a host clock times it (nothing on the CPU).

    Example:
        >>> synchronize(torch.device("cpu"))  # returns at once
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
