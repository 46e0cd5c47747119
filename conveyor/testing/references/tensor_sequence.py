"""Rank functions of the sequence-parallel pipeline tests (pp=2 x tp=2 on 4 gloo ranks).

A small decoder of hand-built stages (embedding + block, blocks, block + norm + LM head), each
parallelized by the "auto" plan with ``sequence_parallel=True``: norms run torch's
``SequenceParallel`` on sequence shards, each block gathers its input and reduce-scatters its
output onto the sequence. Between stages each TP rank sends its sequence shard only. The
reference is the same stages under TP+SP alone: parallelized alike, chained directly (the
DTensors pass from stage to stage), the same microbatch loop and AdamW steps.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import conveyor
from conveyor.layout import DistributedLayout
from conveyor.parallel.mesh import layout_of
from conveyor.parallel.tensor.stages import TensorParallelStages
from conveyor.schedule.registry import resolve_schedule
from conveyor.testing.references.tensor_parallel import whole
from conveyor.testing.references.tensor_pipeline import _optimizer

WIDTH, HEADS, INNER, VOCAB = 32, 4, 64, 96
MICROBATCHES, STEPS, LENGTH = 4, 3, 12


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.head_dim = HEADS, WIDTH // HEADS
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, length, _ = hidden.shape
        q, k, v = (p(hidden).view(batch, length, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(WIDTH, INNER), nn.Linear(INNER, WIDTH)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(hidden)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(WIDTH), Attention()
        self.mlp_norm, self.mlp = nn.LayerNorm(WIDTH), MLP()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attn(self.attn_norm(hidden))
        return hidden + self.mlp(self.mlp_norm(hidden))


class Stage(nn.Module):
    """One block, with the token embedding on the first stage and the final norm and head on the last."""

    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH) if first else None
        self.block = Block()
        self.norm, self.head = (nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.block(self.embed(x) if self.embed is not None else x)
        return self.head(self.norm(hidden)) if self.head is not None else hidden


def build_stages(num_stages: int) -> list[Stage]:
    torch.manual_seed(0)
    return [Stage(s == 0, s == num_stages - 1) for s in range(num_stages)]


def _loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _batch():
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2 * MICROBATCHES, LENGTH + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _record(sent: list, module, args, output) -> None:
    sent.append((type(output).__name__, tuple(output.shape), output.element_size()))


def _tp_sp_alone(num_stages: int, tp_mesh, batch) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The same stages parallelized alike on this rank's TP group, chained without a pipeline."""
    from conveyor.parallel.tensor import parallelize_stage

    stages = [parallelize_stage(s, tp_mesh, "auto", sequence_parallel=True) for s in build_stages(num_stages)]
    params = [p for stage in stages for p in stage.parameters()]
    optimizer = _optimizer(params)
    losses = []
    for _ in range(STEPS):
        total = None
        for tokens, target in zip(batch[0].chunk(MICROBATCHES), batch[1].chunk(MICROBATCHES)):
            value = tokens
            for stage in stages:
                value = stage(value)
            loss = _loss_fn(value, target) / MICROBATCHES
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, {f"{s}.{n}": whole(p).detach() for s, stage in enumerate(stages)
                    for n, p in stage.named_parameters()}


def every_schedule_sequence_parallel(rank: int, world_size: int, names: tuple[str, ...] | None = None) -> dict:
    """pp=2 x tp=2 with sequence_parallel, each built-in schedule: torch.equal to TP+SP alone; the boundary bytes."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    layout_info = layout_of(mesh)
    batch = _batch()
    alone: dict[int, tuple] = {}
    results = {}
    for name in names or conveyor.schedule.available():
        schedule = resolve_schedule(name, MICROBATCHES, None, 2)
        stages = schedule.num_stages
        if stages not in alone:
            alone[stages] = _tp_sp_alone(stages, layout_info.tp_mesh, batch)
        want_losses, want_params = alone[stages]
        everything = build_stages(stages)
        mine = schedule.stages_of(layout_info.pp_rank)
        pipe = conveyor.Pipeline([everything[s] for s in mine], name, _loss_fn, microbatches=MICROBATCHES,
                                 layout=DistributedLayout(mesh=mesh, tensor_parallel="auto", sequence_parallel=True))
        sent: list[tuple] = []  # what each non-last stage hands its transport: after the pipeline's own hook
        for stage in mine:
            if stage != stages - 1:
                pipe.runners[stage].module.register_forward_hook(functools.partial(_record, sent))
        optimizer = _optimizer(pipe.parameters())
        losses = []
        for _ in range(STEPS):
            losses.append(pipe.step(batch[0], target=batch[1]))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        # full_tensor is a collective over the TP group: every one in the same order, none skipped.
        got = {f"{s}.{n}": whole(p).detach() for s in mine for n, p in pipe.runners[s].module.named_parameters()}
        results[name] = {
            "stages": stages,
            "losses_equal": all(torch.equal(a, b) for a, b in zip(losses, want_losses)),
            "params_equal": sorted(n for n in got if not torch.equal(got[n], want_params[n])),
            "params": len(got),
            "sent_shapes": sorted(set(sent)),
            "fields": pipe.ranks.find_part(TensorParallelStages).stage_fields(
                {s: pipe.runners[s].module for s in mine}),
            "sharded": sum(isinstance(p, DTensor) and not p.placements[0].is_replicate() for p in pipe.parameters()),
        }
        pipe.close()
    return results
