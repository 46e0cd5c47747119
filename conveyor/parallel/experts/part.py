"""Expert parallelism as a stage part: each rank keeps 1/ep of every experts module, tokens move all-to-all.

The ``ep`` ranks of an expert-parallel group are borrowed from the mesh's "dp" dim, as torchtitan
and transformers borrow them (ep divides the replica count): replicas ``b*ep .. b*ep + ep - 1`` at
one pipeline position form group ``b``, and the one at place ``i`` in its group owns experts
``i*E/ep .. (i+1)*E/ep - 1`` of every experts module of its stages (dim 0 of the 3-D weights;
memory for expert parameters, gradients and optimizer state drops to 1/ep). The replicas at
the same place of every group hold the same experts: the expert-data-parallel group (dp / ep
ranks, one rank when ep = dp).

A step, for the experts: each microbatch's forward sends every (token, choice) slot to its
expert's owner and back (:func:`conveyor.parallel.experts.dispatch.dispatch_combine`); autograd
sends the gradients the reverse way, so an owner's expert gradient sums its tokens from every
replica of its group. At the step's end (:meth:`ExpertParallel.finish_step`) each expert gradient
is summed over the expert-data-parallel group and divided by dp: the replicas' mean, as the
replicas' part gives the dense gradients (it leaves the experts alone: they are claimed, see
:func:`conveyor.parallel.part.claim_reduction`).

The pipeline's schedules need nothing more: both replicas of an expert-parallel group run the same
program, so they reach each microbatch's all-to-all of each layer in the same order.

With tensor parallelism (the part after :class:`~conveyor.parallel.tensor.stages.TensorParallelStages`), ep
borrows from dp x tp, as torchtitan's and transformers' expert parallelism do: the TP ranks of a stage hold the
same tokens, so each takes its ``1/tp`` of them (by rows) into the experts, and the expert-parallel groups are
``ep`` consecutive (replica, TP rank) positions (:func:`expert_memberships`; ep = tp groups a stage's TP ranks,
ep = dp x tp every rank of a pipeline position). After the combine the TP ranks gather the rows back, so every
TP rank leaves the experts with the whole output (:func:`_on_tensor_parallel_ranks`): no expert is computed
twice, and a rank keeps ``1/ep`` of the experts.

Example (what ``parts_for`` builds for ``DistributedLayout(mesh=mesh, expert_parallel="auto", ep=2)``)::

    part = ExpertParallel("auto", 2, mesh_layout)
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._prims_common import make_contiguous_strides_for

from conveyor.errors import PipelineConfigError
from conveyor.expert_option import is_stacked_experts
from conveyor.options import WholeModel
from conveyor.parallel.clipping import combine_shard_norms, local_part
from conveyor.parallel.experts.discover import find_experts, num_experts_of
from conveyor.parallel.experts.dispatch import Exchanges, dispatch_combine, local_compute
from conveyor.parallel.experts.overlap import check_overlap, stepped_forward
from conveyor.parallel.mesh import MeshLayout
from conveyor.parallel.part import PartSite, StagePart, claim_reduction
from conveyor.runtime.stage.device import collective_device
from conveyor.schedule.ir import Schedule
from conveyor.schedule.overlap import pair_forward_backward


class ExpertParallel(StagePart):
    """This rank's share of every experts module of its stages, and the groups that move their tokens.

    ``plan``: "auto" or {module-name pattern: "ep_dispatch_experts"}; ``ep``: the expert-parallel
    group's size (divides the mesh's dp); ``mesh_layout``: where this rank stands; ``capacity``: the
    capacity factor (None: no slot dropped). :attr:`dropped_slots`: the slots dropped in the last step.
    """

    wants_checkpoint_group = True

    def __init__(self, plan, ep: int, mesh_layout: MeshLayout, capacity: float | None = None,
                 overlap: bool = False) -> None:
        ranks = mesh_layout.dp_size * mesh_layout.tp_size
        if ranks % ep:
            raise PipelineConfigError(f"ep={ep} does not divide the mesh's dp x tp = {ranks}: expert parallelism "
                                      "borrows its ranks from the replicas and their TP ranks; choose ep dividing "
                                      f"{ranks}")
        self.plan = plan
        self.ep = ep
        self.capacity = capacity
        self.overlap = overlap  # each traced stage's forward in steps, for the schedule's overlapped pairs
        self.all_to_alls = Exchanges(None)  # the group's all-to-alls, posted and timed (its group set in agree)
        self._dropped = torch.zeros((), dtype=torch.long)  # this step's, on the stage device (no host read)
        self.mesh_layout = mesh_layout
        # This rank's place in its group (which experts it owns): its (replica, TP rank) position, modulo ep.
        self.ep_rank = (mesh_layout.dp_rank * mesh_layout.tp_size + mesh_layout.tp_rank) % ep
        self.tp_mesh = mesh_layout.tp_mesh if mesh_layout.tp_size > 1 else None  # the TP ranks split the tokens
        self.group = None  # the expert-parallel group: the tokens' all-to-all
        self.replicas_group = None  # the expert-data-parallel group: the expert gradients' sum
        self.experts: dict[int, dict[str, nn.Module]] = {}  # by stage, by name in the stage
        self.num_experts: dict[nn.Module, int] = {}  # each experts module's whole count
        self.runners: dict = {}

    def program(self, schedule: Schedule) -> Schedule:
        """With overlap, ``schedule`` with each forward paired with the backward next to it (each pair's passes
        take turns at their all-to-alls: :mod:`conveyor.parallel.experts.overlap`)."""
        if not self.overlap:
            return schedule
        paired = pair_forward_backward(schedule)
        if schedule.virtual < 2 or not any(paired.overlapped):
            # One stage per rank: a pair's backward waits for the next rank, which waits for the pair's forward.
            raise PipelineConfigError(
                f"expert_overlap=True runs each forward with the backward next to it on the rank, and schedule "
                f"{schedule.name!r} ({schedule.virtual} stage(s) per rank) has no such pair that would not wait on "
                "itself: with one stage per rank the pair's backward needs the next rank, which needs the pair's "
                "forward first. Use a schedule with two stages per rank (zbv, dualpipev, interleaved-1f1b with "
                "virtual=2), or drop expert_overlap")
        return paired

    @classmethod
    def trace_leaves(cls, model: nn.Module) -> list[str]:
        """Every experts module of ``model``: kept whole by the trace, in the stage that holds it by its name, so
        that :meth:`wrap_stages` finds it and reroutes its tokens."""
        return [name for name, module in model.named_modules() if is_stacked_experts(module)]

    def wrap_stages(self, modules: Mapping[int, nn.Module], schedule: Schedule, model: WholeModel) -> None:
        """Keep this rank's experts of every experts module, and route their forward through the group."""
        for stage, module in modules.items():
            found = find_experts(module, self.plan)
            for name, experts in found.items():
                shard_experts(experts, self.ep_rank, self.ep, f"stage {stage} module {name!r}")
                self.num_experts[experts] = num_experts_of(experts) * self.ep  # before the shards become DTensors
                experts.forward = functools.partial(_dispatched_forward, experts, self, self.num_experts[experts])
            self.experts[stage] = found

    def agree(self, site: PartSite) -> None:
        """The expert-parallel and expert-data-parallel groups (built by every rank, in one order); a
        model without experts anywhere in the pipeline is refused on every rank."""
        found = torch.tensor([sum(len(f) for f in self.experts.values())],
                             device=collective_device(site.life.backend, site.device))
        dist.all_reduce(found, group=site.life.groups.group)
        if int(found.item()) == 0:
            raise PipelineConfigError(
                f"expert_parallel={self.plan!r} found no experts in any stage of the pipeline: give a "
                "mixture-of-experts model (transformers 5's experts modules), a plan naming its experts "
                f"modules, or drop expert_parallel{self._inlined_hint(site)}")
        ep_groups, replica_groups = expert_memberships(self.mesh_layout, self.ep)
        self.group = site.life.groups.replica_group(ep_groups)
        # Group ranks follow the global ranks, which a mesh lays out in replica order: this rank's place
        # in the all-to-all is the one whose experts it kept.
        assert dist.get_rank(self.group) == self.ep_rank, (dist.get_rank(self.group), self.ep_rank, ep_groups)
        self.replicas_group = site.life.groups.replica_group(replica_groups) if len(replica_groups[0]) > 1 else None
        self.runners = dict(site.runners)
        self.all_to_alls.group = self.group
        if self.overlap:
            for stage, runner in self.runners.items():
                if self.experts.get(stage):
                    check_overlap(runner, self.tp_mesh is not None)
                    runner.stepped = stepped_forward(self, runner.module, self.experts[stage])
        self._dropped = torch.zeros((), dtype=torch.long, device=site.device)
        self._as_dtensors(site.device)
        shapes = {f"{stage}:{name}": [tuple(p.shape) for p in m.parameters()]
                  for stage, by_name in self.experts.items() for name, m in by_name.items()}
        site.life.groups.agree({**site.built, "expert parallel": f"ep={self.ep} {self.plan!r}",
                                "expert shards": repr(sorted(shapes.items()))}, group=self.group,
                               who="expert-parallel ranks")

    def _inlined_hint(self, site: PartSite) -> str:
        """Why none was found, from this rank's stages: experts modules the plan does not name, or stacked
        expert weights no experts module runs (stages split without leaves inline the experts' code)."""
        modules = {name for runner in site.runners.values() for name in find_experts(runner.module, "auto")}
        if modules:
            return f". This rank's stages hold experts modules the plan does not name: {sorted(modules)}"
        stacked = [name for runner in site.runners.values() for name, p in runner.module.named_parameters()
                   if p.dim() == 3]
        if not stacked:
            return ""
        return (f". This rank's stages hold 3-D expert weights ({stacked[0]}, ...) that no experts module runs: "
                "stages split without expert parallelism inline the experts' code, which it cannot reroute; "
                "build them with conveyor.pipeline(..., layout=DistributedLayout(expert_parallel=...)), "
                "which keeps each experts module whole, or split inside conveyor.frontend.leaves.experts_as_leaves("
                "model)")

    def _as_dtensors(self, device: torch.device) -> None:
        """Each shard as a DTensor sharded on dim 0 over the group's 1-D mesh: its global shape and name are
        the whole experts', so checkpoints (DCP) write and reshard it, export gathers it whole, and
        AdamW's state follows it; the experts' own code runs on its local tensor."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        # Named after the group (as the replicas' mesh is): torch's DTensor caches key meshes by ranks and name.
        mesh = DeviceMesh.from_group(self.group, device.type, mesh_dim_names=(f"ep_{self.group.group_name}",))
        for by_name in self.experts.values():
            for experts in by_name.values():
                for name, param in list(experts.named_parameters(recurse=False)):
                    global_shape = torch.Size((param.shape[0] * self.ep, *param.shape[1:]))
                    sharded = DTensor.from_local(param.detach(), mesh, [Shard(0)], run_check=False,
                                                 shape=global_shape, stride=make_contiguous_strides_for(global_shape))
                    kept = nn.Parameter(sharded, requires_grad=param.requires_grad)
                    claim_reduction(kept, "expert parallelism")
                    setattr(experts, name, kept)

    @property
    def dropped_slots(self) -> int:
        """The (token, choice) slots this rank's experts dropped over capacity in the last step (a host read)."""
        return int(self._dropped.item())

    def start_step(self) -> None:
        """A new step counts its own dropped slots and times its own all-to-alls."""
        self._dropped.zero_()
        self.all_to_alls.spans.clear()
        self.all_to_alls.recording = True

    def exchanges(self) -> tuple[list[tuple[str, float, float]], float]:
        """The last step's all-to-alls, (label, posted, done) each, and the seconds this rank waited for them."""
        spans = self.all_to_alls.spans
        return ([(label, posted, done) for label, posted, _, done in spans],
                sum(done - waited for _, _, waited, done in spans))

    def wrap(self) -> None:
        """The runners re-read their parameters (the shards became DTensors)."""
        for runner in self.runners.values():
            runner.refresh_params()

    def parameters(self) -> list[nn.Parameter]:
        """This rank's expert parameters (its shards), stage by stage."""
        return [p for by_name in self.experts.values() for m in by_name.values() for p in m.parameters()]

    def finish_step(self) -> None:
        """Each expert gradient summed over the expert-data-parallel group, then divided by dp: the replicas' mean."""
        self.all_to_alls.recording = False  # the step's all-to-alls are timed; forward-only calls are not

        for param in self.parameters():
            if param.grad is None:
                continue
            grad = local_part(param.grad)
            if self.replicas_group is not None:
                dist.all_reduce(grad, group=self.replicas_group)
            grad.div_(self.mesh_layout.dp_size)

    def flags(self, flags: torch.Tensor) -> torch.Tensor:
        """The flags' max over the expert-parallel group: one owner's experts may be the only bad ones."""
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return flags

    def whole_norms(self, grads: Sequence[torch.Tensor], norms: list[torch.Tensor],
                    norm_type: float) -> list[torch.Tensor]:
        """An expert gradient's norm over every expert: its shards' norms combined over the group."""
        mine = {id(p.grad) for p in self.parameters() if p.grad is not None}
        ours = [i for i, grad in enumerate(grads) if id(grad) in mine]
        return combine_shard_norms(norms, norm_type, self.group, at=ours)

    def release(self) -> None:
        """Forget the groups (the pipeline destroys them)."""
        self.group = self.replicas_group = self.all_to_alls.group = None


def shard_experts(experts: nn.Module, ep_rank: int, ep: int, where: str) -> None:
    """Keep, in place, the ``ep_rank``-th of ``ep`` equal slices (dim 0) of ``experts``' parameters.

    Example:
        >>> shard_experts(module, 1, 2, "stage 0 module 'mlp.experts'")   # doctest: +SKIP
    """
    num_experts = num_experts_of(experts)
    if num_experts % ep:
        raise PipelineConfigError(f"{where} holds {num_experts} experts, which ep={ep} does not divide: choose an ep "
                                  f"dividing {num_experts} (each rank owns num_experts / ep of them)")
    local = num_experts // ep
    for name, param in list(experts.named_parameters(recurse=False)):
        # Under tensor parallelism the traced stage's experts are replicated DTensors: each holds them whole.
        kept = nn.Parameter(local_part(param.detach())[ep_rank * local:(ep_rank + 1) * local].clone(),
                            requires_grad=param.requires_grad)
        claim_reduction(kept, "expert parallelism")
        setattr(experts, name, kept)
    if hasattr(experts, "num_experts"):
        experts.num_experts = local  # the model's own expert code loops over the local experts


def _dispatched_forward(experts: nn.Module, part: ExpertParallel, num_experts: int, hidden_states: torch.Tensor,
                        top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's forward under expert parallelism: the same signature, the tokens dispatched."""

    compute = local_compute(experts, top_k_weights.dtype)
    if part.group is None:
        raise PipelineConfigError("an expert-parallel experts module ran outside its pipeline (its groups are not "
                                  "built yet or were released): run it through the pipeline's step")
    dispatch = functools.partial(dispatch_combine, num_experts=num_experts, group=part.group, compute=compute,
                                 capacity_factor=part.capacity, dropped=part._dropped, exchanges=part.all_to_alls)
    if part.tp_mesh is not None:  # the TP ranks split the tokens: see _on_tensor_parallel_ranks
        return _on_tensor_parallel_ranks(part.tp_mesh, hidden_states, top_k_index, top_k_weights, dispatch)
    return dispatch(hidden_states, top_k_index, top_k_weights)


def _on_tensor_parallel_ranks(tp_mesh, hidden_states, top_k_index, top_k_weights, forward) -> torch.Tensor:
    """``forward`` on this TP rank's rows of the tokens (``tensor_split`` by rows over the TP ranks, as
    DTensor's ``Shard(0)`` cuts them), the rows gathered back after it: the whole output on every TP rank.

    The TP ranks of a stage hold the same tokens: a traced stage's as DTensors (gathered or reduced to
    ``Replicate`` here if propagation left them otherwise), a hand-built stage's as plain tensors, replicated.
    As DTensors the cut costs nothing and the gather is DTensor's all-gather; both backwards are DTensor's
    own (each TP rank's rows of the replicated gradient in, the rows' input gradients gathered out), so
    every TP rank sends the same gradients on. The output keeps the input's kind (DTensor or plain).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    traced = isinstance(hidden_states, DTensor)
    mesh = hidden_states.device_mesh if traced else tp_mesh
    replicated = [Replicate()] * mesh.ndim

    def rows(value: torch.Tensor) -> torch.Tensor:
        if not isinstance(value, DTensor):
            value = DTensor.from_local(value, mesh, replicated, run_check=False)
        return value.redistribute(mesh, [Shard(0)] * mesh.ndim).to_local()

    out = forward(rows(hidden_states), rows(top_k_index), rows(top_k_weights))
    shape = hidden_states.shape
    whole = DTensor.from_local(out, mesh, [Shard(0)] * mesh.ndim, run_check=False, shape=shape,
                               stride=make_contiguous_strides_for(shape)).redistribute(mesh, replicated)
    return whole if traced else whole.to_local()


def expert_memberships(layout: MeshLayout, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """The expert-parallel groups and the expert-data-parallel groups of the job, as global ranks, in the
    one order every rank builds them: per pipeline position, ``ep`` consecutive (replica, TP rank) positions
    at a time; and the positions at the same place of every such group.

    Example (2 replicas of a 2-stage pipeline, no TP):
        >>> from conveyor.parallel.mesh import MeshLayout
        >>> expert_memberships(MeshLayout(((0, 1), (2, 3)), 0, 0, None), 2)
        ([[0, 2], [1, 3]], [[0], [2], [1], [3]])
    """
    pipelines = layout.group_pipelines  # one per (replica, TP position), replica-major: global ranks ascending
    ep_groups, replica_groups = [], []
    for position in range(layout.pp_size):
        column = [pipeline[position] for pipeline in pipelines]
        ep_groups += [column[start:start + ep] for start in range(0, len(column), ep)]
        replica_groups += [column[place::ep] for place in range(ep)]
    return ep_groups, replica_groups
