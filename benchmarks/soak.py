"""A soak: many steps of a small pipelined model, watching each rank for leaks and slow-down.

One command (not part of the test suite)::

    .venv/bin/python benchmarks/soak.py                  # 1,000 steps at P=4 under zbv (a few minutes)
    .venv/bin/python benchmarks/soak.py --steps 200 --ranks 2 --schedule 1f1b

It launches the ranks through torchrun; each rank trains with AdamW and clipping and
records, per step, its wall time, RSS, open file descriptors and OS threads. At the end it
prints, per rank: RSS growth after step 50 (target under 5 MiB), the median step time of
the last 100 steps against steps 50-150 (target within 5%), and fds and threads at step 50
and at the end (target: constant), with the host's CPU steal over the run. Exit code 0 when
every target is met.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.compare import StealMeter  # noqa: E402

RSS_GROWTH_LIMIT_MIB = 5.0
DRIFT_LIMIT = 0.05
SETTLED_STEP = 50


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--schedule", default="zbv")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # the directory ranks write to
    return parser


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import conveyor
    import conveyor.schedule as cs
    from conveyor.testing.models import TinyConfig, build_stage, lm_loss, make_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    schedule = cs.build(args.schedule, ranks=world, microbatches=args.microbatches)
    cfg = TinyConfig(num_stages=schedule.num_stages, blocks_per_stage=1, dim=32, seq_len=16)
    first, last = schedule.placement.rank_of(0), schedule.placement.rank_of(schedule.num_stages - 1)
    records = []
    with conveyor.Pipeline([build_stage(s, cfg) for s in schedule.stages_of(rank)], schedule=schedule,
                           loss_fn=lm_loss, transport=args.transport) as pipe:
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        for step in range(args.steps):
            ids, targets = make_batch(cfg, 2 * args.microbatches, seed=step % 16)
            start = time.perf_counter()
            pipe.step(ids if rank == first else None, target=targets if rank == last else None)
            pipe.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad()
            seconds = time.perf_counter() - start
            records.append((seconds, _rss_bytes(), len(os.listdir("/proc/self/fd")),
                            len(os.listdir("/proc/self/task"))))
    Path(args.worker, f"rank{rank}.json").write_text(json.dumps(records))
    dist.destroy_process_group()


def figures(records: list[list[float]]) -> dict[str, float]:
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="conveyor-soak-") as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={args.ranks}", str(Path(__file__).resolve()),
                   *(argv if argv is not None else sys.argv[1:]), "--worker", out]
        meter = StealMeter()
        start = time.monotonic()
        with meter.window("soak"):
            code = subprocess.call(command, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if code:
            print(f"the soak's launch failed with exit code {code}")
            return code
        per_rank = [figures(json.loads(Path(out, f"rank{r}.json").read_text())) for r in range(args.ranks)]
    steal = meter.percent().get("soak")
    print(f"soak: {args.steps} steps, P={args.ranks} {args.schedule} M={args.microbatches}, "
          f"{time.monotonic() - start:.0f} s, host CPU steal {'n/a' if steal is None else f'{steal:.0f}%'}")
    ok = True
    for rank, f in enumerate(per_rank):
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


if __name__ == "__main__":
    sys.exit(main())
