"""Summaries, the markdown table and the chart of a comparison run.

:func:`summarize` checks the targets (benchmarks/README.md) against the records;
:func:`render` writes ``compare.md`` and ``compare.png``; :func:`compact` keeps of a run
what those two need (the targets, each case's medians and ratios), which is what
``compare.json`` holds in git, so a finished run can be re-drawn with
``python -m benchmarks --compare --render-only``. Every step time and sample stays in
``compare.raw.json``, written by the run and not kept in git.

Example:
    >>> summarize({"meta": {}, "records": []})["targets"][0]["status"]
    'no data'
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

LIBRARIES = ("conveyor", "torch")
SUMMARY_NAME = "compare.json"
RAW_NAME = "compare.raw.json"


def _ok(record: dict, name: str) -> bool:
    return record.get(f"{name}_status") == "ok" and record.get(f"{name}_ms") is not None


def _shared(record: dict) -> bool:
    return all(_ok(record, name) for name in LIBRARIES)


def _worst(records: Iterable[dict], key: str) -> tuple[float | None, str]:
    """Largest value of ``key`` and the case it came from."""
    best: tuple[float | None, str] = (None, "")
    for r in records:
        value = r.get(key)
        if value is not None and (best[0] is None or value > best[0]):
            best = (value, _case_name(r))
    return best


def _case_name(r: dict) -> str:
    return f"{r['schedule']} P={r['ranks']} V={r['virtual']} M={r['microbatches']}"


def _highest(value: list[float] | float | None) -> float | None:
    # A raw record has one figure per rank; the compact one keeps only the highest.
    if isinstance(value, list):
        return max(value) if value else None
    return value


def _max_rss(r: dict, name: str) -> float | None:
    return _highest(r.get(f"{name}_rss_mb"))


def _max_growth(r: dict, name: str) -> float | None:
    return _highest(r.get(f"{name}_rss_growth_mb"))


def _rss_cell(r: dict, name: str) -> str:
    """Highest rank's peak RSS and, in brackets, the most any rank grew after setup began."""
    growth = _max_growth(r, name)
    peak = _fmt(_max_rss(r, name), "{:.0f}")
    return peak if growth is None else f"{peak} (+{growth:.0f})"


def _target(
    text: str,
    value: float | None,
    where: str = "",
    *,
    limit: float,
    at_least: bool = False,
    fmt: str = "{:.3f}",
) -> dict:
    """A target check: ``value <= limit`` (or ``>=`` with ``at_least``)."""
    if value is None:
        return {"target": text, "value": None, "limit": limit, "status": "no data", "where": where}
    met = value >= limit if at_least else value <= limit
    return {
        "target": text,
        "value": value,
        "limit": limit,
        "status": "pass" if met else "FAIL",
        "where": where,
        "shown": fmt.format(value),
    }


def _overhead_medians(overhead: list[dict]) -> dict[str, float | None]:
    """Per library: the median framework time per microbatch per stage over the P=2 cases."""
    medians = {}
    for name in LIBRARIES:
        values = [
            r[f"{name}_overhead_ms"]
            for r in overhead
            if r["ranks"] == 2 and r.get(f"{name}_overhead_ms") is not None
        ]
        medians[name] = statistics.median(values) if values else None
    return medians


def _worst_rss(records: list[dict]) -> tuple[tuple, tuple]:
    """The worst conveyor / torch ratio of peak RSS, and of RSS growth, over shared cases."""
    rss_ratios = [
        (_max_rss(r, "conveyor") / _max_rss(r, "torch"), _case_name(r))
        for r in records
        if _shared(r) and _max_rss(r, "conveyor") and _max_rss(r, "torch")
    ]
    worst_rss = max(rss_ratios, default=(None, ""))
    # Peak RSS counts what a rank had when forked from its library's zygote (torch and
    # that library's imports: torch.distributed.pipelining adds ~70 MiB, conveyor's
    # runtime ~4); growth after setup began counts what building and stepping added.
    growth_ratios = [
        (_max_growth(r, "conveyor") / _max_growth(r, "torch"), _case_name(r))
        for r in records
        if _shared(r) and _max_growth(r, "conveyor") is not None and _max_growth(r, "torch")
    ]
    return worst_rss, max(growth_ratios, default=(None, ""))


def summarize(results: dict) -> dict:
    """Headline figures and the target checks of one run."""
    records = results["records"]
    emulated = [r for r in records if r["workload"] == "emulated"]
    overhead = [r for r in records if r["workload"] == "overhead"]
    gpt = [r for r in records if r["workload"] == "gpt"]
    summary: dict = {
        "gloo_one_way_ms": results["meta"].get("gloo_one_way_ms"),
        "gloo_one_way_blocking_ms": results["meta"].get("gloo_one_way_blocking_ms"),
    }

    worst_ideal = _worst((r for r in emulated if _ok(r, "conveyor")), "conveyor_vs_ideal")
    # Not a target: the same check against the ideal of the fastest costs measured up front.
    worst_fastest = _worst((r for r in emulated if _ok(r, "conveyor")), "conveyor_vs_ideal_fastest")
    summary["emulated_worst_conveyor_vs_ideal_fastest"] = {
        "value": worst_fastest[0],
        "case": worst_fastest[1],
    }
    shared = [r for r in emulated if _shared(r)]
    worst_vs_torch = _worst(shared, "conveyor_vs_torch")
    worst_multi = _worst((r for r in shared if r["virtual"] > 1), "conveyor_vs_torch")

    per_lib_overhead = _overhead_medians(overhead)
    summary["overhead_ms_per_microbatch_p2"] = per_lib_overhead
    overhead_ratio = None
    if per_lib_overhead["conveyor"] is not None and per_lib_overhead["torch"]:
        overhead_ratio = per_lib_overhead["conveyor"] / per_lib_overhead["torch"]

    speedups: dict = {}
    for name in (*LIBRARIES, "ideal"):
        key = f"{name}_speedup"
        best = max((r for r in gpt if r.get(key) is not None), key=lambda r: r[key], default=None)
        speedups[name] = None if best is None else {"speedup": best[key], "case": _case_name(best)}
    summary["gpt_best_speedup_vs_one_process"] = speedups

    worst_rss, worst_growth = _worst_rss(records)

    conveyor_speedup = speedups["conveyor"]
    summary["targets"] = [
        _target("emulated: conveyor / ideal, every schedule", *worst_ideal, limit=1.03),
        _target("emulated: conveyor / torch, every shared schedule", *worst_vs_torch, limit=1.00),
        _target(
            "emulated: conveyor / torch, multi-stage (V=2) shared schedules",
            *worst_multi,
            limit=0.95,
        ),
        _target(
            "overhead: conveyor ms per microbatch per stage (P=2, median)",
            per_lib_overhead["conveyor"],
            limit=0.5,
        ),
        _target(
            "overhead: conveyor / torch framework time (P=2, median)", overhead_ratio, limit=0.2
        ),
        _target(
            "real compute P=2: best conveyor schedule vs one process (speedup, at least)",
            None if conveyor_speedup is None else conveyor_speedup["speedup"],
            "" if conveyor_speedup is None else conveyor_speedup["case"],
            limit=1.85,
            at_least=True,
            fmt="{:.2f}x",
        ),
        _target(
            "peak RSS per rank: conveyor / torch (max over shared cases)", *worst_rss, limit=1.00
        ),
        _target(
            "peak RSS growth after setup per rank: conveyor / torch (max over shared cases)",
            *worst_growth,
            limit=1.00,
        ),
    ]
    return summary


# ---------------------------------------------------------------------------
# markdown
# ---------------------------------------------------------------------------


def _fmt(value: float | None, spec: str = "{:.1f}") -> str:
    return "-" if value is None else spec.format(value)


def _notes(r: dict) -> str:
    notes = []
    for name in LIBRARIES:
        status = r.get(f"{name}_status", "")
        # "unavailable" (conveyor's runtime missing) is said once above the tables.
        if status and status != "ok" and not status.startswith("unavailable"):
            notes.append(f"{name} {status[:120]}")
    notes += r.get("notes", [])
    if r.get("ideal_ms") is None:
        # Usually the same reason conveyor refused; the json keeps the full text.
        notes.append("no ideal")
    return "; ".join(notes).replace("|", "/")


# Above this share of stolen CPU time a run's timings say more about the host than the code.
STEAL_WARNING_PCT = 10.0

_COLUMNS: list[tuple[str, Callable[[dict], str]]] = [
    ("schedule", lambda r: r["schedule"]),
    ("V", lambda r: str(r["virtual"])),
    ("P", lambda r: str(r["ranks"])),
    ("M", lambda r: str(r["microbatches"])),
    ("ideal ms", lambda r: _fmt(r.get("ideal_ms"))),
    ("fastest-cost ideal ms", lambda r: _fmt(r.get("ideal_fastest_ms"))),
    ("conveyor ms", lambda r: _fmt(r.get("conveyor_ms"))),
    ("torch ms", lambda r: _fmt(r.get("torch_ms"))),
    ("conveyor / ideal", lambda r: _fmt(r.get("conveyor_vs_ideal"), "{:.3f}")),
    ("torch / ideal", lambda r: _fmt(r.get("torch_vs_ideal"), "{:.3f}")),
    ("conveyor / torch", lambda r: _fmt(r.get("conveyor_vs_torch"), "{:.3f}")),
    (
        "peak RSS MiB (growth) conveyor / torch",
        lambda r: f"{_rss_cell(r, 'conveyor')} / {_rss_cell(r, 'torch')}",
    ),
    ("CPU steal % conveyor / torch / ideal (/ one process)", lambda r: _steal_cell(r)),
]


def _steal_cell(r: dict) -> str:
    steal = r.get("steal_pct") or {}
    sides = ["conveyor", "torch", "ideal", *(["single_process"] if "single_process" in steal else [])]
    return " / ".join(_fmt(steal.get(side), "{:.0f}") for side in sides)


def _table(records: list[dict], extra: list[tuple[str, Callable[[dict], str]]] = ()) -> list[str]:
    columns = [*_COLUMNS, *extra, ("notes", _notes)]
    lines = ["| " + " | ".join(c for c, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in records:
        lines.append("| " + " | ".join(fn(r) for _, fn in columns) + " |")
    return lines


def _preamble(meta: dict) -> list[str]:
    """The run's title, machine, load and steal, with warnings where they make timings noisy."""
    load_start, load_end = meta.get("load_average_start"), meta.get("load_average_end")
    lines = [
        "# conveyor vs torch.distributed.pipelining",
        "",
        f"`{meta.get('command', '')}` on commit {meta.get('commit', 'not recorded')}, started "
        f"{meta.get('started', '?')}, torch {meta.get('torch', '?')}, "
        f"{meta.get('cpus', '?')} CPUs, {_fmt(meta.get('elapsed_s'), '{:.0f}')} s. "
        f"Load average at start {_fmt(load_start and load_start[0], '{:.2f}')}, "
        f"at end {_fmt(load_end and load_end[0], '{:.2f}')}.",
        "",
    ]
    if meta.get("steal_pct") is not None:
        lines += [
            f"CPU steal while the cases ran: {meta['steal_pct']:.0f}% of the CPU time this VM wanted went "
            "to other guests of the host (`/proc/stat`); each table's steal column gives it per side "
            "(conveyor's timed steps / torch's / the ideal's samples, and the one-process run for the "
            "GPT). Steps that keep every CPU busy lose more than one process does.",
            "",
        ]
    cpus = meta.get("cpus") or 1
    if max((load_start or [0])[0], (load_end or [0])[0]) > 0.5 * cpus:
        lines += ["**The machine was busy during this run: timings are noisy.**", ""]
    if (meta.get("steal_pct") or 0) > STEAL_WARNING_PCT:
        lines += [
            f"**The host took {meta['steal_pct']:.0f}% of the CPU time this VM wanted: timings are noisy, "
            "and a side that keeps more CPUs busy pays more of it.**",
            "",
        ]
    if meta.get("conveyor_missing"):
        lines += [
            f"conveyor's runtime was not available ({meta['conveyor_missing']}): torch side only.",
            "",
        ]
    return lines


def markdown(results: dict, summary: dict) -> str:
    """``compare.md``: the run, the targets, the headline figures, one table per workload."""
    meta = results["meta"]
    records = results["records"]
    lines = _preamble(meta)
    settings = meta.get("settings", {})
    lines += [
        f"Step time: median of {settings.get('repeats', '?')} steps after {settings.get('warmup', '?')} warm-up "
        "steps, the two libraries alternating step by step; the slowest rank's wall time of a step started "
        "after a barrier. Ideal (`ideal ms`, what the ratios use): conveyor's simulator on per-stage "
        "F / I / W costs measured in one single-thread process, sampled in the same rotation as the "
        "steps (each sample times every stage's passes once) and reported as the same statistic, the "
        "median of the samples' makespans. On a machine with CPU steal, late sleep wake-ups and "
        "compute that varies run to run, the step times pay that noise; an ideal built from the "
        "fastest of several runs, measured at another moment, leaves that noise out and so counts "
        "it against the libraries. `fastest-cost ideal ms` is that older figure "
        "(fastest of >= 5 runs per pass, measured once before the cases), kept for reference.",
        "",
        "## Targets",
        "",
        "| target | value | limit | status | worst case |",
        "|---|---|---|---|---|",
    ]
    for t in summary["targets"]:
        lines.append(
            f"| {t['target']} | {t.get('shown', '-')} | {t['limit']:g} | {t['status']} | {t['where']} |"
        )
    overhead = summary["overhead_ms_per_microbatch_p2"]
    gloo = summary.get("gloo_one_way_ms")
    fastest = summary.get("emulated_worst_conveyor_vs_ideal_fastest") or {}
    lines += [
        "",
        f"Against the fastest-cost ideal instead, the worst emulated conveyor / ideal is "
        f"{_fmt(fastest.get('value'), '{:.3f}')} ({fastest.get('case') or '-'}).",
        "",
        f"Overhead (P=2, median over schedules, ms per microbatch per stage): "
        f"conveyor {_fmt(overhead['conveyor'], '{:.3f}')}, "
        f"torch {_fmt(overhead['torch'], '{:.3f}')}; raw gloo one-way message {_fmt(gloo, '{:.3f}')} ms "
        f"(isend/irecv + wait; blocking send/recv: {_fmt(summary.get('gloo_one_way_blocking_ms'), '{:.3f}')} ms).",
    ]
    speedups = summary["gpt_best_speedup_vs_one_process"]
    parts = []
    for name in (*LIBRARIES, "ideal"):
        s = speedups.get(name)
        parts.append(f"{name} {s['speedup']:.2f}x ({s['case']})" if s else f"{name} -")
    lines += [
        "",
        "Real compute (GPT, P=2), best schedule vs one single-thread process: "
        + ", ".join(parts)
        + ".",
        "",
    ]

    by_workload: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_workload[r["workload"]].append(r)
    titles = {
        "emulated": f"## Emulated device time ({meta.get('sleep_ms', '?')} ms sleep per pass per block)",
        "overhead": "## Overhead (tiny stages)",
        "gpt": "## Real compute (small GPT)",
    }
    extras = {
        "overhead": [
            ("conveyor overhead ms", lambda r: _fmt(r.get("conveyor_overhead_ms"), "{:.3f}")),
            ("torch overhead ms", lambda r: _fmt(r.get("torch_overhead_ms"), "{:.3f}")),
        ],
        "gpt": [
            ("one process ms", lambda r: _fmt(r.get("single_process_ms"))),
            ("conveyor speedup", lambda r: _fmt(r.get("conveyor_speedup"), "{:.2f}")),
            ("torch speedup", lambda r: _fmt(r.get("torch_speedup"), "{:.2f}")),
            ("ideal speedup", lambda r: _fmt(r.get("ideal_speedup"), "{:.2f}")),
        ],
    }
    for workload, rows in by_workload.items():
        lines += [titles.get(workload, f"## {workload}"), ""]
        lines += _table(rows, extras.get(workload, []))
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# chart
# ---------------------------------------------------------------------------


def chart(results: dict, path: Path) -> None:
    """Ratio to ideal per schedule, both libraries: one panel per (workload, P)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in results["records"]:
        if r["workload"] != "overhead" and r.get("ideal_ms"):
            panels[(r["workload"], r["ranks"])].append(r)
    if not panels:
        panels[("no data", 0)] = []
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 3.8 * rows), squeeze=False)
    colors = {"conveyor": "tab:blue", "torch": "tab:orange"}
    for ax, ((workload, ranks), recs) in zip(axes.flat, sorted(panels.items())):
        variants = sorted(
            {(r["schedule"], r["virtual"]) for r in recs}, key=lambda v: _order(v, recs)
        )
        for offset, name in ((-0.2, "conveyor"), (0.2, "torch")):
            xs, mids, lows, highs = [], [], [], []
            for i, (schedule, virtual) in enumerate(variants):
                values = [
                    r[f"{name}_vs_ideal"]
                    for r in recs
                    if (r["schedule"], r["virtual"]) == (schedule, virtual)
                    and r.get(f"{name}_vs_ideal")
                ]
                if values:
                    mid = statistics.median(values)
                    xs.append(i + offset)
                    mids.append(mid)
                    lows.append(mid - min(values))
                    highs.append(max(values) - mid)
            if xs:
                ax.bar(
                    xs,
                    mids,
                    width=0.4,
                    color=colors[name],
                    label=name,
                    yerr=[lows, highs],
                    capsize=2,
                )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(1.03, color="gray", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(variants)))
        ax.set_xticklabels([f"{s}\nV={v}" for s, v in variants], rotation=60, fontsize=7)
        ax.set_ylabel("step time / ideal")
        low = min(
            [0.95] + [r[f"{n}_vs_ideal"] for r in recs for n in LIBRARIES if r.get(f"{n}_vs_ideal")]
        )
        ax.set_ylim(bottom=max(0.0, low - 0.05))
        ax.set_title(f"{workload}, P={ranks} (median over M, bars min-max)", fontsize=9)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _order(variant: tuple[str, int], records: list[dict]) -> int:
    for i, r in enumerate(records):
        if (r["schedule"], r["virtual"]) == variant:
            return i
    return len(records)


def render(results: dict, out: Path) -> dict:
    """Write ``compare.md`` and ``compare.png`` into ``out``; the summary (also stored in ``results``)."""
    summary = summarize(results)
    results["summary"] = summary
    (out / "compare.md").write_text(markdown(results, summary))
    chart(results, out / "compare.png")
    return summary


# ---------------------------------------------------------------------------
# the summary kept in git
# ---------------------------------------------------------------------------

# What a compact record keeps: what the markdown, the chart and the targets read.
_KEPT = (
    "workload", "schedule", "ranks", "virtual", "stages", "microbatches", "torch_class",
    "ideal_ms", "ideal_fastest_ms", "ideal_speedup", "single_process_ms", "single_process_status",
    *(f"{name}_{field}" for name in LIBRARIES for field in (
        "ms", "status", "vs_ideal", "vs_ideal_fastest", "overhead_ms", "speedup",
        "rss_mb", "rss_growth_mb",
    )),
    "conveyor_vs_torch", "steal_pct", "notes",
)


def _rounded(value: object) -> object:
    # Six decimals: far below what the markdown shows (three at most), so it renders the same.
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_rounded(item) for item in value]
    return value


def compact(results: dict) -> dict:
    """``results`` without the per-step and per-sample figures: what ``compare.json`` keeps.

    Per case: the medians, ratios and statuses, the highest rank's peak RSS and growth,
    the steal per side. :func:`render` draws the same markdown and chart from it as from
    the full results.

    Example:
        >>> record = {"workload": "emulated", "conveyor_ms": 1.23456789, "conveyor_steps_ms": [1.2],
        ...           "conveyor_rss_mb": [180.0, 183.5]}
        >>> compact({"meta": {}, "records": [record]})["records"]
        [{'workload': 'emulated', 'conveyor_ms': 1.234568, 'conveyor_rss_mb': 183.5}]
    """
    records = []
    for record in results["records"]:
        kept = {key: record[key] for key in _KEPT if key in record}
        for name in LIBRARIES:
            for field in ("rss_mb", "rss_growth_mb"):
                if f"{name}_{field}" in kept:
                    kept[f"{name}_{field}"] = _highest(kept[f"{name}_{field}"])
        records.append(_rounded(kept))
    summary = results.get("summary") or summarize(results)
    return {"meta": _rounded(results["meta"]), "summary": _rounded(summary), "records": records}


def write_summary(results: dict, path: Path) -> None:
    """Write :func:`compact` of ``results`` to ``path``: one line per case, so diffs read."""
    small = compact(results)
    lines = ["{", f' "meta": {json.dumps(small["meta"])},', f' "summary": {json.dumps(small["summary"], indent=1)},']
    lines.append(' "records": [')
    rows = [f"  {json.dumps(record)}" for record in small["records"]]
    lines.append(",\n".join(rows))
    lines += [" ]", "}"]
    path.write_text("\n".join(lines) + "\n")
