"""conveyor vs torch.distributed.pipelining, side by side on identical work.

One command (see benchmarks/README.md)::

    .venv/bin/python benchmarks/compare.py            # full grid, ~25-35 min on a quiet 2-core machine
    .venv/bin/python benchmarks/compare.py --quick    # a small subset, ~3 min: checks the harness

For every case (workload, schedule, P ranks, V stages per rank, M microbatches)
both libraries get their own group of forked gloo ranks, built from the same
stage modules; the groups then take turns, one step each (A B A B), for
``--warmup`` steps and then ``--repeats`` timed ones; step time = the slowest
rank's wall time of a step all ranks start together (after a barrier); medians.
The ideal is conveyor's simulator (``conveyor.schedule.simulate``) run with the
per-stage F / I / W costs measured in one plain single-thread process, sampled
in the same rotation (A B ideal A B ideal) and reported as the same statistic:
each sample times every stage's passes once, ideal = median of the samples'
makespans. ``ideal_fastest_ms`` (costs measured once up front, fastest of >= 5)
is kept in the json.

Writes benchmarks/results/compare.json, compare.md and compare.png; the json is
rewritten after every case, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402  (after the path set-up, like every import below)

from benchmarks import libraries as lib  # noqa: E402
from benchmarks.costs import MeasuredCosts, per_pass  # noqa: E402
from benchmarks.ranks import RankFailure, RankGroup, RankTimeout, Zygote  # noqa: E402
from benchmarks.report import render  # noqa: E402
from conveyor.testing.models import WORKLOADS, TinyGPT, Workload  # noqa: E402

# (schedule, stages per rank) compared by default; torch ships all but zb-h2.
DEFAULT_VARIANTS = (
    "gpipe:1,1f1b:1,interleaved-1f1b:2,looped-bfs:2,zb-h1:1,zb-h1:2,zb-h2:1,zbv:2,dualpipev:2"
)


@dataclass(frozen=True, slots=True)
class Settings:
    repeats: int
    warmup: int
    cost_repeats: int
    step_timeout_s: float
    libraries: tuple[str, ...]
    conveyor_options: dict


class StealMeter:
    """CPU time the hypervisor gave to someone else while this VM's CPUs wanted it.

    Summed over chosen windows from ``/proc/stat`` (all CPUs, in clock ticks):
    ``steal / (steal + busy)`` is the share of the CPU time this VM's CPUs wanted (to run
    something, not idle) that the host spent elsewhere. On a shared host it swings from 1% to over 50% within seconds, and a step
    whose ranks keep both CPUs busy loses more than one process that keeps one busy; so
    every record says how much each side lost. None where ``/proc/stat`` has no steal.

    Example:
        >>> meter = StealMeter()
        >>> with meter.window("conveyor"):
        ...     pass
        >>> set(meter.percent()) <= {"conveyor"}
        True
    """

    def __init__(self) -> None:
        self.ticks: dict[str, list[int]] = {}

    @staticmethod
    def read() -> tuple[int, int] | None:
        """``(steal, wanted)`` clock ticks of all CPUs since boot (wanted: not idle), or None."""
        try:
            with open("/proc/stat") as stat:
                fields = stat.readline().split()
        except OSError:
            return None
        if len(fields) < 9 or fields[0] != "cpu":
            return None
        # user nice system idle iowait irq softirq steal (guest time is inside user)
        ticks = [int(f) for f in fields[1:9]]
        return ticks[7], sum(ticks) - ticks[3] - ticks[4]

    @contextlib.contextmanager
    def window(self, side: str):
        """Count the ticks of the ``with`` body towards ``side``."""
        start = self.read()
        try:
            yield
        finally:
            end = self.read()
            if start is not None and end is not None:
                totals = self.ticks.setdefault(side, [0, 0])
                totals[0] += end[0] - start[0]
                totals[1] += end[1] - start[1]

    def percent(self) -> dict[str, float]:
        """Per side: steal as a percentage of the CPU time wanted in its windows."""
        return {side: 100.0 * steal / wanted for side, (steal, wanted) in self.ticks.items() if wanted > 0}


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _variants(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        name, _, virtual = item.strip().partition(":")
        out.append((name, int(virtual or 1)))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="small grid, 3 repeats: checks the harness in ~3 min"
    )
    parser.add_argument(
        "--workloads", default="emulated,overhead,gpt", help="comma list of emulated,overhead,gpt"
    )
    parser.add_argument(
        "--schedules", default=DEFAULT_VARIANTS, help="comma list of name:V (default: %(default)s)"
    )
    parser.add_argument("--ranks", default="2,4,8", help="P values for the emulated workload")
    parser.add_argument(
        "--microbatches", default="8,16,32", help="M values for the emulated workload"
    )
    parser.add_argument(
        "--overhead-ranks", default="2,4", help="P values for the overhead workload"
    )
    parser.add_argument(
        "--overhead-microbatches", default="64", help="M values for the overhead workload"
    )
    parser.add_argument(
        "--gpt-microbatches", default="8,16,32", help="M values for the GPT workload (P=2)"
    )
    parser.add_argument(
        "--sleep-ms", type=float, default=5.0, help="emulated F, I and W time per block"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per library per case")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per library per case")
    parser.add_argument("--libraries", default="conveyor,torch", help="which sides to run")
    parser.add_argument(
        "--step-timeout-s", type=float, default=120.0, help="a step slower than this fails the case"
    )
    parser.add_argument(
        "--conveyor-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra keyword for conveyor.Pipeline, e.g. fixed_shapes=True (repeatable; default none)",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="output folder")
    parser.add_argument(
        "--render-only", action="store_true", help="re-render compare.md / .png from compare.json"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.ranks, args.microbatches = "2,4", "8"
        args.overhead_ranks, args.overhead_microbatches = "2", "32"
        args.gpt_microbatches = "8"
        args.repeats, args.warmup = 3, 1
    return args


def _options(items: list[str]) -> dict:
    """``["fixed_shapes=True", "timeout_s=60"]`` -> ``{"fixed_shapes": True, "timeout_s": 60}``."""
    import ast

    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--conveyor-option expects KEY=VALUE, got {item!r}")
        try:
            options[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            options[key.strip()] = value.strip()
    return options


def build_cases(args: argparse.Namespace) -> list[lib.Case]:
    """The grid, emulated first (it carries the headline targets)."""
    variants = _variants(args.schedules)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; choose from {sorted(WORKLOADS)}")
    cases = []
    if "emulated" in workloads:
        for num_ranks in _ints(args.ranks):
            workload = WORKLOADS["emulated"](
                num_ranks=num_ranks,
                forward_ms=args.sleep_ms,
                input_grad_ms=args.sleep_ms,
                weight_grad_ms=args.sleep_ms,
            )
            for m in _ints(args.microbatches):
                cases += [lib.Case(workload, name, v, m) for name, v in variants]
    if "overhead" in workloads:
        for num_ranks in _ints(args.overhead_ranks):
            workload = WORKLOADS["overhead"](num_ranks=num_ranks)
            for m in _ints(args.overhead_microbatches):
                cases += [lib.Case(workload, name, v, m) for name, v in variants]
    if "gpt" in workloads:
        workload = WORKLOADS["gpt"](num_ranks=2)
        for m in _ints(args.gpt_microbatches):
            cases += [lib.Case(workload, name, v, m) for name, v in variants]
    return cases


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
    """conveyor's simulated makespan of ``sched`` with ``costs`` (ms), latency 0."""
    import conveyor.schedule as cs

    return cs.simulate(sched, cs.CostModel.per_stage(costs.as_rows())).makespan


def _serial_ms(costs: MeasuredCosts, num_microbatches: int) -> float:
    """One process doing every pass of every microbatch back to back."""
    return num_microbatches * (sum(costs.forward_ms) + sum(costs.backward_ms))


def _last_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = lines[-1] if lines else repr(error)
    return text.removeprefix("benchmarks.libraries.Refused: ")


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
    groups: dict[str, RankGroup] = {}
    steps: dict[str, list[float]] = {name: [] for name in sides}
    status: dict[str, str] = {}
    notes: list[str] = []  # trouble after the timed steps, which leaves the timings valid
    for name in sides:
        if name == "conveyor" and conveyor_missing:
            status[name] = f"unavailable: {conveyor_missing}"
            continue
        single = name == lib.SINGLE
        group = None
        try:
            group = RankGroup(
                1 if single else case.num_ranks,
                distributed=not single,
                timeout_s=settings.step_timeout_s,
                zygote=zygotes.get(name),
            )
            group.call(lib.setup, name, case, settings.conveyor_options)
        except (RankFailure, RankTimeout) as error:
            kind = "refused" if "Refused" in str(error) else "failed"
            status[name] = f"{kind}: {_last_line(error)}"
            if group is not None:
                group.kill()
            continue
        groups[name], status[name] = group, "ok"
    # The ideal's stage costs are sampled in the same rotation, in one single-thread
    # process: each sample times every stage's passes once, as a step runs them once.
    probe: RankGroup | None = None
    if sched is not None:
        probe = RankGroup(1, distributed=False, timeout_s=settings.step_timeout_s)
        try:
            probe.call(lib.ideal_setup, case.workload, case.num_stages)
        except (RankFailure, RankTimeout) as error:
            probe.kill()
            ideal_note, probe = f"failed: {_last_line(error)}", None
    samples: list[MeasuredCosts] = []
    steal = StealMeter()
    # A B A B: one step of each side in turn, so drifting machine load hits all alike.
    for rep in range(settings.warmup + settings.repeats):
        for name in list(groups):
            try:
                with steal.window(name) if rep >= settings.warmup else contextlib.nullcontext():
                    per_rank_s = groups[name].call(lib.timed_step, timeout_s=settings.step_timeout_s)
            except (RankFailure, RankTimeout) as error:
                status[name] = f"failed: {_last_line(error)}"
                groups.pop(name).kill()
                continue
            if rep >= settings.warmup:
                steps[name].append(max(per_rank_s) * 1e3)
        if probe is not None:
            try:
                with steal.window("ideal") if rep >= settings.warmup else contextlib.nullcontext():
                    sample = probe.call(lib.ideal_sample)[0]
            except (RankFailure, RankTimeout) as error:
                ideal_note, probe, samples = f"failed: {_last_line(error)}", None, []
                continue
            if rep >= settings.warmup:
                samples.append(sample)
    if probe is not None:
        probe.close()
    if "conveyor" in groups:
        # What conveyor itself measured in its last step, to see where time went.
        try:
            record["conveyor_timeline"] = groups["conveyor"].call(lib.conveyor_timeline)[0]
        except (RankFailure, RankTimeout) as error:
            record["conveyor_timeline"] = None
            groups.pop("conveyor")
            notes.append(f"conveyor timeline failed: {_last_line(error)}")
    for name in sides:
        group = groups.pop(name, None)
        key = "single_process" if name == lib.SINGLE else name
        record[f"{key}_steps_ms"] = steps[name]
        record[f"{key}_ms"] = statistics.median(steps[name]) if steps[name] else None
        rss = None
        if group:
            try:
                rss = group.call(lib.peak_rss_mb)
            except (RankFailure, RankTimeout) as error:
                notes.append(f"{name} peak RSS failed: {_last_line(error)}")
        record[f"{key}_status"] = status.get(name, "not run")
        record[f"{key}_rss_mb"] = None if rss is None else [peak for peak, _ in rss]
        record[f"{key}_rss_growth_mb"] = None if rss is None else [growth for _, growth in rss]
        if group:
            group.close()
    record["ideal_note"] = ideal_note
    # Share of CPU time the host took while each side's timed steps ran (see StealMeter).
    record["steal_pct"] = {("single_process" if k == lib.SINGLE else k): v for k, v in steal.percent().items()}
    # Clock ticks behind each figure (10 ms each, all CPUs): a handful make a coarse percentage.
    record["steal_ticks_wanted"] = {("single_process" if k == lib.SINGLE else k): v[1] for k, v in steal.ticks.items()}
    _add_ideal(record, case, sched, samples, fastest)
    record["notes"] = notes
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


def measure_gloo_one_way_ms(shape: tuple[int, ...], rounds: int = 5) -> tuple[float, float]:
    """``(isend/irecv, blocking send/recv)`` one-way ms: the lowest median of ``rounds`` each.

    Rounds alternate the two kinds. On a busy machine a round's median jumps to about
    one scheduler tick (~2 ms): a woken rank waits for a core.
    """
    times: dict[bool, list[float]] = {False: [], True: []}
    with RankGroup(2) as group:
        for _ in range(rounds):
            for blocking in (False, True):
                times[blocking].append(group.call(lib.gloo_one_way_ms, shape, blocking)[0])
    return min(times[False]), min(times[True])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "compare.json"
    if args.render_only:
        render(json.loads(json_path.read_text()), out)
        print(f"rendered {out / 'compare.md'} and {out / 'compare.png'}")
        return 0
    settings = Settings(
        repeats=args.repeats,
        warmup=args.warmup,
        cost_repeats=max(5, args.repeats),
        step_timeout_s=args.step_timeout_s,
        libraries=tuple(n.strip() for n in args.libraries.split(",") if n.strip()),
        conveyor_options=_options(args.conveyor_option),
    )
    # Before this process imports conveyor: each library's ranks fork from a process that
    # imported that library alone, so peak RSS per rank is the library's own.
    zygotes: dict[str, Zygote] = {}
    zygote_failures: dict[str, str] = {}
    for name in settings.libraries:
        if name not in lib.LIBRARY_MODULES:
            raise SystemExit(f"--libraries: unknown {name!r}; choose from {sorted(lib.LIBRARY_MODULES)}")
        try:
            zygotes[name] = Zygote(lib.LIBRARY_MODULES[name])
        except (RankFailure, RankTimeout) as error:
            # Its ranks fork from this process instead; for conveyor, _run also says it is
            # missing and runs torch alone.
            zygote_failures[name] = str(error)
            print(f"{name}: {_last_line(error)}", file=sys.stderr)
    try:
        return _run(args, argv, out, json_path, settings, zygotes, zygote_failures)
    finally:
        for zygote in zygotes.values():
            zygote.close()


def _run(
    args: argparse.Namespace,
    argv: list[str] | None,
    out: Path,
    json_path: Path,
    settings: Settings,
    zygotes: dict[str, Zygote],
    zygote_failures: dict[str, str],
) -> int:
    conveyor_missing = lib.conveyor_runtime_missing() if "conveyor" in settings.libraries else None
    if conveyor_missing:
        print(f"conveyor runtime not available ({conveyor_missing}): running the torch side alone")
    cases = build_cases(args)
    results: dict = {
        "meta": {
            "command": " ".join(
                [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
            ),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_start": os.getloadavg(),
            "settings": asdict(settings),
            "sleep_ms": args.sleep_ms,
            "conveyor_missing": conveyor_missing,
            "zygote_failures": zygote_failures,
        },
        "records": [],
    }
    overhead_shape = (
        WORKLOADS["overhead"](num_ranks=2).rows_per_microbatch,
        WORKLOADS["overhead"](num_ranks=2).width,
    )
    meta = results["meta"]
    meta["gloo_one_way_ms"], meta["gloo_one_way_blocking_ms"] = measure_gloo_one_way_ms(
        overhead_shape
    )
    print(
        f"gloo one-way message {overhead_shape}: isend/irecv {meta['gloo_one_way_ms']:.3f} ms, "
        f"blocking send/recv {meta['gloo_one_way_blocking_ms']:.3f} ms"
    )
    costs = CostCache(settings.cost_repeats)
    started = time.monotonic()
    run_steal = StealMeter()
    for index, case in enumerate(cases, 1):
        with run_steal.window("run"):
            record = run_case(case, settings, costs, conveyor_missing, zygotes)
        results["records"].append(record)
        results["meta"]["elapsed_s"] = time.monotonic() - started
        results["meta"]["load_average_end"] = os.getloadavg()
        results["meta"]["steal_pct"] = run_steal.percent().get("run")
        json_path.write_text(json.dumps(results, indent=1))
        print(_progress_line(index, len(cases), case, record), flush=True)
    render(results, out)
    json_path.write_text(json.dumps(results, indent=1))  # now with the summary
    print(
        f"wrote {json_path}, {out / 'compare.md'}, {out / 'compare.png'} in {time.monotonic() - started:.0f} s"
    )
    return 0


def _progress_line(index: int, total: int, case: lib.Case, record: dict) -> str:
    def ms(value: float | None) -> str:
        return "   -   " if value is None else f"{value:7.1f}"

    parts = [
        f"[{index}/{total}] {case.label():48s}",
        f"ideal {ms(record['ideal_ms'])} (fastest {ms(record['ideal_fastest_ms']).strip()})",
    ]
    for name in lib.LIBRARIES:
        if record.get(f"{name}_status") == "not run":
            continue
        value = record.get(f"{name}_ms")
        note = (
            ""
            if record.get(f"{name}_status") == "ok"
            else f" ({record.get(f'{name}_status', '')[:60]})"
        )
        parts.append(f"{name} {ms(value)}{note}")
    return "  ".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
