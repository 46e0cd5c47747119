"""Launch a short training script through torchrun again and again, and count the clean exits.

A job that did its work and then aborts at exit is a failed job to its launcher. This
starts :mod:`~conveyor.testing.rigs.launch_check` with real ``torchrun`` launches over a plan
that cycles through rank counts, transports, schedules and teardown orders, and counts a
launch clean when torchrun's exit code is the one the teardown order means (0, or 1
when the script leaves through an exception), no rank died of a signal, and nothing printed
"terminate called".

Example:
    $ python tools/launch_stress.py --launches 300       # the full run (about 40 min on 2 cores)
    >>> cases = launch_cases(9)
    >>> sorted({launch.teardown for launch in cases}) == sorted(TEARDOWNS)
    True
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from conveyor.testing.rigs.launch_check import TEARDOWNS

RANKS = (2, 4)
TRANSPORTS = ("shared_memory", "process_group", "hybrid")
SCHEDULES = ("1f1b", "zb-h1", "zbv")
_EXIT_CODE = re.compile(r"exitcode\s*:\s*(-?\d+)")


@dataclass(frozen=True, slots=True)
class Launch:
    """One torchrun launch of the short training script."""

    ranks: int
    transport: str
    schedule: str
    teardown: str

    @property
    def expected_exit_code(self) -> int:
        return 1 if self.teardown == "exception" else 0

    def describe(self) -> str:
        return f"P={self.ranks} {self.transport} {self.schedule} teardown={self.teardown}"


@dataclass(frozen=True, slots=True)
class LaunchResult:
    launch: Launch
    exit_code: int
    seconds: float
    problem: str  # empty when the launch ended cleanly

    @property
    def clean(self) -> bool:
        return not self.problem


def launch_cases(count: int) -> list[Launch]:
    """``count`` launches: first one per teardown order that together hold every value of every
    dimension, then a walk over every combination of rank count, transport, schedule and teardown.

    The first six pair each teardown order with another (transport, rank count) and cycle the
    schedules, so a short run (CI's 6) already holds each teardown order, each schedule and
    every transport at both rank counts. After them the 108 combinations are visited with a
    stride coprime to their number, so consecutive launches differ; a plan longer than that
    starts over.
    """
    teardowns = sorted(TEARDOWNS)
    pairs = list(itertools.product(RANKS, TRANSPORTS))
    covering = [(teardowns[i], SCHEDULES[i % len(SCHEDULES)], pairs[i][1], pairs[i][0])
                for i in range(min(len(teardowns), len(pairs)))]
    combinations = list(itertools.product(teardowns, SCHEDULES, TRANSPORTS, RANKS))
    stride = 5  # coprime to 108
    walk = (combinations[(i * stride) % len(combinations)] for i in itertools.count())
    picked = itertools.islice(itertools.chain(covering, walk), count)
    return [Launch(ranks, transport, schedule, teardown) for teardown, schedule, transport, ranks in picked]


def run_launch(launch: Launch, timeout_s: float = 180.0) -> LaunchResult:
    """One real torchrun launch; what went wrong is in ``problem`` (with the end of its output)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={launch.ranks}",
               str(Path(__file__).with_name("launch_check.py")), "--schedule", launch.schedule,
               "--transport", launch.transport, "--teardown", launch.teardown]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    start = time.monotonic()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return LaunchResult(launch, -1, time.monotonic() - start, f"hung for {timeout_s:g} s\n{output[-2000:]}")
    seconds = time.monotonic() - start
    output = done.stdout + done.stderr
    return LaunchResult(launch, done.returncode, seconds, _problem(launch, done.returncode, output))


def _problem(launch: Launch, exit_code: int, output: str) -> str:
    tail = output[-3000:]
    if "terminate called" in output:
        return f"a rank aborted ('terminate called'):\n{tail}"
    codes = [int(code) for code in _EXIT_CODE.findall(output)]
    if exit_code != launch.expected_exit_code:
        return f"torchrun exited {exit_code}, expected {launch.expected_exit_code}:\n{tail}"
    if launch.expected_exit_code and codes and codes[-1] != launch.expected_exit_code:
        # torchrun lists the first failure ("Root Cause") last; later ranks may be its SIGTERMs.
        return f"the first rank to fail exited {codes[-1]}, expected {launch.expected_exit_code}:\n{tail}"
    if launch.expected_exit_code and "_DeliberateExit" not in output:
        return f"no rank left through the deliberate exception:\n{tail}"
    return ""


def run_cases(count: int, *, report=print, timeout_s: float = 180.0, at_once: int = 1) -> list[LaunchResult]:
    """Run ``launch_cases(count)``, ``at_once`` launches side by side; ``report`` gets a line per launch.

    Side by side costs less wall time (a launch spends much of it waiting on rendezvous and the
    launcher's polls) and is a fair stress: an abort at exit is a matter of timing, and a loaded
    machine is where it shows.
    """
    cases = launch_cases(count)
    results: list[LaunchResult] = []
    with ThreadPoolExecutor(max_workers=max(1, at_once)) as pool:
        for index, result in enumerate(pool.map(lambda launch: run_launch(launch, timeout_s), cases), 1):
            results.append(result)
            verdict = "clean" if result.clean else "FAILED"
            report(f"{index:4d}/{count} {verdict:7s} {result.seconds:5.1f} s  {result.launch.describe()}")
            if not result.clean:
                report(result.problem)
    return results


def summary(results: list[LaunchResult]) -> str:
    """One line per dimension value and a total: ``clean / launched``."""
    lines = [f"clean launches: {sum(r.clean for r in results)} of {len(results)}"]
    for name in ("ranks", "transport", "schedule", "teardown"):
        counts: dict[object, list[int]] = {}
        for result in results:
            tally = counts.setdefault(getattr(result.launch, name), [0, 0])
            tally[0] += result.clean
            tally[1] += 1
        lines.append(f"  by {name}: " + ", ".join(f"{value} {c}/{n}" for value, (c, n) in counts.items()))
    slowest = max((r.seconds for r in results), default=0.0)
    lines.append(f"  slowest launch: {slowest:.1f} s")
    return "\n".join(lines)
