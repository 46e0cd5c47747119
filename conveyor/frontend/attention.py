"""Trace Hugging Face attention on the path eager runs, and say so where no graph can follow it.

transformers' sdpa attention (5.x) picks its path from the mask: with no mask to apply (no
``attention_mask`` given, or one with no padding, and positions counted from 0, unpacked) it
calls ``scaled_dot_product_attention(q, k, v, is_causal=True)``, handing grouped key/value heads
to SDPA (``enable_gqa=True``). Otherwise it builds a boolean mask, repeats the key/value heads
(``repeat_kv``) and passes the mask. Forward values agree on a CPU, but the backward of the
repeat sums each group's key/value gradients in another order than SDPA's grouped kernel, and a
GPU picks another kernel for a mask than for ``is_causal``: the two paths are not bitwise equal.

Under ``torch.export`` transformers always takes the second path, even where the choice needs no
tensor value: ``masking_utils`` refuses to drop the mask while exporting (an exported program may
be called with other shapes later), and cannot see that position ids the model counts itself are
consecutive (``find_packed_sequence_indices``). conveyor's stages are specialised to the example's
shapes, so where the model receives neither ``attention_mask`` nor ``position_ids`` eager's choice
is fixed, and :func:`eager_attention_path` lets the trace make it: the stages then run the very
SDPA call eager runs. Where the mask or the positions are inputs, eager's choice reads their values,
which no graph may; :func:`warn_of_repeated_heads` then says which modules differ, and why.

Example:
    >>> import torch
    >>> with eager_attention_path(torch.nn.Linear(2, 2), (torch.ones(1, 2),), {}):
    ...     pass  # not a Hugging Face model: nothing changes
"""

from __future__ import annotations

import inspect
import logging
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
from torch import nn

logger = logging.getLogger(__name__)

# Inputs from whose values eager transformers chooses the attention path.
_PATH_INPUTS = ("attention_mask", "position_ids")
# What was said of a model, kept on the model: a pipeline traces it more than once (balancing, modes).
_SAID = "_conveyor_said_of_repeated_heads"


def is_hugging_face_model(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``PreTrainedModel`` (recognised without importing transformers)."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.")
        for cls in type(module).__mro__
    )


def _path_inputs_given(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[str] | None:
    """Which of ``attention_mask`` / ``position_ids`` the example gives (None: cannot tell)."""
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    return [name for name in _PATH_INPUTS if bound.arguments.get(name) is not None]


@contextmanager
def eager_attention_path(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Iterator[None]:
    """Within, a Hugging Face ``model`` given no mask and no positions traces eager's attention path.

    The two choices transformers' ``masking_utils`` leaves to tracing are made as eager makes
    them for such a model: the causal mask is dropped for SDPA's ``is_causal`` when shapes allow
    (the check reads shapes only, fixed in conveyor's stages), and the positions the model counts
    itself (0, 1, ..., as transformers' decoders do without a cache) are not packed sequences.
    Everything else (the attention implementation the config names, sliding windows, padding
    given as a mask) is transformers' own decision, unchanged. Put back however it ends.
    """
    masking = sys.modules.get("transformers.masking_utils")
    given = _path_inputs_given(model, args, kwargs) if is_hugging_face_model(model) else None
    names = ("is_torchdynamo_exporting", "find_packed_sequence_indices")
    if masking is None or given != [] or not all(hasattr(masking, name) for name in names):
        yield
        return
    saved = {name: getattr(masking, name) for name in names}
    logger.debug("tracing %s on eager's attention path (no attention_mask, no position_ids given)",
                 type(model).__name__)
    try:
        masking.is_torchdynamo_exporting = lambda: False
        masking.find_packed_sequence_indices = lambda position_ids: None
        yield
    finally:
        for name, value in saved.items():
            setattr(masking, name, value)


def warn_of_repeated_heads(model: nn.Module, nodes: Sequence[fx.Node], args: Sequence[Any],
                           kwargs: Mapping[str, Any]) -> list[str]:
    """Log a warning (once per model) naming the grouped-head attention modules run unlike eager.

    Such a module calls SDPA with a mask over repeated key/value heads in the graph, where eager,
    on a batch without padding, runs the heads grouped with ``is_causal``: gradients then differ
    from one device by rounding. Returns the modules' names (empty: nothing to say).

    Example:
        >>> warn_of_repeated_heads(torch.nn.Linear(2, 2), [], (), {})
        []
    """
    found = []
    for node in nodes:
        if node.target is not torch.ops.aten.scaled_dot_product_attention.default:
            continue
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        path = _innermost_module(node)
        owner = _submodule(model, path)
        if mask is not None and getattr(owner, "num_key_value_groups", 1) > 1 and path not in found:
            found.append(path)
    if found and tuple(found) not in model.__dict__.get(_SAID, ()):
        model.__dict__.setdefault(_SAID, set()).add(tuple(found))
        logger.warning(
            "conveyor: %s (%d module%s with grouped key/value heads) will not be bitwise equal to eager "
            "on batches without padding: %s. Eager transformers, given no padding, drops the mask and runs "
            "the groups inside scaled_dot_product_attention (is_causal); the graph applies the mask and "
            "repeats the key/value heads, whose gradients sum in another order (rounding). Batches with "
            "padding match bitwise.",
            found[0] if len(found) == 1 else f"{found[0]} and {len(found) - 1} more",
            len(found), "" if len(found) == 1 else "s", _why_masked(model, args, kwargs),
        )
    return found


def _why_masked(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    given = _path_inputs_given(model, args, kwargs) if is_hugging_face_model(model) else None
    if given is None:
        return (f"{type(model).__name__} is not a Hugging Face model itself, so conveyor cannot tell whether "
                "the attention mask and positions it hands on read tensor values; trace the Hugging Face "
                "model itself, without attention_mask and position_ids, for bitwise parity")
    if given:
        names = " and ".join(given)
        return (f"{names} {'is an input' if len(given) == 1 else 'are inputs'} of the traced graph, and eager "
                "transformers reads the values to choose the attention path, which a graph serving every "
                f"batch cannot; for bitwise parity without padding, leave {names} out of the inputs")
    return ("this transformers version's masking_utils lacks is_torchdynamo_exporting or "
            "find_packed_sequence_indices, through which conveyor makes eager's choice while tracing")


def _innermost_module(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [re.sub(r"@\d+$", "", path) for path, _type in stack.values()]
    return paths[-1] if paths else ""


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    """The module at ``path`` in ``model``, or None where there is none."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None
