"""Rank functions of the tied-embedding tests under tensor parallelism: GPT-2 (wte = lm_head) at pp=2 x tp=2.

The embedding (vocab-parallel) and the LM head (colwise) are both ``Shard(0)`` on "tp", so each TP
rank holds half of the vocabulary's rows of the one tied matrix on both stages, and its gradient
is summed with the matching TP rank's on the other stage. The references, computed by every rank
itself from the same seed, hold the tied copies as the pipeline does: on one rank (zbv puts stage 0
and the last stage on rank 0) one shared Parameter, on two ranks two copies whose gradients are
summed shard by shard after the step's backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import conveyor
from conveyor.layout import DistributedLayout
from conveyor.options import PipelineOptions, SplitOptions
from conveyor.parallel.mesh import layout_of
from conveyor.testing.compare import relative_difference, worst_absolute, worst_relative
from conveyor.testing.models import gpt2, token_batch
from conveyor.testing.references.tensor_parallel import build, whole
from conveyor.testing.references.tensor_pipeline import (
    MICROBATCHES,
    STEPS,
    _loss_fn,
    _microbatches,
    _one_device_of,
    _optimizer,
    _train,
)

TIED = ("transformer.wte.weight", "lm_head.weight")


def _one_device(batch, layers: int):
    """The pipeline tests' one-device reference, its parameters under every name (the tied matrix under both)."""
    model = build("gpt2", layers)
    losses, _ = _one_device_of(model, batch)
    return losses, {name: model.get_parameter(name) for name, _ in model.named_parameters(remove_duplicate=False)}


def _one_device_grads(batch, layers: int) -> dict[str, torch.Tensor]:
    """One step's gradients on one device (the tied matrix's: both uses summed), by every name."""
    model = build("gpt2", layers)
    for kwargs in _microbatches(batch):
        (model(**kwargs).loss / MICROBATCHES).backward()
    return {name: model.get_parameter(name).grad for name, _ in model.named_parameters(remove_duplicate=False)}


def _tp_alone(num_stages: int, tp_mesh, batch, shared: bool):
    """The pipeline's traced stages, parallelized alike, run in order on one TP group; the tied copies
    one Parameter (``shared``) or summed shard by shard after each step's backward, as the pipeline does."""
    from torch.distributed.tensor.experimental import implicit_replication

    import conveyor.frontend as frontend
    from conveyor.parallel.tensor.stages import model_placements
    from conveyor.parallel.tensor.traced import parallelize_traced_stage

    model = build("gpt2", num_stages)
    split = frontend.split_model(model, num_stages, example_kwargs=_microbatches(batch)[0], split_method="uniform")
    placements = model_placements(model, DistributedLayout(tp=tp_mesh.size()), tp_mesh.size(), split.tied_groups)
    stages = [parallelize_traced_stage(split.stage_module(s), tp_mesh, placements) for s in range(num_stages)]
    first, last = stages[0], stages[-1]
    if shared:
        last.get_submodule("lm_head").register_parameter("weight", first.get_parameter(TIED[0]))
    params = list({id(p): p for stage in stages for p in stage.parameters()}.values())
    microbatch = iter(range(10**9))

    def step_loss(kwargs):
        loss = frontend.run_sequential(stages, (), kwargs, loss_fn=lambda out: out.loss / MICROBATCHES
                                       ).loss.detach() / MICROBATCHES
        if next(microbatch) % MICROBATCHES == MICROBATCHES - 1:
            _settle_and_sum_tied(stages, shared)
        return loss

    losses = _train(step_loss, params, batch, implicit_replication)
    return losses, {n: p for stage in stages for n, p in stage.named_parameters()}


def _settle_and_sum_tied(stages, shared: bool) -> None:
    """What the pipeline does at the end of a step: each gradient at its parameter's placements, then
    the two tied copies' local shards summed (the all-reduce of the tied group, here on one rank)."""
    for stage in stages:
        for param in stage.parameters():
            if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
                param.grad = param.grad.redistribute(param.device_mesh, param.placements)
    if shared:
        return
    embedding, head = stages[0].get_parameter(TIED[0]), stages[-1].get_parameter(TIED[1])
    total = embedding.grad.to_local() + head.grad.to_local()
    embedding.grad.to_local().copy_(total)
    head.grad.to_local().copy_(total)


def meta_tied_shards(mesh) -> dict:
    """GPT-2 built on the meta device at pp=2 x tp=2 (1f1b): each rank keeps its slice of the whole draw, the tied
    copies alike at both ends (by the module owning the first name, transformer.wte); equal after a step."""
    model_class, config = gpt2(num_layers=2)
    with torch.device("meta"):
        model = model_class(config)
    batch = token_batch(batch=2 * MICROBATCHES, length=12, seed=1)
    pipe = conveyor.pipeline(model, example_kwargs=_microbatches(batch)[0], schedule="1f1b",
                             microbatches=MICROBATCHES, loss_fn=_loss_fn,
                             options=PipelineOptions(split=SplitOptions(method="uniform")),
                             layout=conveyor.DistributedLayout(mesh=mesh, tensor_parallel="auto"))
    shards = []
    for _ in range(2):  # as drawn, then after one AdamW step
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, [(n, p.to_local()) for n, p in pipe.named_parameters() if n in TIED])
        shards.append(everyone)
        if len(shards) == 1:
            optimizer = _optimizer(pipe.parameters())
            loss = pipe.step(**batch)
            optimizer.step()
    pipe.close()
    return {"shards": shards, "loss": float(loss)}


def tied_pp_x_tp(rank: int, world_size: int, names: tuple[str, ...] = ("1f1b", "zbv")) -> dict:
    """pp=2 x tp=2 traced GPT-2 (tied), each schedule of ``names``: 3 AdamW steps against TP alone
    (torch.equal) and one device; the tied shards' local shapes and their first step's gradients."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    layout = layout_of(mesh)
    batch = token_batch(batch=2 * MICROBATCHES, length=12, seed=1)
    results = {}
    for name in names:
        layers = 2 * conveyor.schedule.available()[name].default_virtual
        pipe = conveyor.pipeline(build("gpt2", layers), example_kwargs=_microbatches(batch)[0], schedule=name,
                                 microbatches=MICROBATCHES, loss_fn=_loss_fn,
                                 options=PipelineOptions(split=SplitOptions(method="uniform")),
                                 layout=conveyor.DistributedLayout(mesh=mesh, tensor_parallel="auto"))
        stages = pipe.schedule.num_stages
        placement = pipe.schedule.placement
        shared = placement.rank_of(0) == placement.rank_of(stages - 1)
        want_losses, want_params = _tp_alone(stages, layout.tp_mesh, batch, shared)
        device_losses, device_params = _one_device(batch, layers)
        optimizer = _optimizer(pipe.parameters())
        device_grads = _one_device_grads(batch, layers)
        losses, tied_grads, grad_rel = [], {}, None
        for step in range(STEPS):
            losses.append(pipe.step(**batch))
            if step == 0:
                tied_grads = {n: p.grad.to_local().clone() for n, p in pipe.named_parameters() if n in TIED}
                grad_rel = worst_relative((whole(p.grad), device_grads[n]) for n, p in pipe.named_parameters())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        mine = dict(pipe.named_parameters())
        full = {n: whole(p).detach() for n, p in mine.items()}  # a collective over TP: every rank, same order
        results[name] = {
            "pp_rank": layout.pp_rank,
            "tp_rank": layout.tp_rank,
            "shared": shared,
            "tied_local_shapes": {n: (tuple(p.shape), tuple(p.to_local().shape)) for n, p in mine.items()
                                  if n in TIED},
            "tied_grads": tied_grads,
            "losses_equal_tp": all(torch.equal(a, b) for a, b in zip(losses, want_losses, strict=True)),
            "params_unequal_tp": [n for n in full if not torch.equal(full[n], whole(want_params[n]).detach())],
            "param_abs_tp": worst_absolute((full[n], whole(want_params[n]).detach()) for n in full),
            "grad_rel": grad_rel,
            "loss_rel": worst_relative((a, b) for a, b in zip(losses, device_losses, strict=True)),
            "param_abs": worst_absolute((full[n], device_params[n].detach()) for n in full),
        }
        pipe.close()
    results["meta"] = meta_tied_shards(mesh)
    return results


def _shifted_cross_entropy(output, target):
    """The causal LM loss on the logits as they leave the last stage (vocabulary-sharded under loss_parallel)."""
    logits = output.logits[:, :-1].flatten(0, 1)
    _shifted_cross_entropy.placements = getattr(output.logits, "placements", None)
    return torch.nn.functional.cross_entropy(logits, target[:, 1:].flatten())


def traced_loss_parallel(rank: int, world_size: int) -> dict:
    """One 1F1B step at pp=2 x tp=2 with loss_parallel=True on traced stages, against the same step without it
    and one device: Llama with its own loss inside the traced graph, GPT-2 with a user loss on the logits."""
    from conveyor.layout import DistributedLayout

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    batch = token_batch(batch=2 * MICROBATCHES, length=12, seed=1)
    results = {}
    for name, loss_fn in (("llama", _loss_fn), ("gpt2", _shifted_cross_entropy)):
        reference = build(name, 2)
        for kwargs in _microbatches(batch):
            (loss_fn(reference(**kwargs), kwargs["labels"]) / MICROBATCHES).backward()
        found = {}
        for parallel_loss in (False, True):
            layout = DistributedLayout(mesh=mesh, tensor_parallel="auto", loss_parallel=parallel_loss)
            pipe = conveyor.pipeline(build(name, 2), example_kwargs=_microbatches(batch)[0], schedule="1f1b",
                                     microbatches=MICROBATCHES, loss_fn=loss_fn,
                                     layout=layout, options=PipelineOptions(split=SplitOptions(method="uniform")))
            _shifted_cross_entropy.placements = None
            loss = pipe.step(**batch, target=batch["labels"])
            grads = {n: whole(p.grad) for n, p in pipe.named_parameters()}
            found[parallel_loss] = (loss, grads, repr(_shifted_cross_entropy.placements))
            pipe.close()
        (plain_loss, plain_grads, _), (loss, grads, placements) = found[False], found[True]
        results[name] = {
            "loss": float(whole(plain_loss)),
            "loss_rel_gathered": relative_difference(whole(loss), whole(plain_loss)),
            "grad_rel_gathered": worst_relative((grads[n], plain_grads[n]) for n in grads),
            "grad_rel_device": worst_relative((grads[n], reference.get_parameter(n).grad) for n in grads),
            "logits_placements": placements,
        }
    return results
