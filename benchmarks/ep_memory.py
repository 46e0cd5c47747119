"""Expert parallelism: each rank's expert bytes (parameters, gradients, AdamW state) at ep=2 against ep=1.

A Mixtral-style model (8 experts, 2 per token, hidden 64, 2 decoder layers) in hand-built stages
(:mod:`conveyor.testing.models.moe`) trains at pp=2 x dp=2 on 4 ranks under 1f1b, once with every
expert on every rank (ep=1: ddp over both replicas) and once with the experts sharded over the two
replicas (ep=2). After the last step each rank sums the bytes of the expert tensors it holds, as
they are (a shard's local tensor): parameters, gradients and AdamW's ``exp_avg``/``exp_avg_sq``.
The goal is 1/ep of them (within 2%); the dense part is unchanged.

Step time: the median over the timed steps of the slowest rank's step (``pipe.step`` + AdamW,
between barriers), and at ep=2 the share of it each rank spent inside the forward's all-to-alls
(counts and tokens, waiting for the peer included, timed around ``conveyor.parallel.experts.dispatch``'s
calls; the backward's reverse all-to-alls run inside autograd and are not in it, so the whole
all-to-all share is about twice it), with each side's CPU steal (:mod:`benchmarks.steal`).
Reported, not targeted: 4 ranks share this machine's cores.

Run through the one benchmark command:
    .venv/bin/python -m benchmarks --ep [--ep-steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.steal import StealMeter
from conveyor.testing.multiprocess import run_ranks

WARMUP = 2
MICROBATCHES, ROWS, LENGTH = 4, 8, 32


def _local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _model():
    import transformers

    config = transformers.MixtralConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, use_cache=False, num_local_experts=8, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.02)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).train()


def _rank(rank: int, world_size: int, ep: int, steps: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import conveyor
    import conveyor.schedule as cs
    from conveyor.layout import DistributedLayout
    from conveyor.parallel.experts import ExpertParallel
    from conveyor.testing.models.moe import moe_stages

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh.get_local_rank("pp")
    schedule = cs.build("1f1b", ranks=2, microbatches=MICROBATCHES)
    stage = moe_stages(_model(), 2)[pp_rank]
    layout = DistributedLayout(mesh=mesh, expert_parallel="auto", ep=ep) if ep > 1 else DistributedLayout(mesh=mesh)
    pipe = conveyor.Pipeline([stage], schedule, loss_fn=lambda out, y: _loss(out, y), layout=layout)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank % 2)
    times, shares = [], []
    for step in range(steps):
        ids = torch.randint(0, 128, (ROWS, LENGTH), generator=generator)
        dist.barrier()
        began = time.perf_counter()
        pipe.step(ids if pp_rank == 0 else None, target=ids if pp_rank == 1 else None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=step < steps - 1)
        dist.barrier()
        if step >= WARMUP:
            times.append(time.perf_counter() - began)
            part = pipe.ranks.find_part(ExpertParallel)  # each all-to-all it waited for, forward and backward
            shares.append((part.exchanges()[1] if part is not None else 0.0) / times[-1])
    experts = {name: p for name, p in pipe.named_parameters() if ".experts." in name}
    found = {"params": sum(_local_bytes(p) for p in experts.values()),
             "optimizer": sum(_local_bytes(optimizer.state[p][k]) for p in experts.values()
                              for k in ("exp_avg", "exp_avg_sq")),
             "step_s": times, "all_to_all_share": shares}
    pipe.step(ids if pp_rank == 0 else None, target=ids if pp_rank == 1 else None)  # gradients held, as counted
    found["grads"] = sum(_local_bytes(p.grad) for p in experts.values())
    pipe.close()
    return found


def _loss(output, target):
    from conveyor.testing.models.moe import moe_loss

    return moe_loss(output, target, num_experts=8)


def _mib(size: float) -> str:
    return f"{size / 2**20:.3f}"


def run(args: argparse.Namespace) -> int:
    """Train both sides, print the expert-bytes table, the step times and the all-to-all share, with the steal."""
    meter = StealMeter()
    steps = max(args.ep_steps, WARMUP + 2)
    sides = {}
    for ep in (1, 2):
        with meter.window(f"ep={ep}"):
            sides[ep] = run_ranks(_rank, 4, args=(ep, steps), timeout_s=900)
    print(f"\npp=2 x dp=2, Mixtral-style (8 experts, top-2, hidden 64, 2 layers), 1f1b, M={MICROBATCHES}: each "
          "rank's expert bytes (MiB, local tensors)")
    print("| rank | ep=1 params | grads | AdamW | ep=2 params | grads | AdamW | ep=2 / ep=1 (goal 0.500) |")
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for rank, (one, two) in enumerate(zip(sides[1], sides[2], strict=True)):
        totals = [side["params"] + side["grads"] + side["optimizer"] for side in (one, two)]
        worst = max(worst, abs(totals[1] / totals[0] - 0.5) / 0.5)
        print(f"| {rank} | {_mib(one['params'])} | {_mib(one['grads'])} | {_mib(one['optimizer'])} | "
              f"{_mib(two['params'])} | {_mib(two['grads'])} | {_mib(two['optimizer'])} | "
              f"{totals[1] / totals[0]:.3f} |")
    print(f"worst distance from 1/ep: {worst * 100:.2f}% (goal: within 2%)")
    medians = {ep: statistics.median(max(r["step_s"][i] for r in side) for i in range(len(side[0]["step_s"])))
               for ep, side in sides.items()}
    share = statistics.median(s for r in sides[2] for s in r["all_to_all_share"])
    print(f"step time (median of {len(sides[1][0]['step_s'])} timed steps, slowest rank): ep=1 "
          f"{medians[1] * 1e3:.0f} ms, ep=2 {medians[2] * 1e3:.0f} ms; at ep=2 the all-to-alls took "
          f"{share * 100:.1f}% of a rank's step, waited for in the forward and the backward (median over ranks "
          "and steps)")
    print("CPU steal: " + ", ".join(f"{side} {value:.1f}%" for side, value in meter.percent().items()))
    return 0
