"""The one Timeline type: simulated schedules and measured runs alike.

A :class:`Timeline` is every compute action's start and end per rank. Makespan,
bubble ratio and peak live activations are derived from the spans, so a
simulated step and a measured one are summarised by the same code and can be
drawn side by side.

Example:
    >>> from conveyor.schedule.ir import F, B
    >>> tl = Timeline(2, (Span(0, F(0, 0), 0, 1), Span(1, F(1, 0), 1, 2),
    ...                   Span(1, B(1, 0), 2, 4), Span(0, B(0, 0), 4, 6)))
    >>> tl.makespan, tl.bubble_ratio
    (6, 0.5)
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain, repeat
from operator import floordiv, sub

from conveyor.schedule.ir import Action, ActionKind, PackedProgram, in_bulk


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


@dataclass(frozen=True, slots=True)
class CommSpan:
    """One communication (an all-to-all of an MoE layer) of one rank, on its own lane beside the
    compute: ``label`` names what it serves (e.g. ``"2F5"``: an exchange of stage 2's forward of
    microbatch 5), from ``start`` to ``end``."""

    rank: int
    label: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


class _RankSpans:
    """What the spans of one rank of a :class:`PackedSpans` read their fields from."""

    __slots__ = ("rank", "program", "starts", "ends")

    def __init__(self, rank: int, program: PackedProgram, starts: array, ends: array) -> None:
        self.rank, self.program, self.starts, self.ends = rank, program, starts, ends


class _PackedSpan(Span):
    """A Span of a :class:`PackedSpans`, made with two fields (its rank's arrays and its index)
    and reading the others when asked: iterating 3M spans to read their ends makes no Action.
    Equal to, and hashed like, the Span of the same fields."""

    __slots__ = ("_of", "_at")

    rank = property(lambda self: self._of.rank)  # type: ignore[assignment]
    start = property(lambda self: self._of.starts[self._at])  # type: ignore[assignment]
    end = property(lambda self: self._of.ends[self._at])  # type: ignore[assignment]

    @property
    def action(self) -> Action:  # type: ignore[override]
        return self._of.program[self._at]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Span):
            return NotImplemented
        return (self.rank, self.action, self.start, self.end) == (other.rank, other.action, other.start, other.end)

    def __hash__(self) -> int:
        return hash((self.rank, self.action, self.start, self.end))

    def __repr__(self) -> str:
        return f"Span(rank={self.rank!r}, action={self.action!r}, start={self.start!r}, end={self.end!r})"


class PackedSpans(Sequence[Span]):
    """A simulated timeline's spans, rank by rank in program order, made when read.

    Per rank, its (compute-only) program and the start and end of each of its actions: 24
    bytes per action where Span objects take over 150. Sequence of :class:`Span` like the
    tuple it replaces (and equal to it). A rank's actions run one after another, each starting
    no earlier than the previous one ended (the summaries rely on it).

    Example:
        >>> import conveyor.schedule as cs
        >>> spans = cs.simulate(cs.build("1f1b", ranks=2, microbatches=1)).spans
        >>> len(spans), spans[1]
        (4, Span(rank=0, action=Action(kind=<ActionKind.B: 'B'>, stage=0, microbatch=0), start=4.0, end=6.0))
    """

    __slots__ = ("programs", "starts", "ends", "_offsets")

    def __init__(self, programs: Sequence[PackedProgram], starts: Sequence[array], ends: Sequence[array]) -> None:
        self.programs, self.starts, self.ends = tuple(programs), tuple(starts), tuple(ends)
        self._offsets = list(accumulate(map(len, self.starts), initial=0))

    def __len__(self) -> int:
        return self._offsets[-1]

    def rank_spans(self, rank: int) -> list[Span]:
        """The spans of ``rank``, made in bulk (Span.__init__ of a frozen dataclass costs 4x more)."""
        count = len(self.starts[rank])
        if not count:
            return []
        of = _RankSpans(rank, self.programs[rank], self.starts[rank], self.ends[rank])
        return in_bulk(_PackedSpan, count, {"_of": repeat(of, count), "_at": range(count)})

    def __iter__(self) -> Iterator[Span]:
        return chain.from_iterable(map(self.rank_spans, range(len(self.starts))))

    def __getitem__(self, index):  # noqa: ANN001, ANN204 - int or slice, as a tuple's
        if isinstance(index, slice):
            return tuple(self)[index]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("span index out of range")
        rank = bisect_right(self._offsets, index) - 1
        at = index - self._offsets[rank]
        return Span(rank, self.programs[rank][at], self.starts[rank][at], self.ends[rank][at])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedSpans):
            return (self.starts, self.ends, self.programs) == (other.starts, other.ends, other.programs)
        if isinstance(other, tuple | list):
            return len(other) == len(self) and tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"PackedSpans({len(self)} spans on {len(self.starts)} ranks)"

    def deltas(self, rank: int, by_key: Sequence[float]) -> Iterator[float]:
        """``by_key[kind * S + stage]`` of each action of ``rank``, in program order."""
        program = self.programs[rank]
        return map(by_key.__getitem__, map(floordiv, program.codes, repeat(program.num_microbatches)))


@dataclass(frozen=True)
class Timeline:
    """What each rank did when. ``source`` is ``"simulated"`` or ``"measured"``.

    ``stage_activation_bytes[stage]`` (optional) weighs live activations in bytes;
    ``stage_weight_activation_bytes[stage]`` (optional: all of them) is the part a split
    backward's W still needs after its I (see :class:`~conveyor.schedule.cost.StageCosts`).
    ``spans`` come in no particular order across ranks; :meth:`spans_of` sorts one rank's.
    ``comm_spans`` (optional) are the ranks' all-to-alls, drawn on a lane under each rank's
    compute; ``exposed_comm[rank]`` the part of that rank's communication time its compute
    waited for (not hidden behind other compute).
    """

    num_ranks: int
    spans: tuple[Span, ...]
    title: str = ""
    source: str = "simulated"
    time_unit: str = "unit"
    stage_activation_bytes: tuple[float, ...] = ()
    stage_weight_activation_bytes: tuple[float, ...] = ()
    metadata: dict = field(default_factory=dict)
    comm_spans: tuple[CommSpan, ...] = ()
    exposed_comm: tuple[float, ...] = ()

    @property
    def start(self) -> float:
        if isinstance(self.spans, PackedSpans):  # a rank's actions run one after another
            return min((times[0] for times in self.spans.starts if times), default=0.0)
        return min((s.start for s in self.spans), default=0.0)

    @property
    def end(self) -> float:
        if isinstance(self.spans, PackedSpans):
            return max((times[-1] for times in self.spans.ends if times), default=0.0)
        return max((s.end for s in self.spans), default=0.0)

    @property
    def makespan(self) -> float:
        return self.end - self.start

    def spans_of(self, rank: int) -> list[Span]:
        if isinstance(self.spans, PackedSpans):  # in time order already
            return self.spans.rank_spans(rank)
        return sorted((s for s in self.spans if s.rank == rank), key=lambda s: s.start)

    def busy_time(self, rank: int) -> float:
        if isinstance(self.spans, PackedSpans):  # compute actions only, in program order
            return sum(map(sub, self.spans.ends[rank], self.spans.starts[rank]))
        return sum(s.duration for s in self.spans if s.rank == rank and s.action.kind.is_compute)

    @property
    def bubble_ratio(self) -> float:
        """Idle rank-time over ``num_ranks x makespan``."""
        total = self.num_ranks * self.makespan
        if total <= 0:
            return 0.0
        # One pass over the spans (busy_time per rank would scan them num_ranks times).
        if isinstance(self.spans, PackedSpans):  # the same sum, in the same order
            spans = self.spans
            busy = sum(chain.from_iterable(map(map, repeat(sub), spans.ends, spans.starts)))
        else:
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
        if isinstance(self.spans, PackedSpans):
            return self._packed_peaks(weight, kept)
        split = {(s.action.stage, s.action.microbatch) for s in self.spans if s.action.kind is ActionKind.I}
        by_rank: list[list[Span]] = [[] for _ in range(self.num_ranks)]
        for s in self.spans:
            by_rank[s.rank].append(s)
        peaks = []
        for rank_spans in by_rank:
            # A rank runs its actions one after another (by start; a stable sort keeps the given order
            # of a tie): order events by time, then by the action's place in that sequence, so a
            # release at the instant the next action allocates comes first, and a zero-length forward
            # allocates before its own backward (also of zero length) releases.
            events: list[tuple[float, int, float]] = []
            for position, s in enumerate(sorted(rank_spans, key=lambda span: span.start)):
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

    def _packed_peaks(self, weight, kept) -> list[float]:
        """:meth:`_peaks` of a simulated timeline: a rank's actions run one after another, each
        starting no earlier than the last one ended, so its events come in program order
        already (what the sort gives) and the running sum is a C loop."""
        spans = self.spans
        if not spans.programs:
            return []
        S = spans.programs[0].num_stages
        # What each (kind, stage) adds to the live activations, as the sorted events of _peaks.
        by_key = [weight(s) for s in range(S)] + [-weight(s) for s in range(S)]  # F, B
        by_key += [kept(s) - weight(s) for s in range(S)] + [-kept(s) for s in range(S)]  # I, W
        return [max(accumulate(spans.deltas(rank, by_key), initial=0.0)) for rank in range(self.num_ranks)]

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
        } | ({"exposed_comm_share": self.exposed_comm_share} if self.comm_spans else {})

    def comm_time(self, rank: int) -> float:
        """The time ``rank``'s communication lane was busy (its comm spans summed)."""
        return sum(span.end - span.start for span in self.comm_spans if span.rank == rank)

    @property
    def exposed_comm_share(self) -> float:
        """The largest share of the makespan any rank's compute waited for its own communication.

        Example:
            >>> from conveyor.schedule.ir import F
            >>> tl = Timeline(1, (Span(0, F(0, 0), 0, 4),), comm_spans=(CommSpan(0, "0F0", 1, 2),),
            ...               exposed_comm=(1.0,))
            >>> tl.exposed_comm_share, tl.summary()["exposed_comm_share"]
            (0.25, 0.25)
        """
        makespan = self.makespan
        return max(self.exposed_comm, default=0.0) / makespan if makespan > 0 else 0.0

    @classmethod
    def from_spans(cls, num_ranks: int, spans: Sequence[Span], *, title: str = "", source: str = "simulated",
                   time_unit: str = "unit", stage_activation_bytes: Sequence[float] = (),
                   stage_weight_activation_bytes: Sequence[float] = (), metadata: dict | None = None,
                   comm_spans: Sequence[CommSpan] = (), exposed_comm: Sequence[float] = ()) -> Timeline:
        """A Timeline of ``spans`` in any order (sorted here by start, then rank); the other fields as the
        constructor's."""
        return cls(num_ranks, tuple(sorted(spans, key=lambda s: (s.start, s.rank))), title=title, source=source,
                   time_unit=time_unit, stage_activation_bytes=tuple(stage_activation_bytes),
                   stage_weight_activation_bytes=tuple(stage_weight_activation_bytes), metadata=dict(metadata or {}),
                   comm_spans=tuple(sorted(comm_spans, key=lambda s: (s.start, s.rank))),
                   exposed_comm=tuple(exposed_comm))


def measured_timeline(schedule, per_rank_events: Sequence[Sequence[tuple]], *,
                      comm_events: Sequence[tuple[int, str, float, float]] = (),
                      exposed_comm: Sequence[float] | None = None) -> Timeline:
    """A Timeline (seconds from the earliest start) of each rank's ``(action, start, end)`` of a step.

    ``schedule`` names the schedule it ran (its name, ranks, V and M title the picture); actions
    may be :class:`Action` or their text. ``comm_events``: the step's all-to-alls, each
    ``(rank, label, start, end)`` on the same clock, drawn on a lane under their rank's compute.
    ``exposed_comm``: per rank, how long its compute waited for them, where the runtime measured
    it; by default the time a rank's comm events cover and none of its compute spans does (an
    overlapped pair recorded as two spans over its whole interval then hides its waits: pass them).

    Example:
        >>> import conveyor.schedule as cs
        >>> tl = measured_timeline(cs.build("1f1b", ranks=1, microbatches=1), [[("0F0", 1.0, 1.5), ("0B0", 1.5, 2.5)]])
        >>> tl.makespan
        1.5
        >>> tl = measured_timeline(cs.build("1f1b", ranks=1, microbatches=1),
        ...                        [[("0F0", 1.0, 1.5), ("0B0", 2.0, 2.5)]], comm_events=[(0, "0F0", 1.25, 2.0)])
        >>> tl.comm_spans[0].start, tl.exposed_comm
        (0.25, (0.5,))
    """
    starts = [start for events in per_rank_events for _, start, _ in events]
    origin = min(starts + [start for _, _, start, _ in comm_events], default=0.0)
    spans = [
        Span(rank, Action.parse(a) if isinstance(a, str) else a, start - origin, end - origin)
        for rank, events in enumerate(per_rank_events)
        for a, start, end in events
    ]
    comm = [CommSpan(rank, str(label), start - origin, end - origin) for rank, label, start, end in comm_events]
    if exposed_comm is None and comm:
        exposed_comm = [_uncovered([(s.start, s.end) for s in comm if s.rank == rank],
                                   [(s.start, s.end) for s in spans if s.rank == rank])
                        for rank in range(schedule.num_ranks)]
    title, metadata = schedule_labels(schedule)
    return Timeline.from_spans(schedule.num_ranks, spans, title=title, source="measured", time_unit="s",
                               metadata=metadata, comm_spans=comm, exposed_comm=exposed_comm or ())


def schedule_labels(schedule) -> tuple[str, dict]:  # noqa: ANN001 - a Schedule
    """The title and the metadata of a timeline of ``schedule``.

    Example:
        >>> import conveyor.schedule as cs
        >>> schedule_labels(cs.build("1f1b", ranks=4, microbatches=8))[0]
        '1f1b P=4 V=1 M=8'
    """
    title = f"{schedule.name} P={schedule.num_ranks} V={schedule.virtual} M={schedule.num_microbatches}"
    return title, {"schedule": schedule.name, "ranks": schedule.num_ranks, "virtual": schedule.virtual,
                   "microbatches": schedule.num_microbatches}


def _uncovered(intervals: Sequence[tuple[float, float]], cover: Sequence[tuple[float, float]]) -> float:
    """How long the union of ``intervals`` lies outside the union of ``cover``.

    Example:
        >>> _uncovered([(0, 2), (1, 3)], [(0.5, 1), (2.5, 4)])
        2.0
    """
    def union(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
        merged: list[list[float]] = []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return [(start, end) for start, end in merged]

    covered = union(cover)
    total = 0.0
    for start, end in union(intervals):
        total += end - start - sum(max(0.0, min(end, c_end) - max(start, c_start)) for c_start, c_end in covered)
    return total
