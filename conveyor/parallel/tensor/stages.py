"""Tensor parallelism wired into a pipeline: each stage parallelized over its "tp" ranks.

A pipeline whose ``DistributedLayout`` has tp > 1 (``tensor_parallel`` set) parallelizes its stages
before their runners are built:

- traced stages (:func:`conveyor.pipeline`): the plan comes from the unchanged model, once, the
  same on every rank; :func:`conveyor.parallel.tensor.traced.parallelize_traced_stage` distributes
  each stage's parameters by their original names (:attr:`WholeModel.parameter_placements`);
- hand-built stages: torch's ``parallelize_module`` with the plan ("auto" per stage, or the
  user's); a pattern may match in some stages only, so what each rank found is gathered and a
  pattern that matches no module of any stage, or any rank's bad size, is refused on every rank
  with the same message, before any step.

Across a stage boundary each TP rank sends to the matching TP rank of the next stage exactly
its local part, as :func:`boundary_placement` says: with ``sequence_parallel`` (hand-built stages)
a floating-point activation of 2 dims or more is sharded on the sequence (dim 1, ``Shard(1)``),
so each rank sends its ``seq / tp`` rows and the next stage takes them back as a DTensor of the
global shape (:func:`_received_as_shards`); anything else crosses whole (``Replicate``): a traced
stage's outputs leave as plain tensors of the global shape and enter as replicated DTensors. A
traced stage with ``sequence_parallel`` (:mod:`~conveyor.parallel.tensor.traced_sequence`) sends
the activations of its sequence stream's shape (``[batch, seq, hidden]``) as its ``seq / tp`` rows
and the rest (rotary tables, masks, ALiBi biases) whole. The last stage keeps its logits
vocabulary-sharded with ``loss_parallel`` (hand-built or traced: the loss, a Hugging Face model's
own inside the traced graph or the user's ``loss_fn``, runs under torch's ``loss_parallel()``, see
:meth:`TensorParallelStages.runner_context`). What the TP ranks of one stage agree on when the pipeline
is built: the plan, every parameter's name, global and local shape and placements, and each
boundary's placement and local shapes (a traced stage's received shapes are known from the trace;
a hand-built one's follow the rule and the first step's exchange of shapes)
(:meth:`TensorParallelStages.stage_fields`).

Example (on each of 4 ranks: 2 stages of 2 TP ranks)::

    pipe = conveyor.pipeline(model, example_kwargs=batch, schedule="1f1b", microbatches=4,
                             layout=conveyor.DistributedLayout(tp=2), loss_fn=lambda out, _: out.loss)
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import loss_parallel

from conveyor.errors import PipelineConfigError
from conveyor.layout import describe_plan
from conveyor.parallel.clipping import combine_shard_norms
from conveyor.parallel.part import PartSite, StagePart
from conveyor.parallel.tensor.style_map import (
    check_plan,
    eager_plan,
    matching_modules,
    parallelize_stage,
    tensor_parallel_plan,
)
from conveyor.parallel.tensor.traced import parallelize_traced_stage, parameter_placements, whole_outputs
from conveyor.parallel.tensor.traced_sequence import describe_received, on_every_rank, shard_stage_sequences


def model_placements(model: nn.Module, layout: Any, tp_size: int, tied_groups=()) -> dict[str, Any]:
    """The unchanged model's plan as placements by parameter name, for its traced stages (the same on every rank).

    ``layout`` is the :class:`~conveyor.layout.DistributedLayout` (its ``tensor_parallel``, ``loss_parallel``).
    Tied copies on several stages (GPT-2's embedding and head) must be sharded alike, since their
    gradients are summed shard by shard across ranks, each TP rank with the matching TP rank of the
    other stage (:class:`~conveyor.parallel.tied.TiedGradients`). The "auto" plan shards both ends of
    the vocabulary alike (the embedding vocab-parallel, the head colwise: both ``Shard(0)``); only
    where a user's plan places the copies differently (one end left out, or the embedding colwise)
    does every copy of that parameter stay whole (``Replicate``).

    Example::

        placements = model_placements(llama, DistributedLayout(mesh=mesh, tensor_parallel="auto"), 2)
    """
    plan = layout.tensor_parallel
    if isinstance(plan, str):
        plan = tensor_parallel_plan(model, tp_size, sequence_parallel=layout.sequence_parallel,
                                    loss_parallel=layout.loss_parallel)
    else:
        check_plan(model, plan, tp_size)
    placements = parameter_placements(model, plan)
    for group in tied_groups:
        names = list(group.names)
        if len({repr(placements.get(name, Replicate())) for name in names}) > 1:
            placements.update(dict.fromkeys(names, Replicate()))
    return placements


class TensorParallelStages(StagePart):
    """What a pipeline's tensor parallelism holds and does (a stage part): the TP mesh, its group, the
    plan, how this rank's stages run, what crosses their boundaries, their gradients' placements.

    Built by :func:`conveyor.parallel.parts.parts_for` from ``layout`` (``tensor_parallel``,
    ``sequence_parallel``, ``loss_parallel``) and the mesh's "tp" sub-mesh; :meth:`wrap_stages`
    parallelizes the stages before their runners are built.
    """

    wants_checkpoint_group = True  # every TP position's pipeline writes its shards into one checkpoint
    materializes_meta_stages = True  # a meta-device model: each TP rank materializes its own shards only

    @classmethod
    def materialize_stages(cls, modules: list[nn.Module], model: nn.Module, seed: int, device: torch.device,
                           materialize: Callable[..., Any]) -> list[nn.Module]:
        """Each stage module materializing only the shards its TP rank keeps, on first use
        (:mod:`conveyor.parallel.tensor.shards`); a model not on meta is cut materialized, and kept as cut."""
        if not any(p.is_meta for p in model.parameters()):
            return modules
        from conveyor.parallel.tensor.shards import ShardSource, defer_materialization

        source = ShardSource(model, seed, device, materialize)
        return [defer_materialization(module, source) for module in modules]

    @classmethod
    def parameter_placements(cls, model: nn.Module, layout: Any, tied_groups: Any) -> dict[str, Any] | None:
        """The unchanged model's plan as placements by parameter name (:func:`model_placements`)."""
        return model_placements(model, layout, layout.tp, tied_groups)

    def __init__(self, layout: Any, tp_mesh: Any) -> None:
        self.layout, self.tp_mesh = layout, tp_mesh
        self.plan_text = describe_plan(layout.tensor_parallel)
        self.loss_parallel, self.sequence_parallel = layout.loss_parallel, bool(layout.sequence_parallel)
        self.traced = False  # traced stages (conveyor.pipeline), parallelized by original names
        self.last_stage = -1
        self.sequence_stream: frozenset = frozenset()  # traced stages: the shapes that cross as sequence rows
        self.modules: dict[int, nn.Module] = {}  # this rank's stages, once parallelized
        self.runners: Mapping[int, Any] = {}

    def wrap_stages(self, modules: Mapping[int, nn.Module], schedule: Any, model: Any) -> None:
        """Parallelize this rank's stages ({stage: module}) in place over the TP mesh as the layout says: traced
        stages by ``model.parameter_placements`` (each parameter's placement by name, from the unchanged model),
        hand-built ones with torch's ``parallelize_module`` (checked across every rank of the job first: a
        collective)."""
        self.modules, self.last_stage = dict(modules), schedule.num_stages - 1
        self.traced = model.parameter_placements is not None
        tp_mesh, sequence_parallel = self.tp_mesh, self.sequence_parallel
        if self.traced:
            for stage, module in self.modules.items():
                # Under loss_parallel the last stage's logits leave vocabulary-sharded (a DTensor) for the loss.
                parallelize_traced_stage(module, tp_mesh, model.parameter_placements,
                                         outputs_whole=not (self.loss_parallel and stage == self.last_stage))
            if sequence_parallel:  # the shapes that cross as sequence rows
                self.sequence_stream = shard_stage_sequences(self.modules, tp_mesh)
            return
        plans = _hand_built_plans(self.modules, self.layout, self.tp_size)
        for stage, module in self.modules.items():
            if plans[stage]:
                parallelize_stage(module, tp_mesh, plans[stage], sequence_parallel=sequence_parallel,
                                  loss_parallel=self.loss_parallel)
            if sequence_parallel:
                module.register_forward_pre_hook(_received_as_shards(tp_mesh, whole=stage == 0), with_kwargs=True)
            if stage != self.last_stage:
                module.register_forward_hook(_sent_as_local_parts(stage, tp_mesh, sequence_parallel))
            elif not self.loss_parallel:
                module.register_forward_hook(whole_outputs)

    def agree(self, site: PartSite) -> None:
        """The TP ranks of this rank's stages hold alike shards (:meth:`stage_fields`)."""
        site.life.groups.agree({**site.built, **self.stage_fields(self.modules)}, group=self.tp_group,
                        who="tensor-parallel ranks")
        self.runners = site.runners

    def finish_step(self) -> None:
        self.settle_gradients(runner.module for runner in self.runners.values())

    def flags(self, flags: torch.Tensor) -> torch.Tensor:
        """The flags' max over the TP ranks: one rank's shard of a gradient may be the only one that overflowed
        (loss scaling then skips the step on every rank alike)."""
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.tp_group)
        return flags

    @property
    def tp_group(self) -> Any:
        return self.tp_mesh.get_group()

    @property
    def tp_size(self) -> int:
        return self.tp_mesh.size()

    def runner_context(self, stage: int) -> Callable[[], contextlib.AbstractContextManager]:
        """What stage ``stage``'s F, B, I and W run under: implicit replication for a traced stage
        (tensors its graph makes itself meet DTensors, in forward and backward), loss_parallel()
        on the last stage when asked."""
        parallel_loss = self.loss_parallel and stage == self.last_stage

        @contextlib.contextmanager
        def entered():
            with contextlib.ExitStack() as stack:
                if self.traced:
                    stack.enter_context(implicit_replication())
                if parallel_loss:
                    stack.enter_context(loss_parallel())
                yield

        return entered if (self.traced or parallel_loss) else contextlib.nullcontext

    def stage_fields(self, modules: Mapping[int, nn.Module]) -> dict[str, str]:
        """What the TP ranks of these stages agree on: the plan, every parameter's name, shapes,
        placements, and what crosses each boundary (placements, local shapes where known)."""
        entries = []
        for stage, module in sorted(modules.items()):
            for name, param in module.named_parameters():
                placements = tuple(map(repr, getattr(param, "placements", ()))) or ("whole",)
                local = param.to_local() if isinstance(param, DTensor) else param
                entries.append((stage, name, tuple(param.shape), tuple(local.shape), placements))
        digest = hashlib.sha1(repr(entries).encode()).hexdigest()[:12]
        return {
            "tensor parallel": f"tp={self.tp_size} plan {self.plan_text} traced={self.traced} "
                               f"loss_parallel={self.loss_parallel} sequence_parallel={self.sequence_parallel}",
            "stage parameters and placements": f"{len(entries)} parameters ({digest})",
            "stage boundaries": self.describe_boundaries(modules),
        }

    def describe_boundaries(self, modules: Mapping[int, nn.Module]) -> str:
        """Each received boundary's placement and local shape: a traced stage's from its trace, a
        hand-built stage's by the rule (its shapes come with the first step's exchange).

        Example::

            tp.describe_boundaries({1: stage})   # 'stage 1 receives hidden: [2, 12, 32] Replicate local [2, 12, 32]'
        """
        if not self.traced:
            rule = (f"floating tensors of >= 2 dims Shard(1) (each TP rank sends its 1/{self.tp_size} of the "
                    "sequence), the rest Replicate (whole)" if self.sequence_parallel else "every tensor Replicate "
                    "(whole)")
            return f"hand-built stages {sorted(modules)}: {rule}"
        received = [f"stage {stage} receives {line}" for stage, module in sorted(modules.items()) if stage > 0
                    for line in describe_received(module, self.tp_size)]
        return "; ".join(received) or "no boundary received here"

    def boundary_examples(self, shapes: Mapping[int, Any]) -> dict[int, Any]:
        """``TransferOptions(shapes=...)``'s whole example outputs as this TP rank sends them: each
        tensor cut to its local part at its boundary placement (its sequence shard under sequence
        parallelism), so the seeded shapes are the ones that cross.

        Example::

            tp.boundary_examples({0: torch.zeros(2, 12, 32)})    # {0: a [2, 6, 32] tensor} at tp=2 with SP
        """
        rank = self.tp_mesh.get_local_rank()

        def sharded(value) -> bool:
            if self.traced:
                return value.is_floating_point() and tuple(value.shape) in self.sequence_stream
            return isinstance(boundary_placement(value, self.sequence_parallel), Shard)

        def local(value):
            if isinstance(value, torch.Tensor) and sharded(value):
                return value.chunk(self.tp_size, dim=1)[rank].requires_grad_(value.requires_grad)
            return value

        return {stage: pytree.tree_map(local, example) for stage, example in shapes.items()}

    def settle_gradients(self, modules) -> None:
        """Give every DTensor gradient its parameter's placements (at the end of a step).

        DTensor's backward leaves many weight gradients ``Partial`` (each TP rank's partial sum, of
        the whole parameter's shape: a sharded parameter's gradient as large as the parameter).
        Reduced here, once per step, to the parameter's own placements (a reduce-scatter or an
        all-reduce over the TP ranks), the optimizer, clipping and tied sums read each rank's part.
        The same for every TP rank, in the modules' parameter order.
        """
        for module in modules:
            for param in module.parameters():
                grad = param.grad
                if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
                    param.grad = grad.redistribute(param.device_mesh, param.placements)

    def whole_norms(self, grads: list, norms: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
        """Each gradient's norm over every TP shard: a sharded gradient's local norms combined over the
        TP group (the p-th root of the summed p-th powers, or the max), a replicated one as is."""
        # The "tp" dim is the gradient mesh's last: alone, or after "dp" under FSDP2 (whose
        # replicas already combined their own shards' norms). A parameter TP left whole is, under
        # FSDP2, a DTensor over "dp" only: nothing to combine over "tp".
        tp_dim = self.tp_mesh.mesh_dim_names[-1]
        sharded = [i for i, g in enumerate(grads) if isinstance(g, DTensor) and
                   g.device_mesh.mesh_dim_names[-1] == tp_dim and not g.placements[-1].is_replicate()]
        return combine_shard_norms(norms, norm_type, self.tp_group, at=sharded)


def boundary_placement(value: Any, sequence_parallel: bool) -> Any:
    """How ``value`` crosses a stage boundary between TP ranks: ``Shard(1)`` (its sequence rows split
    over the TP ranks) for a floating-point activation of 2 dims or more under sequence parallelism,
    else ``Replicate()`` (each TP rank sends the whole tensor).

    Example::

        boundary_placement(torch.zeros(2, 12, 32), sequence_parallel=True)    # Shard(dim=1)
    """
    if sequence_parallel and isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 2:
        return Shard(1)
    return Replicate()


def _sent_as_local_parts(stage: int, tp_mesh: Any, sequence_parallel: bool) -> Callable:
    """A forward hook giving ``stage``'s outputs as what its TP rank sends the next stage's: the local
    part of each tensor at its boundary placement (a DTensor redistributed there first; a plain
    tensor, the same on every TP rank, taken as replicated: a shard of it is this rank's slice)."""
    def local_part(value):
        if not isinstance(value, torch.Tensor):
            return value
        placement = boundary_placement(value, sequence_parallel)
        if not isinstance(value, DTensor):
            if placement.is_replicate():
                return value
            value = DTensor.from_local(value, tp_mesh, [Replicate()], run_check=False)
        if isinstance(placement, Shard) and value.shape[1] % value.device_mesh.size():
            raise PipelineConfigError(
                f"stage {stage} sends an activation of shape {list(value.shape)} sharded on the sequence (dim 1), "
                f"and tp={value.device_mesh.size()} does not divide its length {value.shape[1]}: give sequences "
                f"whose length is a multiple of {value.device_mesh.size()} (pad them), or drop sequence_parallel")
        return value.redistribute(placements=[placement] * value.device_mesh.ndim).to_local()

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        return pytree.tree_map(local_part, output)

    return hook


def _received_as_shards(tp_mesh: Any, whole: bool) -> Callable:
    """A forward pre-hook taking a stage's floating inputs of 2 dims or more as DTensors of the global
    shape sharded on the sequence (``Shard(1)``), as the norms and blocks of the "auto" plan under
    sequence parallelism expect them: a received sequence shard as it is (its gradient goes back to
    the sender as this rank's shard), or on the first stage (``whole``) the user's whole tensor,
    the same on every TP rank, split there."""
    def as_dtensor(value):
        if isinstance(value, DTensor) or isinstance(boundary_placement(value, True), Replicate):
            return value
        if whole:
            return DTensor.from_local(value, tp_mesh, [Replicate()], run_check=False).redistribute(
                placements=[Shard(1)])
        return DTensor.from_local(value, tp_mesh, [Shard(1)], run_check=False)

    def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
        return pytree.tree_map(as_dtensor, args), pytree.tree_map(as_dtensor, kwargs)

    return hook


def _hand_built_plans(modules: Mapping[int, nn.Module], layout: Any, tp_size: int) -> dict[int, dict]:
    """Each stage's plan, checked on every rank of the job together: the first problem any rank
    found (or a pattern no stage has) is raised on every rank with the same message."""
    plans: dict[int, dict] = {}

    def plan_of(stage: int) -> list[str]:
        module = modules[stage]
        try:
            if isinstance(layout.tensor_parallel, str):
                plans[stage] = eager_plan(module, tp_size, sequence_parallel=layout.sequence_parallel,
                                          loss_parallel=layout.loss_parallel)
            else:
                plans[stage] = {p: s for p, s in layout.tensor_parallel.items() if matching_modules(module, p)}
                check_plan(module, plans[stage], tp_size)
        except PipelineConfigError as error:
            raise PipelineConfigError(f"stage {stage}: {error}") from None
        return sorted(plans[stage])

    matched = on_every_rank(sorted(modules), plan_of, "tensor parallelism refused (found on rank {rank}), {problem}")
    if not isinstance(layout.tensor_parallel, str):
        found = {pattern for patterns in matched for pattern in patterns}
        missing = [pattern for pattern in layout.tensor_parallel if pattern not in found]
        if missing:
            raise PipelineConfigError(
                f"the tensor-parallel plan's pattern(s) {missing} match no module of any stage (each pattern is "
                "matched atom by atom against the stage modules' own submodule names, as parallelize_module "
                "matches them); fix or drop them")
    return plans
