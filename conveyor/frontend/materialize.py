"""The tensors one stage holds: the model's own, copies, or freshly initialised ones.

Rules (``stage_tensors``):

* A model on a real device: a tensor used by this stage only is the model's own
  tensor when it already sits on the stage's device (no copy), else a copy on that
  device. A tensor used by several stages (tied embeddings, a module called on two
  stages) is always a copy, in each of those stages, so that stages behave the same
  whether they live in one process or in several; the pipeline sums the copies'
  gradients (see ``ModelSplit.tied_groups``).
* A model on the meta device: only this stage's tensors are allocated, on the
  stage's device, and initialised the way the model's own init would: each module's
  ``reset_parameters()`` (what torch layers run in ``__init__``), then, for Hugging
  Face models, the model's ``_init_weights`` on every module, children first. The
  random generator is seeded from ``(seed, module path)`` before each module, so a
  tensor gets the same values whatever the split and on whichever rank (tied copies
  included) -- the values differ from an eager ``Model()`` build, whose generator runs
  through all modules in one sequence. A tied tensor is initialised by the module
  that owns its first name (``transformer.wte`` for GPT-2's ``lm_head.weight``).
  Tensors no init method sets (parameters filled in ``__init__`` by hand, buffers
  computed there) are left NaN (integers: their dtype's lowest value, which fails as an
  index; bools: False), so that forgetting to load them from a checkpoint fails loudly; a
  warning lists them (bools only when all False, which an init method may have meant).
"""

from __future__ import annotations

import copy
import logging
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from conveyor.errors import SplitError

logger = logging.getLogger(__name__)


def named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer name of ``model``, aliases (tied names) included."""
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def copy_tensor(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    data = tensor.detach().to(device, copy=True)
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(data, requires_grad=tensor.requires_grad)
    return data


def module_seed(seed: int, path: str) -> int:
    """The generator seed used to initialise the module at ``path``."""
    return (seed * 1_000_003 + zlib.crc32(path.encode())) % (2**63)


def _post_order(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def _hf_initializer(model: nn.Module, path: str) -> Any:
    """The innermost Hugging Face ``PreTrainedModel`` on ``path`` (it owns ``_init_weights``)."""
    parts = path.split(".") if path else []
    for depth in range(len(parts), -1, -1):
        try:
            owner = model.get_submodule(".".join(parts[:depth]))
        except AttributeError:
            continue
        if hasattr(owner, "_init_weights") and hasattr(owner, "config"):
            return owner
    return None


def _initialise(
    model: nn.Module, module: nn.Module, path: str, seed: int, device: torch.device
) -> None:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        for sub_path, sub in _post_order(module, path):
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                torch.manual_seed(module_seed(seed, sub_path))
                reset()
        for sub_path, sub in _post_order(module, path):
            owner = _hf_initializer(model, sub_path)
            if owner is not None:
                torch.manual_seed(module_seed(seed, sub_path + "#init_weights"))
                owner._init_weights(sub)


def _fill_unset(tensors: Iterable[torch.Tensor]) -> None:
    with torch.no_grad():
        for tensor in tensors:
            if tensor.is_floating_point() or tensor.is_complex():
                tensor.fill_(float("nan"))
            elif tensor.dtype == torch.bool:
                tensor.zero_()
            else:
                tensor.fill_(torch.iinfo(tensor.dtype).min)


def materialize(
    model: nn.Module, names: Iterable[str], device: torch.device, seed: int
) -> dict[str, torch.Tensor]:
    """Allocate and initialise the named tensors of a meta-device ``model`` on ``device``.

    Only modules owning a wanted tensor are copied (from meta, which costs nothing)
    and allocated; aliases of one tensor come back as one tensor.

    Example:
        >>> with torch.device("meta"):
        ...     model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> sorted(materialize(model, ["1.weight"], torch.device("cpu"), seed=0))
        ['1.weight']
    """
    first_name: dict[int, str] = {}
    id_of: dict[str, int] = {}
    for name, tensor in named_tensors(model):
        first_name.setdefault(id(tensor), name)
        id_of[name] = id(tensor)
    wanted = {first_name[id_of[name]] for name in names}
    made: dict[str, torch.Tensor] = {}

    def owned(module: nn.Module, prefix: str, recurse: bool) -> list[tuple[str, torch.Tensor]]:
        found = []
        for local, tensor in _own_tensors(module, recurse):
            full = f"{prefix}.{local}" if prefix else local
            if first_name[id(tensor)] == full:
                found.append((full, tensor))
        return found

    def visit(module: nn.Module, prefix: str) -> None:
        mine = owned(module, prefix, recurse=True)
        wanted_here = [name for name, _ in mine if name in wanted]
        if not wanted_here:
            return
        if prefix and len(wanted_here) == len(mine):
            fresh = copy.deepcopy(module)
            fresh.to_empty(device=device)
            fresh_tensors = dict(named_tensors(fresh))
            _fill_unset(fresh_tensors.values())
            _initialise(model, fresh, prefix, seed, device)
            for full, _ in mine:
                local = full[len(prefix) + 1 :]
                made[full] = fresh_tensors[local]
            return
        for child_name, child in module.named_children():
            visit(child, f"{prefix}.{child_name}" if prefix else child_name)
        # Tensors held directly by a module whose other tensors are on other stages:
        # its init method would touch those too, so they are left for loading.
        for full, tensor in owned(module, prefix, recurse=False):
            if full in wanted:
                fresh_tensor = torch.empty_like(tensor, device=device)
                _fill_unset([fresh_tensor])
                if isinstance(tensor, nn.Parameter):
                    fresh_tensor = nn.Parameter(fresh_tensor, requires_grad=tensor.requires_grad)
                made[full] = fresh_tensor

    visit(model, "")
    _warn_of_unset(made)
    missing = [name for name in names if first_name[id_of[name]] not in made]
    if missing:
        raise SplitError(
            f"could not materialise {missing} (internal error: no owning module found)"
        )
    return {name: made[first_name[id_of[name]]] for name in names}


def _warn_of_unset(made: dict[str, torch.Tensor]) -> None:
    """Log the tensors of ``made`` that no init method set (still holding ``_fill_unset``'s mark)."""
    unset: list[str] = []
    with torch.no_grad():
        for full, tensor in made.items():
            if not tensor.numel() or tensor.is_meta:  # a stage built on meta (to size it) holds no values
                continue
            if tensor.is_floating_point() or tensor.is_complex():
                left = bool(torch.isnan(tensor).all())
            elif tensor.dtype == torch.bool:
                left = not bool(tensor.any())
            else:
                left = bool((tensor == torch.iinfo(tensor.dtype).min).all())
            if left:
                unset.append(full)
    if unset:
        logger.warning(
            "%d tensor(s) of this stage are not set by any init method (reset_parameters, "
            "_init_weights) and are left NaN (integers: their lowest value; bools: False) for loading "
            "from a checkpoint: %s",
            len(unset),
            ", ".join(unset[:10]) + (" ..." if len(unset) > 10 else ""),
        )


def _own_tensors(module: nn.Module, recurse: bool) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=recurse, remove_duplicate=False)
    yield from module.named_buffers(recurse=recurse, remove_duplicate=False)
