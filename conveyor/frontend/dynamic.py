"""Dynamic dimensions: one trace whose stages run microbatches of any sequence length (or batch size).

``split_model(..., dynamic_shapes={"input_ids": {1: "seq"}, "labels": {1: "seq"}})`` traces with
``torch.export``'s dynamic shapes: the named dims of those inputs stay symbolic, so every
operation that reads them (``view(x, [b, seq, -1, d])``, ``arange(seq)``) takes the size of the
microbatch at hand, and a size that one stage needs from another crosses the boundary as a
plain int. Each stage still runs exactly the operations eager runs, on the same shapes, so
outputs and gradients stay bitwise equal to the unsplit model. A dim given as a string is
``torch.export.Dim.AUTO`` (export relates equal dims itself); a ``torch.export.Dim`` is kept as
given. A dim that tracing specialised anyway (the model guards on its size) is a
:class:`~conveyor.errors.TracingError` naming it, not a silent fixed shape.

Shapes recorded for checks keep the example's sizes, with the dynamic dims listed apart:
stage 0 and each stage's received values are checked on every other dim.

Example:
    >>> fits((2, 12, 8), (1,), (2, 30, 8)), fits((2, 12, 8), (1,), (3, 30, 8))
    (True, False)
    >>> describe_shape((2, 12, 8), (1,))
    '[2, *, 8]'
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from conveyor.errors import TracingError


def export_dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict, dynamic: Mapping[str, Any] | None) -> Any:
    """``dynamic`` ({input name: {dim: name or Dim}}) as ``torch.export.export`` takes it (None: static)."""
    if dynamic is None:
        return None
    if not isinstance(dynamic, Mapping):
        raise TracingError(f"dynamic_shapes takes {{input name: {{dim: name}}}}; got {type(dynamic).__name__}")
    names = _positional_names(model)
    given = dict(zip(names, args)) | dict(kwargs)
    unknown = sorted(set(dynamic) - set(given))
    if unknown:
        raise TracingError(f"dynamic_shapes names {unknown}, which the example microbatch does not pass; it passes "
                           f"{sorted(given)}")
    spec: dict[str, Any] = {}
    for name, value in given.items():
        dims = dynamic.get(name)
        if dims is None or not isinstance(value, torch.Tensor):
            spec[name] = None
            continue
        spec[name] = {int(dim): torch.export.Dim.AUTO if isinstance(how, str) else how for dim, how in dims.items()}
    if not kwargs:
        return tuple(spec[name] for name in names[:len(args)])
    return {name: spec[name] for name in list(names[:len(args)]) + list(kwargs)}


def _positional_names(model: nn.Module) -> list[str]:
    """The names of ``model.forward``'s parameters that may be passed by position, in order."""
    return [name for name, parameter in inspect.signature(model.forward).parameters.items()
            if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)]


def symbolic_dims(value: Any) -> tuple[int, ...]:
    """The dims of a traced tensor value whose size is symbolic (empty for anything else)."""
    if not isinstance(value, torch.Tensor):
        return ()
    # A symbol that tracing specialised (the model compared it with a number) has become that number.
    return tuple(index for index, size in enumerate(value.shape)
                 if isinstance(size, torch.SymInt) and size.node.maybe_as_int() is None)


def concrete_shape(value: torch.Tensor) -> tuple[int, ...]:
    """A traced tensor's shape with each symbolic size replaced by the example's size."""
    return tuple(_hint(size) for size in value.shape)


def _hint(size: Any) -> int:
    if isinstance(size, torch.SymInt):
        fixed = size.node.maybe_as_int()
        return fixed if fixed is not None else size.node.hint
    return int(size)


def is_data_dependent(value: Any) -> bool:
    """Whether a traced value holds a size or scalar read from tensor data (an unbacked symbol).

    Symbols of dynamic input dims are backed (they have the example's size as a hint) and fine."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return bool(free_unbacked_symbols(value))
    if isinstance(value, torch.Tensor):
        return any(isinstance(size, torch.SymInt) and free_unbacked_symbols(size) for size in value.shape)
    if isinstance(value, tuple | list):
        return any(is_data_dependent(item) for item in value)
    return False


def check_stayed_dynamic(dynamic: Mapping[str, Any] | None, model: nn.Module, args: tuple, kwargs: dict,
                         example: list[Any], in_spec: Any) -> None:
    """Raise TracingError naming each requested dim that tracing fixed to the example's size."""
    if not dynamic:
        return
    import torch.utils._pytree as pytree

    names = _positional_names(model)
    ordered = {key: kwargs[key] for key in in_spec.child(1).context}
    paths = [path for path, _ in pytree.tree_flatten_with_path((tuple(args), ordered))[0]]
    fixed = []
    for leaf, path in zip(example, paths):
        top = path[1]
        name = names[top.idx] if path[0].idx == 0 and top.idx < len(names) else getattr(top, "key", None)
        for dim in (dynamic.get(name) or {}) if len(path) == 2 else {}:
            if leaf.is_tensor and int(dim) not in leaf.dynamic:
                fixed.append(f"{name} dim {dim} (= {leaf.shape[int(dim)]})")
    if fixed:
        raise TracingError(
            f"dynamic_shapes asked for {', '.join(fixed)} to vary, but tracing fixed it to the example's size: the "
            "model's code guards on it (a Python branch on the size, or a size it is checked against). Make that "
            "code size-agnostic, or trace without dynamic_shapes and pad microbatches to one length."
        )


def fits(shape: tuple[int, ...], dynamic: tuple[int, ...], got: tuple[int, ...] | torch.Size) -> bool:
    """Whether a tensor of shape ``got`` fits ``shape`` whose ``dynamic`` dims take any size."""
    return len(got) == len(shape) and all(
        index in dynamic or int(size) == want for index, (size, want) in enumerate(zip(got, shape))
    )


def describe_shape(shape: tuple[int, ...], dynamic: tuple[int, ...]) -> str:
    """``shape`` as a list, ``*`` for each dynamic dim."""
    return "[" + ", ".join("*" if index in dynamic else str(size) for index, size in enumerate(shape)) + "]"
