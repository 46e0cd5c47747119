"""conveyor vs torch.distributed.pipelining, side by side on identical work (``--compare``).

Run through the one benchmark command (see benchmarks/README.md)::

    .venv/bin/python -m benchmarks --compare            # full grid, ~25-35 min on a quiet 2-core machine
    .venv/bin/python -m benchmarks --compare --quick    # a small subset, ~3 min: checks the harness

Each case is measured by :func:`benchmarks.cases.run_case`. The whole run's records go,
after every case, to ``compare.raw.json`` (not kept in git: every step time and sample),
so an interrupted run keeps what it measured; at the end ``compare.json`` (the summary:
targets and per-case medians, see :func:`benchmarks.report.compact`), ``compare.md`` and
``compare.png`` are written next to it.

Example:
    >>> _variants("1f1b,zbv:2")
    [('1f1b', 1), ('zbv', 2)]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks import libraries as lib
from benchmarks.cases import GROUP_ERRORS, CostCache, Settings, last_line, run_case
from benchmarks.provenance import command_line, git_commit
from benchmarks.report import RAW_NAME, SUMMARY_NAME, render, write_summary
from benchmarks.steal import StealMeter
from conveyor.processes import RankGroup, Zygote
from conveyor.testing.models import WORKLOADS

# What --quick sets: a small grid, 1 warm-up and 3 timed rounds (~3 min).
QUICK = dict(
    ranks="2,4", microbatches="8", overhead_ranks="2", overhead_microbatches="32",
    gpt_microbatches="8", repeats=3, warmup=1,
)


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _variants(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        name, _, virtual = item.strip().partition(":")
        out.append((name, int(virtual or 1)))
    return out


def _options(items: list[str]) -> dict:
    """``["fixed_shapes=True", "timeout_s=60"]`` -> ``{"fixed_shapes": True, "timeout_s": 60}``."""
    import ast

    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--conveyor-option expects KEY=VALUE, got {item!r}")
        try:
            options[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            options[key.strip()] = value.strip()
    return options


def build_cases(args: argparse.Namespace) -> list[lib.Case]:
    """The grid, emulated first (it carries the headline targets)."""
    variants = _variants(args.schedules)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; choose from {sorted(WORKLOADS)}")
    grids = {
        "emulated": (args.ranks, args.microbatches),
        "overhead": (args.overhead_ranks, args.overhead_microbatches),
        "gpt": ("2", args.gpt_microbatches),  # real compute: two ranks on the two cores
    }
    sleep = dict(forward_ms=args.sleep_ms, input_grad_ms=args.sleep_ms, weight_grad_ms=args.sleep_ms)
    cases = []
    for name in ("emulated", "overhead", "gpt"):
        if name not in workloads:
            continue
        ranks, microbatches = grids[name]
        for num_ranks in _ints(ranks):
            extra = sleep if name == "emulated" else {}
            workload = WORKLOADS[name](num_ranks=num_ranks, **extra)
            for m in _ints(microbatches):
                cases += [lib.Case(workload, schedule, v, m) for schedule, v in variants]
    return cases


def measure_gloo_one_way_ms(shape: tuple[int, ...], rounds: int = 5) -> tuple[float, float]:
    """``(isend/irecv, blocking send/recv)`` one-way ms: the lowest median of ``rounds`` each.

    Rounds alternate the two kinds. On a busy machine a round's median jumps to about
    one scheduler tick (~2 ms): a woken rank waits for a core.
    """
    times: dict[bool, list[float]] = {False: [], True: []}
    with RankGroup(2) as group:
        for _ in range(rounds):
            for blocking in (False, True):
                times[blocking].append(group.call(lib.gloo_one_way_ms, shape, blocking)[0])
    return min(times[False]), min(times[True])


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """The comparison ``args`` (parsed by benchmarks/__main__.py) ask for; the exit status."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.render_only:
        summary_path = out / SUMMARY_NAME
        render(json.loads(summary_path.read_text()), out)
        print(f"rendered {out / 'compare.md'} and {out / 'compare.png'} from {summary_path}")
        return 0
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    settings = Settings(
        repeats=args.repeats,
        warmup=args.warmup,
        cost_repeats=max(5, args.repeats),
        step_timeout_s=args.step_timeout_s,
        libraries=tuple(n.strip() for n in args.libraries.split(",") if n.strip()),
        conveyor_options=_options(args.conveyor_option),
    )
    # Before this process imports conveyor's runtime: each library's ranks fork from a
    # process that imported that library alone, so peak RSS per rank is the library's own.
    zygotes: dict[str, Zygote] = {}
    zygote_failures: dict[str, str] = {}
    for name in settings.libraries:
        if name not in lib.LIBRARY_MODULES:
            raise SystemExit(f"--libraries: unknown {name!r}; choose from {sorted(lib.LIBRARY_MODULES)}")
        try:
            zygotes[name] = Zygote(lib.LIBRARY_MODULES[name])
        except GROUP_ERRORS as error:
            # Its ranks fork from this process instead; for conveyor, _run also says it is
            # missing and runs torch alone.
            zygote_failures[name] = str(error)
            print(f"{name}: {last_line(error)}", file=sys.stderr)
    try:
        return _run(args, argv, out, settings, zygotes, zygote_failures)
    finally:
        for zygote in zygotes.values():
            zygote.close()


def _meta(args: argparse.Namespace, argv: list[str] | None, settings: Settings) -> dict:
    return {
        "command": command_line(argv),
        "commit": git_commit(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_start": os.getloadavg(),
        "settings": asdict(settings),
        "sleep_ms": args.sleep_ms,
    }


def _run(
    args: argparse.Namespace,
    argv: list[str] | None,
    out: Path,
    settings: Settings,
    zygotes: dict[str, Zygote],
    zygote_failures: dict[str, str],
) -> int:
    conveyor_missing = lib.conveyor_runtime_missing() if "conveyor" in settings.libraries else None
    if conveyor_missing:
        print(f"conveyor runtime not available ({conveyor_missing}): running the torch side alone")
    cases = build_cases(args)
    meta = _meta(args, argv, settings)
    meta.update(conveyor_missing=conveyor_missing, zygote_failures=zygote_failures)
    results: dict = {"meta": meta, "records": []}
    overhead = WORKLOADS["overhead"](num_ranks=2)
    shape = (overhead.rows_per_microbatch, overhead.width)
    meta["gloo_one_way_ms"], meta["gloo_one_way_blocking_ms"] = measure_gloo_one_way_ms(shape)
    print(
        f"gloo one-way message {shape}: isend/irecv {meta['gloo_one_way_ms']:.3f} ms, "
        f"blocking send/recv {meta['gloo_one_way_blocking_ms']:.3f} ms"
    )
    raw_path = out / RAW_NAME
    costs = CostCache(settings.cost_repeats)
    started = time.monotonic()
    run_steal = StealMeter()
    for index, case in enumerate(cases, 1):
        with run_steal.window("run"):
            record = run_case(case, settings, costs, conveyor_missing, zygotes)
        results["records"].append(record)
        meta["elapsed_s"] = time.monotonic() - started
        meta["load_average_end"] = os.getloadavg()
        meta["steal_pct"] = run_steal.percent().get("run")
        raw_path.write_text(json.dumps(results, indent=1))
        print(_progress_line(index, len(cases), case, record), flush=True)
    summary = render(results, out)
    raw_path.write_text(json.dumps(results, indent=1))  # now with the summary
    write_summary(results, out / SUMMARY_NAME)
    _print_summary(summary, meta)
    print(
        f"wrote {out / SUMMARY_NAME}, {out / 'compare.md'}, {out / 'compare.png'} "
        f"(every step: {raw_path}) in {time.monotonic() - started:.0f} s"
    )
    return 0


def _print_summary(summary: dict, meta: dict) -> None:
    steal = meta.get("steal_pct")
    print(f"host CPU steal over the cases: {'n/a' if steal is None else f'{steal:.0f}%'}")
    for target in summary["targets"]:
        where = f" ({target['where']})" if target["where"] else ""
        print(f"{target['status']:>7}  {target['target']}: {target.get('shown', '-')} "
              f"(limit {target['limit']:g}){where}")


def _progress_line(index: int, total: int, case: lib.Case, record: dict) -> str:
    def ms(value: float | None) -> str:
        return "   -   " if value is None else f"{value:7.1f}"

    parts = [
        f"[{index}/{total}] {case.label():48s}",
        f"ideal {ms(record['ideal_ms'])} (fastest {ms(record['ideal_fastest_ms']).strip()})",
    ]
    for name in lib.LIBRARIES:
        if record.get(f"{name}_status") == "not run":
            continue
        value = record.get(f"{name}_ms")
        note = (
            ""
            if record.get(f"{name}_status") == "ok"
            else f" ({record.get(f'{name}_status', '')[:60]})"
        )
        parts.append(f"{name} {ms(value)}{note}")
    return "  ".join(parts)
