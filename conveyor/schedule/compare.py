"""Simulate registered schedules on uniform costs and put the figures into words and tables.

What ``conveyor schedules`` and ``conveyor simulate`` print, as plain functions: the
command line only parses arguments, calls these and writes their text. Pure Python (no
torch), like the rest of the schedule layer.

Example:
    >>> rows = run_compare(4, 8, png=None)
    >>> print(format_compare_table(rows[:2]))
    schedule  V  makespan  bubble  peak act.  = x model/P
    gpipe     1        33   27.3%          8            8
    1f1b      1        33   27.3%          4            4
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from operator import sub
from pathlib import Path

from conveyor.errors import ConveyorError, CostError
from conveyor.schedule.cost import CostModel
from conveyor.schedule.passes import merge_backward_halves
from conveyor.schedule.registry import ScheduleInfo, available, build
from conveyor.schedule.simulate import simulate
from conveyor.schedule.timeline import PackedSpans, Timeline

# (forward, input-gradient, weight-gradient) time per stage and microbatch.
Costs = tuple[float, float, float]
DEFAULT_COSTS: Costs = (1.0, 1.0, 1.0)
DEFAULT_COMPARE_PNG = "out/compare.png"
# The figures of a row of run_compare (None where the schedule cannot serve the sizes), in order.
_FIGURES = ("makespan", "bubble_ratio", "peak_activations", "peak_activations_max", "peak_activation_share")


def virtual_description(info: ScheduleInfo) -> str:
    """The stages per rank a registered schedule takes, e.g. ``"V=1"`` or ``"V>=1 (default 2)"``.

    Example:
        >>> virtual_description(available()["1f1b"])
        'V=1'
    """
    if info.virtual_choices is None:
        return f"V>=1 (default {info.default_virtual})"
    if len(info.virtual_choices) == 1:
        return f"V={info.virtual_choices[0]}"
    choices = ",".join(map(str, info.virtual_choices))
    return f"V in {choices} (default {info.default_virtual})"


def format_schedule_list(infos: Iterable[ScheduleInfo]) -> str:
    """One aligned line per schedule: name, the V it takes, what it does.

    Example:
        >>> format_schedule_list([available()["1f1b"]]).split()[:2]
        ['1f1b', 'V=1']
    """
    infos = list(infos)
    name_width = max(len(info.name) for info in infos)
    v_width = max(len(virtual_description(info)) for info in infos)
    return "\n".join(
        f"{info.name:<{name_width}}  {virtual_description(info):<{v_width}}  {info.description}".rstrip()
        for info in infos
    )


def check_finite(what: str, values: Iterable[float]) -> None:
    """Refuse figures that overflowed to infinity (huge costs or latency), naming ``what``.

    Example:
        >>> check_finite("a makespan", [1.0, float("inf")])  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        conveyor.errors.CostError: a makespan overflows a float with these costs and latency (a sum reached inf);
        give smaller numbers
    """
    if not all(math.isfinite(v) for v in values):
        raise CostError(
            f"{what} overflows a float with these costs and latency (a sum reached inf); give smaller numbers"
        )


def simulate_one(
    schedule: str,
    ranks: int,
    microbatches: int,
    virtual: int | None = None,
    costs: Costs = DEFAULT_COSTS,
    latency: float = 0.0,
) -> Timeline:
    """Build, verify and simulate one registered schedule on uniform per-stage costs.

    A schedule searched for costs (``uses_costs``: ZB-1p, ZB-2p) is built for these.

    What is timed is what the ranks run (:func:`conveyor.schedule.passes.executable`): an I
    directly followed by its own W is one B there (:func:`~conveyor.schedule.passes.merge_backward_halves`).

    Example:
        >>> round(simulate_one("1f1b", 4, 8).bubble_ratio, 3)
        0.273
    """
    forward, backward_input, backward_weight = costs
    info = available().get(schedule) if isinstance(schedule, str) else None
    search_costs = None
    if info is not None and info.uses_costs:  # ZB-1p, ZB-2p: searched for these very costs
        search_costs = CostModel.uniform(
            ranks * (virtual or info.default_virtual), forward, backward_input, backward_weight, latency=latency
        )
    # simulate() checks and times the merged programs in one pass; build(check=True) would check twice.
    built = build(schedule, ranks=ranks, microbatches=microbatches, virtual=virtual, check=False, costs=search_costs)
    model = CostModel.uniform(
        built.num_stages, forward, backward_input, backward_weight, latency=latency
    )
    return simulate(merge_backward_halves(built), model)  # times exactly like the lowered programs


def _compare_row(
    name: str, info: ScheduleInfo, ranks: int, microbatches: int, virtual: int | None,
    costs: Costs, latency: float, same_model: bool,
) -> tuple[dict, Timeline | None]:
    accepts = virtual is not None and (info.virtual_choices is None or virtual in info.virtual_choices)
    chosen = virtual if accepts else info.default_virtual
    divisor = chosen if same_model else 1
    stage_costs = (costs[0] / divisor, costs[1] / divisor, costs[2] / divisor)
    row: dict = {"schedule": name, "virtual": chosen, "stage_costs": list(stage_costs)}
    try:
        timeline = simulate_one(name, ranks, microbatches, chosen, stage_costs, latency)
    except ConveyorError as error:
        # No figures; the rule is the first line (deadlock reports add rank-by-rank detail below it).
        row.update(dict.fromkeys(_FIGURES), error=str(error).splitlines()[0])
        return row, None
    peaks = timeline.peak_activations()
    row.update(
        makespan=timeline.makespan,
        bubble_ratio=timeline.bubble_ratio,
        peak_activations=peaks,
        peak_activations_max=max(peaks),
        peak_activation_share=max(peaks) / divisor,
        error=None,
    )
    return row, timeline


def run_compare(
    ranks: int,
    microbatches: int,
    virtual: int | None = None,
    costs: Costs | None = None,
    png: str | Path | None = DEFAULT_COMPARE_PNG,
    *,
    latency: float = 0.0,
    trace: str | Path | None = None,
    same_model: bool = True,
) -> list[dict]:
    """Simulate every registered schedule for the same sizes; one row per schedule.

    Each schedule runs its default V, or ``virtual`` where it accepts that value.
    With ``same_model`` (the default) every schedule simulates the same model:
    ``costs`` are those of 1/P of it, so a schedule with V stages per rank runs
    each stage at ``costs / V`` and makespans compare directly;
    ``peak_activation_share`` is the peak divided by V, in units of one
    (1/P-model, microbatch) activation. A schedule that cannot serve the sizes
    gets a row whose ``error`` holds the rule it breaks instead of figures. All
    simulated ones are drawn into ``png`` on one time axis (``None`` draws
    nothing) and, if given, into one Chrome trace.

    Example:
        >>> rows = run_compare(4, 8, png=None)
        >>> [(r["schedule"], r["makespan"], r["peak_activations_max"]) for r in rows][:2]
        [('gpipe', 33.0, 8), ('1f1b', 33.0, 4)]
    """
    costs = DEFAULT_COSTS if costs is None else costs
    rows, timelines = [], []
    for name, info in available().items():
        row, timeline = _compare_row(
            name, info, ranks, microbatches, virtual, costs, latency, same_model
        )
        rows.append(row)
        if timeline is not None:
            timelines.append(timeline)
    check_finite("a simulated makespan", [row["makespan"] for row in rows if row["error"] is None])
    if timelines and png is not None:
        from conveyor.schedule.render import to_png

        to_png(timelines, png, share_time=True)
    if timelines and trace is not None:
        from conveyor.schedule.render import write_chrome_trace

        write_chrome_trace(timelines, trace)
    return rows


def _number(value: float) -> str:
    # Two decimals at most, no trailing zeros, never exponent notation: 33, 28.5, 18.67, 3261.
    return f"{value:.2f}".rstrip("0").rstrip(".")


def format_compare_table(rows: Sequence[dict]) -> str:
    """The rows of :func:`run_compare` as an aligned text table.

    Example:
        >>> print(format_compare_table([{"schedule": "1f1b", "virtual": 1, "makespan": 33.0,
        ...     "bubble_ratio": 3 / 11, "peak_activations_max": 4,
        ...     "peak_activation_share": 4.0, "error": None}]))
        schedule  V  makespan  bubble  peak act.  = x model/P
        1f1b      1        33   27.3%          4            4
    """
    header = ("schedule", "V", "makespan", "bubble", "peak act.", "= x model/P")
    cells = []
    for row in rows:
        if row["error"] is None:
            figures = (
                _number(row["makespan"]),
                f"{row['bubble_ratio']:.1%}",
                str(row["peak_activations_max"]),
                _number(row["peak_activation_share"]),
            )
            note = ""
        else:
            figures = ("-", "-", "-", "-")
            note = f"cannot serve: {row['error']}"
        cells.append((row["schedule"], str(row["virtual"]), *figures, note))
    name_width = max([len(header[0])] + [len(c[0]) for c in cells]) + 1
    widths = [name_width, 2, 10, 8, 11, 13]

    def line(values: Sequence[str]) -> str:
        text = f"{values[0]:<{widths[0]}}"
        return text + "".join(f"{v:>{w}}" for v, w in zip(values[1:], widths[1:]))

    out = [line(header)]
    for *values, note in cells:
        out.append(f"{line(values)}  {note}" if note else line(values))
    return "\n".join(out)


def format_compare(
    rows: Sequence[dict], ranks: int, microbatches: int, costs: Costs,
    png: str | Path | None, trace: str | Path | None,
) -> str:
    """What ``conveyor simulate --compare`` prints: the sizes, the table, what was written.

    Example:
        >>> text = format_compare(run_compare(2, 2, png=None), 2, 2, DEFAULT_COSTS, None, None)
        >>> text.splitlines()[0].split(";")[0]
        'P=2 ranks, M=2 microbatches'
    """
    drawn = any(row["error"] is None for row in rows)
    lines = [
        f"P={ranks} ranks, M={microbatches} microbatches; costs F,B,W = "
        f"{','.join(f'{c:g}' for c in costs)} per 1/P of the model (each of V stages per rank: costs/V)",
        format_compare_table(rows),
        "peak act.: live (stage, microbatch) activations on the busiest rank; x model/P: that / V",
    ]
    if not drawn:
        lines.append("no schedule can serve these sizes; nothing drawn")
    elif png is not None:
        lines.append(f"wrote {png}")
        if trace:
            lines.append(f"wrote {trace}")
    return "\n".join(lines)


def busy_per_rank(timeline: Timeline) -> list[float]:
    """Compute time of each rank (one pass over the spans, where ``busy_time`` scans per rank).

    Example:
        >>> busy_per_rank(simulate_one("1f1b", 2, 2))
        [6.0, 6.0]
    """
    if isinstance(timeline.spans, PackedSpans):  # the same sums, in the same order
        return [sum(map(sub, ends, starts), 0.0) for starts, ends in zip(timeline.spans.starts, timeline.spans.ends)]
    busy = [0.0] * timeline.num_ranks
    for span in timeline.spans:
        if span.action.kind.is_compute:
            busy[span.rank] += span.end - span.start
    return busy


def simulation_summary(
    schedule: str, timeline: Timeline, microbatches: int, costs: Costs, latency: float
) -> dict:
    """The figures ``conveyor simulate --json`` prints for one schedule (files written aside).

    Example:
        >>> simulation_summary("1f1b", simulate_one("1f1b", 4, 8), 8, DEFAULT_COSTS, 0.0)["makespan"]
        33.0
    """
    forward, backward_input, backward_weight = costs
    return {
        "schedule": schedule,
        "ranks": timeline.num_ranks,
        "virtual": timeline.metadata["virtual"],
        "stages": timeline.num_ranks * timeline.metadata["virtual"],
        "microbatches": microbatches,
        "costs": {
            "forward": forward,
            "backward_input": backward_input,
            "backward_weight": backward_weight,
        },
        "latency": latency,
        "makespan": timeline.makespan,
        "bubble_ratio": timeline.bubble_ratio,
        "peak_activations": timeline.peak_activations(),
        "busy": busy_per_rank(timeline),
    }


def format_simulation(summary: dict) -> str:
    """:func:`simulation_summary` in words, as ``conveyor simulate`` prints it.

    Example:
        >>> summary = simulation_summary("1f1b", simulate_one("1f1b", 2, 2), 2, DEFAULT_COSTS, 0.0)
        >>> print(format_simulation(summary).splitlines()[0])
        1f1b: 2 ranks x 1 stage(s) per rank = 2 stages, 2 microbatches
    """
    costs = summary["costs"]
    forward, backward_input = costs["forward"], costs["backward_input"]
    backward_weight = costs["backward_weight"]
    peaks = summary["peak_activations"]
    return "\n".join([
        f"{summary['schedule']}: {summary['ranks']} ranks x {summary['virtual']} stage(s) per rank = "
        f"{summary['stages']} stages, {summary['microbatches']} microbatches",
        f"costs per stage: forward {forward:g}, input-gradient {backward_input:g}, "
        f"weight-gradient {backward_weight:g} (full backward {backward_input + backward_weight:g}); "
        f"latency {summary['latency']:g}",
        f"makespan          {summary['makespan']:g} units",
        f"bubble ratio      {summary['bubble_ratio']:.1%}",
        "peak activations  " + " ".join(f"r{rank}:{peak}" for rank, peak in enumerate(peaks)),
        "                  (live microbatch-stages per rank)",
    ])
