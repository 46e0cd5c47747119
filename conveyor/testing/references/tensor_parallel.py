"""Rank functions shared by the tensor-parallel tests: a model under TP against the same model on one device."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from conveyor.parallel.tensor import parallelize_stage
from conveyor.testing.compare import relative_difference, reordered_sum_bound, whole, worst_relative
from conveyor.testing.models import gpt2, grouped_heads_lm, token_batch

MODELS = ("gpt2", "llama", "qwen2", "mixtral")
VOCABULARY = 96  # every test model's and recipe's
# Tensor parallel against one device, one step: TP computes the same products and sums them in another
# order (a row-parallel projection's two partial sums added by the all-reduce; a replicated activation's
# partial input gradients all-reduced; the vocabulary-parallel head's input gradient as two sums of 48 of
# the vocabulary's 96 terms), and each side's matmul kernel picks its own order for what it sums. The
# longest reordered sum is the vocabulary's: reordered_sum_bound(96) = 7.0e-6 for two computations
# of it (Higham-Mary's probabilistic bound, 3e-8 left to chance per sum) at condition 1, i.e. the
# magnitudes summed no larger than the largest result the relative difference divides by. 1e-5 keeps
# a margin of 1.4 for conditioning and the shorter sums (32, 48 terms: 4.0e-6, 4.9e-6) met on the way.
TP_ROUNDING = 1e-5
assert reordered_sum_bound(VOCABULARY) <= TP_ROUNDING
RECIPES = ("recipe:gpt", "recipe:llama", "recipe:mpt")


def build(name: str, num_layers: int = 2) -> torch.nn.Module:
    """A tiny Hugging Face model, or one of ``conveyor train``'s recipes (``recipe:mpt``) at the same sizes."""
    if name.startswith("recipe:"):
        from conveyor.train.config import ModelConfig
        from conveyor.train.models import model_config

        model_class, config = model_config(
            ModelConfig(name=name.removeprefix("recipe:"), layers=num_layers, width=32, heads=4, seq_len=32, kv_heads=2
                        if name == "recipe:llama" else None), 96)
    elif name == "gpt2":
        model_class, config = gpt2(num_layers=num_layers)
    else:
        model_class, config = grouped_heads_lm(name, num_layers)
    torch.manual_seed(0)
    return model_class(config).train()


def tp_mesh(tp: int):
    return init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))


def loss_and_grads(model: torch.nn.Module, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(**batch).loss
    loss.backward()
    grads = {name: whole(param.grad).detach().clone() for name, param in model.named_parameters()}
    return whole(loss).detach(), grads


def tp_parity(rank: int, world_size: int, name: str, sequence_parallel: bool = False,
              loss_parallel: bool = False) -> dict:
    """Loss and every gradient of the TP model against one device: max relative difference, and what is sharded.

    ``loss_parallel``: the head's logits stay sharded on the vocabulary and the model's own loss
    runs under torch's ``loss_parallel()``.
    """
    from contextlib import nullcontext

    from torch.distributed.tensor.parallel import loss_parallel as parallel_loss

    reference = build(name)
    model = copy.deepcopy(reference)
    batch = token_batch(seed=1)
    want_loss, want_grads = loss_and_grads(reference, batch)
    parallelize_stage(model, tp_mesh(world_size), sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    with parallel_loss() if loss_parallel else nullcontext():
        got_loss, got_grads = loss_and_grads(model, batch)
    sharded = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor) and
                     any(not pl.is_replicate() for pl in p.placements))
    assert set(got_grads) == set(want_grads)
    values_equal = all(torch.equal(whole(p), reference.get_parameter(n)) for n, p in model.named_parameters())
    return {
        "loss": relative_difference(got_loss, want_loss),
        "grads": worst_relative((got_grads[n], want_grads[n]) for n in want_grads),
        "sharded": sharded,
        "values_equal": values_equal,
        "tied": name == "gpt2" and model.lm_head.weight is model.transformer.wte.weight,
    }


def split_backward_parity(rank: int, world_size: int) -> dict:
    """A TP Llama taking hidden states as a pipeline stage does: I then W against one full backward (B)."""
    from conveyor.runtime.stage.backward import backward_full, backward_input

    model = parallelize_stage(build("llama"), tp_mesh(world_size))
    params = [p for p in model.parameters() if p.requires_grad]
    ids = token_batch(seed=2)["input_ids"]
    hidden = torch.randn(*ids.shape, 32, generator=torch.Generator().manual_seed(3))
    results = []
    for split in (False, True):
        model.zero_grad(set_to_none=True)
        stage_input = hidden.clone().requires_grad_(True)
        loss = model(inputs_embeds=stage_input, labels=ids).loss
        if split:
            pending = backward_input([loss], [None], [stage_input], params)
            assert all(p.grad is None for p in params)  # I leaves the weights to W
            pending.backward_weight()
            input_grad = pending.input_grads[0]
        else:
            (input_grad,) = backward_full([loss], [None], [stage_input])
        grads = {n: p.grad.to_local().clone() if isinstance(p.grad, DTensor) else p.grad.clone()
                 for n, p in model.named_parameters() if p.grad is not None}
        results.append((input_grad.clone(), grads))
    (full_input, full_grads), (split_input, split_grads) = results
    return {
        "input": torch.equal(full_input, split_input),
        "names": sorted(full_grads) == sorted(split_grads),
        "unequal": [n for n in full_grads if not torch.equal(full_grads[n], split_grads[n])],
        "sharded_grads": sum(isinstance(p.grad, DTensor) for p in params),
    }


def mesh_layouts(rank: int, world_size: int) -> dict:
    """layout_of on 4 ranks: the layouts it reads and the meshes it refuses (their messages)."""
    from torch.distributed.device_mesh import DeviceMesh

    from conveyor.errors import PipelineConfigError
    from conveyor.parallel.mesh import layout_of

    def read(shape, names):
        layout = layout_of(init_device_mesh("cpu", shape, mesh_dim_names=names))
        return (layout.pp_ranks, layout.dp_ranks, list(layout.tp_ranks), layout.pp_rank, layout.dp_rank,
                layout.tp_rank, layout.tp_size, layout.tp_mesh is not None)

    def refused(make):
        try:
            layout_of(make())
        except PipelineConfigError as error:
            return str(error)
        return None

    return {
        "pp_tp": read((2, 2), ("pp", "tp")),
        "dp_pp": read((2, 2), ("dp", "pp")),
        "pp_dp_tp": read((2, 1, 2), ("pp", "dp", "tp")),
        "unknown": refused(lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))),
        "order": refused(lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "pp"))),
        "world": refused(lambda: DeviceMesh("cpu", torch.arange(2).reshape(1, 2), mesh_dim_names=("pp", "tp"))),
    }


def traced_parity(rank: int, world_size: int, name: str, num_layers: int = 2) -> dict:
    """Two traced stages of ``name``, parallelized by the unchanged model's "auto" plan, against eager TP.

    Tied copies (GPT-2's embedding and head on different stages) are compared summed, as the
    pipeline sums them.
    """
    from torch.distributed.tensor.experimental import implicit_replication

    import conveyor.frontend as frontend
    from conveyor.parallel.tensor import tensor_parallel_plan
    from conveyor.parallel.tensor.traced import parallelize_traced_stage, parameter_placements

    model = build(name, num_layers)
    batch = token_batch(seed=1)
    mesh = tp_mesh(world_size)
    eager = parallelize_stage(copy.deepcopy(model), mesh)
    want = eager(**batch).loss
    want.backward()
    split = frontend.split_model(model, 2, example_kwargs=batch, split_method="uniform")
    placements = parameter_placements(model, tensor_parallel_plan(model, world_size))
    stages = [parallelize_traced_stage(split.stage_module(i), mesh, placements) for i in range(2)]
    with implicit_replication():  # tensors the graph makes itself (positions) meet DTensors, also in backward
        got = frontend.run_sequential(stages, (), batch, loss_fn=lambda out: out.loss).loss
    grads: dict[str, torch.Tensor] = {}
    for stage in stages:
        for param_name, param in stage.named_parameters():
            grads[param_name] = grads.get(param_name, 0) + whole(param.grad)
    for group in split.tied_groups:
        total = sum(grads.pop(n) for n in group.names)
        grads[group.names[0]] = total
    sharded = sorted(n for stage in stages for n, p in stage.named_parameters()
                     if any(not pl.is_replicate() for pl in p.placements))
    return {
        "loss": relative_difference(got.detach(), want.detach()),
        "grads": worst_relative((g, whole(eager.get_parameter(n).grad)) for n, g in grads.items()),
        "sharded": sharded,
    }


def _traced_stages(name: str, tp_mesh_, batch):
    import conveyor.frontend as frontend
    from conveyor.parallel.tensor import tensor_parallel_plan
    from conveyor.parallel.tensor.traced import parallelize_traced_stage, parameter_placements

    model = build(name)
    split = frontend.split_model(model, 2, example_kwargs=batch, split_method="uniform")
    placements = parameter_placements(model, tensor_parallel_plan(model, tp_mesh_.size()))
    return split, lambda stage: parallelize_traced_stage(split.stage_module(stage), tp_mesh_, placements)


def _local_grads(stage) -> dict[str, torch.Tensor]:
    return {n: p.grad.to_local().clone() for n, p in stage.named_parameters() if p.grad is not None}


def traced_tp_alone(rank: int, world_size: int, name: str) -> dict:
    """Both traced TP stages on every rank of one TP group (no pipeline): the loss and each rank's local grads."""
    from torch.distributed.tensor.experimental import implicit_replication

    import conveyor.frontend as frontend

    batch = token_batch(seed=1)
    _, make = _traced_stages(name, tp_mesh(world_size), batch)
    stages = [make(0), make(1)]
    with implicit_replication():
        loss = frontend.run_sequential(stages, (), batch, loss_fn=lambda out: out.loss).loss
    return {"loss": loss.detach(), "grads": {**_local_grads(stages[0]), **_local_grads(stages[1])}}


def traced_pp_x_tp(rank: int, world_size: int, name: str) -> dict:
    """pp=2 x tp=2: each TP rank of stage 0 sends its whole (replicated) outputs to the matching TP rank of stage 1."""
    from torch.distributed.tensor.experimental import implicit_replication

    from conveyor.parallel.mesh import layout_of

    layout = layout_of(init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "tp")))
    batch = token_batch(seed=1)
    split, make = _traced_stages(name, layout.tp_mesh, batch)
    stage = make(layout.pp_rank)
    peer = layout.pp_ranks[1 - layout.pp_rank]
    with implicit_replication():
        if layout.pp_rank == 0:
            outputs = stage(**batch)
            tensors = [value for value in outputs if isinstance(value, torch.Tensor)]
            for value in tensors:
                dist.send(value.detach().contiguous(), peer)
            needing = [value for value in tensors if value.requires_grad]
            grads = [torch.empty_like(value) for value in needing]
            for grad in grads:
                dist.recv(grad, peer)
            torch.autograd.backward(needing, grads)
            loss = None
        else:
            received = []
            for spec in split.stage_input_specs(1):
                if not spec.is_tensor:
                    received.append(spec.value)
                    continue
                value = torch.empty(spec.shape, dtype=spec.dtype)
                dist.recv(value, peer)
                received.append(value.requires_grad_(spec.requires_grad))
            loss = stage(*received).loss
            loss.backward()
            for value in received:
                if isinstance(value, torch.Tensor) and value.requires_grad:
                    dist.send(value.grad.contiguous(), peer)
            loss = loss.detach()
    return {"pp_rank": layout.pp_rank, "tp_rank": layout.tp_rank, "loss": loss, "grads": _local_grads(stage)}


def meta_shards(rank: int, world_size: int) -> list:
    """A Llama built on the meta device, parallelized, then materialized: each rank allocates its shards only."""
    model_class, config = grouped_heads_lm("llama", 2)
    with torch.device("meta"):
        model = model_class(config)
    parallelize_stage(model, tp_mesh(world_size))
    model.to_empty(device="cpu")
    return [(name, tuple(p.shape), tuple(p.to_local().shape), p.to_local().device.type)
            for name, p in model.named_parameters() if isinstance(p, DTensor)]


def traced_split_backward(rank: int, world_size: int) -> dict:
    """I then W against B on the last traced TP stage of a Llama (random received activations)."""
    from torch.distributed.tensor.experimental import implicit_replication

    from conveyor.runtime.stage.backward import backward_full, backward_input

    batch = token_batch(seed=1)
    split, make = _traced_stages("llama", tp_mesh(world_size), batch)
    stage = make(1)
    specs = split.stage_input_specs(1)
    generator = torch.Generator().manual_seed(0)
    received = [spec.value if not spec.is_tensor else batch["labels"] if not spec.dtype.is_floating_point
                else torch.randn(spec.shape, generator=generator, dtype=spec.dtype) for spec in specs]
    results = []
    with implicit_replication():
        for split_backward in (False, True):
            stage.zero_grad(set_to_none=True)
            inputs = [v.clone().requires_grad_(s.requires_grad) if s.is_tensor else v for v, s in zip(received, specs)]
            live = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
            loss = stage(*inputs).loss
            if split_backward:
                pending = backward_input([loss], [None], live, list(stage.parameters()))
                pending.backward_weight()
                input_grads = pending.input_grads
            else:
                input_grads = backward_full([loss], [None], live)
            results.append((input_grads, _local_grads(stage)))
    (full_inputs, full), (split_inputs, split_grads) = results
    return {
        "inputs": len(full_inputs) > 0 and all(torch.equal(a, b) for a, b in zip(full_inputs, split_inputs)),
        "names": sorted(full) == sorted(split_grads) and len(full) > 0,
        "unequal": [n for n in full if not torch.equal(full[n], split_grads[n])],
    }


class ManualStage(torch.nn.Module):
    """A hand-written stage (no tracing): a norm and a plain MLP on hidden states."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)
        self.fc = torch.nn.Linear(32, 64)
        self.proj = torch.nn.Linear(64, 32)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.proj(torch.nn.functional.gelu(self.fc(self.norm(hidden))))


def manual_stage_plan(rank: int, world_size: int) -> dict:
    """A manual stage under the user's own plan, against the same stage on one device."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(0)
    reference = ManualStage()
    model = copy.deepcopy(reference)
    parallelize_stage(model, tp_mesh(world_size), {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
    hidden = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(1))
    results = []
    for module in (reference, model):
        stage_input = hidden.clone().requires_grad_(True)
        module(stage_input).square().mean().backward()
        grads = {n: whole(p.grad) for n, p in module.named_parameters()}
        results.append((stage_input.grad, grads))
    (want_input, want), (got_input, got) = results
    return {
        "input": relative_difference(got_input, want_input),
        "grads": worst_relative((got[n], want[n]) for n in want),
        "sharded": sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor)),
    }
