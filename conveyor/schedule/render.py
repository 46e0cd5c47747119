"""Draw timelines: PNG pictures and Chrome-trace JSON (opens in Perfetto).

Simulated and measured steps share the :class:`Timeline` type, so they
share these renderers too, and :func:`side_by_side_png` lays the simulated step
over what really happened. The Chrome-trace writer is :mod:`conveyor.schedule.chrome_trace`;
its functions are importable from here too.

matplotlib (Agg backend) is imported inside the drawing functions only, so
importing this module stays cheap and never needs a display.

Example:
    >>> import conveyor.schedule as cs
    >>> from conveyor.schedule.render import to_chrome_trace
    >>> tl = cs.simulate(cs.build("1f1b", ranks=2, microbatches=2))
    >>> trace = to_chrome_trace(tl)
    >>> sorted((e["ts"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X")[:3]
    [(0.0, 'F s0 m0'), (1000.0, 'F s0 m1'), (1000.0, 'F s1 m0')]
"""

from __future__ import annotations

import functools
import logging
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

# The Chrome-trace writer has its own module; these names stay importable from here.
from conveyor.schedule.chrome_trace import MICROSECONDS_PER_UNIT as MICROSECONDS_PER_UNIT
from conveyor.schedule.chrome_trace import to_chrome_trace as to_chrome_trace
from conveyor.schedule.chrome_trace import write_chrome_trace as write_chrome_trace
from conveyor.schedule.ir import ActionKind
from conveyor.schedule.timeline import Span, Timeline

logger = logging.getLogger(__name__)

# Colour-blind-safe, distinct in greyscale too: F blue, B red, I amber, W green.
KIND_COLORS: Mapping[ActionKind, str] = MappingProxyType({
    ActionKind.F: "#2f6db3",
    ActionKind.B: "#c0392b",
    ActionKind.I: "#e69f00",
    ActionKind.W: "#2e8b57",
})
KIND_NAMES: Mapping[ActionKind, str] = MappingProxyType({
    ActionKind.F: "F forward",
    ActionKind.B: "B full backward",
    ActionKind.I: "I input gradient",
    ActionKind.W: "W weight gradient",
})
COMM_COLOR = "#7f7f7f"
EXCHANGE_COLOR = "#8e44ad"  # an all-to-all (Timeline.comm_spans), on its own lane under the compute
# Rows of a rank as offsets from its centre line: compute alone, or compute above a communication lane.
_COMPUTE_ROW = (-0.4, 0.4)
_COMPUTE_ROW_ABOVE_LANE, _EXCHANGE_LANE = (-0.45, 0.1), (0.16, 0.45)
_COMM_LANE = (0.42, 0.5)  # point-to-point communication, a thin strip at the bottom of the row

# Label and layout limits that keep big pictures fast and small ones legible.
_LABEL_FONT_PT = 7.0
_MAX_LABELS = 6_000
_ROW_HEIGHT_IN = 0.42
_MAX_FIGURE_HEIGHT_IN = 60.0


# --------------------------------------------------------------------------- time units


def _display_unit(time_unit: str, makespan: float) -> tuple[float, str]:
    """How times of one timeline are shown, ``(factor, label)``: ``value * factor`` in ``label``.
    Seconds are shown in s, ms or µs so that the makespan reads as a plain number."""
    if time_unit == "s":
        if makespan >= 10:
            return 1.0, "s"
        if makespan >= 0.01:
            return 1e3, "ms"
        return 1e6, "µs"
    if time_unit == "unit":
        return 1.0, "units"
    return 1.0, time_unit


def format_duration(value: float, time_unit: str) -> str:
    """A duration with its unit, e.g. ``"33 units"`` or ``"12.34 ms"``.

    Example:
        >>> format_duration(33.0, "unit"), format_duration(0.01234, "s")
        ('33 units', '12.34 ms')
    """
    factor, label = _display_unit(time_unit, value)
    return f"{value * factor:.4g} {label}"


def headline(timeline: Timeline, title: str | None = None) -> str:
    """One line naming the timeline with its makespan, bubble ratio and peak activations.

    Example:
        >>> import conveyor.schedule as cs
        >>> headline(cs.simulate(cs.build("1f1b", ranks=4, microbatches=8)))
        '1f1b P=4 V=1 M=8 (simulated): makespan 33 units, bubble 27.3%, peak activations 4'
    """
    name = title if title is not None else (timeline.title or "timeline")
    peak = max(timeline.peak_activations(), default=0)
    exposed = f", exposed comm {timeline.exposed_comm_share:.1%}" if timeline.comm_spans else ""
    return (
        f"{name} ({timeline.source}): makespan {format_duration(timeline.makespan, timeline.time_unit)}, "
        f"bubble {timeline.bubble_ratio:.1%}, peak activations {peak}{exposed}"
    )


# --------------------------------------------------------------------------- PNG


def to_png(
    timelines: Timeline | Sequence[Timeline],
    path: str | os.PathLike,
    *,
    titles: Sequence[str | None] | None = None,
    share_time: bool = False,
    dpi: int = 100,
) -> Path:
    """Draw one or several timelines, one above the other, into a PNG file.

    Each timeline gets one row per rank; boxes are coloured by kind (F, B, I, W)
    and carry their microbatch number, or ``s2:m5`` when a rank runs several
    stages (later stages of a rank are also drawn lighter). Each title states
    makespan, bubble ratio and peak activations. Labels that would not fit their
    box are left out, so a 64-rank, 1024-microbatch timeline draws in seconds.

    ``share_time`` puts every panel on one time axis (the timelines must use the
    same ``time_unit``). Returns the path written; parent folders are created.

    Example:
        >>> import tempfile, conveyor.schedule as cs
        >>> tl = cs.simulate(cs.build("gpipe", ranks=2, microbatches=4))
        >>> to_png(tl, tempfile.mkdtemp() + "/gpipe.png").suffix
        '.png'
    """
    out = png_path(path)
    figure = draw(timelines, titles=titles, share_time=share_time, dpi=dpi)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=dpi)
    logger.info("wrote %s", out)
    return out


def png_path(path: str | os.PathLike) -> Path:
    """The file :func:`to_png` writes for ``path``: ``.png`` added when it has no suffix.

    Example:
        >>> png_path("out/timeline").name
        'timeline.png'
    """
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"{str(out)!r} is a folder; give a file name such as {str(out / 'timeline.png')!r}")
    return out if out.suffix else out.with_name(out.name + ".png")


def draw(
    timelines: Timeline | Sequence[Timeline],
    *,
    titles: Sequence[str | None] | None = None,
    share_time: bool = False,
    dpi: int = 100,
):
    """The matplotlib ``Figure`` that :func:`to_png` saves (Agg canvas, no pyplot state).

    Use it to adjust the picture before saving it, or to save it as SVG or PDF.

    Example:
        >>> import conveyor.schedule as cs
        >>> figure = draw(cs.simulate(cs.build("1f1b", ranks=2, microbatches=2)))
        >>> [t.get_text() for t in figure.axes[0].texts][:3]
        ['0', '1', '0']
    """
    panels = [timelines] if isinstance(timelines, Timeline) else list(timelines)
    if not panels:
        raise ValueError("drawing needs at least one Timeline, got none")
    if titles is not None and len(titles) != len(panels):
        raise ValueError(
            f"got {len(titles)} titles for {len(panels)} timelines; give one title per "
            "timeline (None keeps the timeline's own)"
        )
    if share_time and len({t.time_unit for t in panels}) > 1:
        units = ", ".join(sorted({t.time_unit for t in panels}))
        raise ValueError(
            f"share_time=True needs timelines in one time unit, got {units}; "
            "draw them with share_time=False"
        )
    titles = list(titles) if titles is not None else [None] * len(panels)

    # A bare Figure on the Agg canvas: no pyplot, so no global figure registry and no display.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    width_in = _figure_width(panels)
    row_in = _row_height(panels)
    # Layout in inches, top to bottom: legend band, then per panel a title band, the rank
    # rows and the time axis. Fixed inches (not fractions) keep labels fitting at any size.
    legend_in, title_in, axis_in, gap_in = 0.45, 0.3, 0.45, 0.2
    left_in, right_in = 0.9, 0.25
    panel_heights = [t.num_ranks * row_in for t in panels]
    height_in = (
        legend_in + sum(title_in + h + axis_in for h in panel_heights) + gap_in * (len(panels) - 1)
    )
    figure = Figure(figsize=(width_in, height_in), dpi=dpi)
    FigureCanvasAgg(figure)
    axes_width_px = (width_in - left_in - right_in) * dpi
    shared_end = max((t.makespan for t in panels), default=0.0) if share_time else None
    drawn: list[_Drawn] = []
    top_in = height_in - legend_in
    for timeline, title, rows_in in zip(panels, titles, panel_heights):
        bottom_in = top_in - title_in - rows_in
        ax = figure.add_axes(
            (
                left_in / width_in,
                bottom_in / height_in,
                (width_in - left_in - right_in) / width_in,
                rows_in / height_in,
            )
        )
        top_in = bottom_in - axis_in - gap_in
        drawn.append(_draw_panel(ax, timeline, title, axes_width_px, row_in * dpi, shared_end, dpi))
    _legend(figure, drawn)
    return figure


def side_by_side_png(
    simulated: Timeline,
    measured: Timeline,
    path: str | os.PathLike,
    *,
    titles: Sequence[str | None] | None = None,
) -> Path:
    """Draw the simulated step above its measured run, on one time axis when the units agree.

    The measured title also gives its makespan as a multiple of the simulated one
    when both are in the same unit (a simulator fed with profiled seconds).

    Example:
        >>> import tempfile, conveyor.schedule as cs
        >>> simulated = cs.simulate(cs.build("1f1b", ranks=2, microbatches=2))
        >>> side_by_side_png(simulated, simulated, tempfile.mkdtemp() + "/both.png").name
        'both.png'
    """
    if simulated.num_ranks != measured.num_ranks:
        raise ValueError(
            f"side_by_side_png compares one step: the simulated timeline has {simulated.num_ranks} "
            f"ranks but the measured one has {measured.num_ranks}"
        )
    same_unit = simulated.time_unit == measured.time_unit
    if titles is None:
        measured_title = measured.title or "measured"
        if same_unit and simulated.makespan > 0:
            ratio = measured.makespan / simulated.makespan
            measured_title = f"{measured_title}, {ratio:.2f}x the simulated makespan"
        titles = [simulated.title or "simulated", measured_title]
    return to_png([simulated, measured], path, titles=titles, share_time=same_unit)


def compare_summary(simulated: Timeline, measured: Timeline) -> dict:
    """Headline figures of a simulated step and its measured run, with their ratio when units agree.

    Example:
        >>> import conveyor.schedule as cs
        >>> simulated = cs.simulate(cs.build("1f1b", ranks=2, microbatches=2))
        >>> compare_summary(simulated, simulated)["makespan_ratio"]
        1.0
    """
    ratio = None
    if simulated.time_unit == measured.time_unit and simulated.makespan > 0:
        ratio = measured.makespan / simulated.makespan
    return {
        "simulated": simulated.summary(),
        "measured": measured.summary(),
        "makespan_ratio": ratio,
        "bubble_difference": measured.bubble_ratio - simulated.bubble_ratio,
    }


@dataclass(frozen=True, slots=True)
class _Drawn:
    kinds: frozenset[ActionKind]
    stages_per_rank: int
    has_comm: bool
    has_exchanges: bool = False


def _figure_width(panels: Sequence[Timeline]) -> float:
    # Wide enough for ~0.2 in per box on the busiest rank, within a screen-ish range.
    busiest = max(
        (count for t in panels for count in Counter(s.rank for s in t.spans if s.action.kind.is_compute).values()),
        default=0,
    )
    return min(max(busiest * 0.2 + 1.2, 10.0), 30.0)


def _row_height(panels: Sequence[Timeline]) -> float:
    total_ranks = sum(t.num_ranks for t in panels)
    budget = _MAX_FIGURE_HEIGHT_IN - 1.0 * len(panels)
    return max(min(_ROW_HEIGHT_IN, budget / max(total_ranks, 1)), 0.08)


def _local_stage_index(timeline: Timeline) -> tuple[dict[tuple[int, int], int], int]:
    """Per (rank, stage), its position among the stages that rank runs; and the most per rank."""
    stages: dict[int, set[int]] = {}
    for span in timeline.spans:
        stages.setdefault(span.rank, set()).add(span.action.stage)
    index = {(rank, stage): position for rank, rank_stages in stages.items()
             for position, stage in enumerate(sorted(rank_stages))}
    return index, max((len(s) for s in stages.values()), default=1)


def _shade(hex_color: str, position: int, count: int) -> tuple[float, float, float]:
    """The kind's colour for the first stage of a rank, mixed towards white for later ones."""
    red, green, blue = (int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5))
    mix = 0.0 if count <= 1 else 0.5 * position / (count - 1)
    return (red + (1 - red) * mix, green + (1 - green) * mix, blue + (1 - blue) * mix)


def _text_color(rgb: tuple[float, float, float]) -> str:
    luminance = 0.2126 * rgb[0] + 0.7152 * rgb[1] + 0.0722 * rgb[2]
    return "black" if luminance > 0.55 else "white"


def _draw_panel(ax, timeline, title, axes_width_px, row_px, shared_end, dpi) -> _Drawn:
    from matplotlib.collections import PolyCollection

    origin = timeline.start
    makespan = timeline.makespan
    factor, label = _display_unit(timeline.time_unit, shared_end if shared_end is not None else makespan)
    x_end = (shared_end if shared_end is not None else makespan) * factor or 1.0
    stage_index, stages_per_rank = _local_stage_index(timeline)
    compute = [s for s in timeline.spans if s.action.kind.is_compute]
    comm = [s for s in timeline.spans if not s.action.kind.is_compute]

    # One PolyCollection for every box: one artist instead of one per span, and numpy
    # vertices take matplotlib's fast path, so 100k boxes draw in about a second.
    import numpy as np

    starts = np.fromiter((s.start for s in compute), float, len(compute))
    ends = np.fromiter((s.end for s in compute), float, len(compute))
    ranks = np.fromiter((s.rank for s in compute), float, len(compute))
    x0, x1 = (starts - origin) * factor, (ends - origin) * factor
    # With all-to-alls, each rank's row holds its compute above a lane of its communication.
    row_top, row_bottom = _COMPUTE_ROW_ABOVE_LANE if timeline.comm_spans else _COMPUTE_ROW
    top, bottom = ranks + row_top, ranks + row_bottom
    # Each box's four corners (x, y), clockwise from the top left.
    boxes = np.stack([x0, top, x1, top, x1, bottom, x0, bottom], axis=1).reshape(len(compute), 4, 2)
    shade = functools.cache(_shade)  # one colour per (kind, local stage)
    colors = [shade(KIND_COLORS[s.action.kind], stage_index[(s.rank, s.action.stage)], stages_per_rank)
              for s in compute]
    px_per_x = axes_width_px / x_end
    narrowest_px = float((x1 - x0).min()) * px_per_x if compute else 0.0
    # Outlines separate neighbouring boxes; on boxes a few pixels wide they would hide the colour.
    edge = 0.4 if narrowest_px >= 4 else 0.0
    ax.add_collection(
        PolyCollection(
            boxes, facecolors=colors, edgecolors="white", linewidths=edge, antialiased=edge > 0
        )
    )
    if comm:
        _draw_lane(ax, comm, _COMM_LANE, COMM_COLOR, origin, factor, px_per_x)
    if timeline.comm_spans:
        _draw_lane(ax, timeline.comm_spans, _EXCHANGE_LANE, EXCHANGE_COLOR, origin, factor, px_per_x)

    _label_boxes(ax, compute, colors, origin, factor, px_per_x, row_px * (row_bottom - row_top) / 0.8,
                 stages_per_rank, dpi, (row_top + row_bottom) / 2)  # (a row without a lane is 0.8 high)

    ax.set_xlim(0, x_end)
    ax.set_ylim(timeline.num_ranks - 0.5, -0.5)  # rank 0 on top
    step = max(1, timeline.num_ranks // 32)
    ax.set_yticks(range(0, timeline.num_ranks, step))
    ax.set_yticklabels([f"rank {r}" for r in range(0, timeline.num_ranks, step)], fontsize=8)
    ax.set_xlabel(f"time ({label})", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(headline(timeline, title), fontsize=10, loc="left")
    return _Drawn(frozenset(s.action.kind for s in compute), stages_per_rank, bool(comm), bool(timeline.comm_spans))


def _draw_lane(ax, spans, lane, color, origin, factor, px_per_x) -> None:
    """Communication spans (p2p, or the all-to-alls) on a lane of each rank's row (at least half a pixel wide each)."""
    from matplotlib.collections import PolyCollection

    top, bottom = lane
    boxes = []
    for span in spans:
        x0 = (span.start - origin) * factor
        x1 = max((span.end - origin) * factor, x0 + 0.5 / px_per_x)
        boxes.append(((x0, span.rank + top), (x1, span.rank + top), (x1, span.rank + bottom), (x0, span.rank + bottom)))
    ax.add_collection(PolyCollection(boxes, facecolors=color, linewidths=0))


def _label_boxes(
    ax, spans: Sequence[Span], colors, origin, factor, px_per_x, row_px, stages_per_rank, dpi, y_shift=0.0
):
    """Write each box's microbatch (and stage, when ranks run several) where it fits.

    Fit is judged with the panel's longest label, so boxes of one size are all
    labelled or all bare (not "0".."9" labelled and "10".. bare). The font shrinks
    a little when that lets the typical box carry its label.
    """
    if not spans:
        return
    widths_px = [(s.end - s.start) * factor * px_per_x for s in spans]
    short_chars = len(str(max(s.action.microbatch for s in spans)))
    long_chars = short_chars + 3 + len(str(max(s.action.stage for s in spans)))
    typical_px = sorted(widths_px)[len(widths_px) // 2]
    font_pt = next((pt for pt in (_LABEL_FONT_PT, 6.0) if _text_px(short_chars, pt, dpi) <= typical_px), 5.0)
    if row_px < font_pt * dpi / 72 * 1.2:
        return
    short_px = _text_px(short_chars, font_pt, dpi)
    long_px = _text_px(long_chars, font_pt, dpi) if stages_per_rank > 1 else float("inf")
    labels = []
    for span, color, width_px in zip(spans, colors, widths_px):
        action = span.action
        if width_px >= long_px:
            text = f"s{action.stage}:m{action.microbatch}"
        elif width_px >= short_px:
            text = str(action.microbatch)  # the shading still tells the stage apart
        else:
            continue
        labels.append(((span.start + span.end) / 2, span.rank + y_shift, text, color))
    if len(labels) > _MAX_LABELS:
        logger.info(
            "skipping %d box labels (more than %d would be slow to draw)", len(labels), _MAX_LABELS
        )
        return
    for mid, rank, text, color in labels:
        ax.text(
            (mid - origin) * factor,
            rank,
            text,
            ha="center",
            va="center",
            fontsize=font_pt,
            color=_text_color(color),
            clip_on=True,
        )


def _text_px(num_chars: int, font_pt: float, dpi: int) -> float:
    # DejaVu digits are ~0.62 em wide; 3 px keeps the text off the box edges.
    return num_chars * font_pt * dpi / 72 * 0.62 + 3


def _legend(figure, drawn: Sequence[_Drawn]) -> None:
    """What the panels drawn show: their kinds, the shades of a rank's stages, their communication lanes."""
    from matplotlib.patches import Patch

    kinds = frozenset().union(*(d.kinds for d in drawn))
    stages_per_rank = max(d.stages_per_rank for d in drawn)
    handles = [Patch(color=KIND_COLORS[k], label=KIND_NAMES[k]) for k in KIND_COLORS if k in kinds]
    if stages_per_rank > 1:
        for position in range(stages_per_rank):
            shade = _shade("#606060", position, stages_per_rank)
            handles.append(Patch(color=shade, label=f"{_ordinal(position + 1)} stage of a rank"))
    if any(d.has_comm for d in drawn):
        handles.append(Patch(color=COMM_COLOR, label="communication"))
    if any(d.has_exchanges for d in drawn):
        handles.append(Patch(color=EXCHANGE_COLOR, label="all-to-all"))
    if not handles:
        return  # an empty timeline: nothing to explain
    figure.legend(
        handles=handles,
        loc="upper center",
        ncol=len(handles),
        fontsize=8,
        frameon=False,
        borderaxespad=0.3,
    )


def _ordinal(number: int) -> str:
    suffix = {1: "st", 2: "nd", 3: "rd"}.get(
        number % 10 if number % 100 not in (11, 12, 13) else 0, "th"
    )
    return f"{number}{suffix}"
