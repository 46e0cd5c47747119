"""``save``: one checkpoint of a pipeline (or a module), its optimizer, LR scheduler, RNG and extras."""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from conveyor.checkpoint import files
from conveyor.checkpoint.shards import storable
from conveyor.checkpoint.targets import Target, loss_scaling_of, target_of, with_masters
from conveyor.checkpoint.values import capture_rng, encode
from conveyor.errors import CheckpointError

log = logging.getLogger(__name__)

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def save(path: str | os.PathLike, pipe: Any, optimizer: torch.optim.Optimizer | None = None,
         lr_scheduler: Any = None, *, extra: Any = None, keep_last: int | None = None) -> Path:
    """Save a checkpoint of ``pipe`` at ``path``; a collective: call it on every rank alike.

    ``pipe`` is a :class:`~conveyor.Pipeline` (distributed or in-process) or an
    unsplit ``nn.Module``. Tensors are keyed by the model's original names (a tied one once,
    by its first name) and written with ``torch.distributed.checkpoint`` over the pipeline's
    own process group; the optimizer's state by the same names (flattened keys), the LR
    scheduler's state, the loss scaler's (fp16), every rank's random generators and ``extra`` (JSON; each rank's own
    is kept when they differ) come along. The directory appears complete or not at all:
    ``path``'s parent also gets a ``latest`` marker, and ``keep_last=K`` removes all but the
    last K checkpoints conveyor wrote there. Returns ``path``. With a :class:`~conveyor.MasterWeights`
    for ``optimizer``, its fp32 masters are saved in place of the bf16 parameters, by their names.

    Example:
        >>> conveyor.checkpoint.save("ckpt/step_100", pipe, optimizer, scheduler,   # doctest: +SKIP
        ...                          extra={"step": 100}, keep_last=3)
    """
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointError(f"keep_last must be a whole number >= 1 (or None: keep all); got {keep_last!r}")
    final = Path(path)
    target = target_of(pipe)
    _, optimizer = with_masters(target, optimizer)  # a MasterWeights: its fp32 masters, by the params' names
    mine: dict[str, Any] = {"problem": None, "token": uuid.uuid4().hex[:12], "rank": target.global_rank}
    tensors: dict[str, torch.Tensor] = {}
    try:
        if target.coordinator:
            files.check_destination(final)
        mine["extra"] = encode(extra, "extra")
        mine["optimizer"] = _optimizer_state(target, optimizer, tensors) if optimizer is not None else None
        mine["lr_scheduler"] = encode(lr_scheduler.state_dict(), "sched", tensors) if lr_scheduler else None
        scaling = loss_scaling_of(pipe)  # fp16's loss scale: the same on every rank
        mine["loss_scaling"] = scaling.state_dict() if scaling is not None else None
    except CheckpointError as exc:
        mine["problem"] = str(exc)
    except Exception as exc:  # anything else, too, must reach the peers before they wait in DCP
        log.exception("conveyor: preparing the checkpoint failed on this rank")
        mine["problem"] = f"{type(exc).__name__}: {exc}"
    mine["aliases"], mine["order"] = target.aliases, target.order
    everyone = target.gather(mine)  # every rank learns of any rank's problem: all raise, none waits
    for theirs in everyone:
        if theirs["problem"]:
            raise CheckpointError(f"cannot save {final} (rank {theirs['rank']}): {theirs['problem']}")
    partial = files.partial_dir(final, everyone[0]["token"])
    for name, tensor in target.tensors.items():
        tensors[f"model.{name}"] = tensor.detach()
    for name, tensor in capture_rng().items():
        tensors[f"rng.rank{target.global_rank}.{name}"] = tensor
    outcome = target.guard(_write, tensors, partial, target)
    if isinstance(outcome, BaseException):
        raise CheckpointError(f"writing {final} failed on some rank: {outcome}") from outcome
    status = None
    if target.coordinator:
        try:
            files.write_meta(partial, _meta(target, everyone, optimizer))
            files.publish(partial, final, keep_last)
        except OSError as exc:
            status = f"{type(exc).__name__}: {exc}"
    statuses = target.gather(status)  # also the barrier: no rank returns before the checkpoint exists
    if statuses[0]:
        raise CheckpointError(f"the checkpoint's files were written, but publishing {final} failed: {statuses[0]}")
    return final


def _write(tensors: dict[str, torch.Tensor], partial: Path, target: Target) -> Any:
    if target.coordinator:
        files.remove_leftovers(partial.parent, keep=partial)  # what earlier interrupted saves left behind
    # Packed DTensor shards are gathered here, where a failed peer is named rather than awaited.
    tensors = {key: storable(tensor) for key, tensor in tensors.items()}
    writer = FileSystemWriter(partial, overwrite=True)
    try:
        with files.quiet_single_process():
            dcp.save(tensors, storage_writer=writer, process_group=target.group, no_dist=target.group is None)
    except CheckpointException as exc:
        return exc  # DCP gathered it on every rank: all raise alike, the pipeline stays usable
    return None


def _optimizer_state(target: Target, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> dict:
    """Put the optimizer's tensors (keyed ``optim.state.<name>.<key>``) in ``tensors``; return the rest as JSON."""
    container = target.container()
    names = {id(p): n for n, p in container.named_parameters()}
    strangers = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in names]
    if strangers:
        raise CheckpointError(
            f"the optimizer holds {len(strangers)} parameter(s) (the first of shape {list(strangers[0].shape)}) "
            "that are not the pipeline's on this rank: build it from pipe.parameters()"
        )
    if optimizer.state:
        # The helper would run a step with zero gradients to create missing state: only when some exists.
        flat = get_optimizer_state_dict(container, optimizer, options=FLAT)
    else:
        flat = group_values(optimizer, names)
    values = {}
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            tensors[f"optim.{key}"] = value.detach()
        else:
            values[key] = encode(value, f"optimizer {key}", None)
    stateful = [names[id(p)] for p in optimizer.state if optimizer.state[p]]
    return {"class": type(optimizer).__name__, "values": values, "stateful": stateful}


def group_values(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, Any]:
    """``param_groups.<name>.<key>``: each parameter's hyper-parameters, as the flattened helper keys them."""
    return {f"param_groups.{names[id(param)]}.{key}": value for group in optimizer.param_groups
            for param in group["params"] for key, value in group.items() if key != "params"}


def _meta(target: Target, everyone: list[dict], optimizer: Any) -> dict[str, Any]:
    """conveyor.json: the coordinator's view, merged with what every rank holds."""
    aliases: dict[str, str] = {}
    placed: dict[str, tuple[int, int]] = {}
    for rank, theirs in enumerate(everyone):
        aliases.update(theirs["aliases"])
        for position, (stage, name) in enumerate(theirs["order"]):
            placed.setdefault(name, (stage, rank * 1_000_000 + position))
    info = target.model_info
    known = info.get("state_names") if info else None
    order = [n for n in known if n in placed] if known else []
    order += sorted(placed.keys() - set(order), key=placed.__getitem__)
    meta = files.new_meta({
        "model": {"info": info, "names": order, "aliases": aliases},
        "layout": target.layout,
        "lr_scheduler": everyone[0]["lr_scheduler"],
        "loss_scaling": everyone[0].get("loss_scaling"),
        "extra": everyone[0]["extra"],
        "rng_ranks": [theirs["rank"] for theirs in everyone],
        "optimizer": None,
    })
    if any(theirs["extra"] != everyone[0]["extra"] for theirs in everyone):
        meta["extra_by_rank"] = {str(theirs["rank"]): theirs["extra"] for theirs in everyone}
    if optimizer is not None:
        states = [theirs["optimizer"] for theirs in everyone]
        meta["optimizer"] = {"class": states[0]["class"],
                             "values": {key: value for s in states for key, value in s["values"].items()},
                             "stateful": sorted({name for s in states for name in s["stateful"]})}
    return meta
