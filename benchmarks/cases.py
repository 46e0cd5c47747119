"""One comparison case: both libraries and the ideal, in turn, step by step; one record.

For a case (workload, schedule, P ranks, V stages per rank, M microbatches) each library
gets its own group of P live ranks (forked from that library's zygote); the groups take
one step each in turn, then the ideal takes one sample (A B ideal A B ideal ...):
``warmup`` untimed rounds, then ``repeats`` timed ones. Step time = the slowest rank's
wall time of a step all ranks start together (after a barrier); medians. The ideal is
conveyor's simulator on per-stage F / I / W costs timed in one plain single-thread
process (see benchmarks/costs.py), one sample per round; ``ideal_ms`` is the median of
the samples' makespans (benchmarks/README.md says why).

Example:
    >>> _ratio(3.0, 2.0), _ratio(None, 2.0), _ratio(3.0, 0.0)
    (1.5, None, None)
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field

from benchmarks import libraries as lib
from benchmarks.costs import MeasuredCosts, per_pass
from benchmarks.steal import StealMeter
from conveyor.errors import GroupClosed, RankFailure, RankTimeout, ZygoteFailure
from conveyor.processes import RankGroup, Zygote
from conveyor.testing.models import TinyGPT, Workload

# What a group that fails to start or to step raises (its ranks are gone by then).
GROUP_ERRORS = (RankFailure, RankTimeout, ZygoteFailure, GroupClosed)


@dataclass(frozen=True, slots=True)
class Settings:
    """How each case is run (the same for every case of a run; recorded in ``meta``)."""

    repeats: int
    warmup: int
    cost_repeats: int
    step_timeout_s: float
    libraries: tuple[str, ...]
    conveyor_options: dict


class CostCache:
    """Per-stage costs measured once per (workload, number of stages) in a single-thread process.

    The fastest of ``repeats`` samples of each pass, taken before the cases: the
    ``ideal_fastest_ms`` kept next to the in-rotation ideal (see run_case).
    """

    def __init__(self, repeats: int) -> None:
        self.repeats = repeats
        self._costs: dict[tuple[Workload, int], MeasuredCosts] = {}

    def get(self, workload: Workload, num_stages: int) -> MeasuredCosts:
        key = (workload, num_stages)
        if key not in self._costs:
            with RankGroup(1, distributed=False) as group:
                self._costs[key] = group.call(
                    lib.measure_costs, workload, num_stages, self.repeats
                )[0]
        return self._costs[key]


def ideal_schedule(case: lib.Case):
    """conveyor's schedule for ``case`` (to simulate), or None and why not."""
    try:
        import conveyor.schedule as cs
        from conveyor.errors import ConveyorError

        sched = cs.build(
            case.schedule,
            ranks=case.num_ranks,
            microbatches=case.num_microbatches,
            virtual=case.virtual,
        )
        cs.verify(sched)
    except (ImportError, ConveyorError) as error:
        return None, f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return sched, "ok"


def makespan_ms(sched, costs: MeasuredCosts) -> float:
    """conveyor's simulated makespan of ``sched``'s executed programs with ``costs`` (ms), latency 0."""
    import conveyor.schedule as cs

    return cs.simulate(cs.executable(sched).compute, cs.CostModel.per_stage(costs.as_rows())).makespan


def _serial_ms(costs: MeasuredCosts, num_microbatches: int) -> float:
    """One process doing every pass of every microbatch back to back."""
    return num_microbatches * (sum(costs.forward_ms) + sum(costs.backward_ms))


def _serial_ms(costs: MeasuredCosts, num_microbatches: int) -> float:
    """One process doing every pass of every microbatch back to back."""
    return num_microbatches * (sum(costs.forward_ms) + sum(costs.backward_ms))


def last_line(error: BaseException) -> str:
    """The line of a failure worth a table cell: the rank's exception, without the class path."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = lines[-1] if lines else repr(error)
    return text.removeprefix("benchmarks.libraries.Refused: ")


@dataclass
class _Round:
    """One case's live state: the sides' groups, what they measured, what went wrong."""

    case: lib.Case
    settings: Settings
    sides: list[str]
    groups: dict[str, RankGroup] = field(default_factory=dict)
    status: dict[str, str] = field(default_factory=dict)
    steps: dict[str, list[float]] = field(default_factory=dict)
    samples: list[MeasuredCosts] = field(default_factory=list)
    probe: RankGroup | None = None
    ideal_note: str = "ok"
    notes: list[str] = field(default_factory=list)  # trouble after the timed steps
    steal: StealMeter = field(default_factory=StealMeter)

    def start_sides(self, conveyor_missing: str | None, zygotes: dict[str, Zygote]) -> None:
        for name in self.sides:
            self.steps[name] = []
            if name == "conveyor" and conveyor_missing:
                self.status[name] = f"unavailable: {conveyor_missing}"
                continue
            single = name == lib.SINGLE
            try:
                group = RankGroup(
                    1 if single else self.case.num_ranks,
                    distributed=not single,
                    timeout_s=self.settings.step_timeout_s,
                    zygote=zygotes.get(name),
                )
            except GROUP_ERRORS as error:
                self.status[name] = f"failed: {last_line(error)}"
                continue
            try:
                group.call(lib.setup, name, self.case, self.settings.conveyor_options)
            except GROUP_ERRORS as error:
                kind = "refused" if "Refused" in str(error) else "failed"
                self.status[name] = f"{kind}: {last_line(error)}"
                continue
            self.groups[name], self.status[name] = group, "ok"

    def start_probe(self) -> None:
        # The ideal's stage costs are sampled in the same rotation, in one single-thread
        # process: each sample times every stage's passes once, as a step runs them once.
        probe = RankGroup(1, distributed=False, timeout_s=self.settings.step_timeout_s)
        try:
            probe.call(lib.ideal_setup, self.case.workload, self.case.num_stages)
        except GROUP_ERRORS as error:
            self.ideal_note = f"failed: {last_line(error)}"
            return
        self.probe = probe

    def alternate(self) -> None:
        """A B ideal, A B ideal: one step of each side in turn, so drifting load hits all alike."""
        for rep in range(self.settings.warmup + self.settings.repeats):
            timed = rep >= self.settings.warmup
            for name in list(self.groups):
                try:
                    with self.steal.window(name) if timed else contextlib.nullcontext():
                        per_rank_s = self.groups[name].call(
                            lib.timed_step, timeout_s=self.settings.step_timeout_s
                        )
                except GROUP_ERRORS as error:
                    self.status[name] = f"failed: {last_line(error)}"
                    self.groups.pop(name)
                    continue
                if timed:
                    self.steps[name].append(max(per_rank_s) * 1e3)
            if self.probe is not None:
                try:
                    with self.steal.window("ideal") if timed else contextlib.nullcontext():
                        sample = self.probe.call(lib.ideal_sample)[0]
                except GROUP_ERRORS as error:
                    self.ideal_note, self.probe, self.samples = f"failed: {last_line(error)}", None, []
                    continue
                if timed:
                    self.samples.append(sample)

    def finish(self, record: dict) -> None:
        """Close every group, recording the timeline, steps, status and peak RSS of each side."""
        if self.probe is not None:
            self.probe.close()
        if "conveyor" in self.groups:
            # What conveyor itself measured in its last step, to see where time went.
            try:
                record["conveyor_timeline"] = self.groups["conveyor"].call(lib.conveyor_timeline)[0]
            except GROUP_ERRORS as error:
                record["conveyor_timeline"] = None
                self.groups.pop("conveyor")
                self.notes.append(f"conveyor timeline failed: {last_line(error)}")
        for name in self.sides:
            group = self.groups.pop(name, None)
            key = _key(name)
            record[f"{key}_steps_ms"] = self.steps[name]
            record[f"{key}_ms"] = statistics.median(self.steps[name]) if self.steps[name] else None
            rss = None
            if group:
                try:
                    rss = group.call(lib.peak_rss_mb)
                except GROUP_ERRORS as error:
                    self.notes.append(f"{name} peak RSS failed: {last_line(error)}")
                group.close()
            record[f"{key}_status"] = self.status.get(name, "not run")
            record[f"{key}_rss_mb"] = None if rss is None else [peak for peak, _ in rss]
            record[f"{key}_rss_growth_mb"] = None if rss is None else [growth for _, growth in rss]
        # Share of CPU time the host took while each side's timed steps ran (see StealMeter),
        # and the clock ticks behind each figure (10 ms each, all CPUs: a handful is coarse).
        record["steal_pct"] = {_key(k): v for k, v in self.steal.percent().items()}
        record["steal_ticks_wanted"] = {_key(k): v[1] for k, v in self.steal.ticks.items()}


def _key(side: str) -> str:
    return "single_process" if side == lib.SINGLE else side


def run_case(
    case: lib.Case,
    settings: Settings,
    costs: CostCache,
    conveyor_missing: str | None,
    zygotes: dict[str, Zygote],
) -> dict:
    """Both libraries on ``case``, alternating, then an ideal sample; one JSON-ready record."""
    started = time.monotonic()
    sched, ideal_note = ideal_schedule(case)
    fastest = costs.get(case.workload, case.num_stages)
    record: dict = {
        "workload": case.workload.name,
        "schedule": case.schedule,
        "ranks": case.num_ranks,
        "virtual": case.virtual,
        "stages": case.num_stages,
        "microbatches": case.num_microbatches,
        "torch_class": lib.TORCH_SCHEDULES.get(case.schedule, ("",))[0] or None,
        "ideal_ms": None,
        "ideal_fastest_ms": None if sched is None else makespan_ms(sched, fastest),
        "ideal_note": ideal_note,
    }
    # The real-compute workload also times the whole model in one process, in the same rotation.
    sides = [*settings.libraries, *([lib.SINGLE] if isinstance(case.workload, TinyGPT) else [])]
    run = _Round(case, settings, sides, ideal_note=ideal_note)
    run.start_sides(conveyor_missing, zygotes)
    if sched is not None:
        run.start_probe()
    run.alternate()
    run.finish(record)
    record["ideal_note"] = run.ideal_note
    _add_ideal(record, case, sched, run.samples, fastest)
    record["notes"] = run.notes
    _add_ratios(record, case)
    record["elapsed_s"] = time.monotonic() - started
    return record


def _costs_json(costs: MeasuredCosts) -> dict:
    return {
        "forward": costs.forward_ms,
        "backward_input": costs.backward_input_ms,
        "backward_weight": costs.backward_weight_ms,
    }


def _add_ideal(
    record: dict, case: lib.Case, sched, samples: list[MeasuredCosts], fastest: MeasuredCosts
) -> None:
    """``ideal_ms``: the median of the samples' makespans, the statistic of the step times."""
    makespans = [makespan_ms(sched, sample) for sample in samples]
    record["ideal_samples_ms"] = makespans
    record["ideal_ms"] = statistics.median(makespans) if makespans else None
    record["stage_costs_ms"] = (
        _costs_json(per_pass(samples, statistics.median)) if samples else None
    )
    record["stage_costs_fastest_ms"] = _costs_json(fastest)
    if isinstance(case.workload, TinyGPT) and makespans:
        # One process doing the sampled work back to back, over that sample's makespan: the
        # best speedup this schedule allows, free of the noise in single_process_ms.
        record["ideal_speedup"] = statistics.median(
            _serial_ms(sample, case.num_microbatches) / makespan
            for sample, makespan in zip(samples, makespans)
        )


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _add_ratios(record: dict, case: lib.Case) -> None:
    for name in lib.LIBRARIES:
        ms = record.get(f"{name}_ms")
        record[f"{name}_vs_ideal"] = _ratio(ms, record["ideal_ms"])
        record[f"{name}_vs_ideal_fastest"] = _ratio(ms, record["ideal_fastest_ms"])
        if case.workload.name == "overhead" and ms is not None and record["ideal_ms"] is not None:
            # Framework time a rank spends per microbatch per stage it runs (one boundary in, one out).
            record[f"{name}_overhead_ms"] = (ms - record["ideal_ms"]) / (
                case.num_microbatches * case.virtual
            )
    record["conveyor_vs_torch"] = _ratio(record.get("conveyor_ms"), record.get("torch_ms"))
    if "single_process_ms" in record:
        for name in lib.LIBRARIES:
            record[f"{name}_speedup"] = _ratio(
                record["single_process_ms"], record.get(f"{name}_ms")
            )
