"""The tensors one stage holds: the model's own, copies, or freshly initialised ones.

Rules (``stage_tensors``):

* A model on a real device: a tensor used by this stage only is the model's own
  tensor when it already sits on the stage's device (no copy), else a copy on that
  device. A tensor used by several stages (tied embeddings, a module called on two
  stages) is always a copy, in each of those stages, so that stages behave the same
  whether they live in one process or in several; the pipeline sums the copies'
  gradients (see ``ModelSplit.tied_groups``).
* A model on the meta device: only this stage's tensors are allocated, on the
  stage's device, owning module by owning module (the module holding a tensor directly;
  a tied tensor's is the module of its first name, ``transformer.wte`` for GPT-2's
  ``lm_head.weight``). A fresh copy of the owning module is initialised the way the
  model's own init would: each of its modules' ``reset_parameters()`` (what torch layers
  run in ``__init__``), then, for Hugging Face models, the model's ``_init_weights`` on
  them, children first, and on each of its ancestors up to the root (run on a meta
  skeleton holding the fresh copy, so GPT-2's attention and MLP modules re-draw their
  ``c_proj`` weight and touch nothing else). The random generator is seeded from
  ``(seed, module path)`` before each call. So a tensor's values depend on the seed and
  its name only: the same whatever the split (pp), whichever rank, tied copies included,
  and under tensor parallelism (each TP rank draws the whole and keeps its slice,
  :mod:`conveyor.parallel.tensor.shards`). They differ from an eager ``Model()`` build,
  whose generator runs through all modules in one sequence;
  :func:`initialise_as_on_meta` gives an eager model the meta build's values
  (``conveyor train`` does so wherever it builds the model eagerly).
  Tensors no init method sets (parameters filled in ``__init__`` by hand, buffers
  computed there) are left NaN (integers: their dtype's lowest value, which fails as an
  index; bools: False), so that forgetting to load them from a checkpoint fails loudly; a
  warning lists them (bools only when all False, which an init method may have meant).
"""

from __future__ import annotations

import copy
import itertools
import logging
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from conveyor.errors import SplitError
from conveyor.frontend.attention import _submodule

logger = logging.getLogger(__name__)


def named_tensors(model: nn.Module, recurse: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer name of ``model`` (``recurse=False``: those it holds directly), aliases (tied
    names) included."""
    yield from model.named_parameters(recurse=recurse, remove_duplicate=False)
    yield from model.named_buffers(recurse=recurse, remove_duplicate=False)


def tensor_names(model: nn.Module) -> list[list[str]]:
    """Every name of each parameter and buffer of ``model`` (several for a tied tensor), in model order."""
    names: dict[int, list[str]] = {}
    for name, tensor in named_tensors(model):
        names.setdefault(id(tensor), []).append(name)
    return list(names.values())


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
        owner = _submodule(model, ".".join(parts[:depth]))
        if hasattr(owner, "_init_weights") and hasattr(owner, "config"):
            return owner
    return None


def _initialise(model: nn.Module, module: nn.Module, path: str, seed: int) -> None:
    """Run the model's own init on ``module`` (a fresh copy of the model's module at ``path``): each
    submodule's ``reset_parameters()``, then each one's Hugging Face ``_init_weights``, children first,
    the generator seeded from ``(seed, submodule path)`` before each call."""
    for sub_path, sub in _post_order(module, path):
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            torch.manual_seed(module_seed(seed, sub_path))
            reset()
    for sub_path, sub in _post_order(module, path):
        _init_weights_seeded(model, sub, sub_path, seed)


def _init_weights_seeded(model: nn.Module, module: nn.Module, path: str, seed: int) -> None:
    owner = _hf_initializer(model, path)
    if owner is not None:
        torch.manual_seed(module_seed(seed, path + "#init_weights"))
        owner._init_weights(module)


def _initialise_in_ancestors(model: nn.Module, fresh: nn.Module, path: str, seed: int) -> None:
    """The ``_init_weights`` of every ancestor of ``path`` (nearest first, the root last), as a whole
    model's children-first pass reaches them, each run on a meta skeleton of the ancestor that holds
    ``fresh`` at ``path``: only ``fresh``'s tensors are real, so an ancestor's init (GPT-2's scaled
    ``c_proj`` draw, made by its attention and MLP modules) sets them and touches nothing else."""
    if not path:
        return
    parts = path.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        ancestor_path = ".".join(parts[:depth])
        if _hf_initializer(model, ancestor_path) is None:
            continue
        skeleton = _skeleton_holding(model.get_submodule(ancestor_path), parts[depth:], fresh)
        _init_weights_seeded(model, skeleton, ancestor_path, seed)


def _skeleton_holding(ancestor: nn.Module, relative: list[str], fresh: nn.Module) -> nn.Module:
    """A copy of ``ancestor``'s module tree, sharing its (meta) tensors, with ``fresh`` at ``relative``:
    only the modules on the way down are copied (shallowly), so nothing is allocated."""
    top = copy.copy(ancestor)
    top._modules = dict(ancestor._modules)
    parent = top
    for name in relative[:-1]:
        child = copy.copy(parent._modules[name])
        child._modules = dict(child._modules)
        parent._modules[name] = child
        parent = child
    parent._modules[relative[-1]] = fresh
    return top


def _unset_mark(tensor: torch.Tensor) -> float | bool | int:
    """What a tensor no init method sets holds: NaN (bools: False; integers: their dtype's lowest value)."""
    if tensor.is_floating_point() or tensor.is_complex():
        return float("nan")
    return False if tensor.dtype == torch.bool else torch.iinfo(tensor.dtype).min


def materialize(
    model: nn.Module, names: Iterable[str], device: torch.device, seed: int
) -> dict[str, torch.Tensor]:
    """Allocate and initialise the named tensors of a meta-device ``model`` on ``device``.

    Owning module by owning module (the module holding a tensor directly; a tied tensor's is the one
    of its first name): a fresh copy of it is allocated and initialised as the module docstring says,
    so the peak is one owning module and a tensor's values do not depend on which other tensors are
    asked for with it (the same at every split). Aliases of one tensor come back as one tensor.

    Example:
        >>> with torch.device("meta"):
        ...     model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> sorted(materialize(model, ["1.weight"], torch.device("cpu"), seed=0))
        ['1.weight']
    """
    first_of = {name: names[0] for names in tensor_names(model) for name in names}  # name -> its tensor's first
    names = list(names)
    unknown = [name for name in names if name not in first_of]
    if unknown:
        raise SplitError(f"could not materialise {unknown}: the model has no tensor of that name "
                         f"(internal error: names come from the model's own named_parameters/named_buffers)")
    by_owner: dict[str, list[str]] = {}
    for first in dict.fromkeys(first_of[name] for name in names):
        by_owner.setdefault(first.rpartition(".")[0], []).append(first)
    made: dict[str, torch.Tensor] = {}
    for owner_path in by_owner:
        made.update(_owner_tensors(model, owner_path, device, seed))
    _warn_of_unset({first: made[first] for firsts in by_owner.values() for first in firsts})
    return {name: made[first_of[name]] for name in names}


def _owner_tensors(model: nn.Module, owner_path: str, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """The tensors held directly by the module at ``owner_path``, by their full names, freshly initialised."""
    fresh = copy.deepcopy(model.get_submodule(owner_path))
    fresh.to_empty(device=device)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():  # each draw seeded by its module's path
        for _, tensor in named_tensors(fresh):
            tensor.fill_(_unset_mark(tensor))
        _initialise(model, fresh, owner_path, seed)
        _initialise_in_ancestors(model, fresh, owner_path, seed)
    prefix = f"{owner_path}." if owner_path else ""
    return {prefix + local: tensor for local, tensor in named_tensors(fresh, recurse=False)}


def _warn_of_unset(made: dict[str, torch.Tensor]) -> None:
    """Log the tensors of ``made`` that no init method set (still holding ``_unset_mark``)."""
    unset: list[str] = []
    with torch.no_grad():
        for full, tensor in made.items():
            if not tensor.numel() or tensor.is_meta:  # a stage built on meta (to size it) holds no values
                continue
            mark = _unset_mark(tensor)
            if bool((torch.isnan(tensor) if isinstance(mark, float) else tensor == mark).all()):  # NaN equals nothing
                unset.append(full)
    if unset:
        logger.warning(
            "%d tensor(s) of this stage are not set by any init method (reset_parameters, "
            "_init_weights) and are left NaN (integers: their lowest value; bools: False) for loading "
            "from a checkpoint: %s",
            len(unset),
            ", ".join(unset[:10]) + (" ..." if len(unset) > 10 else ""),
        )


def initialise_as_on_meta(model: nn.Module, seed: int) -> nn.Module:
    """Give every tensor of an eagerly built ``model`` the values :func:`materialize` gives it when the
    same model is built on the meta device, in place (tied tensors stay one tensor); returns ``model``.

    ``Model()`` draws its tensors in one sequence from the global generator, so its values depend on
    the order of construction; a meta-device model is initialised owning module by owning module
    (the module docstring). After this call an eager build starts from the same values as a meta
    build split at any ``pp`` and sharded at any ``tp``, for the same ``seed``. It allocates one
    owning module at a time beside the model.

    Example:
        >>> _ = torch.manual_seed(1)  # the global generator's state does not matter
        >>> eager = initialise_as_on_meta(torch.nn.Linear(4, 2), seed=0)
        >>> with torch.device("meta"):
        ...     meta = torch.nn.Linear(4, 2)
        >>> torch.equal(eager.weight, materialize(meta, ["weight"], torch.device("cpu"), seed=0)["weight"])
        True
    """
    owners: dict[str, dict[str, torch.Tensor]] = {}
    # A tied tensor is set once, through its first name (torch's named_* yield each tensor once, so).
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        owner_path, _, local = name.rpartition(".")
        owners.setdefault(owner_path, {})[local] = tensor
    with torch.no_grad():
        for owner_path, tensors in owners.items():
            device = next(iter(tensors.values())).device
            prefix = f"{owner_path}." if owner_path else ""
            values = _owner_tensors(model, owner_path, device, seed)
            for local, tensor in tensors.items():
                tensor.copy_(values[prefix + local])
    return model
