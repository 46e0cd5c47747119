"""What every written benchmark result says about how it was made: the commit it measured, the
command that made it, and the CPU steal and load average while it ran.

A figure quoted in a README is only worth its provenance: the same grid a few hours apart on
this shared VM moves by more than what separates it from its targets (steal from 0% to 70%,
load from 1 to 40), and a result without its commit cannot be told from the code it measured.

Example:
    >>> run = RunProvenance(["--plan", "--predict-ranks", "2"]).start()
    >>> sorted(run.record())
    ['command', 'commit', 'load_average_end', 'load_average_start', 'started', 'steal_pct']
    >>> run.record()["command"]
    'python -m benchmarks --plan --predict-ranks 2'
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.steal import StealMeter

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("command", "commit", "started", "load_average_start", "load_average_end", "steal_pct")


def git_commit(root: Path = ROOT) -> str:
    """The checked-out commit (12 hex digits), ``+`` the count of changed files when the tree has
    changes outside ``benchmarks/results/``, or ``"unknown: ..."`` where git cannot say.

    Example:
        >>> git_commit(Path("/")).startswith("unknown")
        True
    """
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=30)
        if head.returncode != 0:
            return f"unknown: git rev-parse says {(head.stderr or head.stdout).strip()[:120]!r}"
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown: {type(exc).__name__}: {exc}"
    changed = [line for line in status.stdout.splitlines() if "benchmarks/results/" not in line]
    return head.stdout.strip() + (f" + {len(changed)} uncommitted file(s)" if changed else "")


def command_line(argv: list[str] | None) -> str:
    """The command as one would type it again: ``python -m benchmarks`` and its arguments."""
    arguments = sys.argv[1:] if argv is None else argv
    return " ".join(["python -m benchmarks", *(shlex.quote(a) for a in arguments)])


class RunProvenance:
    """The provenance of one run: :meth:`start` it before the work, :meth:`record` it into each result written.

    ``steal_pct`` is the host's CPU steal over the whole run so far (:class:`~benchmarks.steal.StealMeter`;
    None where ``/proc/stat`` has no steal); load averages are the 1, 5 and 15-minute figures.
    """

    def __init__(self, argv: list[str] | None) -> None:
        self.command = command_line(argv)
        self.commit = git_commit()
        self.started = ""
        self.load_start: list[float] = []
        self._meter = StealMeter()
        self._first: tuple[int, int] | None = None

    def start(self) -> RunProvenance:
        self.started = time.strftime("%Y-%m-%d %H:%M:%S")
        self.load_start = [round(x, 2) for x in os.getloadavg()]
        self._first = self._meter.read()
        return self

    def record(self) -> dict:
        """The fields of :data:`FIELDS`, as of now."""
        now = self._meter.read()
        steal = None
        if self._first is not None and now is not None and now[1] > self._first[1]:
            steal = round(100.0 * (now[0] - self._first[0]) / (now[1] - self._first[1]), 1)
        return {"command": self.command, "commit": self.commit, "started": self.started,
                "load_average_start": self.load_start, "load_average_end": [round(x, 2) for x in os.getloadavg()],
                "steal_pct": steal}


def line(provenance: dict) -> str:
    """One markdown line of a result's provenance, for the reports that print one.

    Example:
        >>> line({"command": "python -m benchmarks --plan", "commit": "abc", "started": "2026-12-01",
        ...       "load_average_start": [1.0, 1.0, 1.0], "load_average_end": [2.0, 1.5, 1.0], "steal_pct": 3.0})
        '`python -m benchmarks --plan` on commit abc, started 2026-12-01; load average 1.0 -> 2.0; CPU steal 3.0%'
    """
    steal = "no CPU steal figure" if provenance.get("steal_pct") is None else f"CPU steal {provenance['steal_pct']}%"
    start, end = provenance.get("load_average_start") or ["?"], provenance.get("load_average_end") or ["?"]
    return (f"`{provenance.get('command')}` on commit {provenance.get('commit')}, started {provenance.get('started')}; "
            f"load average {start[0]} -> {end[0]}; {steal}")
