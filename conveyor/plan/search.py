"""The search: split points x schedule x microbatches x stages per rank, each simulated.

For every microbatch count M (divisors of the global batch, at least the rank count when
one is) the unit costs are rescaled to the microbatch size; for every V, the fastest split
of the units into P x V stages is found once (:func:`~conveyor.plan.balance.fastest_split`)
and shared by every schedule of that V. Candidates are visited in order of a lower bound on
their step (the busiest rank's compute, plus the forwards before it); one whose bound is
above the best step found so far is not simulated. Each simulated candidate gets the
memory of each rank: parameters, gradients and optimizer state of its stages, plus the
activations at the simulation's peak. When a lighter split is within ``SearchSpace.balance_tolerance``
of the fastest one's slowest stage (fewer blocks where the schedule keeps more microbatches
in flight), it is simulated too and kept when it fits where the other does not, or runs as
fast; a candidate over ``memory_per_rank`` also tries the lightest split at any speed. When no
candidate fits, the fastest few over the limit try recomputing blocks' activations in backward, stage by stage
(:func:`~conveyor.plan.predict.fit_by_recomputing`): a plan that fits that way carries its
policies (``Plan.recompute``), which the pipeline applies.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import conveyor.schedule as cs
from conveyor.errors import ConveyorError, PlanError, positive_int
from conveyor.plan.balance import StageSums, bounds_of, fastest_split, lightest_split
from conveyor.plan.costs import CostTable
from conveyor.plan.expert_search import ExpertParallelOption, expert_units
from conveyor.plan.predict import fit_by_recomputing, predict_split, stage_costs
from conveyor.plan.settings import Machine, SearchSpace
from conveyor.plan.tensor_search import TensorParallelOption, shard_units
from conveyor.schedule.overlap import pair_forward_backward

RECOMPUTE_TRIES = 8  # over-memory candidates, fastest first, that try recomputation when nothing fits

if TYPE_CHECKING:  # measuring a calibration loads torch; searching with one does not
    from conveyor.plan.calibration import Calibration


@dataclass
class Candidate:
    """One (schedule, V, M, split) and what simulating it predicted; ``verdict`` is ``"fits"``,
    ``"over memory"``, ``"slower (bound)"`` (not simulated: its lower bound is above the best step)
    or ``"failed: ..."``."""

    schedule: str
    virtual: int
    microbatches: int
    cuts: tuple[int, ...] = ()
    split_points: tuple[str, ...] = ()
    step_time: float = math.inf
    bubble: float = math.nan
    memory_per_rank: tuple[float, ...] = ()
    stage_times: tuple[float, ...] = ()
    lower_bound: float = 0.0
    verdict: str = "pending"
    schedule_costs: cs.CostModel | None = None  # what a cost-planned schedule (zb-1p, zb-2p) was built for
    recompute: tuple = ()  # a policy per stage that made it fit (conveyor.plan.predict.fit_by_recomputing)
    expert_overlap: bool = False  # the all-to-alls hidden in the schedule's pairs (what was simulated)

    @property
    def peak_memory(self) -> float:
        return max(self.memory_per_rank, default=math.nan)

    def describe(self) -> str:
        """One line: schedule, V, M, predicted step and peak memory."""
        memory = f", peak {self.peak_memory / 2**30:.3g} GiB/rank" if self.memory_per_rank else ""
        recompute = f", recompute {list(self.recompute)}" if self.recompute else ""
        overlap = ", all-to-alls overlapped" if self.expert_overlap else ""
        return (f"{self.schedule} V={self.virtual} M={self.microbatches}: step {self.step_time:.4g} s{memory}"
                f"{recompute}{overlap}")


@dataclass
class SearchResult:
    """Every candidate looked at (fastest fitting first), the microbatch size of each M, the settings used."""

    candidates: list[Candidate]
    settings: dict = field(default_factory=dict)

    @property
    def fitting(self) -> list[Candidate]:
        return sorted((c for c in self.candidates if c.verdict == "fits"), key=lambda c: (c.step_time, c.peak_memory))

    def counts(self) -> dict[str, int]:
        """How many candidates ended how (``failed: ...`` counted as ``failed``)."""
        return dict(Counter("failed" if c.verdict.startswith("failed") else c.verdict for c in self.candidates))

    def best_over_memory(self) -> Candidate | None:
        over = [c for c in self.candidates if c.verdict == "over memory"]
        return min(over, key=lambda c: c.step_time, default=None)


def microbatch_choices(global_batch: int, ranks: int) -> list[int]:
    """Divisors M of the global batch with M >= ranks (every divisor when none is that large).

    Example:
        >>> microbatch_choices(16, 2), microbatch_choices(4, 8)
        ([2, 4, 8, 16], [1, 2, 4])
    """
    divisors = [m for m in range(1, global_batch + 1) if global_batch % m == 0]
    return [m for m in divisors if m >= ranks] or divisors


def schedule_choices(schedules: Sequence[str] | None, virtual: Sequence[int]) -> list[tuple[str, int]]:
    """(name, V) pairs to try: every registered schedule (or those named) with each V it runs.

    Example:
        >>> schedule_choices(["1f1b", "zbv"], (1, 2))
        [('1f1b', 1), ('zbv', 2)]
    """
    known = cs.available()
    names = list(known) if schedules is None else list(schedules)
    unknown = [name for name in names if name not in known]
    if unknown:
        raise PlanError(f"unknown schedule(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
    pairs = []
    for name in names:
        choices = known[name].virtual_choices
        pairs += [(name, v) for v in virtual if choices is None or v in choices]
    return pairs


def search(table: CostTable, *, ranks: int, global_batch: int, memory_per_rank: float,
           schedules: Sequence[str] | None = None, microbatches: Sequence[int] | None = None,
           space: SearchSpace = SearchSpace(), machine: Machine = Machine(),
           optimizer_s_per_parameter: float = 0.0,
           tensor_parallel: TensorParallelOption | None = None,
           expert_parallel: ExpertParallelOption | None = None) -> SearchResult:
    """Simulate the candidates worth simulating; see the module docstring.

    ``space`` adds the stages per rank to try and the balance tolerance; ``machine`` the links
    (``bandwidth``, ``latency``) and the optimizer state per parameter. With a
    ``machine.calibration`` (a :class:`~conveyor.plan.calibration.Calibration`) each step is
    :func:`~conveyor.plan.predict.predict_split`'s: the calibration's overheads and message
    latency (instead of the links'), its per-step time, and each rank's optimizer step at
    ``optimizer_s_per_parameter``, on ``machine.cores`` shared CPU cores (None or "auto": a device per rank).
    ``tensor_parallel`` (a :class:`~conveyor.plan.tensor_search.TensorParallelOption`): each of the ``ranks``
    pipeline ranks is a group of its ``tp`` ranks, the units costed as one of them
    (:func:`~conveyor.plan.tensor_search.shard_units`). ``expert_parallel`` (an
    :class:`~conveyor.plan.expert_search.ExpertParallelOption`): the experts shared by ep replicas, their tokens
    moved all-to-all (:func:`~conveyor.plan.expert_search.expert_units`), sized for ``tensor_parallel``'s tp.

    Example:
        >>> from conveyor.plan.costs import synthetic_table
        >>> table = synthetic_table([("embed", 1, 0, 1, 8, 64)] + [(f"b{i}", 1, 1, 1, 8, 64, True) for i in range(4)])
        >>> result = search(table, ranks=2, global_batch=4, memory_per_rank=1e6, schedules=["1f1b"])
        >>> best = result.fitting[0]
        >>> best.schedule, best.microbatches, best.split_points
        ('1f1b', 4, ('b2',))
    """
    calibration = machine.calibration
    if calibration is not None and not hasattr(calibration, "as_dict"):
        raise PlanError(f"search() takes Machine(calibration=) as a conveyor.plan.calibration.Calibration, got "
                        f"{type(calibration).__name__}; conveyor.plan.plan() converts its as_dict(), or pass "
                        "Calibration(**that)")
    cores = None if machine.cores == "auto" else machine.cores  # "auto" needs the model's device: plan() resolves it
    _check_sizes(ranks, global_batch, memory_per_rank, len(table.units))
    ms = list(microbatches) if microbatches is not None else microbatch_choices(global_batch, ranks)
    bad = [m for m in ms if global_batch % m]
    if bad:
        raise PlanError(f"microbatch counts {bad} do not divide the global batch {global_batch}")
    context = _Context(table, ranks, global_batch, memory_per_rank, machine, space, optimizer_s_per_parameter, cores,
                       tensor_parallel, _sized_alike(tensor_parallel, expert_parallel))
    queue = []
    for m in ms:
        for name, v in schedule_choices(schedules, space.virtual):
            candidate = Candidate(name, v, m)
            if ranks * v > len(table.units):
                candidate.verdict = (f"failed: {ranks * v} stages need {ranks * v} units, "
                                     f"the model has {len(table.units)}")
            else:
                candidate.cuts = tuple(context.fastest(m, v))
                candidate.lower_bound = context.lower_bound(candidate)
            queue.append(candidate)
    best = math.inf
    for candidate in sorted(queue, key=lambda c: c.lower_bound):
        if candidate.verdict != "pending":
            continue
        if candidate.lower_bound > best:
            candidate.verdict = "slower (bound)"
            continue
        context.evaluate(candidate)
        if candidate.verdict == "fits":
            best = min(best, candidate.step_time)
    if best == math.inf:  # nothing fits as it is: the fastest few, with blocks recomputed where they must be
        over = sorted((c for c in queue if c.verdict == "over memory"), key=lambda c: c.step_time)
        for candidate in over[:RECOMPUTE_TRIES]:
            context.fit_by_recomputing(candidate)
    settings = dict(ranks=ranks, global_batch=global_batch, memory_per_rank=memory_per_rank,
                    bandwidth=machine.bandwidth, latency=machine.latency,
                    optimizer_bytes_per_parameter=machine.optimizer_bytes_per_parameter,
                    balance_tolerance=space.balance_tolerance,
                    calibration=None if calibration is None else calibration.as_dict(),
                    optimizer_s_per_parameter=optimizer_s_per_parameter, cores=cores)
    if tensor_parallel is not None:
        settings["tensor_parallel"] = tensor_parallel.tp
    if expert_parallel is not None:  # and whether its all-to-alls were tried overlapped
        settings["expert_parallel"], settings["expert_overlap"] = expert_parallel.ep, space.expert_overlap
    return SearchResult(queue, settings)


def _check_sizes(ranks: int, global_batch: int, memory_per_rank: float, units: int) -> None:
    for name, value in (("ranks", ranks), ("global_batch", global_batch)):
        if not positive_int(value):
            raise PlanError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(memory_per_rank, int | float) or not memory_per_rank > 0:
        raise PlanError(f"memory_per_rank must be a positive number of bytes, got {memory_per_rank!r}")
    if ranks > units:
        raise PlanError(f"{ranks} ranks need at least {ranks} splittable units, the model has {units}; "
                        "use fewer ranks")


def _sized_alike(tensor: TensorParallelOption | None, experts: ExpertParallelOption | None):
    """``experts``, refused unless it was sized for ``tensor``'s tp (its all-to-alls move one TP rank's rows)."""
    tp = tensor.tp if tensor is not None else 1
    if experts is not None and experts.tp != tp:
        raise PlanError(f"an ExpertParallelOption sized for tp={experts.tp} cannot cost ranks of tp={tp}: "
                        "build it for the tensor-parallel size it runs with")
    return experts


class _Context:
    """What the candidates share: rescaled costs and fastest splits per (M, V), built schedules."""

    def __init__(self, table: CostTable, ranks: int, global_batch: int, limit: float, machine: Machine,
                 space: SearchSpace, optimizer_rate: float, cores: int | None, tensor: TensorParallelOption | None,
                 experts: ExpertParallelOption | None) -> None:
        self.table, self.ranks, self.global_batch, self.limit = table, ranks, global_batch, limit
        self.bandwidth, self.latency, self.tolerance = machine.bandwidth, machine.latency, space.balance_tolerance
        self.tensor_bandwidth = machine.tensor_bandwidth or machine.bandwidth
        self.overlap = space.expert_overlap  # whether to try the all-to-alls overlapped in the schedules' pairs
        self.optimizer_bytes = machine.optimizer_bytes_per_parameter
        self.calibration: Calibration | None = machine.calibration
        self.optimizer_rate, self.cores, self.tensor, self.experts = optimizer_rate, cores, tensor, experts
        self._sums: dict[int, StageSums] = {}
        self._paired: dict[int, tuple[cs.Schedule, cs.Schedule]] = {}  # the schedule evaluated last, and its pairs
        self._fastest: dict[tuple[int, int], list[int]] = {}

    def sums(self, m: int) -> StageSums:
        if m not in self._sums:
            size = self.global_batch // m
            units = self.table.at(size)
            if self.tensor is not None:
                units = shard_units(units, self.tensor, size, bandwidth=self.tensor_bandwidth, latency=self.latency)
            if self.experts is not None:
                units = expert_units(units, self.experts, size, bandwidth=self.bandwidth, latency=self.latency,
                                     tensor_bandwidth=self.tensor_bandwidth)
            self._sums[m] = StageSums(units, optimizer_bytes=self.optimizer_bytes)
        return self._sums[m]

    def fastest(self, m: int, v: int) -> list[int]:
        if (m, v) not in self._fastest:
            self._fastest[(m, v)] = fastest_split(self.sums(m), self.ranks * v)
        return self._fastest[(m, v)]

    def lower_bound(self, c: Candidate) -> float:
        """No schedule runs faster: with one stage per rank, the busiest rank's compute for all
        microbatches plus the forwards of the first microbatch on the stages before it; with more, the
        mean rank's compute (which rank holds which stage is the schedule's)."""
        sums, stages = self.sums(c.microbatches), bounds_of(c.cuts, len(self.table.units))
        times = [sums.time(i, j) for i, j in stages]
        if self.may_overlap(c.virtual):  # pairs may hide the all-to-alls
            times = [t - 2 * sums.exchange_time(i, j) for t, (i, j) in zip(times, stages)]
        if c.virtual == 1:
            return max(sums.forward(0, i) + c.microbatches * t for (i, _), t in zip(stages, times))
        return c.microbatches * sum(times) / self.ranks

    def evaluate(self, c: Candidate) -> None:
        sums = self.sums(c.microbatches)
        info = cs.available().get(c.schedule)
        # A schedule that plans its order for the costs gets the fastest split's; the plan keeps them,
        # so that the pipeline builds the very order that was simulated.
        c.schedule_costs = self._cost_model(sums, list(c.cuts)) if info is not None and info.uses_costs else None
        try:
            schedule = cs.build(c.schedule, ranks=self.ranks, microbatches=c.microbatches, virtual=c.virtual,
                                costs=c.schedule_costs)
        except ConveyorError as error:
            c.verdict = f"failed: {str(error).splitlines()[0]}"
            return
        first = self._simulate(schedule, sums, list(c.cuts))
        options = [first]
        in_flight = first[4]

        def estimate(cuts) -> float:  # the heaviest stage as the split's DP weighs it
            return max(sums.static(i, j) + in_flight[s] * sums.activations(i, j)
                       for s, (i, j) in enumerate(bounds_of(cuts, len(sums.units))))

        time_limit = max(first[3]) * (1 + self.tolerance)
        for limit in (time_limit, math.inf):
            try:
                cuts = lightest_split(sums, schedule.num_stages, in_flight, limit)
            except PlanError:
                continue
            lighter = estimate(cuts) < 0.99 * min(estimate(o[0]) for o in options)
            # Simulating costs more than the DP: only a split that may fit, or be lighter, is worth it.
            worth = lighter and (limit != math.inf or estimate(cuts) <= self.limit)
            if worth and all(tuple(cuts) != tuple(o[0]) for o in options):
                options.append(self._simulate(schedule, sums, cuts))
            if any(o[2] <= self.limit for o in options):
                break
        if self.can_overlap(schedule, sums):
            options += [self._simulate(schedule, sums, o[0], overlap=True) for o in options]
        cuts, step, peak, stage_times, _, bubble, memory, overlap = min(options, key=self._preference(options))
        names = self.table.names
        c.expert_overlap = overlap
        c.cuts, c.split_points = tuple(cuts), tuple(names[i] for i in cuts)
        c.step_time, c.bubble, c.memory_per_rank, c.stage_times = step, bubble, tuple(memory), tuple(stage_times)
        c.verdict = "fits" if peak <= self.limit else "over memory"

    def can_overlap(self, schedule: cs.Schedule, sums: StageSums) -> bool:
        """Whether the ranks could run ``schedule`` with expert parallelism's all-to-alls overlapped: they
        exchange (ep > 1), the experts are not tensor-parallel, and ``schedule`` pairs forwards with backwards
        (two stages per rank: what ``ExpertParallel.program`` takes). Uncalibrated only: a calibrated prediction
        does not time pairs yet."""
        if not self.may_overlap(schedule.virtual) or not sums.exchanges(0, len(sums.units)):
            return False
        return any(self.paired(schedule).overlapped)

    def may_overlap(self, virtual: int) -> bool:
        """What :meth:`can_overlap` asks of the search alone: overlap tried, uncalibrated, experts not
        tensor-parallel, V >= 2 (the lower bound's test, before any schedule is built)."""
        return (self.overlap and self.calibration is None and self.experts is not None and self.experts.tp == 1
                and virtual > 1)

    def paired(self, schedule: cs.Schedule) -> cs.Schedule:
        """``schedule``'s executed programs with their pairs (found once per schedule: finding them steps it)."""
        key = id(schedule)
        if key not in self._paired:
            self._paired = {key: (schedule, pair_forward_backward(cs.executable(schedule).compute))}
        return self._paired[key][1]

    def fit_by_recomputing(self, c: Candidate) -> None:
        """Make an over-memory candidate fit by recomputing blocks, stage by stage, if it can (the runtime's
        overlap cuts the forward a recomputation replays: such a plan runs its all-to-alls plainly)."""
        schedule = cs.build(c.schedule, ranks=self.ranks, microbatches=c.microbatches, virtual=c.virtual,
                            costs=c.schedule_costs)
        fit = fit_by_recomputing(schedule, self.sums(c.microbatches), list(c.cuts), ranks=self.ranks,
                                   memory_limit=self.limit, latency=self.latency)
        if fit is not None:
            c.recompute, c.memory_per_rank, c.bubble = fit.policies, fit.memory_per_rank, fit.bubble
            c.expert_overlap = False
            c.step_time += fit.added_s  # the recomputations' share of the step
            c.verdict = "fits"

    def _preference(self, options):
        fastest_fitting = min((o[1] for o in options if o[2] <= self.limit), default=None)

        def key(option):
            fits = option[2] <= self.limit
            if not fits:
                return (1, option[2], option[1])
            # Among fitting splits, anything within a tenth of the tolerance of the fastest counts as as
            # fast, and the lighter one wins.
            close = option[1] <= fastest_fitting * (1 + self.tolerance / 10)
            return (0, 0.0 if close else option[1], option[2])

        return key

    def _cost_model(self, sums: StageSums, cuts: list[int]) -> cs.CostModel:
        """Per-stage costs of the split at ``cuts``; one message latency, of the largest boundary's bytes."""
        stages = bounds_of(cuts, len(sums.units))
        costs = [cs.StageCosts(sums.forward(i, j), sums.backward_input(i, j), sums.backward_weight(i, j),
                               sums.activations(i, j), sums.weight_kept(i, j)) for i, j in stages]
        return cs.CostModel(tuple(costs), self.latency + sums.largest_message(cuts) / self.bandwidth)

    def _simulate(self, schedule, sums: StageSums, cuts: list[int], overlap: bool = False):
        """(cuts, step, peak memory, stage times, in-flight microbatches per stage, bubble, memory per rank,
        ``overlap``).

        What is simulated is what the ranks run: the executed programs, a stage whose backward is
        not split paying its full B; with ``overlap``, their forward/backward pairs, each pass's
        all-to-alls hidden behind the other's compute where they can be, and the activations each
        forward in segments keeps beside its own (:func:`~conveyor.plan.predict.stage_costs`)."""
        stages = bounds_of(cuts, len(sums.units))
        latency = self.latency + sums.largest_message(cuts) / self.bandwidth
        model = stage_costs(schedule, sums, cuts, latency=latency, overlap=overlap)
        programs = self.paired(schedule) if overlap else cs.executable(schedule).compute
        timeline = cs.simulate(programs, model, time_unit="s")
        peaks = timeline.peak_activation_bytes()
        memory, in_flight = [], [1.0] * len(stages)
        for rank in range(self.ranks):
            mine = schedule.stages_of(rank)
            activations = sum(sums.activations(*stages[s]) for s in mine)
            for s in mine:
                in_flight[s] = peaks[rank] / activations if activations else 1.0
            memory.append(sum(sums.static(*stages[s]) for s in mine) + peaks[rank])
        stage_times = [sums.time(i, j) for i, j in stages]
        step = timeline.end  # every span starts at 0 or later: the step ends with the last one
        # The bubble is the idle share of the very timeline the step comes from (so 0 <= bubble < 1): never
        # M x (F + I + W) against the step, which counts a split I + W where the ranks run one cheaper B.
        bubble = timeline.bubble_ratio
        if self.calibration is not None:
            prediction = predict_split(schedule, model, self.calibration, sums, cuts,
                                       optimizer_s_per_parameter=self.optimizer_rate, cores=self.cores)
            step, bubble = prediction.step_s, prediction.timeline.bubble_ratio
        return cuts, step, max(memory), stage_times, in_flight, bubble, memory, overlap
