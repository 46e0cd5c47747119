"""Variable-length microbatches against one device: what the parity tests and the full table share.

Each step hands the pipeline its M microbatches already split (``pipe.step(conveyor.Microbatches(inputs=...,
targets=...))``), every one with its own batch size and sequence length, through the hand-built
stages of :mod:`conveyor.testing.models.tiny_lm`. The reference is one device looping over the
same microbatches: ``(lm_loss(model(x_i), y_i) / M).backward()`` for each i in order. With data
parallelism each replica gets microbatches of its own lengths, the loss is normalized by the
global token count (``normalize_by``), and the reference averages the replicas' gradients.

Example:
    >>> from conveyor.testing.models import TinyConfig
    >>> [tuple(x.shape) for (x,) in varlen_batches(TinyConfig(), step=0)[0]]
    [(2, 5), (1, 8), (3, 3), (2, 7)]
"""

from __future__ import annotations

from typing import Any

import torch

import conveyor
import conveyor.schedule as cs
from conveyor.parallel.mesh import pipeline_mesh
from conveyor.runtime.stage.device import torch_threads
from conveyor.testing.models import TinyConfig, build_stage, lm_loss, reference_model
from conveyor.testing.references.data_parallel import MLPStack, MLPStage, average, full_tensor

NUM_MICROBATCHES = 4
NUM_STEPS = 2
# (batch size, sequence length) of each microbatch; step s rotates them by s.
SHAPES = ((2, 5), (1, 8), (3, 3), (2, 7))


def varlen_batches(cfg: TinyConfig, step: int, vocab: int | None = None, seed: int = 0
                   ) -> tuple[list[tuple[torch.Tensor]], list[torch.Tensor]]:
    """Step ``step``'s microbatches (one positional input each) and their next-token targets."""
    generator = torch.Generator().manual_seed(1000 * seed + step)
    shapes = SHAPES[step % len(SHAPES):] + SHAPES[:step % len(SHAPES)]
    inputs, targets = [], []
    for batch, length in shapes[:NUM_MICROBATCHES]:
        tokens = torch.randint(0, vocab or cfg.vocab_size, (batch, length + 1), generator=generator)
        inputs.append((tokens[:, :-1].contiguous(),))
        targets.append(tokens[:, 1:].contiguous())
    return inputs, targets


def train_varlen(rank: int, world_size: int, name: str, virtual: int, transport: str) -> tuple[list, dict]:
    """One rank: NUM_STEPS steps of variable-length microbatches; the losses and the accumulated gradients."""
    schedule = cs.build(name, ranks=world_size, microbatches=NUM_MICROBATCHES, virtual=virtual)
    cfg = TinyConfig(num_stages=schedule.num_stages)
    mine = schedule.stages_of(rank)
    stages = {s: build_stage(s, cfg) for s in mine}
    transfer = conveyor.TransferOptions(timeout_s=60, transport=transport, variable_shapes=transport == "ordered")
    first, last = schedule.placement.rank_of(0), schedule.placement.rank_of(schedule.num_stages - 1)
    losses = []
    with conveyor.Pipeline([stages[s] for s in mine], schedule=schedule, loss_fn=lm_loss, transfer=transfer) as pipe:
        for step in range(NUM_STEPS):
            inputs, targets = varlen_batches(cfg, step)
            losses.append(pipe.step(conveyor.Microbatches(inputs=inputs if rank == first else None,
                                                          targets=targets if rank == last else None)))
    return losses, {s: {n: p.grad.clone() for n, p in stages[s].named_parameters()} for s in mine}


def train_each(rank: int, world_size: int, cases: list[tuple[str, int]], transport: str) -> list:
    """:func:`train_varlen` for each ``(schedule, virtual)`` case, one after the other in these ranks."""
    results = []
    for name, virtual in cases:
        try:
            results.append(train_varlen(rank, world_size, name, virtual, transport))
        except Exception as exc:
            exc.add_note(f"while rank {rank} ran {name} (virtual={virtual}) over {transport} with variable lengths")
            raise
    return results


def reference_varlen(name: str, virtual: int, num_ranks: int) -> tuple[list, list[dict]]:
    """One device looping over the same microbatches (one thread, as the ranks): losses and gradients per stage."""
    schedule = cs.build(name, ranks=num_ranks, microbatches=NUM_MICROBATCHES, virtual=virtual)
    cfg = TinyConfig(num_stages=schedule.num_stages)
    with torch_threads(1):
        model = reference_model(cfg)
        losses = []
        for step in range(NUM_STEPS):
            inputs, targets = varlen_batches(cfg, step)
            total = None
            for (ids,), target in zip(inputs, targets):
                loss = lm_loss(model(ids), target) / NUM_MICROBATCHES
                loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
            losses.append(total)
    return losses, [{n: p.grad.clone() for n, p in stage.named_parameters()} for stage in model.stages]


def differences(case: str, results: list, want: tuple[list, list[dict]]) -> list[str]:
    """What differs between the ranks' ``results`` (of :func:`train_varlen`) and the reference: empty if bitwise."""
    want_losses, want_grads = want
    found = []
    for rank, (losses, grads) in enumerate(results):
        for step, (got, expected) in enumerate(zip(losses, want_losses)):
            if not torch.equal(got, expected):
                found.append(f"{case} rank {rank} step {step} loss {got.item()!r} != {expected.item()!r}")
        for stage, named in grads.items():
            for param, grad in named.items():
                if not torch.equal(grad, want_grads[stage][param]):
                    worst = (grad - want_grads[stage][param]).abs().max().item()
                    found.append(f"{case} rank {rank} stage {stage} {param} grad differs by {worst:.3g}")
    return found


def refusal(rank: int, world_size: int, transport: str) -> str:
    """A fixed-shape pipeline given a microbatch of another shape: the message each rank ends with."""
    schedule = cs.build("1f1b", ranks=world_size, microbatches=NUM_MICROBATCHES)
    cfg = TinyConfig(num_stages=schedule.num_stages)
    transfer = conveyor.TransferOptions(timeout_s=60, transport=transport, fixed_shapes=transport != "ordered")
    pipe = conveyor.Pipeline([build_stage(rank, cfg)], schedule=schedule, loss_fn=lm_loss, transfer=transfer)
    try:
        for step in range(NUM_STEPS):
            inputs, targets = varlen_batches(cfg, step)
            pipe.step(conveyor.Microbatches(inputs=inputs if rank == 0 else None,
                                            targets=targets if rank == world_size - 1 else None))
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    finally:
        pipe.close()
    return "no error"


def _token_sum_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             reduction="sum")


def _replica_batches(replica: int, step: int) -> tuple[list[tuple[torch.Tensor]], list[torch.Tensor]]:
    return varlen_batches(TinyConfig(), step + replica, vocab=32, seed=1 + replica)


def _global_tokens(dp: int, step: int) -> int:
    return sum(t.numel() for replica in range(dp) for t in _replica_batches(replica, step)[1])


def train_replicas_varlen(rank: int, world_size: int, name: str, dp: int = 2) -> tuple[list, dict]:
    """A rank of a dp x pp job: each replica its own variable-length microbatches, loss per token; the
    losses of every step and the last step's gradients."""
    mesh = pipeline_mesh(world_size // dp)
    schedule = cs.build(name, ranks=world_size // dp, microbatches=NUM_MICROBATCHES)
    dp_rank, pp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    modules = {s: MLPStage(s, schedule.num_stages) for s in schedule.stages_of(pp_rank)}
    first, last = schedule.placement.rank_of(0), schedule.placement.rank_of(schedule.num_stages - 1)
    losses = []
    with conveyor.Pipeline(list(modules.values()), schedule=schedule, loss_fn=_token_sum_loss,
                           transfer=conveyor.TransferOptions(timeout_s=60),
                           layout=conveyor.DistributedLayout(mesh=mesh)) as pipe:
        for step in range(NUM_STEPS):
            for param in pipe.parameters():
                param.grad = None  # each step's gradients on their own: the reference averages per step
            inputs, targets = _replica_batches(dp_rank, step)
            given = conveyor.Microbatches(inputs=inputs if pp_rank == first else None,
                                          targets=targets if pp_rank == last else None)
            losses.append(pipe.step(given, normalize_by=_global_tokens(dp, step)))
    return losses, {s: {n: full_tensor(p.grad) for n, p in m.named_parameters()} for s, m in modules.items()}


def reference_replicas_varlen(num_stages: int, dp: int = 2) -> tuple[list, list[dict]]:
    """One process: each replica's microbatches (loss sum / (N / dp)) on their own, then averaged over replicas;
    the losses of every step and the last step's gradients."""
    with torch_threads(1):
        model = MLPStack(num_stages)
        params = list(model.parameters())
        losses: list[Any] = []
        averaged: list[torch.Tensor] = []
        for step in range(NUM_STEPS):
            divisor = _global_tokens(dp, step) / dp
            replica_losses, replica_grads = [], []
            for replica in range(dp):
                total = None
                for (ids,), target in zip(*_replica_batches(replica, step)):
                    loss = _token_sum_loss(model(ids), target) / divisor
                    loss.backward()
                    total = loss.detach() if total is None else total + loss.detach()
                replica_losses.append(total)
                replica_grads.append([p.grad for p in params])
                model.zero_grad()
            losses.append(average(replica_losses))
            averaged = [average(list(grads)) for grads in zip(*replica_grads)]
    grads = dict(zip((n for n, _ in model.named_parameters()), averaged))
    return losses, [{n.split(".", 2)[2]: g for n, g in grads.items() if n.startswith(f"stages.{s}.")}
                    for s in range(num_stages)]
