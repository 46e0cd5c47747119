"""Time the schedule layer on a big schedule: build, verify, passes, simulate (best of 3).

"passes" is :func:`conveyor.schedule.executable` (lower, merge I+W, the forward-only
programs): what every rank runs, which is what is simulated.

The target: a 64-rank, 2-stages-per-rank, 1024-microbatch interleaved 1F1B schedule
goes from name to simulated Timeline in under 2 s, so `conveyor simulate` and
the checks before a run never make a user wait.

Run through the one benchmark command:
    .venv/bin/python -m benchmarks --schedule [--schedule-name NAME] [--schedule-ranks 64] [--schedule-virtual 2]
        [--schedule-microbatches 1024] [--schedule-repeat 3]

Example:
    >>> pick_schedule("1f1b", 2)
    ('1f1b', 1, [])
"""

from __future__ import annotations

import argparse
import time

import conveyor.schedule as cs

TARGET_S = 2.0
PHASES = ("build", "verify", "passes", "simulate")
# The schedule the target is stated for, then stand-ins while it is not registered yet.
PREFERRED = ("interleaved-1f1b", "looped-bfs", "1f1b")


def pick_schedule(asked: str | None, virtual: int) -> tuple[str, int, list[str]]:
    """The schedule to time, the V it takes, and notes on any fallback taken."""
    available = cs.available()
    if asked is not None:
        if asked not in available:
            raise SystemExit(f"unknown schedule {asked!r}; known: {', '.join(available)}")
        return asked, _fit_virtual(available[asked], virtual), []
    notes = []
    for name in PREFERRED:
        if name in available:
            chosen_virtual = _fit_virtual(available[name], virtual)
            if chosen_virtual != virtual:
                notes.append(f"{name} runs V={chosen_virtual}, not V={virtual}")
            return name, chosen_virtual, notes
        notes.append(f"{name} is not registered yet")
    raise SystemExit("none of " + ", ".join(PREFERRED) + " is registered")


def _fit_virtual(info, virtual: int) -> int:
    if info.virtual_choices is None or virtual in info.virtual_choices:
        return virtual
    return info.default_virtual


def time_once(name: str, ranks: int, virtual: int, microbatches: int) -> dict[str, float]:
    times: dict[str, float] = {}
    start = time.perf_counter()
    schedule = cs.build(name, ranks=ranks, microbatches=microbatches, virtual=virtual, check=False)
    times["build"] = time.perf_counter() - start
    start = time.perf_counter()
    cs.verify(schedule)
    times["verify"] = time.perf_counter() - start
    start = time.perf_counter()
    runs = cs.executable(schedule)  # verification remembered
    runs.compute, runs.train  # noqa: B018 - merging I+W, then lowering: what every rank's runtime builds
    times["passes"] = time.perf_counter() - start
    start = time.perf_counter()
    timeline = cs.simulate(runs.compute)  # the programs the runtime executes, timed without their comms
    times["simulate"] = time.perf_counter() - start
    start = time.perf_counter()
    timeline.bubble_ratio, timeline.peak_activations()  # noqa: B018 - timed for its cost
    times["summary"] = time.perf_counter() - start
    return times


def run(args: argparse.Namespace) -> int:
    """Time the schedule ``args`` name (``schedule_name``, ``schedule_ranks``, ...) and print each phase's best."""
    return _report(
        args.schedule_name, args.schedule_ranks, args.schedule_virtual, args.schedule_microbatches, args.schedule_repeat
    )


def _report(asked: str | None, ranks: int, virtual: int, microbatches: int, repeat: int) -> int:
    name, virtual, notes = pick_schedule(asked, virtual)
    for note in notes:
        print(f"note: {note}")

    best: dict[str, float] = {}
    for _ in range(repeat):
        for phase, seconds in time_once(name, ranks, virtual, microbatches).items():
            best[phase] = min(seconds, best.get(phase, float("inf")))

    schedule = cs.build(name, ranks=ranks, microbatches=microbatches, virtual=virtual, check=False)
    num_actions = sum(len(program) for program in schedule.programs)
    print(
        f"{name}: P={ranks} V={virtual} M={microbatches}, {num_actions} compute actions; "
        f"best of {repeat}"
    )
    for phase in PHASES:
        if phase in best:
            print(f"  {phase:<9}{best[phase]:8.3f} s")
        else:
            print(f"  {phase:<9}       - (skipped)")
    total = sum(best[p] for p in PHASES if p in best)
    verdict = "within" if total <= TARGET_S else "OVER"
    print(f"  {'total':<9}{total:8.3f} s  ({total / TARGET_S:.2f}x the {TARGET_S:g} s target: {verdict})")
    print("  (the passes and simulate() reuse that verification: an immutable schedule remembers it passed)")
    print(f"  summary  {best['summary']:8.3f} s  (bubble ratio + peak activations, not in total)")
    return 0

