"""Custom ``torch.autograd.Function``s met while tracing: their backward would be lost, so they are refused.

``torch.export(strict=False)`` runs a Function's ``forward`` and records its operations; its
``backward`` is not in the graph, so the stages would differentiate the forward's operations
instead. Where the backward is not the forward's own derivative, training silently changes: the
DeepSeek-V3 modelling code's ``AddAuxiliaryLoss`` returns its input unchanged and gives the
auxiliary loss a gradient of one in ``backward``; traced, the loss is computed and dropped, and
the router gets no gradient from it. :func:`custom_functions_met` records every such call during
a trace, with the module it ran in, so that the trace can refuse, naming them.

Example:
    >>> with custom_functions_met(torch.nn.Linear(2, 2)) as met:
    ...     _ = torch.nn.Linear(2, 2)(torch.ones(1, 2))
    >>> met
    []
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def custom_functions_met(model: nn.Module) -> Iterator[list[tuple[str, str]]]:
    """Within, each call of a custom autograd Function is listed as ``(its name, the module path)``.

    Torch's own Functions are left out: tracing them is torch's business. Put back however it ends.
    """
    names = {id(module): name for name, module in model.named_modules()}
    met: list[tuple[str, str]] = []
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if not cls.__module__.startswith("torch."):
            entry = (f"{cls.__module__}.{cls.__qualname__}", _calling_module(names))
            if entry not in met:
                met.append(entry)
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield met
    finally:
        torch.autograd.Function.apply = original


def _calling_module(names: dict[int, str]) -> str:
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            return names[id(owner)] or "<root>"
        frame = frame.f_back
    return "<root>"


def refusal(model: nn.Module, met: list[tuple[str, str]]) -> str:
    """The TracingError message for custom Functions met while tracing ``model``.

    Example:
        >>> print(refusal(torch.nn.Linear(2, 2), [("m.AddAuxiliaryLoss", "layers.0.mlp")]).splitlines()[1])
          m.AddAuxiliaryLoss in module 'layers.0.mlp'
    """
    where = "\n".join(f"  {function} in module {module!r}" for function, module in met)
    return (
        f"could not split {type(model).__name__}: it calls custom torch.autograd.Function(s), whose "
        f"backward torch.export does not trace:\n{where}\n"
        "the stages would differentiate the forward's operations instead of calling that backward, "
        "so training would differ from the model's (an auxiliary loss attached by such a Function, "
        "as DeepSeek-V3's AddAuxiliaryLoss, would get no gradient at all).\n"
        "how to fix: return the auxiliary loss beside the model's output and add it in loss_fn, or "
        "build those stages by hand (a list of nn.Modules, run eagerly, keeps every Function's "
        "backward) and pass them to conveyor.Pipeline."
    )
