"""The schedule layer at scale: every built-in schedule at P=256, M=2048 (V=2 where it has V).

Each case runs ``conveyor simulate --schedule NAME --ranks 256 --microbatches 2048 [--virtual 2]
--json`` (build, verify, simulate and the summary it prints) in a fresh process and reports
its wall seconds and maximum RSS (``os.wait4``'s rusage of that child). The target: every
case under 5 s and 300 MB.

Then the start-up of one rank's runtime at P=64 (M=1024): what ``conveyor.Pipeline`` asks of
the schedule layer for its own rank (build, verify, the pass chain's programs of that rank,
the in-order channels, the agreement hash), again in a fresh process per case. A rank should
pay for its own program, not for all ranks'.

Run through the one benchmark command:
    .venv/bin/python -m benchmarks --schedule-scale [--scale-ranks 256] [--scale-microbatches 2048]
        [--scale-schedules zbv,1f1b] [--scale-root PATH]

``--scale-root`` runs the children on another checkout's ``conveyor`` (a before/after).
Every figure comes with the CPU steal of its window (benchmarks/steal.py).

Example:
    >>> virtual_for("zbv"), virtual_for("1f1b")
    (2, 1)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.steal import StealMeter

TARGET_S, TARGET_MB = 5.0, 300.0
ROOT = Path(__file__).resolve().parent.parent

# What a rank's Pipeline asks of the schedule layer when it is built (conveyor/pipe.py).
_STARTUP = """
import hashlib, sys, time
from conveyor.schedule.passes import executable
from conveyor.schedule.registry import resolve_schedule
start = time.perf_counter()
name, ranks, microbatches, virtual, rank = sys.argv[1], *map(int, sys.argv[2:6])
schedule = resolve_schedule(name, microbatches, virtual, ranks)
schedule.stages_of(rank)
hashlib.sha1(repr(schedule.programs).encode()).hexdigest()
runs = executable(schedule)
runs.in_order_channels(rank), runs.train_posts(rank, "in_order"), runs.eval_posts(rank, "in_order")
runs.train.programs, runs.eval.programs
runs.train_program(rank), runs.eval_program(rank), runs.gradients_final(rank)
print(time.perf_counter() - start)
"""


def virtual_for(name: str, wanted: int = 2) -> int:
    """The V a built-in runs at the scale point: ``wanted`` where it takes it, else its default."""
    import conveyor.schedule as cs

    info = cs.available()[name]
    if info.virtual_choices is None or wanted in info.virtual_choices:
        return wanted
    return info.default_virtual


# Runs the command as its only child: RUSAGE_CHILDREN's max RSS is then that command's own.
_MEASURE = """
import resource, subprocess, sys, time
start = time.perf_counter()
code = subprocess.run(sys.argv[1:]).returncode
wall = time.perf_counter() - start
print(f"MEASURED {wall} {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}", file=sys.stderr)
sys.exit(code)
"""


def _run_child(
    command: list[str], root: Path, meter: StealMeter, side: str, timeout_s: float
) -> tuple[float, float, str]:
    """Run ``command`` on ``root``'s conveyor: (wall s, max RSS MB, its stdout)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    with meter.window(side):
        done = subprocess.run([sys.executable, "-c", _MEASURE, *command], cwd=root, env=env, capture_output=True,
                              text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    _, wall, rss_kib = done.stderr.strip().splitlines()[-1].split()
    return float(wall), int(rss_kib) / 1024.0, done.stdout


def run(args: argparse.Namespace) -> int:
    """Time every case ``args`` names; 1 if any is over its target, else 0."""
    import conveyor.schedule as cs

    root = Path(args.scale_root).resolve() if args.scale_root else ROOT
    names = args.scale_schedules.split(",") if args.scale_schedules else list(cs.available())
    meter = StealMeter()
    P, M = args.scale_ranks, args.scale_microbatches
    print(f"conveyor simulate --json at P={P} M={M} on {root} (target {TARGET_S:g} s, {TARGET_MB:g} MB)")
    status = 0
    for name in names:
        V = virtual_for(name)
        command = [sys.executable, "-m", "conveyor.cli", "simulate", "--schedule", name, "--ranks", str(P),
                   "--microbatches", str(M), "--virtual", str(V), "--json"]
        try:
            wall, rss, out = _run_child(command, root, meter, name, 600.0)
        except SystemExit as failed:  # e.g. a schedule the other checkout does not have
            print(f"  {name:<17} V={V}  failed: {str(failed).strip().splitlines()[-1]}")
            status = 1
            continue
        makespan = json.loads(out)["makespan"]
        steal = meter.percent().get(name)
        over = wall > TARGET_S or rss > TARGET_MB
        status |= over
        print(f"  {name:<17} V={V}  {wall:6.2f} s  {rss:7.1f} MB  makespan {makespan:<9g} "
              f"steal {'-' if steal is None else f'{steal:.0f}%'}{'  OVER' if over else ''}")
    print(f"one rank's start-up at P={args.startup_ranks} M={args.startup_microbatches} (fresh process each)")
    for name in (args.startup_schedules or "interleaved-1f1b,zbv").split(","):
        V = virtual_for(name)
        for rank in (0, args.startup_ranks - 1):
            side = f"startup {name} {rank}"
            command = [sys.executable, "-c", _STARTUP, name, str(args.startup_ranks), str(args.startup_microbatches),
                       str(V), str(rank)]
            wall, rss, out = _run_child(command, root, meter, side, 600.0)
            steal = meter.percent().get(side)
            print(f"  {name:<17} V={V} rank {rank:<3} {float(out):6.3f} s in the schedule layer, "
                  f"{wall:6.2f} s process, {rss:7.1f} MB  steal {'-' if steal is None else f'{steal:.0f}%'}")
    return int(status)

