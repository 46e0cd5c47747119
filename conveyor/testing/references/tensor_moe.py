"""Rank functions of the mixture-of-experts tensor-parallel tests: traced Mixtral stages at pp=2 x tp=2.

For Mixtral, TP shards the attention and the LM head; the router and the experts stay whole on
every TP rank (their op, transformers' ``grouped_mm_fallback``, runs replicated:
``conveyor.parallel.tensor.traced._replicate_opaque_custom_ops``). The model is built with
``output_router_logits=True``: every layer's router logits travel to the last stage, whose loss
adds ``router_aux_loss_coef`` x the load-balancing loss, as ``conveyor train configs/moe.yaml`` does.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import conveyor
from conveyor.options import PipelineOptions, SplitOptions
from conveyor.parallel.mesh import layout_of
from conveyor.testing.compare import worst_absolute, worst_relative
from conveyor.testing.models import grouped_heads_lm, token_batch
from conveyor.testing.references.tensor_parallel import whole
from conveyor.testing.references.tensor_pipeline import (
    MICROBATCHES,
    _loss_fn,
    _microbatches,
    _one_device_of,
    _train,
    _train_pipeline,
)

AUX_COEFFICIENT = 0.02  # configs/moe.yaml's, large enough for the auxiliary part to move the parameters


def build_mixtral(layers: int) -> torch.nn.Module:
    """The tiny grouped-head Mixtral (4 experts, 2 per token), returning its router logits and auxiliary loss."""
    model_class, config = grouped_heads_lm("mixtral", layers, output_router_logits=True,
                                           router_aux_loss_coef=AUX_COEFFICIENT)
    torch.manual_seed(0)
    return model_class(config).train()


def _one_device(batch, layers: int):
    return _one_device_of(build_mixtral(layers), batch)


def _tp_alone(num_stages: int, tp_mesh, batch):
    """The pipeline's cut into traced stages, parallelized alike, run in order on this rank's TP group."""
    from torch.distributed.tensor.experimental import implicit_replication

    import conveyor.frontend as frontend
    from conveyor.layout import DistributedLayout
    from conveyor.parallel.tensor.stages import model_placements
    from conveyor.parallel.tensor.traced import parallelize_traced_stage

    model = build_mixtral(num_stages)
    split = frontend.split_model(model, num_stages, example_kwargs=_microbatches(batch)[0], split_method="uniform")
    placements = model_placements(model, DistributedLayout(tp=tp_mesh.size()), tp_mesh.size(), split.tied_groups)
    stages = [parallelize_traced_stage(split.stage_module(s), tp_mesh, placements) for s in range(num_stages)]

    def step_loss(kwargs):
        return frontend.run_sequential(stages, (), kwargs, loss_fn=lambda out: out.loss / MICROBATCHES
                                       ).loss.detach() / MICROBATCHES

    losses = _train(step_loss, [p for stage in stages for p in stage.parameters()], batch, implicit_replication)
    return losses, {n: p for stage in stages for n, p in stage.named_parameters()}


def _whole_on_this_rank(param) -> bool:
    """A parameter TP left whole: every TP rank holds all of it (a replicated DTensor, or a plain tensor)."""
    if not isinstance(param, DTensor):
        return True
    return all(pl.is_replicate() for pl in param.placements) and param.to_local().shape == param.shape


def mixtral_schedules(rank: int, world_size: int, names: tuple[str, ...]) -> dict:
    """pp=2 x tp=2 traced Mixtral under each schedule, 3 AdamW steps: against TP alone and one device."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    tp_mesh = layout_of(mesh).tp_mesh
    batch = token_batch(batch=2 * MICROBATCHES, length=12, seed=1)
    references: dict[int, tuple] = {}
    results = {}
    for name in names:
        layers = 2 * conveyor.schedule.available()[name].default_virtual  # one decoder layer per stage
        pipe = conveyor.pipeline(build_mixtral(layers), example_kwargs=_microbatches(batch)[0], schedule=name,
                                 microbatches=MICROBATCHES, loss_fn=_loss_fn,
                                 options=PipelineOptions(split=SplitOptions(method="uniform")),
                                 layout=conveyor.DistributedLayout(mesh=mesh, tensor_parallel="auto"))
        stages = pipe.schedule.num_stages
        if stages not in references:
            references[stages] = (_tp_alone(stages, tp_mesh, batch), _one_device(batch, layers))
        (alone_losses, alone_params), (device_losses, device_params) = references[stages]
        losses = _train_pipeline(pipe, batch)
        mine = dict(pipe.named_parameters())
        full = {n: whole(p).detach() for n, p in mine.items()}  # a TP collective, in the same order everywhere
        alone = {n: whole(alone_params[n]).detach() for n in mine}
        expert_names = sorted(n for n in mine if ".mlp." in n)  # the router (mlp.gate) and the experts
        results[name] = {
            "stages": stages,
            "sharded": sorted(n for n, p in mine.items() if not _whole_on_this_rank(p)),
            "experts": expert_names,
            "experts_whole": all(_whole_on_this_rank(mine[n]) for n in expert_names),
            "losses_equal_tp": all(torch.equal(a, b) for a, b in zip(losses, alone_losses)),
            "params_equal_tp": all(torch.equal(full[n], alone[n]) for n in full),
            "loss_rel": worst_relative((a, b) for a, b in zip(losses, device_losses, strict=True)),
            "param_abs": worst_absolute((full[n], device_params[n].detach()) for n in full),
        }
        pipe.close()
    return results
