"""Everything a checkpoint holds that is not a model tensor: JSON values and random-generator states.

A checkpoint loads no pickled code. Tensors go to DCP (read back with ``weights_only``);
every other value (optimizer hyper-parameters, the LR scheduler's counters, the user's
``extra``) goes to JSON. JSON has no tuple, and ``betas=(0.9, 0.95)`` must come back a
tuple, so two markers keep Python's shape: ``{"__tuple__": [...]}`` and, for dicts whose
keys are not all strings, ``{"__items__": [[key, value], ...]}``. A tensor inside such a value
(an LR given as a tensor) becomes ``{"__tensor__": key}`` and travels through DCP.

Random states are tensors too, keyed per global rank: torch's CPU generator, Python's
``random`` (624 words, an index and the cached Gaussian) and, when CUDA is in use, each
device's generator.

Example:
    >>> tensors = {}
    >>> encoded = encode({"betas": (0.9, 0.95), "lr": 0.1}, "sched", tensors)
    >>> encoded
    {'betas': {'__tuple__': [0.9, 0.95]}, 'lr': 0.1}
    >>> decode(encoded, tensors)
    {'betas': (0.9, 0.95), 'lr': 0.1}
"""

from __future__ import annotations

import random
from typing import Any

import torch

from conveyor.errors import CheckpointError

_TUPLE, _ITEMS, _TENSOR = "__tuple__", "__items__", "__tensor__"
_MARKERS = frozenset({_TUPLE, _ITEMS, _TENSOR})


def encode(value: Any, where: str, tensors: dict[str, torch.Tensor] | None = None) -> Any:
    """``value`` as JSON; tensors go to ``tensors`` under keys derived from ``where`` (None: refused).

    Raises :class:`CheckpointError` naming the path of a value JSON cannot hold.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        if tensors is None:
            raise CheckpointError(
                f"{where} is a tensor, and this part of a checkpoint is JSON: convert it (.tolist(), "
                ".item()) or keep tensors in the model or the optimizer"
            )
        tensors[where] = value.detach()
        return {_TENSOR: where}
    if isinstance(value, tuple):
        return {_TUPLE: [encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not _MARKERS & set(value):
            return {k: encode(v, f"{where}.{k}", tensors) for k, v in value.items()}
        return {_ITEMS: [[encode(k, f"{where} key", None), encode(v, f"{where}[{k!r}]", tensors)]
                         for k, v in value.items()]}
    raise CheckpointError(
        f"{where} is a {type(value).__name__}, which a checkpoint cannot hold: checkpoints store tensors "
        "and JSON values (numbers, strings, booleans, None, lists, tuples, dicts) and never pickled "
        "objects; convert it to one of those"
    )


def decode(value: Any, tensors: dict[str, torch.Tensor] | None = None) -> Any:
    """The inverse of :func:`encode` (``tensors``: the loaded tensors, by key)."""
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if _TUPLE in value:
        return tuple(decode(v, tensors) for v in value[_TUPLE])
    if _ITEMS in value:
        return {_hashable(decode(k)): decode(v, tensors) for k, v in value[_ITEMS]}
    if _TENSOR in value:
        if tensors is None or value[_TENSOR] not in tensors:
            raise CheckpointError(f"the checkpoint's tensor {value[_TENSOR]!r} was not loaded")
        return tensors[value[_TENSOR]]
    return {k: decode(v, tensors) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def tensor_keys(value: Any) -> list[str]:
    """The DCP keys an encoded value refers to."""
    if isinstance(value, list):
        return [k for v in value for k in tensor_keys(v)]
    if isinstance(value, dict):
        if _TENSOR in value:
            return [value[_TENSOR]]
        return [k for v in value.values() for k in tensor_keys(v)]
    return []


# --- random generators -----------------------------------------------------------------------

def capture_rng() -> dict[str, torch.Tensor]:
    """This process's generator states as tensors.

    Example:
        >>> state = capture_rng(); a = torch.rand(1); restore_rng(state); bool(torch.rand(1) == a)
        True
    """
    version, words, gauss = random.getstate()
    state = {
        "torch_cpu": torch.get_rng_state(),
        "python": torch.tensor([version, *words], dtype=torch.int64),  # 32-bit words and an index
        "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for device, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            state[f"cuda{device}"] = cuda_state
    return state


def restore_rng(state: dict[str, torch.Tensor]) -> None:
    """Put back what :func:`capture_rng` returned (CUDA generators only where both sides have them)."""
    torch.set_rng_state(state["torch_cpu"].to(torch.uint8))
    version, *words = state["python"].tolist()
    has_gauss, gauss = state["python_gauss"].tolist()
    random.setstate((version, tuple(words), gauss if has_gauss else None))
    cuda = sorted(k for k in state if k.startswith("cuda"))
    if cuda and torch.cuda.is_available():
        for key in cuda:
            device = int(key[len("cuda"):])
            if device < torch.cuda.device_count():
                torch.cuda.set_rng_state(state[key].to(torch.uint8), device)
