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
