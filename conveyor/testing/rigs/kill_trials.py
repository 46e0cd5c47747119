"""Kill one rank of a training run at a chosen point and time how fast every survivor stops, and with what.

Ranks are plain processes forked from this one (see :mod:`~conveyor.testing.rigs.kill_check`), so nothing but the
pipeline itself tells a survivor that its peer is gone. A trial passes when every survivor
exits non-zero within ``limit_s`` of the victim's death with a message that names the dead
rank, and no process is left to kill.

Example:
    $ python tools/kill_trials.py --trials 2            # every point x death x transport, twice
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

from conveyor.testing.rigs import kill_check
from conveyor.testing.rigs.kill_check import DEATHS, POINTS

TRANSPORTS = ("shared_memory", "process_group", "hybrid")


@dataclass(frozen=True, slots=True)
class Trial:
    point: str
    death: str
    transport: str
    ranks: int = 4
    victim: int = 1

    def describe(self) -> str:
        return f"{self.point:9s} {self.death:11s} {self.transport}"


@dataclass(frozen=True, slots=True)
class TrialResult:
    trial: Trial
    slowest_s: float  # from the victim's death to the last survivor's exit
    problem: str

    @property
    def passed(self) -> bool:
        return not self.problem


def trial_cases(trials_each: int) -> list[Trial]:
    """Every point x death x transport, ``trials_each`` times (a MemoryError cannot strike a wait)."""
    combos = [Trial(p, d, t) for p, d, t in itertools.product(POINTS, DEATHS, TRANSPORTS)
              if not (p == "waiting" and d == "MemoryError")]
    return [trial for trial in combos for _ in range(trials_each)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_trial(trial: Trial, limit_s: float = 30.0, hard_limit_s: float = 120.0) -> TrialResult:
    with tempfile.TemporaryDirectory(prefix="conveyor-kill-") as folder:
        paths = [os.path.join(folder, f"rank{rank}.log") for rank in range(trial.ranks)]
        exited, left, returncodes = _run_ranks(trial, paths, hard_limit_s)
        texts = [open(path, errors="replace").read() for path in paths]  # noqa: SIM115 - read at once
    if trial.victim not in exited:
        return TrialResult(trial, float("nan"), f"the victim never died; left running: {left}")
    death = exited[trial.victim]
    problems, slowest = [], 0.0
    for rank in range(trial.ranks):
        if rank == trial.victim:
            continue
        if rank in left:
            problems.append(f"rank {rank} still ran {hard_limit_s:g} s after the start and was killed:\n"
                            f"{texts[rank][-1500:]}")
            continue
        seconds = exited[rank] - death
        slowest = max(slowest, seconds)
        if returncodes[rank] == 0:
            problems.append(f"rank {rank} exited 0 although rank {trial.victim} died")
        elif seconds > limit_s:
            problems.append(f"rank {rank} took {seconds:.1f} s to stop (limit {limit_s:g} s)")
        elif "CommTimeout" in texts[rank]:
            problems.append(f"rank {rank} timed out instead of learning of rank {trial.victim}'s death:\n"
                            f"{texts[rank][-1500:]}")
        elif f"rank {trial.victim}" not in texts[rank]:
            problems.append(f"rank {rank}'s output does not name rank {trial.victim}:\n{texts[rank][-1500:]}")
    return TrialResult(trial, slowest, "\n".join(problems))


def _run_ranks(trial: Trial, paths: list[str], hard_limit_s: float):
    """Start every rank, note when each exits; kill what still runs after ``hard_limit_s``.

    Ranks are forked from this process, which has imported torch already (a trial then
    costs a second or two, not a torch import per rank), and never touches torch.distributed.
    """
    _import_once_for_every_rank()
    port = _free_port()
    context = multiprocessing.get_context("fork")
    procs = []
    for rank, path in enumerate(paths):
        env = {"RANK": str(rank), "WORLD_SIZE": str(trial.ranks), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(trial.ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        argv = ["--point", trial.point, "--death", trial.death, "--victim", str(trial.victim),
                "--transport", trial.transport]
        procs.append(context.Process(target=_rank_entry, args=(env, argv, path), name=f"kill-trial-rank{rank}"))
        procs[-1].start()
    exited: dict[int, float] = {}
    start = time.monotonic()
    while len(exited) < trial.ranks and time.monotonic() - start < hard_limit_s:
        for rank, proc in enumerate(procs):
            if rank not in exited and proc.exitcode is not None:
                exited[rank] = time.monotonic()
        time.sleep(0.05)
    left = [rank for rank, proc in enumerate(procs) if proc.exitcode is None]
    for rank in left:
        procs[rank].kill()
        procs[rank].join()
    return exited, left, [proc.exitcode for proc in procs]


def _import_once_for_every_rank() -> None:
    """What each rank would import (torch._dynamo comes with the optimizer), imported in the parent."""
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401

    import conveyor.pipe  # noqa: F401
    import conveyor.testing.models  # noqa: F401


def _rank_entry(env: dict[str, str], argv: list[str], log_path: str) -> None:
    """One rank, in a forked child: its output to ``log_path``; exit 1 with the traceback on an exception."""
    with open(log_path, "wb") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    # The parent's sys.stdout/stderr may not write to fds 1 and 2 (pytest's capture): rebind them.
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives as long as the process
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.update(env)
    code = 0
    try:
        kill_check.main(argv)
    except BaseException:  # noqa: BLE001 - a survivor's error is what the trial reads
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown in a forked child


def run_cases(trials_each: int, *, report=print) -> list[TrialResult]:
    results = []
    trials = trial_cases(trials_each)
    for index, trial in enumerate(trials, 1):
        result = run_trial(trial)
        results.append(result)
        report(f"{index:4d}/{len(trials)} {'pass' if result.passed else 'FAIL'}  slowest {result.slowest_s:5.1f} s  "
               f"{trial.describe()}")
        if not result.passed:
            report(result.problem)
    return results


def summary(results: list[TrialResult]) -> str:
    lines = [f"trials survived: {sum(r.passed for r in results)} of {len(results)}"]
    groups: dict[tuple[str, str], list[TrialResult]] = {}
    for result in results:
        groups.setdefault((result.trial.point, result.trial.transport), []).append(result)
    for (point, transport), group in groups.items():
        slowest = max(r.slowest_s for r in group)
        lines.append(f"  {point:9s} {transport:13s} {sum(r.passed for r in group)}/{len(group)}, "
                     f"slowest exit {slowest:.1f} s")
    return "\n".join(lines)
