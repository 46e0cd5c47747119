"""What one process saves and loads: its tensors under model-wide names, and whom it talks to.

A :class:`Target` is the same view of a distributed :class:`~conveyor.Pipeline` (this rank's
stages), an in-process one (every stage, one process) or a plain
``nn.Module`` (the unsplit model, one process), so saving and loading are one code path.

Names. Stages built by :func:`conveyor.pipeline` (or ``split_model``) keep the unsplit
model's names, so a tensor has the same key whatever the layout: that is what makes
resharding across pp sizes, schedules and V a non-event. A tied tensor (GPT-2's
``transformer.wte.weight`` / ``lm_head.weight``) is keyed once, by its first name; its other
names are recorded as aliases, and every rank holding a copy loads the same key. Stages
built by hand have no model-wide names: their tensors are keyed ``stages.<s>.<name>``, as in
a module holding the stages in a ``ModuleList`` called ``stages``, and such checkpoints load
into any layout with the same stages.

The optimizer. One user optimizer may hold the parameters of several stage modules (V > 1,
or an in-process one). torch's ``get/set_optimizer_state_dict`` key state by a module's
parameter names, so :meth:`Target.container` builds a module whose ``named_parameters()``
are exactly this process's parameters under their checkpoint names (the same Parameter
objects the optimizer holds): the helpers then key optimizer state by model-wide names.

Data parallelism: replicas over a "dp" dimension hold the same tensors under the same names
(whole with ``"ddp"``, as DTensor shards with ``"fsdp"``); the pipeline's
``checkpoint_group`` spans every replica, and DCP writes each replicated tensor once and each
shard by its holder.

Tensor parallelism: a TP stage's parameters (and their AdamW state) are DTensors; each is saved
under its original name and global shape, every TP rank writing its own shard (see
:mod:`conveyor.checkpoint.shards`), and DCP reshards on load to any pp, dp or tp. The
``checkpoint_group`` of a TP pipeline spans every rank of the job, and the layout that decides
whether random states come back records tp.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.errors import CheckpointError
from conveyor.frontend import StageModule
from conveyor.frontend.pretrained import model_info
from conveyor.pipe import Pipeline
from conveyor.runtime.stage.main_grad import MasterWeights


@dataclass
class Target:
    """This process's share of a checkpoint (see the module docstring)."""

    tensors: dict[str, torch.Tensor]  # checkpoint name -> the tensor saved and loaded in place
    params: dict[str, nn.Parameter]  # the parameters among them, for the optimizer
    copies: dict[str, list[torch.Tensor]]  # other local tensors of one name (filled after a load)
    aliases: dict[str, str]  # another name of a tensor -> its checkpoint name
    order: list[tuple[int, str]]  # (stage, name) of each tensor here, to order a hand-built model
    layout: dict[str, Any]  # processes, global ranks, stage placement: when RNG states may be restored
    model_info: dict[str, Any] | None
    group: Any = None  # torch.distributed group of every process of the checkpoint; None: one process
    guard: Callable[..., Any] = field(default=lambda fn, *args: fn(*args))
    rank: int = 0  # in ``group``
    global_rank: int = 0

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    def gather(self, value: Any) -> list[Any]:
        """Every process's ``value`` in group-rank order (one collective; just ``[value]`` alone)."""
        if self.group is None:
            return [value]

        def exchange() -> list[Any]:
            everyone: list[Any] = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(everyone, value, group=self.group)
            return everyone

        return self.guard(exchange)

    def container(self) -> nn.Module:
        """A module whose ``named_parameters()`` are this process's parameters under checkpoint names."""
        root = nn.Module()
        for name, param in self.params.items():
            owner = root
            *path, leaf = name.split(".")
            for part in path:
                # Straight into the tables: a model's names may shadow nn.Module attributes ("training").
                owner = owner._modules.setdefault(part, nn.Module())
            owner._parameters[leaf] = param
        return root


def with_masters(target: Target, optimizer: Any) -> tuple[MasterWeights | None, Any]:
    """``(master_weights, torch_optimizer)``: for a :class:`~conveyor.MasterWeights`, its fp32
    masters stand in for the low-precision parameters in ``target`` (saved and loaded under the
    parameters' names: a checkpoint holds the fp32 weights, which load into a bf16 model rounded,
    as its parameters are) and its inner optimizer's state is keyed by them; else ``(None, optimizer)``.
    """
    if not isinstance(optimizer, MasterWeights):
        return None, optimizer
    master_of = {id(p): m for p, m in zip(optimizer.params, optimizer.masters)}
    for name, param in list(target.params.items()):
        master = master_of.get(id(param))
        if master is not None:
            target.params[name] = target.tensors[name] = master
    return optimizer, optimizer.optimizer


def target_of(obj: Any) -> Target:
    """The :class:`Target` of a pipeline or an unsplit module."""
    if isinstance(obj, Pipeline):
        return _of_pipeline(obj)
    if isinstance(obj, nn.Module):
        return _of_module(obj)
    raise CheckpointError(
        f"checkpoints save and load a conveyor Pipeline (distributed or in-process) or an nn.Module; got "
        f"{type(obj).__name__}"
    )


def loss_scaling_of(obj: Any) -> Any:
    """A pipeline's loss scaling (fp16: :mod:`conveyor.pipe.loss_scaling`), whose state checkpoints keep; None
    for a module, or a pipeline without loss scaling."""
    return obj.gradient_checks.loss_scaling if isinstance(obj, Pipeline) else None


def _of_module(module: nn.Module) -> Target:
    target = Target({}, {}, {}, {}, [], {"processes": 1, "global_ranks": [0], "stages": None}, model_info(module))
    return _fill(target, ((0, name, tensor) for name, tensor in module.state_dict(keep_vars=True).items()))


def _of_pipeline(pipe: Pipeline) -> Target:
    runners = dict(sorted(pipe.runners.items()))
    schedule = pipe.schedule
    placement = [schedule.placement.rank_of(s) for s in range(schedule.num_stages)]
    aliases: dict[str, str] = {}
    if all(isinstance(r.module, StageModule) for r in runners.values()):
        first = {name: tied.names[0] for tied in pipe.tied_parameters for name in getattr(tied, "names", ())}
        aliases = {name: canonical for name, canonical in first.items() if name != canonical}

        def key(stage: int, name: str) -> str:
            return first.get(name, name)
    else:
        tied_keys = {}
        for tied in pipe.tied_parameters:
            stage0, name0 = min(tied.uses)
            tied_keys.update({use: f"stages.{stage0}.{name0}" for use in tied.uses})

        def key(stage: int, name: str) -> str:
            return tied_keys.get((stage, name), f"stages.{stage}.{name}")

    if not pipe.ranks.in_process:
        life = pipe.ranks.life
        life.check_usable()
        group, global_ranks, rank = life.group, list(life.global_ranks), life.rank
        if pipe.checkpoint_group is not None:  # data parallelism: every replica writes its part
            group = pipe.checkpoint_group
            global_ranks = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
            rank = dist.get_rank(group)
        layout = {"processes": len(global_ranks), "global_ranks": global_ranks, "stages": placement}
        if pipe.layout.tensor_parallel is not None:  # same ranks and stages, other shards
            layout["tp"] = pipe.ranks.mesh_layout.tp_size
        target = Target({}, {}, {}, dict(aliases), [], layout, pipe.model_info, group=group,
                        guard=pipe.ranks.guarded, rank=rank, global_rank=life.global_ranks[life.rank])
    else:  # every rank in this process
        layout = {"processes": 1, "global_ranks": [0], "stages": placement}
        target = Target({}, {}, {}, dict(aliases), [], layout, pipe.model_info)
    return _fill(target, ((stage, key(stage, name), tensor) for stage, runner in runners.items()
                          for name, tensor in runner.module.state_dict(keep_vars=True).items()))


def _fill(target: Target, entries: Iterable[tuple[int, str, torch.Tensor]]) -> Target:
    """``target`` holding each ``(stage, checkpoint name, tensor)`` of ``entries``, in order."""
    seen: dict[int, str] = {}
    for stage, canonical, tensor in entries:
        if id(tensor) in seen:  # one tensor under two names (tied within a module, or shared by local stages)
            if seen[id(tensor)] != canonical:
                target.aliases.setdefault(canonical, seen[id(tensor)])
            continue
        seen[id(tensor)] = canonical
        if canonical in target.tensors:  # a second local copy of a tensor several stages use
            target.copies.setdefault(canonical, []).append(tensor)
            continue
        target.tensors[canonical] = tensor
        target.order.append((stage, canonical))
        if isinstance(tensor, nn.Parameter):
            target.params[canonical] = tensor
    return target
