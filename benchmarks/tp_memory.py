"""Tensor parallelism in ``conveyor train``: each rank's parameter, gradient and optimizer bytes at tp=2 against tp=1.

The llama recipe (configs/llama.yaml) is trained by the trainer's own code (``conveyor.train.loop``'s
``setup`` and step) on pp=2 ranks, then on pp=2 x tp=2 ranks. After the last step each rank sums the
bytes of the tensors it holds, as they are: every parameter's local shard (``DTensor.to_local()``;
a plain tensor whole), every gradient's, every AdamW state tensor's (``exp_avg``, ``exp_avg_sq``,
``step``). The table pairs each tp=2 rank with the tp=1 rank of the same pipeline stage; "sharded"
is the part of the parameters that the plan splits (attention, MLP, the token embedding and the LM
head, both by the vocabulary), which is expected at exactly half, and the rest (norms) stays replicated.

Step time: the median over the timed steps of the slowest rank's step (``pipe.step`` + clipping +
AdamW, between barriers), at tp=2 over tp=1, with each side's CPU steal (:mod:`benchmarks.steal`).
Reported, not targeted: 2 and 4 ranks share this machine's cores, so TP's halved matmuls do not run
in parallel and its collectives are pure cost here.

Run through the one benchmark command:
    .venv/bin/python -m benchmarks --tp [--tp-steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.steal import StealMeter
from conveyor.testing.multiprocess import run_ranks

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "llama.yaml"
WARMUP = 2


def _local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _sharded(param: torch.Tensor) -> bool:
    return any(p.is_shard() for p in getattr(param, "placements", ()))


def _rank(rank: int, world_size: int, tp: int, steps: int, run_dir: str) -> dict:
    import torch.distributed as dist

    from conveyor.train.config import load_config
    from conveyor.train.loop import setup, train_step

    torch.set_num_threads(1)
    cfg = load_config(RECIPE, [f"parallel.tp={tp}", f"train.steps={steps}", "train.eval_interval=0",
                               "train.sample_tokens=0", "run.tensorboard=false", "run.device=cpu",
                               f"run.dir={run_dir}/tp{tp}"], world_size=world_size)
    run = setup(cfg)
    times = []
    for step in range(steps - 1):
        dist.barrier()
        began = time.perf_counter()
        train_step(run)
        dist.barrier()
        if step >= WARMUP:
            times.append(time.perf_counter() - began)
    found = _measured_step(run)
    run.pipe.close()
    return {**found, "step_s": times}


def _measured_step(run) -> dict:
    """The last step, as train_step runs it, with the bytes counted where each kind is at its fullest."""
    pipe, optimizer = run.pipe, run.optimizer
    x, y = next(run.train_data) if run.train_data is not None else (None, None)
    pipe.step(x if pipe.needs_inputs else None, target=y if pipe.needs_target else None)
    named = dict(pipe.named_parameters())
    params = list(named.values())
    found = {"params": sum(_local_bytes(p) for p in params), "grads": sum(_local_bytes(p.grad) for p in params),
             "by_name": {name: _local_bytes(p) for name, p in named.items()},
             "sharded": sorted(name for name, p in named.items() if _sharded(p))}
    pipe.clip_grad_norm_(run.cfg.train.clip)
    optimizer.step()
    found["optimizer"] = sum(_local_bytes(value) for state in optimizer.state.values() for value in state.values()
                             if isinstance(value, torch.Tensor))
    optimizer.zero_grad(set_to_none=True)
    return found


def _side(tp: int, steps: int, meter: StealMeter, run_dir: str) -> list[dict]:
    ranks = 2 * tp
    with meter.window(f"tp={tp}"):
        return run_ranks(_rank, ranks, args=(tp, steps, run_dir), timeout_s=900)


def _mib(size: float) -> str:
    return f"{size / 2**20:.3f}"


def run(args: argparse.Namespace) -> int:
    """Train both sides, print the memory table and the step-time ratio with the steal."""
    meter = StealMeter()
    steps = max(args.tp_steps, WARMUP + 2)
    with tempfile.TemporaryDirectory() as run_dir:
        one = _side(1, steps, meter, run_dir)
        two = _side(2, steps, meter, run_dir)
    print(f"\nconveyor train, {RECIPE.relative_to(ROOT)} (pp=2), after {steps} AdamW steps: each rank's bytes "
          "(MiB) of its local tensors")
    print("| rank (pp, tp) | tp=1 params | grads | AdamW | total | tp=2 params | grads | AdamW | total | tp=2 / tp=1 "
          "| sharded params tp=1 -> tp=2 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for rank, mine in enumerate(two):
        stage = rank // 2
        base = one[stage]
        totals = [side["params"] + side["grads"] + side["optimizer"] for side in (base, mine)]
        print(f"| {rank} ({stage}, {rank % 2}) | {_mib(base['params'])} | {_mib(base['grads'])} | "
              f"{_mib(base['optimizer'])} | {_mib(totals[0])} | {_mib(mine['params'])} | {_mib(mine['grads'])} | "
              f"{_mib(mine['optimizer'])} | {_mib(totals[1])} | {totals[1] / totals[0]:.3f} | "
              f"{_mib(sum(base['by_name'][n] for n in mine['sharded']))} -> "
              f"{_mib(sum(mine['by_name'][n] for n in mine['sharded']))} |")
    medians = [statistics.median(max(r["step_s"][i] for r in side) for i in range(len(side[0]["step_s"])))
               for side in (one, two)]
    steal = meter.percent()
    print(f"\nstep time (median of {len(one[0]['step_s'])} timed steps, slowest rank): tp=1 (2 ranks) "
          f"{medians[0] * 1e3:.0f} ms, tp=2 (4 ranks) {medians[1] * 1e3:.0f} ms, ratio tp=2 / tp=1 "
          f"{medians[1] / medians[0]:.2f}")
    print("CPU steal: " + ", ".join(f"{side} {value:.1f}%" for side, value in steal.items()))
    return 0

