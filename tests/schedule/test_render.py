"""PNG and Chrome-trace rendering of simulated and measured timelines."""

from __future__ import annotations

import json
import struct

import pytest

import conveyor.schedule as cs
from conveyor.schedule.ir import ActionKind, F, I, Placement, Schedule, W
from conveyor.schedule.render import (
    compare_summary,
    draw,
    format_duration,
    headline,
    side_by_side_png,
    to_chrome_trace,
    to_png,
    write_chrome_trace,
)
from conveyor.schedule.timeline import Span, Timeline

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def looped_split(num_ranks: int, num_microbatches: int) -> Schedule:
    """Two stages per rank (looped), backward split into I and W: every kind and shading at once."""
    programs = []
    for rank in range(num_ranks):
        late = rank + num_ranks
        program = [F(rank, m) for m in range(num_microbatches)]
        program += [F(late, m) for m in range(num_microbatches)]
        program += [I(late, m) for m in range(num_microbatches)]
        program += [I(rank, m) for m in range(num_microbatches)]
        program += [W(late, m) for m in range(num_microbatches)]
        program += [W(rank, m) for m in range(num_microbatches)]
        programs.append(program)
    return Schedule.from_programs(
        "looped-split", Placement.looped(num_ranks, 2), num_microbatches, programs
    )


def measured_from(simulated: Timeline, seconds_per_unit: float, origin_s: float) -> Timeline:
    """A 'measured' timeline: the plan in seconds from a perf_counter-like origin, plus comm spans."""
    spans = [
        Span(
            s.rank,
            s.action,
            origin_s + s.start * seconds_per_unit,
            origin_s + s.end * seconds_per_unit,
        )
        for s in simulated.spans
    ]
    # One receive per forward on ranks > 0, just before it, as a recorder would log it.
    for s in simulated.spans:
        if s.action.kind is ActionKind.F and s.rank > 0:
            recv = cs.Action(ActionKind.RECV_F, s.action.stage, s.action.microbatch)
            at = origin_s + s.start * seconds_per_unit
            spans.append(Span(s.rank, recv, at - seconds_per_unit / 4, at))
    return Timeline.from_spans(
        simulated.num_ranks, spans, title="1f1b measured", source="measured", time_unit="s"
    )


@pytest.fixture(scope="module")
def one_f_one_b() -> Timeline:
    return cs.simulate(cs.build("1f1b", ranks=4, microbatches=8))


def test_png_of_one_timeline_is_a_sane_png(tmp_path, one_f_one_b):
    path = to_png(one_f_one_b, tmp_path / "sub" / "one.png")
    assert path == tmp_path / "sub" / "one.png"
    width, height = png_size(path)
    assert 1000 <= width <= 3000
    assert 200 <= height <= 1000
    assert 5_000 < path.stat().st_size < 2_000_000


def test_every_box_is_labelled_with_its_microbatch_when_boxes_are_wide(one_f_one_b):
    figure = draw(one_f_one_b)
    texts = [t.get_text() for t in figure.axes[0].texts]
    # 4 ranks x 8 microbatches x (F + B), each labelled with its microbatch number.
    assert len(texts) == 64
    assert sorted(texts) == sorted(str(m) for m in range(8) for _ in range(8))
    assert figure.axes[0].get_title(loc="left") == (
        "1f1b P=4 V=1 M=8 (simulated): makespan 33 units, bubble 27.3%, peak activations 4"
    )
    legend = [t.get_text() for t in figure.legends[0].get_texts()]
    assert legend == ["F forward", "B full backward"]


def test_ranks_with_several_stages_show_stage_and_microbatch():
    timeline = cs.simulate(looped_split(2, 2))
    figure = draw(timeline)
    texts = {t.get_text() for t in figure.axes[0].texts}
    assert {"s0:m0", "s2:m1", "s1:m0", "s3:m1"} <= texts
    legend = [t.get_text() for t in figure.legends[0].get_texts()]
    assert legend == [
        "F forward",
        "I input gradient",
        "W weight gradient",
        "1st stage of a rank",
        "2nd stage of a rank",
    ]


def test_p8_m32_panels_keep_labels_and_big_timelines_skip_them(tmp_path):
    small = cs.simulate(cs.build("1f1b", ranks=8, microbatches=32))
    split = cs.simulate(looped_split(8, 32))
    figure = draw([small, split])
    assert len(figure.axes[0].texts) == 8 * 32 * 2  # every box readable
    assert len(figure.axes[1].texts) == 8 * 2 * 32 * 3  # narrower boxes, smaller font, still all
    big = cs.simulate(cs.build("1f1b", ranks=16, microbatches=512))
    assert len(draw(big).axes[0].texts) == 0  # boxes a few pixels wide: no labels at all
    width, height = png_size(to_png([small, split], tmp_path / "p8.png"))
    assert width == 3000 and 800 <= height <= 1400


def test_shared_time_axis_and_titles(tmp_path):
    gpipe = cs.simulate(cs.build("gpipe", ranks=2, microbatches=2))
    longer = cs.simulate(cs.build("gpipe", ranks=2, microbatches=6))
    figure = draw([gpipe, longer], titles=["short", None], share_time=True)
    assert figure.axes[0].get_xlim() == figure.axes[1].get_xlim() == (0.0, longer.makespan)
    assert figure.axes[0].get_title(loc="left").startswith("short (simulated): makespan 9 units")
    assert figure.axes[1].get_title(loc="left").startswith("gpipe P=2 V=1 M=6 (simulated)")
    with pytest.raises(ValueError, match="one title per timeline"):
        to_png([gpipe, longer], tmp_path / "x.png", titles=["only one"])
    with pytest.raises(ValueError, match="at least one Timeline"):
        to_png([], tmp_path / "x.png")


def test_chrome_trace_has_one_event_per_span(one_f_one_b):
    trace = to_chrome_trace(one_f_one_b)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(one_f_one_b.spans) == 64
    by_name = {(e["pid"], e["name"]): e for e in events}
    # Rank 3 (last stage) runs F(3, 0) at t=3..4 units and its full backward at 4..6.
    forward = by_name[(3, "F s3 m0")]
    assert (forward["ts"], forward["dur"], forward["tid"]) == (3000.0, 1000.0, 0)
    assert forward["args"] == {"kind": "F", "stage": 3, "microbatch": 0, "rank": 3, "action": "3F0"}
    backward = by_name[(3, "B s3 m0")]
    assert (backward["ts"], backward["dur"], backward["cat"]) == (4000.0, 2000.0, "compute")
    for event, span in zip(events, one_f_one_b.spans):
        assert event["pid"] == span.rank
        assert event["ts"] == span.start * 1000
        assert event["dur"] == (span.end - span.start) * 1000
    names = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2", 3: "rank 3"}
    assert trace["otherData"]["timelines"][0]["microseconds_per_unit"] == 1000.0


def test_chrome_trace_of_measured_seconds_starts_at_zero(tmp_path, one_f_one_b):
    measured = measured_from(one_f_one_b, seconds_per_unit=0.25, origin_s=1000.0)
    path = write_chrome_trace(measured, tmp_path / "trace" / "measured.json")
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(measured.spans) == 64 + 3 * 8
    first_recv = min(
        (e for e in events if e["args"]["kind"] == "RECV_F" and e["pid"] == 1),
        key=lambda e: e["ts"],
    )
    # F(1, 0) starts at 1 unit = 0.25 s after the first span (at 1000 s); its receive 1/16 s before.
    assert (first_recv["ts"], first_recv["dur"], first_recv["tid"]) == (187500.0, 62500.0, 1)
    assert first_recv["cat"] == "communication"
    forward = next(e for e in events if e["name"] == "F s1 m0")
    assert (forward["ts"], forward["dur"]) == (250000.0, 250000.0)


def test_unknown_time_unit_is_refused(one_f_one_b):
    odd = Timeline(one_f_one_b.num_ranks, one_f_one_b.spans, time_unit="fortnight")
    with pytest.raises(ValueError, match="time unit 'fortnight'"):
        to_chrome_trace(odd)


def test_measured_and_simulated_side_by_side(tmp_path, one_f_one_b):
    measured = measured_from(one_f_one_b, seconds_per_unit=0.004, origin_s=52.0)
    path = side_by_side_png(one_f_one_b, measured, tmp_path / "both.png")
    width, height = png_size(path)
    assert width >= 1000 and height >= 500
    figure = draw([one_f_one_b, measured])
    titles = [ax.get_title(loc="left") for ax in figure.axes]
    assert titles[1].startswith("1f1b measured (measured): makespan 132 ms")
    assert figure.axes[1].get_xlabel() == "time (ms)"
    assert [t.get_text() for t in figure.legends[0].get_texts()][-1] == "communication"

    # Same unit: one time axis, and the measured title states the ratio.
    slower = Timeline.from_spans(
        4,
        [Span(s.rank, s.action, s.start * 1.5, s.end * 1.5) for s in one_f_one_b.spans],
        title="slow run",
        source="measured",
    )
    summary = compare_summary(one_f_one_b, slower)
    assert summary["makespan_ratio"] == 1.5
    assert summary["bubble_difference"] == 0.0
    side_by_side_png(one_f_one_b, slower, tmp_path / "same-unit.png")
    assert png_size(tmp_path / "same-unit.png")[0] >= 1000
    other = cs.simulate(cs.build("1f1b", ranks=2, microbatches=8))
    with pytest.raises(ValueError, match="4 ranks but the measured one has 2"):
        side_by_side_png(one_f_one_b, other, tmp_path / "bad.png")


def test_headline_and_durations(one_f_one_b):
    assert headline(one_f_one_b, "plan") == (
        "plan (simulated): makespan 33 units, bubble 27.3%, peak activations 4"
    )
    assert format_duration(12.5, "s") == "12.5 s"
    assert format_duration(0.5, "s") == "500 ms"
    assert format_duration(0.0025, "s") == "2500 µs"
    assert format_duration(7.0, "unit") == "7 units"


def test_empty_timeline_draws_and_traces(tmp_path):
    empty = Timeline(3, ())
    assert png_size(to_png(empty, tmp_path / "empty.png"))[0] == 1000
    events = to_chrome_trace(empty)["traceEvents"]
    assert [e for e in events if e["ph"] == "X"] == []
    assert sum(e["name"] == "process_name" for e in events) == 3
