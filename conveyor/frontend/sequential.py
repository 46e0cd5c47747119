"""Run stages one after another in one process, exactly as a pipeline would.

Each stage receives the previous stage's outputs as a transport would deliver
them: fresh contiguous copies (an ``expand``-ed mask arrives materialised), leaves
that require grad iff the sent tensor did. Stage boundaries are real, as across
processes. The backward pass then runs stage by stage from the last one, handing
each stage the gradients of its outputs, as the runtime does.

Parity this gives (checked by tests/frontend): outputs and every untied
parameter's gradient are bitwise equal (``torch.equal``) to the unsplit model's for
the same inputs, because each stage runs the very operations eager mode runs, in
the same order. A tied parameter (held by several stages, see
``ModelSplit.tied_groups``) gets one gradient per copy; their sum equals the unsplit
gradient up to the order of the floating-point additions (``allclose``; with two
copies the sum is even bitwise equal, since ``a + b == b + a``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from conveyor.frontend.split import ModelSplit


def run_sequential(
    stages: ModelSplit | Sequence[nn.Module],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> Any:
    """Run ``stages`` on one microbatch; with ``loss_fn``, also run the backward pass.

    Args:
        stages: a ``ModelSplit`` (its stage modules are built here, on ``split.device``)
            or the stage modules themselves (any modules following the stage call
            convention, e.g. built by hand).
        args, kwargs: the model's inputs, given to stage 0.
        loss_fn: maps the last stage's output to a scalar to backpropagate
            (``lambda out: out.loss`` for a Hugging Face model called with ``labels``).

    Returns:
        The last stage's output (what the unsplit model returns). Gradients are
        accumulated into the stages' parameters' ``.grad``.

    Example:
        >>> import conveyor.frontend as frontend
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> x = torch.randn(3, 4)
        >>> split = frontend.split_model(model, 2, example_args=(x,))
        >>> out = run_sequential(split.stage_modules(), (x,), loss_fn=lambda out: out.sum())
        >>> torch.equal(out, model(x))
        True
    """
    modules = stages.stage_modules() if isinstance(stages, ModelSplit) else list(stages)
    if not modules:
        raise ValueError("run_sequential needs at least one stage")
    received: list[tuple[Any, ...]] = []  # what each stage > 0 was given
    sent: list[tuple[Any, ...]] = []  # what each stage < last returned
    output: Any = None
    for index, module in enumerate(modules):
        if index == 0:
            output = module(*args, **dict(kwargs or {}))
        else:
            inputs = tuple(_as_received(value) for value in sent[-1])
            received.append(inputs)
            output = module(*inputs)
        if index < len(modules) - 1:
            sent.append(output if isinstance(output, tuple) else (output,))
    if loss_fn is None:
        return output

    loss = loss_fn(output)
    loss.backward()
    for index in range(len(modules) - 2, -1, -1):
        tensors, grads = [], []
        for value, leaf in zip(sent[index], received[index]):
            if isinstance(value, torch.Tensor) and value.requires_grad and leaf.grad is not None:
                tensors.append(value)
                grads.append(leaf.grad)
        if tensors:
            torch.autograd.backward(tensors, grads)
    return output


def _as_received(value: Any) -> Any:
    """What a transport delivers: a fresh contiguous copy, a leaf that requires grad iff the sent one did."""
    if isinstance(value, torch.Tensor):
        received = value.detach().clone(memory_format=torch.contiguous_format)
        return received.requires_grad_(value.requires_grad)
    return value

