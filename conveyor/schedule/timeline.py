"""The one Timeline type: simulated plans and measured runs alike.

A :class:`Timeline` is every compute action's start and end per rank. Makespan,
bubble ratio and peak live activations are derived from the spans, so a
simulated plan and a measured step are summarised by the same code and can be
drawn side by side.

Example:
    >>> from conveyor.schedule.ir import F, B
    >>> tl = Timeline(2, (Span(0, F(0, 0), 0, 1), Span(1, F(1, 0), 1, 2),
    ...                   Span(1, B(1, 0), 2, 4), Span(0, B(0, 0), 4, 6)))
    >>> tl.makespan, tl.bubble_ratio
    (6, 0.5)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from conveyor.schedule.ir import Action, ActionKind


@dataclass(frozen=True, slots=True)
class Span:
    """One action on one rank, from ``start`` to ``end`` (simulator units or seconds)."""

    rank: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Timeline:
    """What each rank did when. ``source`` is ``"simulated"`` or ``"measured"``.

    ``stage_activation_bytes[stage]`` (optional) weighs live activations in bytes;
    ``stage_weight_activation_bytes[stage]`` (optional: all of them) is the part a split
    backward's W still needs after its I (see :class:`~conveyor.schedule.cost.StageCosts`).
    ``spans`` come in no particular order across ranks; :meth:`spans_of` sorts one rank's.
    """

    num_ranks: int
    spans: tuple[Span, ...]
    title: str = ""
    source: str = "simulated"
    time_unit: str = "unit"
    stage_activation_bytes: tuple[float, ...] = ()
    stage_weight_activation_bytes: tuple[float, ...] = ()
    metadata: dict = field(default_factory=dict)

    @property
    def start(self) -> float:
        return min((s.start for s in self.spans), default=0.0)

    @property
    def end(self) -> float:
        return max((s.end for s in self.spans), default=0.0)

    @property
    def makespan(self) -> float:
        return self.end - self.start

    def spans_of(self, rank: int) -> list[Span]:
        return sorted((s for s in self.spans if s.rank == rank), key=lambda s: s.start)

    def busy_time(self, rank: int) -> float:
        return sum(s.duration for s in self.spans if s.rank == rank and s.action.kind.is_compute)

    @property
    def bubble_ratio(self) -> float:
        """Idle rank-time over ``num_ranks x makespan``."""
        total = self.num_ranks * self.makespan
        if total <= 0:
            return 0.0
        # One pass over the spans (busy_time per rank would scan them num_ranks times).
        busy = sum(s.end - s.start for s in self.spans if s.action.kind.is_compute)
        return (total - busy) / total

    def peak_activations(self) -> list[int]:
        """Per rank, the most (stage, microbatch) activations alive at once.

        An activation lives, whole, from the start of its forward to the end of its last
        backward pass (B, or W after I): W still needs the stage's saved inputs. That bounds
        what a split backward holds; :meth:`peak_activation_bytes` counts what I frees.
        """
        return [int(p) for p in self._peaks(lambda stage: 1, lambda stage: 1)]

    def peak_activation_bytes(self) -> list[float]:
        """Like :meth:`peak_activations`, weighted by ``stage_activation_bytes``; between a
        split backward's I and W only ``stage_weight_activation_bytes`` stay (the zero-bubble
        paper's M_W: I frees what only the input gradient needed).

        Example:
            >>> import conveyor.schedule as cs
            >>> sched = cs.executable(cs.build("zb-h1", ranks=2, microbatches=4)).compute
            >>> costs = cs.CostModel.uniform(2, activation_bytes=4.0, weight_activation_bytes=3.0)
            >>> cs.simulate(sched).peak_activations(), cs.simulate(sched, costs).peak_activation_bytes()
            ([2, 2], [8.0, 7.0])
        """
        if not self.stage_activation_bytes:
            return [0.0] * self.num_ranks
        full = self.stage_activation_bytes
        kept = self.stage_weight_activation_bytes or full
        return self._peaks(lambda stage: full[stage], lambda stage: kept[stage])

    def _peaks(self, weight, kept) -> list[float]:
        split = {(s.action.stage, s.action.microbatch) for s in self.spans if s.action.kind is ActionKind.I}
        by_rank: list[list[tuple[float, int, Span]]] = [[] for _ in range(self.num_ranks)]
        for index, s in enumerate(self.spans):
            by_rank[s.rank].append((s.start, index, s))
        peaks = []
        for rank_spans in by_rank:
            # A rank runs its actions one after another: order events by time, then by the
            # action's place in that sequence, so a release at the instant the next action
            # allocates comes first, and a zero-length forward allocates before its own backward
            # (also of zero length) releases.
            events: list[tuple[float, int, float]] = []
            for position, (_, _, s) in enumerate(sorted(rank_spans, key=lambda e: (e[0], e[1]))):
                a = s.action
                if a.kind is ActionKind.F:
                    events.append((s.start, 2 * position, weight(a.stage)))
                elif a.kind is ActionKind.I:
                    events.append((s.end, 2 * position + 1, kept(a.stage) - weight(a.stage)))
                elif a.kind is ActionKind.W:
                    events.append((s.end, 2 * position + 1, -kept(a.stage)))
                elif a.kind is ActionKind.B and (a.stage, a.microbatch) not in split:
                    events.append((s.end, 2 * position + 1, -weight(a.stage)))
            live = peak = 0.0
            for _, _, delta in sorted(events):
                live += delta
                peak = max(peak, live)
            peaks.append(peak)
        return peaks

    def summary(self) -> dict:
        """A JSON-ready dict of the headline figures."""
        return {
            "title": self.title,
            "source": self.source,
            "time_unit": self.time_unit,
            "ranks": self.num_ranks,
            "makespan": self.makespan,
            "bubble_ratio": self.bubble_ratio,
            "peak_activations": self.peak_activations(),
            "peak_activation_bytes": self.peak_activation_bytes(),
        }

    @classmethod
    def from_spans(cls, num_ranks: int, spans: Sequence[Span], **kwargs) -> Timeline:
        return cls(num_ranks, tuple(sorted(spans, key=lambda s: (s.start, s.rank))), **kwargs)


def measured_timeline(schedule, per_rank_events: Sequence[Sequence[tuple]]) -> Timeline:
    """A Timeline (seconds from the earliest start) of each rank's ``(action, start, end)`` of a step.

    ``schedule`` names the plan it ran (its name, ranks, V and M title the picture); actions
    may be :class:`Action` or their text.

    Example:
        >>> import conveyor.schedule as cs
        >>> tl = measured_timeline(cs.build("1f1b", ranks=1, microbatches=1), [[("0F0", 1.0, 1.5), ("0B0", 1.5, 2.5)]])
        >>> tl.makespan
        1.5
    """
    starts = [start for events in per_rank_events for _, start, _ in events]
    origin = min(starts, default=0.0)
    spans = [
        Span(rank, Action.parse(a) if isinstance(a, str) else a, start - origin, end - origin)
        for rank, events in enumerate(per_rank_events)
        for a, start, end in events
    ]
    return Timeline.from_spans(
        schedule.num_ranks, spans,
        title=f"{schedule.name} P={schedule.num_ranks} V={schedule.virtual} M={schedule.num_microbatches}",
        source="measured", time_unit="s",
        metadata={"schedule": schedule.name, "ranks": schedule.num_ranks, "virtual": schedule.virtual,
                  "microbatches": schedule.num_microbatches},
    )
