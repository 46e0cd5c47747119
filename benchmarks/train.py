"""``conveyor train`` measured as a user runs it: pipeline speed-up over one rank, and memory per rank.

Two parts, each through the real command (``python -m conveyor.cli train``, elastic launch):

* **Throughput.** The same model, batch and microbatches trained with ``parallel.pp=2`` and
  with ``parallel.pp=1`` (one thread per rank, so pp=1 uses one of the 2 cores and pp=2
  both), alternating the sides ``--train-rounds`` times. Each run's tokens/s is the median
  of its steps after the first few (start-up, allocator warm-up); the ratio pp=2 / pp=1 is
  printed per round and as the median, with each side's CPU steal. The ideal is 2x less
  the schedule's bubble.
* **Memory.** ``parallel.pp=3`` on a text corpus of ``--data-mb`` MB and on one of 2 MB:
  each rank's peak RSS (from the run's summary). Only the first and last stage read the
  data, so the middle rank's peak must not grow with the corpus.

Run through the one benchmark command:
    .venv/bin/python -m benchmarks --train [--train-rounds 3] [--data-mb 200]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from benchmarks.steal import StealMeter

# Wide enough that compute, not messaging, decides the step; M=32 keeps 1F1B's bubble at
# 1/33 of the step, so the ideal speed-up is 2 x 32/33 = 1.94.
MODEL = ["model.layers=8", "model.width=256", "model.heads=4", "model.seq_len=128",
         "train.batch_size=64", "parallel.microbatches=32", "parallel.schedule=1f1b"]
QUIET = ["train.eval_interval=0", "checkpoint.interval=0", "run.log_interval=1000"]


def train_command(run_dir: str, overrides: list[str]) -> list[str]:
    """The ``conveyor train`` invocation for one run.

    Example:
        >>> train_command("/tmp/r", ["train.steps=3"])[-2:]
        ['run.dir=/tmp/r', 'train.steps=3']
    """
    return [sys.executable, "-m", "conveyor.cli", "train", f"run.dir={run_dir}", *overrides]


def run_train(run_dir: str, overrides: list[str], timeout_s: float = 900) -> str:
    """Run ``conveyor train`` to the end; returns its output (raises on a non-zero exit)."""
    done = subprocess.run(train_command(run_dir, overrides), capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})  # a thread per rank
    if done.returncode != 0:
        raise RuntimeError(f"conveyor train {' '.join(overrides)} exited {done.returncode}:\n"
                           f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def steady_tokens_per_s(metrics: Path, skip: int) -> float:
    """The median tokens/s of the steps after the first ``skip`` in a run's metrics.jsonl."""
    rates = [record["tokens_per_s"] for record in map(json.loads, metrics.read_text().splitlines())
             if "tokens_per_s" in record and record["step"] > skip]
    return statistics.median(rates)


def peak_rss(output: str) -> list[float]:
    """Each rank's peak RSS in MiB, read from the summary line ``peak memory (RSS): rank 0 812 MiB, ...``.

    Example:
        >>> peak_rss("peak memory (RSS): rank 0 812 MiB, rank 1 790 MiB")
        [812.0, 790.0]
    """
    line = next(line for line in output.splitlines() if line.startswith("peak memory (RSS)"))
    return [float(mib) for mib in re.findall(r"rank \d+ (\d+(?:\.\d+)?) MiB", line)]


def throughput(args: argparse.Namespace, scratch: Path) -> None:
    meter = StealMeter()
    steps, skip = args.train_steps, 4
    ratios, sides = [], {1: [], 2: []}
    print(f"throughput: {' '.join(MODEL)}, {steps} steps per run (median tokens/s of steps {skip + 1}-{steps})")
    for round_ in range(args.train_rounds):
        rates = {}
        # Alternate which side goes first, so a drift in steal favours neither.
        for pp in ((1, 2) if round_ % 2 == 0 else (2, 1)):
            run_dir = scratch / f"pp{pp}_r{round_}"
            with meter.window(f"pp={pp}"):
                run_train(str(run_dir), [*MODEL, *QUIET, f"parallel.pp={pp}", f"train.steps={steps}"])
            rates[pp] = steady_tokens_per_s(run_dir / "metrics.jsonl", skip)
            sides[pp].append(rates[pp])
        ratios.append(rates[2] / rates[1])
        print(f"  round {round_ + 1}: pp=1 {rates[1]:,.0f} tokens/s, pp=2 {rates[2]:,.0f} tokens/s, "
              f"ratio {ratios[-1]:.2f}x", flush=True)
    steal = meter.percent()
    print(f"  median: pp=1 {statistics.median(sides[1]):,.0f} tokens/s, pp=2 {statistics.median(sides[2]):,.0f} "
          f"tokens/s, ratio {statistics.median(ratios):.2f}x (min {min(ratios):.2f}, max {max(ratios):.2f}; "
          f"ideal 1.94x); steal pp=1 {steal.get('pp=1', 0):.1f}%, pp=2 {steal.get('pp=2', 0):.1f}%")


def write_corpus(folder: Path, megabytes: float, files: int = 20) -> Path:
    """``files`` text files of Python source, ``megabytes`` MB in all, cut from the standard library."""
    folder.mkdir(parents=True, exist_ok=True)
    source = b"".join(path.read_bytes() for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")))
    per_file = int(megabytes * 1e6 / files)
    for i in range(files):
        repeated = (source * (per_file // len(source) + 1))[:per_file]
        (folder / f"part_{i:02d}.txt").write_bytes(repeated)
    return folder


def memory(args: argparse.Namespace, scratch: Path) -> None:
    print(f"memory: parallel.pp=3, a text corpus of {args.data_mb} MB against one of 2 MB (20 files each)")
    rows = {}
    for megabytes in (2, args.data_mb):
        corpus = write_corpus(scratch / f"corpus_{megabytes}", megabytes)
        output = run_train(str(scratch / f"mem_{megabytes}"),
                           ["parallel.pp=3", "train.steps=3", "train.batch_size=6", "parallel.microbatches=3",
                            "model.layers=3", "model.width=64", "model.seq_len=64", *QUIET,
                            f"data.source={corpus}/*.txt"])
        rows[megabytes] = peak_rss(output)
    print(f"  | rank | stage | peak RSS, 2 MB corpus (MiB) | peak RSS, {args.data_mb} MB corpus (MiB) | growth (MiB) |")
    print("  |---|---|---|---|---|")
    for rank, (small, large) in enumerate(zip(rows[2], rows[args.data_mb])):
        place = ("first", "middle", "last")[rank]
        print(f"  | {rank} | {place} | {small:.0f} | {large:.0f} | {large - small:+.0f} |")


def run(args: argparse.Namespace) -> int:
    """Both parts; the figures go to standard output."""
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-train-") as scratch:
        if not args.train_skip_throughput:
            throughput(args, Path(scratch))
        if not args.train_skip_memory:
            memory(args, Path(scratch))
    print(f"--train took {time.perf_counter() - began:.0f} s")
    return 0
