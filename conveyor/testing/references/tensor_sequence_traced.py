"""Rank functions of the traced sequence-parallel tests.

Traced stages of unchanged models, parallelized by the "auto" plan (``parameter_placements``) and
made sequence-parallel by :mod:`conveyor.parallel.tensor.traced_sequence`, against one device and
against the pipeline. Run one after the other (``run_sequential``: real stage boundaries, each TP
rank handing the next stage its own sequence rows) they are the "TP+SP alone" reference of the
pipeline tests.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.experimental import implicit_replication

import conveyor
import conveyor.frontend as frontend
from conveyor.errors import PipelineConfigError
from conveyor.layout import DistributedLayout
from conveyor.options import PipelineOptions, SplitOptions
from conveyor.parallel.mesh import layout_of
from conveyor.parallel.tensor.stages import TensorParallelStages
from conveyor.testing.compare import relative_difference, worst_absolute, worst_relative
from conveyor.testing.models import token_batch
from conveyor.testing.references.tensor_parallel import build, tp_mesh, whole
from conveyor.testing.references.tensor_pipeline import (
    MICROBATCHES,
    STEPS,
    _microbatches,
    _optimizer,
    _train_pipeline,
)


def sequence_stages(model: torch.nn.Module, num_stages: int, mesh, example: dict) -> tuple[list, list]:
    """``model``'s traced stages, parallelized with sequence parallelism over ``mesh`` (the 1-D TP mesh),
    and the names of each tied parameter's copies."""
    from conveyor.parallel.tensor.stages import model_placements
    from conveyor.parallel.tensor.traced import parallelize_traced_stage
    from conveyor.parallel.tensor.traced_sequence import shard_sequence

    split = frontend.split_model(model, num_stages, example_kwargs=example, split_method="uniform")
    layout = DistributedLayout(tp=mesh.size(), sequence_parallel=True)  # the references have no pipeline mesh
    placements = model_placements(model, layout, mesh.size(), split.tied_groups)
    stages = []
    for index in range(num_stages):
        stage = parallelize_traced_stage(split.stage_module(index), mesh, placements)
        shard_sequence(stage, mesh)
        stages.append(stage)
    return stages, [list(group.names) for group in split.tied_groups]


def _record(sent: list, module, args, output) -> None:
    sent.extend(tuple(v.shape) for v in output if isinstance(v, torch.Tensor) and v.is_floating_point())


def models_against_one_device(rank: int, world_size: int, names: tuple[str, ...]) -> dict:
    """Each model's two traced TP+SP stages, one forward and backward, against the unchanged model on one
    device; for each, what crossed the boundary and the collectives of stage 0's forward and backward."""
    torch.set_num_threads(1)
    mesh = tp_mesh(world_size)
    batch = token_batch(seed=1)  # [2, 12] tokens
    results = {}
    for name in names:
        reference = build(name)
        model = copy.deepcopy(reference)
        want = reference(**batch).loss
        want.backward()
        stages, tied = sequence_stages(model, 2, mesh, batch)
        sent: list = []
        stages[0].register_forward_hook(lambda m, a, o, sent=sent: _record(sent, m, a, o))
        counts = {}
        with implicit_replication():
            with CommDebugMode() as forward:
                outputs = stages[0](**batch)
            counts["forward"] = {str(op): n for op, n in forward.get_comm_counts().items()}
            got = frontend.run_sequential(stages, (), batch, loss_fn=lambda out: out.loss).loss
        grads: dict[str, torch.Tensor] = {}
        for stage in stages:
            for param_name, param in stage.named_parameters():
                grads[param_name] = grads.get(param_name, 0) + whole(param.grad)
        for names in tied:  # the copies' gradients summed, as the pipeline sums them
            grads[names[0]] = sum(grads.pop(n) for n in names)
        del outputs
        results[name] = {
            "loss": relative_difference(got.detach(), want.detach()),
            "grads": worst_relative((g, reference.get_parameter(n).grad) for n, g in grads.items()),
            "sent": sent,
            "comms": counts,
        }
    return results


def traced_sequence_checks(rank: int, world_size: int, names: tuple[str, ...]) -> dict:
    """One launch of ranks for the cheap checks: ``names`` against one device, the collectives of a stage
    of 2 Llama blocks, and the message a graph that mixes sequence positions is refused with."""
    return {"models": models_against_one_device(rank, world_size, names),
            "collectives": stage_zero_collectives(rank, world_size, 4), "refused": refused_graph(rank, world_size)}


def stage_zero_collectives(rank: int, world_size: int, layers: int) -> dict:
    """Stage 0 of a ``layers``-layer Llama cut in 2 (``layers // 2`` blocks): its collectives forward and backward."""
    torch.set_num_threads(1)
    mesh = tp_mesh(world_size)
    batch = token_batch(seed=1)
    stages, _ = sequence_stages(build("llama", layers), 2, mesh, batch)
    with implicit_replication():
        with CommDebugMode() as forward:
            outputs = stages[0](**batch)
        sent = [value for value in outputs if isinstance(value, torch.Tensor) and value.requires_grad]
        with CommDebugMode() as backward:
            torch.autograd.backward(sent, [torch.ones_like(value) for value in sent])
    return {"forward": {str(op): n for op, n in forward.get_comm_counts().items()},
            "backward": {str(op): n for op, n in backward.get_comm_counts().items()},
            "sent": [tuple(value.shape) for value in sent]}


class MixingSequence(torch.nn.Module):
    """A toy decoder whose stream takes a running sum over the sequence between its blocks (cumsum on dim 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(96, 32)
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict(
            {"norm": torch.nn.LayerNorm(32), "mlp": _Mlp()}) for _ in range(2))
        self.head = torch.nn.Linear(32, 96, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = hidden + layer["mlp"](layer["norm"](hidden))
            hidden = hidden.cumsum(dim=1)
        return self.head(hidden)


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(self.fc(hidden)))


def refused_graph(rank: int, world_size: int) -> str | None:
    """A model whose traced stage mixes sequence positions between its blocks: the message it is refused with."""
    torch.manual_seed(0)
    try:
        sequence_stages(MixingSequence(), 2, tp_mesh(world_size), {"input_ids": torch.zeros(2, 12, dtype=torch.long)})
    except PipelineConfigError as error:
        return str(error)
    return None


def _train(run_microbatch, params) -> list:
    optimizer = _optimizer(params)
    losses = []
    for _ in range(STEPS):
        losses.append(sum(run_microbatch(kwargs) for kwargs in _microbatches(_BATCH)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


_BATCH = token_batch(batch=2 * MICROBATCHES, length=12, seed=1)  # microbatches of 2 rows


def _alone(num_stages: int, layers: int, mesh) -> tuple[list, dict]:
    """The pipeline's traced TP+SP stages, one after the other on this rank's TP group (no pipeline)."""
    stages, _ = sequence_stages(build("llama", layers), num_stages, mesh, _microbatches(_BATCH)[0])

    def run(kwargs):
        with implicit_replication():
            return frontend.run_sequential(stages, (), kwargs, loss_fn=lambda out: out.loss / MICROBATCHES
                                           ).loss.detach() / MICROBATCHES

    losses = _train(run, [p for stage in stages for p in stage.parameters()])
    return losses, {n: whole(p).detach() for stage in stages for n, p in stage.named_parameters()}


def _one_device(layers: int) -> tuple[list, dict]:
    model = build("llama", layers)

    def run(kwargs):
        loss = model(**kwargs).loss / MICROBATCHES
        loss.backward()
        return loss.detach()

    return _train(run, list(model.parameters())), dict(model.named_parameters())


def pipeline_against_alone(rank: int, world_size: int, names: tuple[str, ...]) -> dict:
    """pp=2 x tp=2 traced Llama with sequence_parallel under each of ``names``, 3 AdamW steps: losses and
    parameters against TP+SP alone (torch.equal) and one device (relative); the shapes each stage sent."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    tp = layout_of(mesh).tp_mesh
    references: dict[int, tuple] = {}
    results = {}
    for name in names:
        layers = 2 * conveyor.schedule.available()[name].default_virtual
        pipe = conveyor.pipeline(build("llama", layers), example_kwargs=_microbatches(_BATCH)[0], schedule=name,
                                 microbatches=MICROBATCHES, loss_fn=lambda out, _: out.loss,
                                 options=PipelineOptions(split=SplitOptions(method="uniform")),
                                 layout=DistributedLayout(mesh=mesh, tensor_parallel="auto", sequence_parallel=True))
        stages = pipe.schedule.num_stages
        if stages not in references:
            references[stages] = (_alone(stages, layers, tp), _one_device(layers))
        (want_losses, want_params), (device_losses, device_params) = references[stages]
        sent: list = []
        for stage, runner in pipe.runners.items():
            if stage != stages - 1:
                runner.module.register_forward_hook(lambda m, a, o, sent=sent: _record(sent, m, a, o))
        losses = _train_pipeline(pipe, _BATCH)
        # full_tensor is a collective over the TP group: every one in the same order, none skipped.
        full = {n: whole(p).detach() for n, p in pipe.named_parameters()}
        results[name] = {
            "stages": stages,
            "losses_equal_alone": all(torch.equal(a, b) for a, b in zip(losses, want_losses)),
            "params_unequal_alone": sorted(n for n in full if not torch.equal(full[n], want_params[n])),
            "loss_rel": worst_relative((a, b) for a, b in zip(losses, device_losses, strict=True)),
            "param_abs": worst_absolute((full[n], device_params[n].detach()) for n in full),
            "sent": sorted(set(sent)),
            "boundaries": pipe.ranks.find_part(TensorParallelStages).stage_fields(
                {s: r.module for s, r in pipe.runners.items()})["stage boundaries"],
        }
        pipe.close()
    return results
