"""``compile=True`` against eager: the GPT workload's step time at P=2.

The model zoo's small GPT (:class:`conveyor.testing.models.TinyGPT`: 8 blocks, width 128,
seq 64, embeddings on stage 0 and the head on the last) cut into two stages, on two ranks
(one thread each), M=8 microbatches of 2 rows. Each rank builds two pipelines over the same
weights, one eager and one with every stage compiled by inductor (``compile=True``), and
times whole steps (barrier to barrier, the slower rank's time) of each in turn: rounds of
``--compile-steps`` steps per side, the side that goes first alternating, so that a busy
spell of the shared host slows both alike. Figures: the median step per side, the ratio,
the first step of each side (the compiled one includes compiling), and the host's CPU steal
during each side's timed steps.

Two schedules: 1F1B (no I/W split) and ZB-H1, whose compiled stage 1 runs its I as the full
backward and its W as nothing (a compiled region's backward is one graph; see
:mod:`conveyor.runtime.stage.compile`), so the figure shows what compile costs zero-bubble there.

Run through the one benchmark command:
    .venv/bin/python -m benchmarks --compile [--compile-rounds 6] [--compile-steps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks.steal import StealMeter
from conveyor.testing.multiprocess import run_ranks

CASES = (("1f1b", 1), ("zb-h1", 1))
SIDES = ("eager", "compiled")
MICROBATCHES = 8


def _timed(rank: int, world_size: int, name: str, virtual: int, rounds: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    import conveyor
    import conveyor.schedule as cs
    from conveyor.testing.models import TinyGPT

    workload = TinyGPT(num_ranks=world_size)
    schedule = cs.build(name, ranks=world_size, microbatches=MICROBATCHES, virtual=virtual)
    pipes = {side: conveyor.Pipeline([workload.build_stage(s, schedule.num_stages) for s in schedule.stages_of(rank)],
                                     schedule=schedule, loss_fn=workload.loss_fn,
                                     stage=conveyor.StageOptions(compile=side == "compiled"),
                                     transfer=conveyor.TransferOptions(timeout_s=900))
             for side in SIDES}
    x, y = workload.batch(MICROBATCHES)

    def step(side: str) -> tuple[float, float]:
        pipe = pipes[side]
        dist.barrier()
        start = time.perf_counter()
        loss = pipe.step(x if pipe.needs_inputs else None, target=y if pipe.needs_target else None)
        dist.barrier()
        elapsed = time.perf_counter() - start
        for param in pipe.parameters():
            param.grad = None
        return elapsed, float(loss)

    first = {side: step(side) for side in SIDES}  # the compiled side compiles here
    for side in SIDES:
        step(side)  # warm
    meter = StealMeter()
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for index in range(rounds):
        for side in SIDES if index % 2 == 0 else SIDES[::-1]:
            with meter.window(side):
                times[side].extend(step(side)[0] for _ in range(steps))
    for pipe in pipes.values():
        pipe.close()
    torch.distributed.barrier()
    return {"times": times, "first": first, "steal": meter.ticks}


def _case(name: str, virtual: int, rounds: int, steps: int) -> str:
    per_rank = run_ranks(_timed, 2, args=(name, virtual, rounds, steps), timeout_s=1800)
    # A step ends at a barrier on both ranks: each side's time is the slower rank's.
    median = {side: statistics.median(max(times) for times in zip(*(r["times"][side] for r in per_rank)))
              for side in SIDES}
    first = {side: max(r["first"][side][0] for r in per_rank) for side in SIDES}
    loss = {side: per_rank[0]["first"][side][1] for side in SIDES}
    meter = StealMeter()
    meter.ticks = per_rank[0]["steal"]  # /proc/stat is the host's: rank 0's windows cover both ranks
    steal = meter.percent()
    return (f"| {name} | {virtual} | {median['eager'] * 1e3:.1f} | {median['compiled'] * 1e3:.1f} | "
            f"{median['compiled'] / median['eager']:.2f} | {first['eager']:.2f} | {first['compiled']:.1f} | "
            f"{loss['eager']:.6f} / {loss['compiled']:.6f} | "
            f"{steal.get('eager', float('nan')):.1f}% | {steal.get('compiled', float('nan')):.1f}% |")


def run(args: argparse.Namespace) -> int:
    """Print one row per schedule: medians, ratio, first steps, first losses, steal per side."""
    rounds, steps = args.compile_rounds, args.compile_steps
    print(f"compile=True (inductor) vs eager: TinyGPT (8 x 128, seq 64) at P=2, M={MICROBATCHES}, one thread per "
          f"rank; medians of {rounds * steps} steps per side, {rounds} rounds of {steps} alternating:")
    print("| schedule | V | eager step (ms) | compiled step (ms) | compiled / eager | first step eager (s) | "
          "first step compiled (s) | first loss eager / compiled | steal eager | steal compiled |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    load = os.getloadavg()[0]
    for name, virtual in CASES:
        print(_case(name, virtual, rounds, steps), flush=True)
    # Steal is the host's; other processes on these cores slow both sides alike, the load says how many.
    print(f"\nload average (1 min) at start {load:.1f}, at end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    return 0
