"""A soak: many steps of a small pipelined model, watching each rank for leaks and slow-down.

Run through the one benchmark command (not part of the test suite)::

    .venv/bin/python -m benchmarks --soak       # 1,000 steps at P=4 under zbv (a few minutes)
    .venv/bin/python -m benchmarks --soak --soak-steps 200 --soak-ranks 2 --soak-schedule 1f1b

The ranks are the library's own (``conveyor.testing.run_ranks``: one gloo group, the
environment torchrun gives ranks on one machine, so conveyor picks the transport it would
there); each trains with AdamW and clipping and records, per step, its wall time, RSS, open
file descriptors and OS threads. At the end it prints, per rank: RSS growth after step 50
(target under 5 MiB), the median step time of the last 100 steps against steps 50-150
(target within 5%), and fds and threads at step 50 and at the end (target: constant), with
the host's CPU steal over the run. Exit code 0 when every target is met.

Example:
    >>> f = figures([[0.01, 100 * 2**20, 12, 3]] * 10)
    >>> round(f["drift"], 3), f["rss_growth_mib"], f["fds_end"]
    (0.0, 0.0, 12)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks.steal import StealMeter

RSS_GROWTH_LIMIT_MIB = 5.0
DRIFT_LIMIT = 0.05
SETTLED_STEP = 50


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak_rank(
    rank: int, world: int, steps: int, schedule_name: str, microbatches: int, transport: str
) -> list[tuple[float, int, int, int]]:
    """One rank's soak (run by ``run_ranks``): per step, (seconds, RSS bytes, fds, threads)."""
    import torch

    import conveyor
    import conveyor.schedule as cs
    from conveyor.testing.models import TinyConfig, build_stage, lm_loss, make_batch

    schedule = cs.build(schedule_name, ranks=world, microbatches=microbatches)
    cfg = TinyConfig(num_stages=schedule.num_stages, blocks_per_stage=1, dim=32, seq_len=16)
    first, last = schedule.placement.rank_of(0), schedule.placement.rank_of(schedule.num_stages - 1)
    records = []
    with conveyor.Pipeline([build_stage(s, cfg) for s in schedule.stages_of(rank)], schedule=schedule,
                           loss_fn=lm_loss, transfer=conveyor.TransferOptions(transport=transport)) as pipe:
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        for step in range(steps):
            ids, targets = make_batch(cfg, 2 * microbatches, seed=step % 16)
            start = time.perf_counter()
            pipe.step(ids if rank == first else None, target=targets if rank == last else None)
            pipe.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad()
            seconds = time.perf_counter() - start
            records.append((seconds, _rss_bytes(), len(os.listdir("/proc/self/fd")),
                            len(os.listdir("/proc/self/task"))))
    return records


def figures(records: list) -> dict[str, float]:
    """The soak's figures for one rank from its per-step (seconds, rss, fds, threads)."""
    settled = SETTLED_STEP if len(records) > SETTLED_STEP + 100 else 0
    times = [r[0] for r in records]
    early = statistics.median(times[settled:settled + 100])
    late = statistics.median(times[-100:])
    return {
        "rss_growth_mib": (records[-1][1] - records[settled][1]) / 2**20,
        "drift": late / early - 1.0,
        "early_ms": early * 1e3, "late_ms": late * 1e3,
        "fds_settled": records[settled][2], "fds_end": records[-1][2],
        "threads_settled": records[settled][3], "threads_end": records[-1][3],
    }


def run(args: argparse.Namespace) -> int:
    """The soak ``args`` ask for (``soak_steps``, ``soak_ranks``, ...); 0 when every target is met."""
    from conveyor.testing import run_ranks

    steps, ranks, schedule = args.soak_steps, args.soak_ranks, args.soak_schedule
    meter = StealMeter()
    start = time.monotonic()
    with meter.window("soak"):
        per_rank = run_ranks(
            soak_rank, ranks,
            args=(steps, schedule, args.soak_microbatches, args.soak_transport),
            timeout_s=max(600.0, 2.0 * steps),  # about 0.1 s a step at P=4 on a quiet machine
        )
    steal = meter.percent().get("soak")
    print(f"soak: {steps} steps, P={ranks} {schedule} M={args.soak_microbatches}, "
          f"{time.monotonic() - start:.0f} s, host CPU steal {'n/a' if steal is None else f'{steal:.0f}%'}")
    ok = True
    for rank, f in enumerate(figures(records) for records in per_rank):
        good = (f["rss_growth_mib"] < RSS_GROWTH_LIMIT_MIB and abs(f["drift"]) <= DRIFT_LIMIT
                and f["fds_settled"] == f["fds_end"] and f["threads_settled"] == f["threads_end"])
        ok &= good
        print(f"rank {rank}: RSS +{f['rss_growth_mib']:.2f} MiB after step {SETTLED_STEP}; step median "
              f"{f['early_ms']:.1f} ms (steps 50-150) -> {f['late_ms']:.1f} ms (last 100), {f['drift']:+.1%}; "
              f"fds {f['fds_settled']} -> {f['fds_end']}; threads {f['threads_settled']} -> {f['threads_end']}"
              f"{'' if good else '   <- over a target'}")
    print("every target met" if ok else "a target was missed (RSS < 5 MiB growth, drift within 5%, fds and "
          "threads constant)")
    return 0 if ok else 1
