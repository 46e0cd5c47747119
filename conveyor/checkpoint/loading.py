"""``load`` into any layout, and ``to_state_dict`` in one process.

Loading checks before it reads: every tensor this process needs must be in the checkpoint
with the same shape, and its bytes on disk. Each rank checks its own share, the verdicts are
exchanged, and every rank raises the same error (naming the first missing or mismatched key)
or none does: no rank is left waiting in DCP's collectives, and the pipeline stays usable.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from conveyor.checkpoint import files
from conveyor.checkpoint.saving import FLAT, group_values
from conveyor.checkpoint.shards import Landing
from conveyor.checkpoint.targets import Target, loss_scaling_of, target_of, with_masters
from conveyor.checkpoint.values import decode, restore_rng, tensor_keys
from conveyor.errors import CheckpointError, CheckpointIncompleteError, CheckpointMismatchError

log = logging.getLogger(__name__)


class _Refusal(Exception):
    """A problem found while preparing a load, with the error class every rank will raise."""

    def __init__(self, kind: type[CheckpointError], message: str) -> None:
        super().__init__(message)
        self.kind = kind


def load(path: str | os.PathLike, pipe: Any, optimizer: torch.optim.Optimizer | None = None,
         lr_scheduler: Any = None) -> Any:
    """Load the checkpoint at ``path`` into ``pipe`` (and ``optimizer``, ``lr_scheduler``); return its ``extra``.

    A collective on a distributed pipeline: call it on every rank. Any pp size, schedule, V,
    dp and tp load a checkpoint saved under any other (tensors are keyed by the model's names,
    DTensor shards resharded by DCP);
    ``pipe`` may also be an in-process Pipeline or the plain unsplit ``nn.Module`` (one process,
    no process group). ``path`` may be a parent directory with a ``latest`` marker. Random
    generators are restored when the layout (processes, global ranks, stage placement, tp) is
    the one saved, else left alone with a log line. A :class:`~conveyor.MasterWeights` loads the
    checkpoint's weights into its fp32 masters, then rounds them into the parameters; a pipeline with loss
    scaling (fp16) continues from the saved scale and growth count. Raises
    :class:`CheckpointMismatchError` or :class:`CheckpointIncompleteError` on every rank, before
    anything is changed.

    Example:
        >>> extra = conveyor.checkpoint.load("ckpt/step_100", pipe, optimizer)   # doctest: +SKIP
        >>> extra["step"]                                                        # doctest: +SKIP
        100
    """
    target = target_of(pipe)
    masters, optimizer = with_masters(target, optimizer)  # a MasterWeights: into its fp32 masters
    state: dict[str, torch.Tensor] = {}
    problem = None
    held = dict(optimizer.state) if optimizer is not None else {}  # put back if the load is refused
    landing = Landing()  # DTensor shards DCP cannot load in place (packed q|k|v) land beside them
    try:
        directory = files.resolve(path)
        meta, metadata = files.read_meta(directory), files.read_dcp_metadata(directory)
        _expect_model_tensors(target, meta, metadata, directory, state, landing)
        if optimizer is not None:
            prepared_optimizer = _prepare_optimizer(target, optimizer, meta, metadata, directory, state, landing)
        rng_prefix = _prepare_rng(target, meta, metadata, state)
        sched_tensors = _prepare_sched(meta, metadata, directory, state, lr_scheduler)
        _check_bytes(directory, metadata, state)
    except (_Refusal, CheckpointError) as exc:
        kind = exc.kind if isinstance(exc, _Refusal) else type(exc)
        problem = (kind.__name__, str(exc))
    except Exception as exc:  # anything else, too, must reach the peers before they wait in DCP
        log.exception("conveyor: preparing the load failed on this rank")
        problem = (CheckpointError.__name__, f"{type(exc).__name__}: {exc}")
    verdicts = target.gather((problem, sorted(k for k in state if k.startswith("model."))))
    first = next((p for p, _ in verdicts if p is not None), None)
    if first is None:  # every rank holds every rank's list: all reach the same verdict
        first = _unexpected(meta, metadata, [names for _, names in verdicts], directory)
    if first is not None:
        if optimizer is not None:
            optimizer.state.clear()
            optimizer.state.update(held)
        kinds = {k.__name__: k for k in (CheckpointError, CheckpointIncompleteError, CheckpointMismatchError)}
        raise kinds.get(first[0], CheckpointError)(first[1])
    outcome = target.guard(_read, state, directory, target)
    if isinstance(outcome, BaseException):
        raise CheckpointError(f"reading {directory} failed on some rank: {outcome}") from outcome
    landing.settle()
    for name, copies in target.copies.items():
        with torch.no_grad():
            for copy in copies:
                copy.copy_(target.tensors[name])
    if masters is not None:
        masters.copy_to_params()  # the bf16 parameters: their masters rounded
    if optimizer is not None:
        _finish_optimizer(optimizer, prepared_optimizer)
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(decode(meta["lr_scheduler"], sched_tensors))
    _restore_loss_scaling(pipe, meta)
    if rng_prefix is not None:
        restore_rng({key.rsplit(".", 1)[-1]: t for key, t in state.items() if key.startswith(rng_prefix)})
    by_rank = meta.get("extra_by_rank")
    if by_rank and rng_prefix is not None and str(target.global_rank) in by_rank:
        return decode(by_rank[str(target.global_rank)])  # the same layout: this rank's own
    if by_rank:
        log.warning("conveyor: the ranks saved different extras; another layout gets the coordinator's")
    return decode(meta["extra"])


def check(path: str | os.PathLike, model: torch.nn.Module | None = None, *, optimizer: str | None = None,
          lr_scheduler: bool = False) -> Path:
    """The checkpoint directory ``path`` names, checked in this one process without reading a tensor.

    Raises what :func:`load` would raise on every rank, so that a launcher refuses a checkpoint
    before any rank starts: :class:`CheckpointIncompleteError` unless ``conveyor.json``, DCP's
    index and every stored tensor's bytes are there; :class:`CheckpointMismatchError` unless
    ``model`` (the unsplit model: on the meta device is enough) has exactly the checkpoint's
    tensors with their shapes, unless it holds the state of an ``optimizer`` of that class name,
    and (``lr_scheduler=True``) a learning-rate scheduler's; :class:`CheckpointError` for
    metadata that cannot be read.

    Example:
        >>> conveyor.checkpoint.check("runs/train/checkpoints", model, optimizer="AdamW")  # doctest: +SKIP
        PosixPath('runs/train/checkpoints/step_000500')
    """
    directory = files.resolve(path)
    try:
        meta, metadata = files.read_meta(directory), files.read_dcp_metadata(directory)
        _check_bytes(directory, metadata, metadata.state_dict_metadata)
        if model is not None:
            state: dict[str, torch.Tensor] = {}
            _expect_model_tensors(target_of(model), meta, metadata, directory, state, Landing())
            unexpected = _unexpected(meta, metadata, [sorted(state)], directory)
            if unexpected is not None:
                raise _Refusal(CheckpointMismatchError, unexpected[1])
        saved = meta.get("optimizer")
        if optimizer is not None and (saved is None or saved.get("class") != optimizer):
            held = f"the state of a {saved.get('class')}" if saved else "no optimizer state"
            raise _Refusal(CheckpointMismatchError, f"the checkpoint {directory} holds {held}, not of a {optimizer}")
        if lr_scheduler and meta.get("lr_scheduler") is None:
            raise _Refusal(CheckpointMismatchError, f"the checkpoint {directory} holds no LR scheduler state")
    except _Refusal as refusal:
        raise refusal.kind(str(refusal)) from None
    except (ValueError, KeyError, TypeError, AttributeError) as error:  # conveyor.json edited by hand or cut
        raise CheckpointError(f"the checkpoint {directory} has metadata conveyor cannot read ({type(error).__name__}: "
                              f"{error}): it was changed after the save; use another checkpoint") from None
    return directory


def _read(state: dict[str, torch.Tensor], directory: Path, target: Target) -> Any:
    try:
        with files.quiet_single_process():
            dcp.load(state, storage_reader=files.SafeFileSystemReader(directory), process_group=target.group,
                     no_dist=target.group is None)
    except CheckpointException as exc:
        return exc
    return None


def _expect(metadata: Metadata, key: str, shape: torch.Size, directory: Path, what: str, meta: dict) -> None:
    entry = files.tensor_entry(metadata, key)
    if entry is None:
        held = [k for k in metadata.state_dict_metadata if k.startswith(key.split(".", 1)[0] + ".")]
        info = (meta.get("model") or {}).get("info") or {}
        raise _Refusal(CheckpointMismatchError, (
            f"{what} {key.split('.', 1)[1]!r} (shape {list(shape)}) is not in the checkpoint {directory}, which "
            f"holds {len(held)} such tensors (such as {', '.join(repr(k.split('.', 1)[1]) for k in held[:3])}) "
            f"saved from {info.get('class', 'an unknown model')}. Load a checkpoint of this model (same class "
            "and config), or build the model the checkpoint was saved from"))
    if tuple(entry.size) != tuple(shape):
        raise _Refusal(CheckpointMismatchError, (
            f"{what} {key.split('.', 1)[1]!r} has shape {list(shape)} here but {list(entry.size)} in the "
            f"checkpoint {directory}: it was saved from another configuration of the model; build the model "
            "with the configuration it was saved with"))


def _expect_model_tensors(target: Target, meta: dict, metadata: Metadata, directory: Path, state: dict,
                          landing: Landing) -> None:
    aliases = meta["model"]["aliases"]
    for name, tensor in target.tensors.items():
        key = f"model.{aliases.get(name, name)}"  # a module may know a tied tensor by another first name
        _expect(metadata, key, tensor.shape, directory, "tensor", meta)
        state[key] = landing.receive(tensor)


def _unexpected(meta: dict, metadata: Metadata, requested: list[list[str]], directory: Path) -> Any:
    wanted = {k for names in requested for k in names}
    for key in metadata.state_dict_metadata:
        if key.startswith("model.") and key not in wanted:
            return (CheckpointMismatchError.__name__, (
                f"the checkpoint {directory} holds {key[len('model.'):]!r} "
                f"(shape {list(metadata.state_dict_metadata[key].size)}), which this model does not have: it "
                f"was saved from another model ({(meta['model'].get('info') or {}).get('class', 'unknown')}); "
                "load it into the model it was saved from"))
    return None


def _prepare_optimizer(target: Target, optimizer: torch.optim.Optimizer, meta: dict, metadata: Metadata,
                       directory: Path, state: dict, landing: Landing) -> dict[str, Any]:
    saved = meta.get("optimizer")
    if saved is None:
        raise _Refusal(CheckpointMismatchError, f"the checkpoint {directory} holds no optimizer state; "
                                                "load it without an optimizer")
    if saved["class"] != type(optimizer).__name__:
        raise _Refusal(CheckpointMismatchError, (
            f"the checkpoint {directory} holds the state of a {saved['class']}, not of a "
            f"{type(optimizer).__name__}: build the optimizer it was saved with"))
    container = target.container()
    names = {id(p): n for n, p in container.named_parameters()}
    known = set(names.values())
    stateful = set(saved["stateful"]) & known
    prepared = {"container": container, "names": names, "stateful": stateful,
                "saved_values": {k: decode(v) for k, v in saved["values"].items()}}
    if not stateful:
        prepared["flat"] = group_values(optimizer, names)
        return prepared
    # The helpers key state by names taken from the optimizer's current state: give it a fresh one
    # (a step with zero gradients and lr 0, as torch does), then load every tensor into it.
    grads = {p: p.grad for p in container.parameters()}
    optimizer.state.clear()
    try:
        for p in grads:
            p.grad = None
        prepared["flat"] = get_optimizer_state_dict(container, optimizer, options=FLAT)
    finally:
        for p, grad in grads.items():
            p.grad = grad
    for key, value in prepared["flat"].items():
        fqn = _fqn_of(key, known)
        if key.startswith("state.") and fqn in stateful and isinstance(value, torch.Tensor):
            _expect(metadata, f"optim.{key}", value.shape, directory, "optimizer state", meta)
            state[f"optim.{key}"] = landing.receive(value)
    for key in metadata.state_dict_metadata:
        if key.startswith("optim.state.") and _fqn_of(key[len("optim."):], known) in stateful \
                and key not in state and key[len("optim."):] not in saved["values"]:
            raise _Refusal(CheckpointMismatchError, (
                f"the checkpoint's optimizer state {key[len('optim.'):]!r} has no place in this optimizer "
                "(its options differ, e.g. amsgrad or momentum): build the optimizer with the options it was "
                "saved with"))
    return prepared


def _fqn_of(key: str, known: set[str]) -> str | None:
    """The parameter name in a flattened key ``state.<name>.<state key>`` (names hold dots too)."""
    body = key.split(".", 1)[1]
    while "." in body:
        body = body.rsplit(".", 1)[0]
        if body in known:
            return body
    return None


def _finish_optimizer(optimizer: torch.optim.Optimizer, prepared: dict) -> None:
    # The template's tensors were loaded in place; its other values (hyper-parameters) are the
    # checkpoint's where it has them (a key it lacks, from a newer torch, keeps today's value).
    saved = prepared["saved_values"]
    values = {k: v if isinstance(v, torch.Tensor) else saved.get(k, v) for k, v in prepared["flat"].items()}
    names = prepared["names"]
    if not prepared["stateful"]:
        for group in optimizer.param_groups:
            first = names[id(group["params"][0])]
            for k in group:
                if k != "params" and f"param_groups.{first}.{k}" in values:
                    group[k] = values[f"param_groups.{first}.{k}"]
        optimizer.state.clear()
        return
    set_optimizer_state_dict(prepared["container"], optimizer, values, options=FLAT)
    for param in list(optimizer.state):
        if names.get(id(param)) not in prepared["stateful"]:
            del optimizer.state[param]  # it had no state when saved: as after the same steps


def _restore_loss_scaling(pipe: Any, meta: dict) -> None:
    """The loss scale and its growth count where both the pipeline and the checkpoint have them (fp16)."""
    scaling, saved = loss_scaling_of(pipe), meta.get("loss_scaling")
    if scaling is not None and saved is not None:
        scaling.load_state_dict(saved)
    elif scaling is not None:
        log.info("conveyor: the checkpoint holds no loss scale (saved without loss scaling): starting from %s",
                 scaling.scaler.scaling.init_scale)


def _prepare_rng(target: Target, meta: dict, metadata: Metadata, state: dict) -> str | None:
    if meta["layout"] != target.layout:
        # Another layout draws other numbers anyway (other ranks run other stages): said once, by the coordinator,
        # as information (a resharding load is asked for; conveyor train names both layouts in words).
        if target.coordinator:
            saved, now = meta["layout"], target.layout
            log.info("conveyor: random generator states not restored: the checkpoint was saved by %s process(es) "
                     "(tp=%s, stages by rank %s), this is %s (tp=%s, stages by rank %s)", saved.get("processes"),
                     saved.get("tp", 1), saved.get("stages"), now.get("processes"), now.get("tp", 1),
                     now.get("stages"))
        return None
    prefix = f"rng.rank{target.global_rank}."
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith(prefix):
            state[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    return prefix


def _prepare_sched(meta: dict, metadata: Metadata, directory: Path, state: dict, lr_scheduler: Any) -> dict:
    if lr_scheduler is None:
        return {}
    if meta.get("lr_scheduler") is None:
        raise _Refusal(CheckpointMismatchError, f"the checkpoint {directory} holds no LR scheduler state; "
                                                "load it without lr_scheduler")
    loaded = {}
    for key in tensor_keys(meta["lr_scheduler"]):
        entry = files.tensor_entry(metadata, key)
        if entry is None:
            raise _Refusal(CheckpointIncompleteError, f"the checkpoint {directory} lacks the LR scheduler's {key!r}")
        state[key] = loaded[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    return loaded


def _check_bytes(directory: Path, metadata: Metadata, keys: Iterable[str]) -> None:
    problem = files.missing_bytes(directory, metadata, keys)
    if problem:
        raise _Refusal(CheckpointIncompleteError, problem)


def to_state_dict(path: str | os.PathLike) -> OrderedDict[str, torch.Tensor]:
    """The unsplit model's state dict from a checkpoint, in one process (no torch.distributed).

    Keys are the model's own, in its order, tied names included (one tensor), so
    ``model.load_state_dict(to_state_dict(path))`` works on the unsplit model.

    Example:
        >>> model.load_state_dict(conveyor.checkpoint.to_state_dict("ckpt/step_100"))   # doctest: +SKIP
    """
    directory = files.resolve(path)
    meta, metadata = files.read_meta(directory), files.read_dcp_metadata(directory)
    state = {}
    for name in meta["model"]["names"]:
        entry = files.tensor_entry(metadata, f"model.{name}")
        if entry is None:
            raise CheckpointIncompleteError(f"checkpoint {directory} lists {name!r} but DCP's index lacks it")
        state[f"model.{name}"] = torch.empty(entry.size, dtype=entry.properties.dtype)
    problem = files.missing_bytes(directory, metadata, state)
    if problem:
        raise CheckpointIncompleteError(problem)
    with files.quiet_single_process():
        dcp.load(state, storage_reader=files.SafeFileSystemReader(directory), no_dist=True)
    aliases = meta["model"]["aliases"]
    info = meta["model"].get("info") or {}
    order = info.get("state_names") or [*meta["model"]["names"], *aliases]
    return OrderedDict((name, state[f"model.{aliases.get(name, name)}"]) for name in order
                       if f"model.{aliases.get(name, name)}" in state)
