"""Chrome-trace JSON of timelines (opens in ui.perfetto.dev, or chrome://tracing).

Simulated schedules and measured runs share the :class:`Timeline` type, so one writer serves
both; :mod:`conveyor.schedule.render` draws the same timelines as pictures (and keeps
these names importable).

Example:
    >>> import conveyor.schedule as cs
    >>> tl = cs.simulate(cs.build("1f1b", ranks=2, microbatches=2))
    >>> trace = to_chrome_trace(tl)
    >>> sorted((e["ts"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X")[:3]
    [(0.0, 'F s0 m0'), (1000.0, 'F s0 m1'), (1000.0, 'F s1 m0')]
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

from conveyor.schedule.timeline import Timeline

# Microseconds per time unit in Chrome traces. A simulated unit is shown as one
# millisecond: Perfetto's ruler then reads "1 ms" per unit, which is easy to count.
MICROSECONDS_PER_UNIT: Mapping[str, float] = MappingProxyType({
    "unit": 1_000.0,
    "s": 1_000_000.0,
    "ms": 1_000.0,
    "us": 1.0,
    "ns": 0.001,
})


EXCHANGE_TID = 2  # the thread of a rank's all-to-alls (a timeline's comm_spans), under compute and p2p


def to_chrome_trace(timelines: Timeline | Sequence[Timeline]) -> dict:
    """Chrome-trace JSON (a dict) of one or several timelines; open it in ui.perfetto.dev.

    Every span becomes one complete (``"X"``) event named like ``"F s2 m5"``, with
    ``args`` holding kind, stage, microbatch and rank. Each rank is a process
    (``pid``); compute runs on thread 0 and communication on thread 1; a timeline's
    all-to-alls (``comm_spans``) on thread 2, named ``"rank r comm"``. Times are
    microseconds from the timeline's start: seconds are converted exactly, and a
    simulated unit is shown as 1 ms (:data:`MICROSECONDS_PER_UNIT`). Several
    timelines get consecutive pids, their processes named after each title.

    Example:
        >>> import conveyor.schedule as cs
        >>> tl = cs.simulate(cs.build("gpipe", ranks=2, microbatches=1))
        >>> event = next(e for e in to_chrome_trace(tl)["traceEvents"] if e.get("name") == "F s1 m0")
        >>> event["name"], event["pid"], event["ts"], event["dur"]
        ('F s1 m0', 1, 1000.0, 1000.0)
    """
    panels = [timelines] if isinstance(timelines, Timeline) else list(timelines)
    events: list[dict] = []
    pid_offset = 0
    for timeline in panels:
        scale = MICROSECONDS_PER_UNIT.get(timeline.time_unit)
        if scale is None:
            known = ", ".join(MICROSECONDS_PER_UNIT)
            raise ValueError(
                f"cannot convert time unit {timeline.time_unit!r} to microseconds; "
                f"use one of {known} for Timeline.time_unit"
            )
        prefix = f"{timeline.title or timeline.source}: " if len(panels) > 1 else ""
        for rank in range(timeline.num_ranks):
            pid = pid_offset + rank
            events.append(_metadata("process_name", pid, 0, {"name": f"{prefix}rank {rank}"}))
            events.append(_metadata("process_sort_index", pid, 0, {"sort_index": pid}))
            events.append(_metadata("thread_name", pid, 0, {"name": "compute"}))
            events.append(_metadata("thread_name", pid, 1, {"name": "communication"}))
            if timeline.comm_spans:
                events.append(_metadata("thread_name", pid, EXCHANGE_TID, {"name": f"rank {rank} comm"}))
        origin = timeline.start
        # The all-to-alls of ``timeline``, each on its rank's exchange thread.
        for span in timeline.comm_spans:
            events.append(_complete(f"all-to-all {span.label}", "all-to-all", span, origin, scale, pid_offset,
                                    EXCHANGE_TID, {"rank": span.rank, "of": span.label}))
        for span in timeline.spans:
            action = span.action
            is_compute = action.kind.is_compute
            args = {"kind": action.kind.value, "stage": action.stage, "microbatch": action.microbatch,
                    "rank": span.rank, "action": str(action)}
            events.append(_complete(f"{action.kind.value} s{action.stage} m{action.microbatch}",
                                    "compute" if is_compute else "communication", span, origin, scale, pid_offset,
                                    0 if is_compute else 1, args))
        pid_offset += timeline.num_ranks
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "timelines": [
                {
                    "title": t.title,
                    "source": t.source,
                    "time_unit": t.time_unit,
                    "microseconds_per_unit": MICROSECONDS_PER_UNIT[t.time_unit],
                    "makespan": t.makespan,
                    "bubble_ratio": t.bubble_ratio,
                } | ({"exposed_comm_share": t.exposed_comm_share} if t.comm_spans else {})
                for t in panels
            ]
        },
    }


def write_chrome_trace(timelines: Timeline | Sequence[Timeline], path: str | os.PathLike) -> Path:
    """Write :func:`to_chrome_trace` to ``path`` (parents created); returns the path.

    Example:
        >>> import tempfile, conveyor.schedule as cs
        >>> tl = cs.simulate(cs.build("gpipe", ranks=2, microbatches=1))
        >>> write_chrome_trace(tl, tempfile.mkdtemp() + "/t.json").name
        't.json'
    """
    trace = to_chrome_trace(timelines)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    # json.dumps runs the C encoder; json.dump to a file falls back to the pure-Python one (10x slower).
    out.write_text(json.dumps(trace, separators=(",", ":")))
    return out


def _complete(name: str, cat: str, span, origin: float, scale: float, pid_offset: int, tid: int,
              args: dict) -> dict:
    """A complete (``"X"``) event of ``span`` (a Span or a CommSpan), in microseconds from ``origin``."""
    return {"name": name, "cat": cat, "ph": "X", "ts": round((span.start - origin) * scale, 3),
            "dur": round((span.end - span.start) * scale, 3), "pid": pid_offset + span.rank, "tid": tid,
            "args": args}


def _metadata(name: str, pid: int, tid: int, args: dict) -> dict:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}
