"""Activation recomputation per policy: peak memory per rank, predicted and measured, and step time.

The llama recipe (``configs/llama.yaml``: 4 blocks of width 128, grouped-query attention, seq 128,
batch 16 in 4 microbatches, 1F1B) at pp=2 on two ranks (one thread each), under each policy of
:data:`POLICIES` (``stage.recompute``: none, the whole stage, every other block, every block,
every block keeping its matmul outputs, and the first stage only, which holds the most microbatches
under 1F1B). Per rank:

* predicted: ``conveyor train --dry-run``'s activation peak (:func:`conveyor.train.dry_run.run_layout`:
  each stage's forward on the meta device with its policy applied, weighed by the schedule's
  simulation), without and with the region rebuilt during a recomputation;
* measured: ``pipe.memory()``'s peak (``measure_memory=True``: what autograd keeps, and the outputs a
  selective policy keeps, counted while held; a recomputation's short-lived set is not held
  between passes and so not counted), the most over the timed steps;
* step time: the median step (barrier to barrier, the slower rank's), policies rotating within each
  round so that a busy spell of the shared host slows all alike; the host's CPU steal per policy.

Run through the one benchmark command:
    .venv/bin/python -m benchmarks --recompute [--recompute-rounds 2] [--recompute-steps 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from benchmarks.steal import StealMeter
from conveyor.testing.multiprocess import run_ranks

RECIPE = Path(__file__).resolve().parent.parent / "configs" / "llama.yaml"
# (label, the stage.recompute override)
POLICIES = (
    ("none", "null"),
    ("whole stage", "true"),
    ("every=2", "{every: 2}"),
    ("every=1", "{every: 1}"),
    ("every=1 save=matmul", "{every: 1, save: [matmul]}"),
    ("stage 0 every=1, stage 1 none", "[{every: 1}, null]"),
)


def _config(policy: str, quick: bool) -> object:
    from conveyor.train.config import load_config

    overrides = [f"stage.recompute={policy}", "stage.measure_memory=true", "run.dir=/tmp/conveyor-bench-ckpt"]
    return load_config(RECIPE, overrides + (["model.seq_len=64"] if quick else []))


def _timed(rank: int, world_size: int, rounds: int, steps: int, quick: bool) -> dict:
    import torch
    import torch.distributed as dist

    from conveyor.train.data import load_tokenizer
    from conveyor.train.loop import build_pipeline
    from conveyor.train.models import build_model

    torch.set_num_threads(1)
    pipes, batch = {}, None
    for label, policy in POLICIES:
        cfg = _config(policy, quick)
        tokenizer = load_tokenizer(cfg.data.tokenizer)
        vocab = getattr(tokenizer, "vocab_size", None) or len(tokenizer)
        torch.manual_seed(0)
        pipes[label] = build_pipeline(cfg, build_model(cfg, vocab))
        if batch is None:
            batch = torch.randint(0, vocab, (cfg.train.batch_size, cfg.model.seq_len + 1),
                                  generator=torch.Generator().manual_seed(1))
    ids, targets = batch[:, :-1], batch[:, 1:]
    peaks = {label: 0 for label in pipes}

    def step(label: str) -> float:
        pipe = pipes[label]
        dist.barrier()
        start = time.perf_counter()
        pipe.step(ids if pipe.needs_inputs else None, target=targets if pipe.needs_target else None)
        dist.barrier()
        elapsed = time.perf_counter() - start
        peaks[label] = max(peaks[label], pipe.memory().peak_bytes)
        for param in pipe.parameters():
            param.grad = None
        return elapsed

    for label in pipes:
        step(label)  # warm
    meter = StealMeter()
    times: dict[str, list[float]] = {label: [] for label in pipes}
    labels = list(pipes)
    for index in range(rounds):
        for label in labels[index % len(labels):] + labels[:index % len(labels)]:
            with meter.window(label):
                times[label].extend(step(label) for _ in range(steps))
    for pipe in pipes.values():
        pipe.close()
    return {"times": times, "peaks": peaks, "steal": meter.ticks}


def _predicted(policy: str, quick: bool) -> list[tuple[int, int]]:
    """Per rank: (the dry run's activation peak without, with the recomputed region)."""
    from conveyor.train.dry_run import run_layout

    layout = run_layout(_config(policy, quick))
    return [(row.activation_bytes - row.recompute_bytes, row.activation_bytes) for row in layout.ranks]


def _mib(size: float) -> str:
    return f"{size / 2**20:.2f}"


def run(args: argparse.Namespace) -> int:
    """Print one row per policy: predicted and measured peak per rank, their ratio, step time, steal."""
    rounds, steps, quick = args.recompute_rounds, args.recompute_steps, args.quick
    load = os.getloadavg()[0]
    per_rank = run_ranks(_timed, 2, args=(rounds, steps, quick), timeout_s=3000)
    meter = StealMeter()
    meter.ticks = per_rank[0]["steal"]  # /proc/stat is the host's: rank 0's windows cover both ranks
    steal = meter.percent()
    print(f"activation recomputation policies on {RECIPE.name} (pp=2, 1f1b, 4 microbatches"
          f"{', seq 64' if quick else ''}), one thread per rank; peaks in MiB of activations kept for backward "
          f"(parameters and optimizer state apart); step: median of {rounds * steps} steps, {rounds} rounds of "
          f"{steps}, policies rotating")
    print("| policy | rank | predicted peak | + recompute | measured peak | measured / predicted | "
          "step (ms) | steal |")
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for label, policy in POLICIES:
        predicted = _predicted(policy, quick)
        median = statistics.median(max(t) for t in zip(*(r["times"][label] for r in per_rank)))
        for rank, result in enumerate(per_rank):
            kept, with_recompute = predicted[rank]
            measured = result["peaks"][label]
            ratio = measured / kept if kept else float("nan")
            worst = max(worst, abs(ratio - 1))
            print(f"| {label} | {rank} | {_mib(kept)} | {_mib(with_recompute)} | {_mib(measured)} | {ratio:.3f} | "
                  f"{median * 1e3:.0f} | {steal.get(label, float('nan')):.1f}% |", flush=True)
    print(f"\nlargest |measured / predicted - 1|: {worst:.1%}; load average (1 min) at start {load:.1f}, at end "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    return 0 if worst <= 0.10 else 1
