"""Timing a step's actions: host clocks on the CPU, CUDA events on a GPU.

On a GPU an action's kernels run after the host has queued them and moved on, so host
clocks around an action time the queueing, not the work. :class:`EventRecorder` records a
CUDA event before and after each action on the current stream, and resolves them to seconds
only when the timeline is read: one synchronisation at the end of the step, none per action.
On the CPU :class:`StepRecorder` reads ``time.perf_counter`` as before.

Example:
    >>> recorder = make_recorder(torch.device("cpu"))
    >>> start = recorder.mark(); recorder.add("0F0", start, recorder.mark())
    >>> [action for action, _, _ in recorder.events]
    ['0F0']
"""

from __future__ import annotations

import time
from typing import Any

import torch


class StepRecorder:
    """Start and end of every action of a step (perf_counter seconds); cheap enough to stay on."""

    mark = staticmethod(time.perf_counter)

    def __init__(self) -> None:
        self.events: list[tuple[Any, float, float]] = []

    def add(self, action: Any, start: float, end: float) -> None:
        self.events.append((action, start, end))


class EventRecorder:
    """Start and end of every action as device events; ``events`` resolves them to seconds.

    ``event_class`` is ``torch.cuda.Event`` (anything with ``record()``, ``synchronize()``
    and ``elapsed_time(other)`` in milliseconds, which tests fake). The first mark is the
    step's origin, paired with the host clock when it was recorded, so that ranks' timelines
    line up as the host-clock ones do (to the launch latency of that first event).
    """

    def __init__(self, event_class: Any = None, stream: Any = None) -> None:
        self.event_class = event_class if event_class is not None else torch.cuda.Event
        self.stream = stream  # the stage device's current stream (None: the current device's)
        self._marks: list[tuple[Any, Any, Any]] = []
        self._origin: tuple[Any, float] | None = None
        self._resolved: list[tuple[Any, float, float]] | None = None

    def mark(self) -> Any:
        event = self.event_class(enable_timing=True)
        event.record(self.stream)
        if self._origin is None:
            self._origin = (event, time.perf_counter())
        return event

    def add(self, action: Any, start: Any, end: Any) -> None:
        self._marks.append((action, start, end))
        self._resolved = None

    @property
    def events(self) -> list[tuple[Any, float, float]]:
        """``(action, start, end)`` in host-clock seconds; the first read waits for the last event."""
        if self._resolved is None:
            self._resolved = []
            if self._marks:
                origin, host_origin = self._origin  # type: ignore[misc]  # set by the first mark
                self._marks[-1][2].synchronize()  # the one wait: every earlier event is done then
                self._resolved = [(action, host_origin + origin.elapsed_time(start) / 1e3,
                                   host_origin + origin.elapsed_time(end) / 1e3)
                                  for action, start, end in self._marks]
        return self._resolved


def make_recorder(device: torch.device | None, event_class: Any = None) -> StepRecorder | EventRecorder:
    """The recorder for a step on ``device``: CUDA events on a GPU, the host clock elsewhere.

    Example:
        >>> type(make_recorder(torch.device("cpu"))).__name__
        'StepRecorder'
    """
    if device is not None and device.type == "cuda":
        stream = torch.cuda.current_stream(device) if event_class is None else None
        return EventRecorder(event_class, stream)
    return StepRecorder()


def replica_timeline(schedule: Any, gathered: list, replicas: Any = None) -> Any:
    """The step's Timeline from every rank's ``(events, reduction spans)`` (as the pipeline gathers them).

    With ``replicas`` (data parallelism) its metadata also says, per rank, the (stage or "wait",
    start, end) of the calls that reduced gradients across replicas, on the timeline's clock:
    what of the reduction the rank spent waiting.

    Example:
        >>> import conveyor.schedule as cs
        >>> replica_timeline(cs.build("1f1b", ranks=1, microbatches=1), [([("0F0", 1.0, 1.5)], [])]).makespan
        0.5
    """
    from conveyor.schedule.timeline import measured_timeline

    timeline = measured_timeline(schedule, [events for events, _ in gathered])
    if replicas is not None:
        origin = min((start for events, _ in gathered for _, start, _ in events), default=0.0)
        timeline.metadata["data_parallel"] = {
            "kind": replicas.kind, "replicas": replicas.dp_size,
            "reductions": [[(what, start - origin, end - origin) for what, start, end in spans]
                           for _, spans in gathered],
        }
    return timeline
