"""Split a minibatch into microbatches exactly as a single-device loop would.

Every tensor in the inputs and the target is cut with
``torch.tensor_split(t, num_microbatches, dim=0)``; other values are given to
every microbatch unchanged. The batch size must be divisible by the number of
microbatches, so that each microbatch's ``loss / M`` weighs the same as in
single-device gradient accumulation.

Example:
    >>> import torch
    >>> parts = split_microbatches((torch.arange(6),), {"scale": 2}, 3)
    >>> [p[0][0].tolist() for p in parts], parts[0][1]
    ([[0, 1], [2, 3], [4, 5]], {'scale': 2})
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from conveyor.errors import PipelineConfigError


def _path_name(path) -> str:
    return "".join(str(k) for k in path) or "<value>"


def split_value(value: Any, num_microbatches: int, what: str) -> list[Any]:
    """Split every tensor leaf of ``value`` along dim 0 into ``num_microbatches`` parts."""
    leaves_with_path, spec = pytree.tree_flatten_with_path(value)
    per_leaf: list[list[Any]] = []
    for path, leaf in leaves_with_path:
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0:
                raise PipelineConfigError(
                    f"{what}{_path_name(path)} is a 0-d tensor and cannot be split into "
                    f"{num_microbatches} microbatches; pass per-sample tensors with the batch on dim 0"
                )
            batch = leaf.shape[0]
            if batch % num_microbatches:
                raise PipelineConfigError(
                    f"{what}{_path_name(path)} has batch size {batch} on dim 0, which "
                    f"{num_microbatches} microbatches do not divide; use a batch size that is a "
                    f"multiple of {num_microbatches} or another number of microbatches"
                )
            per_leaf.append(list(torch.tensor_split(leaf, num_microbatches, dim=0)))
        else:
            per_leaf.append([leaf] * num_microbatches)
    return [
        pytree.tree_unflatten([parts[i] for parts in per_leaf], spec) for i in range(num_microbatches)
    ]


def split_microbatches(
    args: tuple, kwargs: dict, num_microbatches: int
) -> list[tuple[tuple, dict]]:
    """``(args, kwargs)`` of each microbatch, in microbatch order."""
    arg_parts = split_value(tuple(args), num_microbatches, "input args")
    kwarg_parts = split_value(dict(kwargs), num_microbatches, "input kwargs")
    return list(zip(arg_parts, kwarg_parts))


@dataclass(frozen=True, slots=True)
class Microbatches:
    """The M microbatches of one step, split by the caller, each with its own shapes.

    ``inputs``: one per microbatch (None where this rank does not run stage 0), each a dict of
    keyword inputs, a tuple of positional ones or one tensor; ``targets``: one per microbatch (or
    None: no targets, or this rank does not run the last stage). :meth:`conveyor.Pipeline.step`
    takes it as its one positional argument, so no name of the model's own inputs is taken; the
    last stage's outputs come back as a list, one per microbatch.

    Example:
        >>> mbs = Microbatches(inputs=[{"ids": torch.ones(1, 3)}, {"ids": torch.ones(2, 5)}], targets=[0, 1])
        >>> len(mbs.inputs), mbs.targets
        (2, [0, 1])
        >>> loss = pipe.step(Microbatches(inputs=[(a,), (b,)], targets=[ta, tb]))   # doctest: +SKIP
    """

    inputs: Sequence[Any] | None = None
    targets: Sequence[Any] | None = None


def check_given_microbatches(microbatches: Any, num_microbatches: int) -> list[tuple[tuple, dict]]:
    """``(args, kwargs)`` of each microbatch the caller split itself, in order.

    Each microbatch is a dict of keyword inputs, a tuple (or list) of positional ones, or one
    tensor (the single positional input); each may have its own shapes (sequence length, batch
    size). Raises :class:`PipelineConfigError` naming the first that is neither, or when there
    are not ``num_microbatches`` of them.

    Example:
        >>> parts = check_given_microbatches([{"ids": torch.ones(1, 3)}, (torch.ones(2, 5),)], 2)
        >>> [(args, sorted(kwargs)) for args, kwargs in parts][0], parts[1][0][0].shape
        (((), ['ids']), torch.Size([2, 5]))
    """
    if not isinstance(microbatches, (list, tuple)):
        raise PipelineConfigError(
            f"Microbatches(inputs=...) takes a list of the {num_microbatches} microbatches (each a dict of keyword "
            f"inputs or a tuple of positional ones); got {type(microbatches).__name__}"
        )
    if len(microbatches) != num_microbatches:
        raise PipelineConfigError(
            f"Microbatches(inputs=...) holds {len(microbatches)} microbatches, but the schedule runs "
            f"{num_microbatches}: pass exactly {num_microbatches} (or build the schedule with "
            f"microbatches={len(microbatches)})"
        )
    parts = []
    for index, microbatch in enumerate(microbatches):
        if isinstance(microbatch, dict):
            parts.append(((), dict(microbatch)))
        elif isinstance(microbatch, (tuple, list)):
            parts.append((tuple(microbatch), {}))
        elif isinstance(microbatch, torch.Tensor):
            parts.append(((microbatch,), {}))
        else:
            raise PipelineConfigError(
                f"microbatch {index} is a {type(microbatch).__name__}; each microbatch is a dict of keyword "
                "inputs, a tuple of positional inputs or one tensor"
            )
    return parts


def merge_outputs(outputs: list[Any]) -> Any:
    """Concatenate microbatch outputs along dim 0 (tensors); other leaves come from microbatch 0.

    0-d tensors (per-microbatch scalars such as a loss) are stacked instead.
    """
    if not outputs:
        return None
    flat = [pytree.tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    merged = []
    for i, leaf in enumerate(flat[0][0]):
        if isinstance(leaf, torch.Tensor):
            parts = [f[0][i] for f in flat]
            merged.append(torch.stack(parts) if leaf.dim() == 0 else torch.cat(parts, dim=0))
        else:
            merged.append(leaf)
    return pytree.tree_unflatten(merged, spec)
