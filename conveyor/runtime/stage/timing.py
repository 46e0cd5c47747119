"""Timing a step's actions: host clocks on the CPU, CUDA events on a GPU.

On a GPU an action's kernels run after the host has queued them and moved on, so host
clocks around an action time the queueing, not the work. :class:`EventRecorder` records a
CUDA event before and after each action on the current stream, and resolves them to seconds
only when the timeline is read: one synchronisation after the step, none per action. They are
put on the host clock through an anchor event recorded then (:func:`event_seconds`), so that
ranks' timelines line up on when each GPU ran its work, however far it lagged its host.
:class:`SpanTimer` does the same for spans whose work runs on side streams (the gradient
reductions of data parallelism). On the CPU :class:`StepRecorder` reads ``time.perf_counter``.

Example:
    >>> recorder = make_recorder(torch.device("cpu"))
    >>> start = recorder.mark(); recorder.add("0F0", start, recorder.mark())
    >>> [action for action, _, _ in recorder.events]
    ['0F0']
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
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
    and ``elapsed_time(other)`` in milliseconds, which tests fake). The events are put on the
    host clock when read, through one anchor event recorded then (:func:`event_seconds`): the
    ranks' timelines then line up on when the device ran each action, not on when the host
    queued it (a GPU that lags the host runs its kernels later than that).
    """

    def __init__(
        self, event_class: Any = None, stream: Any = None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.event_class = event_class if event_class is not None else torch.cuda.Event
        self.stream = stream  # the stage device's current stream (None: the current device's)
        self.clock = clock
        self._marks: list[tuple[Any, Any, Any]] = []
        self._resolved: list[tuple[Any, float, float]] | None = None

    def mark(self) -> Any:
        return _recorded(self.event_class, self.stream)

    def add(self, action: Any, start: Any, end: Any) -> None:
        self._marks.append((action, start, end))
        self._resolved = None

    @property
    def events(self) -> list[tuple[Any, float, float]]:
        """``(action, start, end)`` in host-clock seconds; the first read waits for the device (once)."""
        if self._resolved is None:
            times = event_seconds([event for _, start, end in self._marks for event in (start, end)],
                                  self.event_class, self.stream, self.clock) if self._marks else []
            self._resolved = [(action, times[2 * i], times[2 * i + 1])
                              for i, (action, _, _) in enumerate(self._marks)]
        return self._resolved


def event_seconds(events: Sequence[Any], event_class: Any = None, stream: Any = None,
                  clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """The host-clock time (``clock``'s seconds) at which the device reached each of ``events``.

    One anchor event is recorded on ``stream`` and waited for: the device reaches it after
    everything queued before it, and the wait returns as it does, so ``clock`` read right
    then is the anchor's time (to the wake-up latency of the wait); each event's time is
    that minus the device-measured time from it to the anchor. The only synchronisation,
    after the step, when a timeline is asked for. Events recorded on other streams must be
    complete (synchronize the device first).

    Example (a fake event class; on a GPU, ``torch.cuda.Event``):
        >>> class Clocked:
        ...     now = 0.0
        ...     def __init__(self, enable_timing): self.at = None
        ...     def record(self, stream=None): self.at = Clocked.now
        ...     def synchronize(self): pass
        ...     def elapsed_time(self, other): return (other.at - self.at) * 1e3
        >>> early = Clocked(True); early.record(); Clocked.now = 2.5
        >>> event_seconds([early], Clocked, clock=lambda: 10.0)
        [7.5]
    """
    anchor = _recorded(event_class if event_class is not None else torch.cuda.Event, stream)
    anchor.synchronize()
    now = clock()
    return [now - event.elapsed_time(anchor) / 1e3 for event in events]


def _recorded(event_class: Any, stream: Any = None) -> Any:
    """A timing event of ``event_class``, recorded on ``stream`` (None: the current one)."""
    event = event_class(enable_timing=True)
    event.record(stream)
    return event


class SpanTimer:
    """Named spans on a device, read after the step: the host clock on the CPU; on a GPU an
    event on the current stream at the start and one on each given stream at the end (work
    run on side streams, such as gradient reductions), resolved by :func:`event_seconds`.

    Example:
        >>> timer = SpanTimer(torch.device("cpu"))
        >>> started = timer.start(); timer.end("0", started)
        >>> [what for what, _, _ in timer.spans()]
        ['0']
    """

    def __init__(self, device: torch.device | None, event_class: Any = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.on_device = device is not None and device.type == "cuda"
        self.device = device
        self.event_class = event_class if event_class is not None or not self.on_device else torch.cuda.Event
        self.clock = clock
        self._spans: list[tuple[str, Any, list[Any]]] = []

    def start(self) -> Any:
        """A start mark: the host clock, or an event on the current stream."""
        return _recorded(self.event_class) if self.on_device else self.clock()

    def end(self, what: str, started: Any, streams: Sequence[Any] = ()) -> None:
        """End ``what``: when the current stream and each of ``streams`` (the work's) reach this point."""
        if not self.on_device:
            self._spans.append((what, started, [self.clock()]))
            return
        self._spans.append((what, started, [_recorded(self.event_class, stream) for stream in [None, *streams]]))

    def clear(self) -> None:
        self._spans = []

    def spans(self) -> list[tuple[str, float, float]]:
        """``(what, start, end)`` in host-clock seconds, the end the latest of its streams'."""
        if not self.on_device:
            return [(what, start, ends[0]) for what, start, ends in self._spans]
        if not self._spans:
            return []
        if self.event_class is torch.cuda.Event:  # events on side streams: every one complete
            torch.cuda.synchronize(self.device)
        flat = [event for _, start, ends in self._spans for event in (start, *ends)]
        times, out, at = event_seconds(flat, self.event_class, clock=self.clock), [], 0
        for what, _, ends in self._spans:
            out.append((what, times[at], max(times[at + 1:at + 1 + len(ends)])))
            at += 1 + len(ends)
        return out


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
