"""Tied parameters across stages: one Parameter within a rank, gradients summed across ranks.

A parameter several stages use (GPT-2's token embedding and LM head) has a copy in each of
them. Copies on one rank become one Parameter (:func:`share_tied_locally`); copies on
several ranks have this step's gradient summed across exactly those ranks at the end of
every step (:class:`TiedGradients`), so they stay equal after each optimizer step (the
summation order differs from one device: equal to rounding, not bitwise). With data
parallelism each replica sums its own copies, after the replicas' mean. With tensor
parallelism each TP position is a pipeline of its own (``MeshLayout.group_pipelines``), so a
copy's group joins the matching TP ranks of the stages holding it, and what is summed is this
rank's local shard of the gradient (settled to the parameter's placements first): the copies
must be sharded alike, as :func:`conveyor.parallel.tensor.stages.model_placements` sees to.

Example (what :class:`conveyor.Pipeline` and its distributed ranks backend do; a :class:`StagePart`)::

    share_tied_locally(runners, tied_parameters)
    tied = TiedGradients(); tied.agree(site)
    tied.start_step(); ...run the step...; tied.finish_step()
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from conveyor.parallel.clipping import local_part
from conveyor.parallel.part import PartSite, StagePart
from conveyor.runtime.stage.main_grad import gradient, gradient_attribute
from conveyor.runtime.stage.runner import StageRunner


def share_tied_locally(runners: dict[int, StageRunner], tied_parameters) -> None:
    """Stages of one rank that use the same tied parameter get one Parameter object."""
    for tied in tied_parameters:
        local = [(stage, name) for stage, name in tied.uses if stage in runners]
        if len(local) < 2:
            continue
        first_stage, first_name = local[0]
        shared = runners[first_stage].module.get_parameter(first_name)
        for stage, name in local[1:]:
            owner_name, _, leaf = name.rpartition(".")
            setattr(runners[stage].module.get_submodule(owner_name), leaf, shared)  # "" names the module itself
            runners[stage].refresh_params()


def tied_copies_outside_their_first_stage(runners: dict[int, StageRunner], tied_parameters) -> set[int]:
    """Ids of this rank's copies of tied parameters that the unsplit model counts elsewhere.

    The unsplit model lists a tied parameter once, where its first stage uses it; the
    copies on later stages (on other ranks: distinct objects) must not count again.
    """
    skip: set[int] = set()
    for tied in tied_parameters:
        first = min(stage for stage, _ in tied.uses)
        kept = runners[first].module.get_parameter(dict(tied.uses)[first]) if first in runners else None
        for stage, name in tied.uses:
            if stage != first and stage in runners:
                copy = runners[stage].module.get_parameter(name)
                if copy is not kept:
                    skip.add(id(copy))
    return skip


class TiedGradients(StagePart):
    """This rank's copies of tied parameters that live on several ranks, each with its group.

    :meth:`agree` creates one process group per set of ranks sharing a parameter: collective
    over the whole job, so every rank builds every group, in the same order, whether it holds a
    copy or not (with replicas, each replica's group: ``site.mesh_layout.replica_ranks``);
    :meth:`wrap` then finds this rank's copies.
    """

    def __init__(self) -> None:
        self.subgroups: dict[tuple[int, ...], Any] = {}  # by the ranks sharing a parameter
        self.copies: list[tuple[torch.nn.Parameter, Any]] = []
        self.summed_before: set[int] = set()  # copies some rank had a gradient for in an earlier step
        self.held: list[torch.Tensor | None] = []  # earlier steps' gradients, set aside during a step

    def agree(self, site: PartSite) -> None:
        """One group per set of ranks sharing a tied parameter (a collective over the job)."""
        self.site = site
        placement, layout = site.schedule.placement, site.mesh_layout
        for tied in site.model.tied_parameters:
            owners = tuple(sorted({placement.rank_of(stage) for stage, _ in tied.uses}))
            if len(owners) > 1 and owners not in self.subgroups:
                replicas = layout.replica_ranks(list(owners)) if layout is not None else None
                self.subgroups[owners] = site.life.groups.subgroup(owners, replicas)

    def wrap(self) -> None:
        """This rank's copies, as the stages hold them once every part wrapped them (replicas swap them)."""
        runners, placement = self.site.runners, self.site.schedule.placement
        for tied in self.site.model.tied_parameters:
            owners = tuple(sorted({placement.rank_of(stage) for stage, _ in tied.uses}))
            if len(owners) > 1 and self.site.life.rank in owners:
                stage, name = next((s, n) for s, n in tied.uses if s in runners)
                self.copies.append((runners[stage].module.get_parameter(name), self.subgroups[owners]))

    def release(self) -> None:
        """Forget the copies and their groups (after a failure: nothing may hold the groups)."""
        self.copies.clear()

    def start_step(self) -> None:
        """Take the tied copies' gradients of earlier steps out of the way: only this step's
        share is summed across ranks (summing the whole .grad would count the earlier steps'
        summed gradient again on every copy when the user accumulates over steps)."""
        self.held = []
        for param, _ in self.copies:
            self.held.append(gradient(param))  # main_grad where it accumulates there
            setattr(param, gradient_attribute(param), None)

    def finish_step(self) -> None:
        """Sum this step's gradient of every copy across the ranks holding one; add back what was held.

        A frozen parameter (frozen on every rank: one model) gets no gradient, as on one device.
        A copy that got none this step adds nothing (zeros). Until some copy of a parameter got a
        gradient, the ranks first ask each other whether any did (a host read of one flag) and,
        if none did, the parameter keeps what it had, so that the optimizer skips a parameter
        nothing used; from then on the sum runs without asking (no host round trip per step),
        so a parameter that every copy leaves unused in a later step gets zeros, not None.
        """
        for (param, subgroup), earlier in zip(self.copies, self.held, strict=True):
            attribute = gradient_attribute(param)  # "main_grad" where the gradient accumulates there
            if param.requires_grad and self._any_gradient(param, attribute, subgroup):
                grad = getattr(param, attribute)
                if grad is None:
                    grad = torch.zeros_like(param, dtype=torch.float32 if attribute == "main_grad" else None)
                    setattr(param, attribute, grad)
                # A replicated DTensor's local tensor is all of it (the replicas' mean already).
                dist.all_reduce(local_part(grad), op=dist.ReduceOp.SUM, group=subgroup)
            grad = getattr(param, attribute)
            if earlier is not None:
                setattr(param, attribute, earlier if grad is None else earlier.add_(grad))

    def _any_gradient(self, param: torch.nn.Parameter, attribute: str, subgroup) -> bool:
        """Whether some copy of ``param`` got a gradient (in ``attribute``); asked only until one did
        (every rank of ``subgroup`` reads the same flag, so all stop asking at the same step)."""
        if id(param) in self.summed_before:
            return True
        got_one = torch.tensor([getattr(param, attribute) is not None], dtype=torch.int32, device=param.device)
        dist.all_reduce(got_one, op=dist.ReduceOp.MAX, group=subgroup)
        if not got_one.item():
            return False
        self.summed_before.add(id(param))
        return True
