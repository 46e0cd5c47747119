"""ZB-1p and ZB-2p, zero-bubble schedules searched for the given costs (Qi et al., "Zero Bubble
(Almost) Pipeline Parallelism", ICLR 2024, Section 3, "Automatic pipeline scheduling"; the
heuristic of sail-sg/zero-bubble-pipeline-parallelism, re-derived here as a list scheduler).

One stage per rank, looped; the backward split into ``I`` (input gradient, on the
critical path) and ``W`` (weight gradient, any time after its ``I``). Where ZB-H1
and ZB-H2 fix the order of F, I and W by hand for equal costs, these are searched
for per-stage costs T_F, T_I, T_W and the message latency of a :class:`CostModel`,
under a cap on live activations per rank: P for ZB-1p (1F1B's peak), 2P for ZB-2p.
Every rank runs its F, its I and its W each in microbatch order (a stage
accumulates weight gradients as one device would), so the search only decides how
the three queues interleave. An activation counts as live from the start of its F
to the end of its W, as :meth:`Timeline.peak_activations` counts it.

Phases of the search, for P ranks, M microbatches and memory limit L:
  1. list-schedule all ranks at once in simulated time: a rank that falls idle runs
     the next I if its gradient has arrived, else the next F if it has arrived, the
     rank holds fewer than L live activations and fewer than its warm-up cap of F
     ahead of its I, else the oldest W if the gap until the next I or F is at least
     theta x T_W (theta = 1: W only fills a whole gap; 0: W whenever nothing else can run);
  2. repeat step 1 for 13 combinations of the knobs: warm-up caps a(P-1-r)+1+b on
     rank r (a in 1..3, b in 0..1, at most L), theta in {1, 0}, and whether an I that
     has arrived goes first or F and I alternate (see ``_KNOB_TABLE``); a run stops as
     soon as one rank's remaining work cannot end before the best makespan found;
  3. keep the best by makespan, and ZB-H1 (or ZB-H2, when L >= 2P-1) where that is
     no worse and fits the limit, so ZB-1p never loses to ZB-H1 on the same costs;
  4. stop early when the best makespan and longest span meet their lower bounds
     (:func:`span_bounds`); a tie in makespan goes to the shorter longest span (the
     paper's iteration time, when steps follow each other without a global barrier).

The times of step 1 are those :func:`~conveyor.schedule.simulate.simulate` computes for
the programs found (each action starts when its rank is free and its inputs have
arrived), so the makespan kept is the simulated one. The list scheduler keeps its own clock
rather than calling the engine's stepping loop (:mod:`conveyor.schedule.engine`), because
that loop steps programs already written, one rank as far as it can go, while here the
program is being written: which action a rank runs next depends on what its neighbours
have finished by that moment, so every rank advances together in time order (a heap of
events), and a run stops as soon as it cannot beat the best found. The handcrafted
candidates of step 3 are timed by :func:`~conveyor.schedule.simulate.simulate` itself. With no costs given,
T_F = T_I = T_W = 1 and no latency; there ZB-H1 and ZB-H2 already meet the lower
bound (P-1) T_F + M(T_F+T_I+T_W): ZB-1p returns ZB-H1, ZB-2p ZB-H2, whose ranks have
no gap from their first action to their last (below). Once T_W < T_F < T_I or
messages take time, the search wins: e.g. P=8, M=32, T = (1, 1.5, 0.5), latency 0.1:
ZB-2p 107.4 against ZB-H2's 107.9 (1F1B 123.8). Even at the lower bound the idle fraction of
:attr:`Timeline.bubble_ratio` keeps the start-up skew, rank r starting r x T_F late,
which the paper's bubble rate (per-rank spans) leaves out: see :func:`steady_bubble`.
Serves every P >= 1 and M >= 1, exactly V = 1.

Programs of build("zb-2p", ranks=4, microbatches=8), V=1, one line per rank::

    rank 0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 0I0 0W0 0F7 0I1 0W1 0I2 0W2 0I3 0W3 0I4 0W4 0I5 0W5 0I6
            0W6 0I7 0W7
    rank 1: 1F0 1F1 1F2 1F3 1F4 1I0 1F5 1I1 1F6 1I2 1W0 1F7 1I3 1W1 1I4 1W2 1I5 1W3 1I6 1W4 1I7
            1W5 1W6 1W7
    rank 2: 2F0 2F1 2F2 2I0 2F3 2I1 2F4 2I2 2F5 2I3 2F6 2I4 2W0 2F7 2I5 2W1 2I6 2W2 2I7 2W3 2W4
            2W5 2W6 2W7
    rank 3: 3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3F4 3I4 3F5 3I5 3F6 3I6 3W0 3F7 3I7 3W1 3W2 3W3 3W4
            3W5 3W6 3W7

Simulated with F=I=W=1 (so B=2), no latency: makespan 27, idle fraction 0.111,
peak live activations per rank [7, 7, 7, 7].
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from conveyor.errors import CostError, ScheduleError, positive_int
from conveyor.schedule.builtin._program import ProgramWriter, check_sizes
from conveyor.schedule.builtin.zb_h1 import zb_h1
from conveyor.schedule.builtin.zb_h2 import zb_h2
from conveyor.schedule.cost import CostModel
from conveyor.schedule.ir import ActionKind, Placement, Schedule
from conveyor.schedule.registry import register
from conveyor.schedule.timeline import Timeline

_F, _I, _W = 0, 1, 2
_KINDS = (ActionKind.F, ActionKind.I, ActionKind.W)
_INF = math.inf
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class Knobs:
    """One point of the search: warm-up caps per rank and the three tie rules (see the module)."""

    caps: tuple[int, ...]
    theta: float  # W runs in a gap of at least theta x T_W
    alternate: bool  # after an I, a ready F goes before a ready I (and after an F, the I)


@dataclass(frozen=True, slots=True)
class RankOrders:
    """What the search found: each rank's kinds in order (0 F, 1 I, 2 W), their makespan, and
    their longest span of one rank, first start to last end (the paper's iteration time)."""

    kinds: tuple[tuple[int, ...], ...]
    makespan: float
    span: float
    knobs: Knobs | None  # None: a handcrafted schedule won

    def beats(self, other: RankOrders) -> bool:
        """Ends sooner, or as soon with a shorter longest span (floats equal to 1e-9 relative)."""
        if self.makespan < other.makespan * (1 - _EPS):
            return True
        return self.makespan <= other.makespan * (1 + _EPS) and self.span < other.span * (1 - _EPS)


class _Costs:
    """Per-stage times as plain lists (the search reads them in its innermost loop)."""

    __slots__ = ("forward", "backward_input", "backward_weight", "latency")

    def __init__(self, costs: CostModel, num_ranks: int) -> None:
        costs.check_stages(num_ranks)
        self.forward = [s.forward for s in costs.stages]
        self.backward_input = [s.backward_input for s in costs.stages]
        self.backward_weight = [s.backward_weight for s in costs.stages]
        self.latency = float(costs.latency)


class _ListScheduler:
    """Step 1 of the search for one :class:`Knobs`: every rank's kinds in order, in simulated time.

    Events are (time, rank): a rank decides when it falls free, when an input it waits
    for arrives, and when a neighbour commits an action (its guess of an arrival may
    then change). An action starts at max(rank free, inputs arrived), as in simulate().
    """

    def __init__(self, num_ranks: int, num_microbatches: int, costs: _Costs, limit: int, knobs: Knobs) -> None:
        P, M = num_ranks, num_microbatches
        self.num_ranks, self.num_microbatches, self.limit, self.knobs = P, M, limit, knobs
        self.costs = costs
        self.end_f = [[_INF] * M for _ in range(P)]
        self.end_i = [[_INF] * M for _ in range(P)]
        self.done_f, self.done_i, self.done_w = [0] * P, [0] * P, [0] * P
        self.free = [0.0] * P
        self.first = [_INF] * P
        self.previous = [_I] * P  # the last F or I each rank ran
        self.remaining = [
            M * (costs.forward[r] + costs.backward_input[r] + costs.backward_weight[r]) for r in range(P)
        ]
        self.kinds: list[list[int]] = [[] for _ in range(P)]
        self.heap = [(0.0, r) for r in range(P)]

    def run(self, bound: float) -> RankOrders | None:
        """Each rank's kinds in order, or None once a rank cannot end by ``bound`` (the best makespan known)."""
        heap, free, remaining = self.heap, self.free, self.remaining
        pop, choose, commit = heapq.heappop, self._choose, self._commit
        left = 3 * self.num_ranks * self.num_microbatches
        while left:
            if heap:
                now, rank = pop(heap)
                if now < free[rank]:
                    continue  # busy: it decides again when it falls free
                kind, start = choose(rank, now, False)
                if kind < 0:
                    continue  # waits for an arrival or a neighbour's next action
            else:  # every rank waits on a guess: the first with a W held runs it
                rank = self._first_holding_weights()
                now = free[rank]
                kind, start = _W, now
            end = commit(rank, kind, start, now)
            if end + remaining[rank] > bound:
                return None
            left -= 1
        span = max(end - start for start, end in zip(self.first, free))
        return RankOrders(tuple(map(tuple, self.kinds)), max(free), span, self.knobs)

    def _first_holding_weights(self) -> int:
        holding = [r for r in range(self.num_ranks) if self.done_w[r] < self.done_i[r]]
        assert holding, "the list scheduler found no rank able to run anything"
        return min(holding, key=self.free.__getitem__)

    def _choose(self, r: int, now: float, forced: bool) -> tuple[int, float]:
        """(kind, start) of rank r's next action at time ``now``, or (-1, 0) to wait."""
        costs, knobs, c = self.costs, self.knobs, self.costs.latency
        t0, next_i, next_f = self.free[r], self.done_i[r], self.done_f[r]
        if next_i < next_f:
            if r == self.num_ranks - 1:
                ready_i = guess_i = self.end_f[r][next_i]
            else:
                ready_i = guess_i = self.end_i[r + 1][next_i] + c
                if ready_i == _INF:  # not started yet: the earliest it could arrive
                    guess_i = max(self.free[r + 1], now) + costs.backward_input[r + 1] + c
        else:
            ready_i = guess_i = _INF
        if (next_f < self.num_microbatches and next_f - self.done_w[r] < self.limit
                and next_f - next_i < knobs.caps[r]):
            if r == 0:
                ready_f = guess_f = 0.0
            else:
                ready_f = guess_f = self.end_f[r - 1][next_f] + c
                if ready_f == _INF:
                    guess_f = max(self.free[r - 1], now) + costs.forward[r - 1] + c
        else:
            ready_f = guess_f = _INF
        if ready_i <= now and (ready_f > now or not knobs.alternate or self.previous[r] == _F):
            return _I, max(t0, ready_i)
        if ready_f <= now:
            return _F, max(t0, ready_f)
        if self.done_w[r] < next_i and (forced or min(guess_i, guess_f) - t0 >= knobs.theta * costs.backward_weight[r]):
            return _W, t0
        return -1, 0.0

    def _commit(self, r: int, kind: int, start: float, now: float) -> float:
        """Run ``kind`` on rank r from ``start``; wake who depends on it; return its end."""
        costs, push, heap, c = self.costs, heapq.heappush, self.heap, self.costs.latency
        if kind == _W:
            took = costs.backward_weight[r]
            self.done_w[r] += 1
        else:  # a forward feeds the next rank, an I the rank before
            took, ends, done, fed = ((costs.forward[r], self.end_f, self.done_f, r + 1) if kind == _F
                                     else (costs.backward_input[r], self.end_i, self.done_i, r - 1))
            ends[r][done[r]] = start + took
            done[r] += 1
            if 0 <= fed < self.num_ranks:
                push(heap, (start + took + c, fed))
        end = start + took
        for neighbour in (r - 1, r + 1):  # their guesses of this rank's next action may change
            if 0 <= neighbour < self.num_ranks and self.free[neighbour] <= now:
                push(heap, (now, neighbour))
        self.free[r] = end
        if self.first[r] == _INF:
            self.first[r] = start
        self.remaining[r] -= took
        self.kinds[r].append(kind)
        if kind != _W:
            self.previous[r] = kind
        push(heap, (end, r))
        return end


# (slope, extra, theta, alternate) of the searched knobs, most useful first: a greedy set cover
# over 2,040 cases (P 2..12, M P..4P, uniform and random per-stage costs T_W < T_F < T_I among
# them, latency 0..0.3) kept the 13 that reach the best of all 48 tried (the grid below, and an
# F waiting for an I about to arrive, which never won) in every case.
_KNOB_TABLE = (
    (2, 1, 0.0, True), (2, 0, 0.0, True), (2, 0, 1.0, True), (3, 0, 0.0, False), (2, 1, 1.0, True),
    (1, 1, 0.0, True), (3, 0, 0.0, True), (1, 0, 0.0, True), (3, 1, 0.0, False), (1, 1, 1.0, True),
    (2, 0, 0.0, False), (3, 0, 1.0, False), (2, 1, 0.0, False),
)


def knob_grid(num_ranks: int, limit: int) -> list[Knobs]:
    """Step 2's combinations, the likeliest winners first (so that pruning bites early).

    Example:
        >>> grid = knob_grid(4, 8)
        >>> len(grid), grid[0]
        (13, Knobs(caps=(8, 6, 4, 2), theta=0.0, alternate=True))
    """
    grid = (Knobs(tuple(max(1, min(limit, slope * (num_ranks - 1 - r) + 1 + extra)) for r in range(num_ranks)),
                  theta, alternate) for slope, extra, theta, alternate in _KNOB_TABLE)
    return list(dict.fromkeys(grid))  # once each: small limits cap several slopes alike


def lower_bound(num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: int | None = None) -> float:
    """No schedule of one stage per rank holding at most ``memory_limit`` live activations
    per rank (None: no limit) ends sooner (see :func:`span_bounds`).

    Example:
        >>> lower_bound(4, 8, CostModel.uniform(4)), lower_bound(4, 8, CostModel.uniform(4, 1, 2, 1), 4)
        (27.0, 38.0)
    """
    return max(skew + span for skew, span in span_bounds(num_ranks, num_microbatches, costs, memory_limit))


def span_bounds(
    num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: int | None = None
) -> list[tuple[float, float]]:
    """Per rank r: (earliest first start, shortest span from first start to last end).

    Rank r starts after the forwards of the ranks before it; its span holds all its own
    work, and at least: its first L forwards, the round trip of microbatch 0 until its
    I on rank r can start, then every I and W and the forwards beyond the first L, which
    need the first W to have freed an activation.

    Example:
        >>> span_bounds(2, 4, CostModel.uniform(2), 2)
        [(0.0, 13.0), (1.0, 12.0)]
    """
    P, M, c = num_ranks, num_microbatches, costs.latency
    stages = costs.stages[:P]
    limit = M if memory_limit is None else memory_limit
    bounds = []
    for r, stage in enumerate(stages):
        skew = sum(s.forward for s in stages[:r]) + r * c
        turn = sum(s.forward for s in stages[r:]) + sum(s.backward_input for s in stages[r + 1 :]) + 2 * (P - 1 - r) * c
        after = M * stage.full_backward + max(0, M - limit) * stage.forward
        bounds.append((float(skew), float(max(M * (stage.forward + stage.full_backward), turn + after))))
    return bounds


def search(num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: int,
           best: RankOrders = RankOrders((), _INF, _INF, None)) -> RankOrders:
    """Steps 1, 2 and 4 alone: the best list-scheduled orders (:func:`zb_auto` adds step 3, passing
    the handcrafted candidate's score as ``best``, the one to beat; returned when nothing does).

    Example:
        >>> found = search(2, 3, CostModel.uniform(2), 4)
        >>> found.makespan, found.span, found.kinds[0]
        (10.0, 9.0, (0, 0, 0, 1, 2, 1, 2, 1, 2))
    """
    plain = _Costs(costs, num_ranks)
    bounds = span_bounds(num_ranks, num_microbatches, costs, memory_limit)
    floor = max(skew + span for skew, span in bounds) * (1 + _EPS)
    floor_span = max(span for _, span in bounds) * (1 + _EPS)
    for knobs in knob_grid(num_ranks, memory_limit):
        if best.makespan <= floor and best.span <= floor_span:
            break
        found = _ListScheduler(num_ranks, num_microbatches, plain, memory_limit, knobs).run(
            best.makespan * (1 + _EPS)
        )
        if found is not None and found.beats(best):
            best = found
    return best


def zb_auto(
    num_ranks: int,
    num_microbatches: int,
    *,
    memory_limit: int,
    costs: CostModel | None = None,
    name: str = "zb-auto",
) -> Schedule:
    """A zero-bubble schedule searched for ``costs``, holding at most ``memory_limit`` live
    activations per rank (in units of one microbatch's activations of one stage).

    ``costs`` has one stage per rank (default: F=I=W=1, no latency). ZB-1p is
    ``memory_limit=P``, ZB-2p ``memory_limit=2P``.

    Example:
        >>> import conveyor.schedule as cs
        >>> costs = cs.CostModel.uniform(4, 1.0, 1.5, 0.5, latency=0.1)
        >>> sched = zb_auto(4, 12, memory_limit=6, costs=costs)
        >>> max(cs.simulate(sched, costs).peak_activations()) <= 6
        True
    """
    check_sizes(name, num_ranks, num_microbatches, 1)
    if not positive_int(memory_limit):
        raise ScheduleError(
            f"schedule {name!r}: memory_limit must be a positive integer (live activations per rank, "
            f"P = {num_ranks} for 1F1B's peak), got {memory_limit!r}"
        )
    if costs is None:
        costs = CostModel.uniform(num_ranks)
    if not isinstance(costs, CostModel):
        raise CostError(f"schedule {name!r}: costs must be a CostModel, got {type(costs).__name__}")
    costs.check_stages(num_ranks)
    handcrafted, found = _best_handcrafted(num_ranks, num_microbatches, costs, memory_limit)
    found = search(num_ranks, num_microbatches, costs, memory_limit, found)
    if found.knobs is None and handcrafted is not None:
        return Schedule(name, handcrafted.placement, num_microbatches, handcrafted.programs)
    return _schedule_of(name, num_ranks, num_microbatches, found)


def _best_handcrafted(
    num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: int
) -> tuple[Schedule | None, RankOrders]:
    """ZB-H1 or ZB-H2, the better of those within the limit, and its simulated score (no kinds)."""
    from conveyor.schedule.simulate import simulate  # simulate imports the registry's neighbours

    best, score = None, RankOrders((), _INF, _INF, None)
    for builder, peak in ((zb_h1, num_ranks), (zb_h2, 2 * num_ranks - 1)):
        if min(peak, num_microbatches) > memory_limit:
            continue
        schedule = builder(num_ranks, num_microbatches)
        timeline = simulate(schedule, costs)
        candidate = RankOrders((), timeline.makespan, max(b - a for a, b in _rank_spans(timeline)), None)
        if candidate.beats(score):
            best, score = schedule, candidate
    return best, score


def _schedule_of(name: str, num_ranks: int, num_microbatches: int, found: RankOrders) -> Schedule:
    programs = []
    for rank, kinds in enumerate(found.kinds):
        writer, counts = ProgramWriter(), [0, 0, 0]
        for kind in kinds:
            writer.add(_KINDS[kind], rank, counts[kind])
            counts[kind] += 1
        programs.append(writer.packed(num_ranks, num_microbatches))
    return Schedule(name, Placement.looped(num_ranks, 1), num_microbatches, tuple(programs))


def zb_1p(num_ranks: int, num_microbatches: int, virtual: int = 1, *, costs: CostModel | None = None) -> Schedule:
    """ZB-1p: searched for ``costs``, at most P live activations per rank (1F1B's peak).

    Example:
        >>> [str(a) for a in zb_1p(2, 2).programs[1]]
        ['1F0', '1I0', '1F1', '1I1', '1W0', '1W1']
    """
    check_sizes("zb-1p", num_ranks, num_microbatches, virtual, only_virtual=1)
    return zb_auto(num_ranks, num_microbatches, memory_limit=num_ranks, costs=costs, name="zb-1p")


def zb_2p(num_ranks: int, num_microbatches: int, virtual: int = 1, *, costs: CostModel | None = None) -> Schedule:
    """ZB-2p: searched for ``costs``, at most 2P live activations per rank.

    Example:
        >>> [str(a) for a in zb_2p(2, 3).programs[0]]
        ['0F0', '0F1', '0F2', '0I0', '0W0', '0I1', '0W1', '0I2', '0W2']
    """
    check_sizes("zb-2p", num_ranks, num_microbatches, virtual, only_virtual=1)
    return zb_auto(num_ranks, num_microbatches, memory_limit=2 * num_ranks, costs=costs, name="zb-2p")


def steady_bubble(timeline: Timeline) -> float:
    """The zero-bubble paper's bubble rate: idle time within each rank's own span, over
    P x the longest span (what :attr:`Timeline.bubble_ratio` counts, less the start-up skew).

    Example:
        >>> import conveyor.schedule as cs
        >>> timeline = cs.simulate(cs.build("zb-2p", ranks=4, microbatches=12))
        >>> round(timeline.bubble_ratio, 3), steady_bubble(timeline)
        (0.077, 0.0)
    """
    busy = sum(span.end - span.start for span in timeline.spans)
    longest = max((b - a for a, b in _rank_spans(timeline) if b >= a), default=0.0)
    total = timeline.num_ranks * longest
    return (total - busy) / total if total > 0 else 0.0


register(
    "zb-1p",
    zb_1p,
    description="zero bubble searched for the costs, memory P (1F1B's); never slower than zb-h1 (Qi et al. 2024)",
    default_virtual=1,
    virtual_choices=(1,),
    uses_costs=True,
)
register(
    "zb-2p",
    zb_2p,
    description="zero bubble searched for the costs, memory 2P; no bubble but start-up with F=I=W (Qi et al. 2024)",
    default_virtual=1,
    virtual_choices=(1,),
    uses_costs=True,
)


def _rank_spans(timeline: Timeline) -> list[tuple[float, float]]:
    """(first start, last end) of each rank ((inf, -inf) for a rank that ran nothing)."""
    first = [_INF] * timeline.num_ranks
    last = [-_INF] * timeline.num_ranks
    for span in timeline.spans:
        first[span.rank] = min(first[span.rank], span.start)
        last[span.rank] = max(last[span.rank], span.end)
    return list(zip(first, last))
