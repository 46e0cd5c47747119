"""Predicted against measured step time, plan by plan: ``python -m benchmarks --plan``.

For each workload (emulated: blocks that sleep; gpt: the zoo's small GPT) and P, each plan
(the default split with a schedule and V) is predicted, then run:

* prediction: conveyor's simulator on per-stage F / I / W costs profiled in one single-thread
  process (the last stage's F holds the loss), plus this machine's
  :class:`~conveyor.plan.calibration.Calibration` (measured at the start, once per P) and each rank's
  optimizer step (AdamW, profiled the same way). ``predicted_ms``: the costs are the median of
  two samples per round taken between the rounds, so they see the machine when the steps do;
  ``predicted_before_ms``: the median of ``PROFILE_SAMPLES`` samples taken before the runs, as
  a planner profiles once;
* measurement: every plan keeps its own live group of P ranks; round after round each plan
  takes ``--predict-steps`` steps, the plans' order rotating per round (after ``--predict-warmup``
  untimed steps each). A step: zero the gradients, barrier, ``pipe.step``, ``optimizer.step()``;
  the slowest rank's wall time. Reported: the median, min and max, with the host's CPU steal
  over the plan's timed steps.

Beside them, ``uncalibrated_ms``: what ``conveyor plan`` prints without ``--calibrate`` (the profiled
compute on the planner's default links, :func:`uncalibrated_step`), with the measured step's ratio to it.

It writes ``plan.json``, ``plan.md`` and one PNG per case (the simulated plan above the
measured last step, one time axis) under ``--predict-out`` (default ``benchmarks/results/plan``), with
the commit, the command, the load average and the steal. ``--quick``: the GPT at P=2, 1F1B and ZB-H1
and the planner's own plan, one timed round of 2 steps, under ``benchmarks/results/plan-quick``.

Example:
    >>> parse_plans("1f1b:1,interleaved-1f1b:2")
    [('1f1b', 1), ('interleaved-1f1b', 2)]
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from pathlib import Path

from benchmarks import libraries as lib
from benchmarks import plan_chosen
from benchmarks.provenance import RunProvenance
from benchmarks.provenance import line as provenance_line
from benchmarks.steal import StealMeter
from conveyor.processes import RankGroup
from conveyor.testing.models import Emulated, TinyGPT

PROFILE_SAMPLES = 7
DEFAULT_PLANS = "1f1b:1,zb-h1:1,interleaved-1f1b:2,gpipe:1"
# --quick: a few minutes on a busy 2-core machine, written beside (not over) the full run's results.
QUICK = dict(predict_workloads="gpt", predict_ranks="2", predict_schedules="1f1b:1,zb-h1:1", predict_rounds=1,
             predict_steps=2, predict_warmup=1)


def parse_plans(text: str) -> list[tuple[str, int]]:
    """``name:V`` comma list -> ``[(name, V), ...]`` (V defaults to 1)."""
    plans = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, virtual = item.partition(":")
        plans.append((name, int(virtual or 1)))
    return plans


def build_workload(name: str, ranks: int):
    """The zoo's workload ``name`` at P = ``ranks`` (its defaults: 5 ms sleeps; an 8-layer GPT)."""
    if name == "emulated":
        return Emulated(num_ranks=ranks)
    if name == "gpt":
        return TinyGPT(num_ranks=ranks)
    raise ValueError(f"--predict-workloads takes emulated and gpt, got {name!r}")


# ---------------------------------------------------------------------------
# calls run in the ranks (a profiling process, or a plan's group)
# ---------------------------------------------------------------------------


def _optimizer_seconds(module) -> float:
    """A median AdamW step over ``module``'s parameters, timed as the planner times it."""
    from conveyor.plan.profile import optimizer_seconds_per_parameter

    count = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return optimizer_seconds_per_parameter(module) * count if count else 0.0


def probe_cut(case: lib.Case) -> tuple[int, tuple[int, ...] | None, int]:
    """What a case's stage costs are probed on: (stages, blocks per stage or None, rows per microbatch).

    A built-in runs the workload's default cut on its own microbatch; a chosen plan its own cut,
    its global batch split into its microbatch count.

    Example:
        >>> probe_cut(lib.Case(TinyGPT(num_ranks=2), "1f1b", 1, 8))
        (2, None, 2)
    """
    if case.plan is None:
        return case.num_stages, case.split, case.workload.rows_per_microbatch
    return case.num_stages, case.split, case.plan.global_batch // case.plan.microbatches


def split_sample(worker, cut: tuple) -> list[tuple[float, float]]:
    """Each stage's I and W as conveyor's runtime splits them (ms), on the probe's stages."""
    import torch

    from conveyor.plan.profile import split_backward_seconds
    from conveyor.runtime.stage.backward import GraphAnalysisCache

    probe = worker.state[("probe", cut)]
    caches = worker.state.setdefault(("analyses", cut), [GraphAnalysisCache() for _ in range(probe.num_stages)])
    out = []
    for stage, module in enumerate(probe.modules):
        outs = probe._forward(stage)
        inputs = [t for t in probe.inputs[stage] if t.requires_grad]
        i, w = split_backward_seconds(list(outs), [torch.ones_like(o) for o in outs], inputs,
                                      list(module.parameters()), caches[stage])
        module.zero_grad(set_to_none=True)
        for t in inputs:
            t.grad = None
        out.append((i * 1e3, w * 1e3))
    return out


def profile(worker, workload, cut: tuple, samples: int = PROFILE_SAMPLES) -> dict:
    """Per-stage F, I, W (s, median of ``samples``), the largest boundary message, each stage's AdamW step,
    on ``cut`` (:func:`probe_cut`)."""
    from benchmarks.costs import StageCostProbe, per_pass

    num_stages, split, rows = cut
    probe = StageCostProbe(workload, num_stages, split=split, microbatch_rows=rows)
    worker.state[("probe", cut)] = probe
    probe.sample()  # warm-up
    costs = per_pass([probe.sample() for _ in range(samples)], statistics.median)
    split_sample(worker, cut)  # warm-up (and the graph analyses)
    split = _split_rows_s([split_sample(worker, cut) for _ in range(samples)])
    message = max(
        (sum(t.numel() * t.element_size() for t in inputs) for inputs in probe.inputs[1:]), default=0
    )
    return {
        "rows_s": [(f / 1e3, i / 1e3, w / 1e3) for f, i, w in costs.as_rows()],
        "split_s": split,
        "message_bytes": message,
        "optimizer_s": [_optimizer_seconds(module) for module in probe.modules],
    }


def profile_sample(worker, cut: tuple):
    """One more sample of the stages :func:`profile` built: each stage's F, I, B, and I, W split (ms)."""
    return worker.state[("probe", cut)].sample(), split_sample(worker, cut)


def setup(worker, case: lib.Case) -> list[int]:
    """Build conveyor's pipeline for ``case`` on this rank, with an AdamW over its stages."""
    import torch

    runner = lib.ConveyorRunner(case, worker.rank)
    params = [p for module in runner.modules for p in module.parameters()]
    # A chosen plan splits the benchmark's global batch into its own microbatch count.
    rows = case.plan.global_batch if case.plan is not None else None
    units = rows // case.workload.rows_per_microbatch if rows else case.num_microbatches
    worker.state.update(runner=runner, optimizer=torch.optim.AdamW(params, lr=1e-4),
                        batch=case.workload.batch(units))
    return list(runner.stage_ids)


def timed_step(worker) -> float:
    """Zero the gradients, barrier, then the timed part: ``pipe.step`` and ``optimizer.step()``."""
    import torch.distributed as dist

    runner, optimizer = worker.state["runner"], worker.state["optimizer"]
    optimizer.zero_grad(set_to_none=True)
    x, y = worker.state["batch"]
    dist.barrier()
    start = time.perf_counter()
    runner.step(x, y)
    optimizer.step()
    return time.perf_counter() - start


def measured_timeline(worker):
    """The last step's measured Timeline (a collective over the group)."""
    return worker.state["runner"].pipe.timeline()


# ---------------------------------------------------------------------------
# one (workload, P): every plan predicted, then run in rotation
# ---------------------------------------------------------------------------


def cores_for(workload) -> int | None:
    """The cores a workload's ranks share: the machine's for real compute, None for sleeping blocks.

    Example:
        >>> cores_for(Emulated(num_ranks=4)) is None
        True
    """
    return None if isinstance(workload, Emulated) else os.cpu_count()


def _split_rows_s(samples: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Per stage, the median I and W (s) over samples of :func:`split_sample`."""
    return [(statistics.median(i for i, _ in column) / 1e3, statistics.median(w for _, w in column) / 1e3)
            for column in zip(*samples)]


def _rows_s(samples) -> list[tuple[float, float, float]]:
    from benchmarks.costs import per_pass

    return [(f / 1e3, i / 1e3, w / 1e3) for f, i, w in per_pass(samples, statistics.median).as_rows()]


def _predict(case: lib.Case, profiled: dict, calibration):
    import conveyor.schedule as cs
    from conveyor.plan.predict import predict_step

    sched = _schedule(case)
    extra = [sum(profiled["optimizer_s"][s] for s in sched.stages_of(r)) for r in range(case.num_ranks)]
    # A stage whose W runs on its own pays the runtime's split I and W; elsewhere one full B.
    split = {a.stage for program in cs.executable(sched).compute.programs for a in program
             if a.kind is cs.ActionKind.W}
    rows = [(f, *profiled["split_s"][s]) if s in split else (f, i, w)
            for s, (f, i, w) in enumerate(profiled["rows_s"])]
    return predict_step(sched, rows, calibration, message_bytes=profiled["message_bytes"],
                        rank_extra_s=extra, cores=cores_for(case.workload))


def uncalibrated_step(case: lib.Case, profiled: dict) -> float:
    """The step ``conveyor plan`` predicts without ``--calibrate`` (s): the simulated compute of the profiled
    stages on the planner's default links (:class:`~conveyor.plan.settings.Machine`'s latency and bandwidth),
    no runtime overheads, no optimizer step, a device per rank. A chosen plan: its own costs, so."""
    import dataclasses

    import conveyor.schedule as cs
    from conveyor.plan.calibration import Calibration
    from conveyor.plan.predict import predict_plan, predict_step
    from conveyor.plan.settings import DEFAULT_BANDWIDTH, DEFAULT_LATENCY

    links = Calibration(latency_s=DEFAULT_LATENCY, seconds_per_byte=1 / DEFAULT_BANDWIDTH)
    if case.plan is not None:
        bare = dataclasses.replace(case.plan, settings={**case.plan.settings, "optimizer_s_per_parameter": 0.0,
                                                        "cores": None})
        return predict_plan(bare, links).step_s
    sched = _schedule(case)
    split = {a.stage for program in cs.executable(sched).compute.programs for a in program
             if a.kind is cs.ActionKind.W}
    rows = [(f, *profiled["split_s"][s]) if s in split else (f, i, w)
            for s, (f, i, w) in enumerate(profiled["rows_s"])]
    return predict_step(sched, rows, links, message_bytes=profiled["message_bytes"]).step_s


def _rotate(items: list, by: int) -> list:
    by %= len(items)
    return items[by:] + items[:by]


def _measure(cases: list[lib.Case], probe: RankGroup, rotation: dict[tuple, list], args) -> dict:
    """Every plan's group, the rounds (plans rotating, cost samples between rounds), the last timelines."""
    groups: dict[lib.Case, RankGroup] = {}
    steps: dict[lib.Case, list[float]] = {case: [] for case in cases}
    loads: dict[lib.Case, list[float]] = {case: [] for case in cases}
    steal = StealMeter()
    try:
        for case in cases:
            groups[case] = RankGroup(case.num_ranks, timeout_s=args.step_timeout_s)
            groups[case].call(setup, case)
        for round_index in range(1 + args.predict_rounds):
            timed = round_index > 0
            for case in _rotate(cases, round_index):
                for _ in range(args.predict_steps if timed else args.predict_warmup):
                    with steal.window(case.label()) if timed else contextlib.nullcontext():
                        wall = max(groups[case].call(timed_step))
                    if timed:
                        steps[case].append(wall)
                        loads[case].append(os.getloadavg()[0])
            for cut in rotation if timed else ():
                # The costs again, between the steps: the same moments of the machine as the steps.
                rotation[cut] += [probe.call(profile_sample, cut)[0] for _ in range(2)]
        measured = {case: groups[case].call(measured_timeline)[0] for case in cases}
    finally:
        for group in groups.values():
            group.close()
    return {"steps": steps, "loads": loads, "steal": steal.percent(), "timelines": measured}


def run_cell(workload, cases: list[lib.Case], calibration, args, out: Path, chosen: bool = False) -> list[dict]:
    """Predict and run every case of one (workload, P); one record per case. ``chosen``: add the
    case of ``conveyor.plan.plan()``'s own plan (:mod:`benchmarks.plan_chosen`).

    Every case, the chosen one too, is predicted from its own stages' costs sampled between the
    rounds (``predicted_ms``); ``predicted_before_ms`` is the prediction made before the runs: the
    profile's for a built-in, the planner's own step for the chosen plan.
    """
    from conveyor.plan.predict import predict_plan

    profiles: dict[tuple, dict] = {}
    with RankGroup(1, distributed=False, timeout_s=args.step_timeout_s) as probe:
        if chosen:
            plan = probe.call(plan_chosen.choose, workload, args.predict_microbatches, calibration.as_dict())[0]
            cases = [*cases, plan_chosen.chosen_case(plan, workload)]
            print(f"{workload.name} P={workload.num_ranks}: conveyor.plan chose {plan_chosen.describe(plan)} "
                  f"(predicted {plan.step_time * 1e3:.1f} ms)", flush=True)
        for case in cases:
            cut = probe_cut(case)
            if cut not in profiles:
                profiles[cut] = probe.call(profile, workload, cut)[0]
        rotation: dict[tuple, list] = {cut: [] for cut in profiles}
        run = _measure(cases, probe, rotation, args)
    records = []
    for case in cases:
        cut = probe_cut(case)
        profiled, samples = profiles[cut], rotation[cut]
        rotated = {**profiled, "rows_s": _rows_s([costs for costs, _ in samples]),
                   "split_s": _split_rows_s([split for _, split in samples])}
        prediction = _predict(case, rotated, calibration)
        before = (predict_plan(case.plan, calibration) if case.plan is not None
                  else _predict(case, profiled, calibration))
        record = _record(case, prediction, before, profiled, samples, run, out, calibration)
        uncalibrated = uncalibrated_step(case, profiled)
        record.update(uncalibrated_ms=uncalibrated * 1e3,
                      ratio_to_uncalibrated=record["measured_ms"] / 1e3 / uncalibrated)
        records.append(record)
    return records


def _schedule(case: lib.Case):
    import conveyor.schedule as cs

    spec = case.plan.schedule_spec() if case.plan is not None else case.schedule
    if not isinstance(spec, str):
        return spec
    return cs.build(spec, ranks=case.num_ranks, microbatches=case.num_microbatches, virtual=case.virtual)


def _replay(case: lib.Case, measured, calibration) -> float:
    """Simulated makespan (s) of ``case`` on the per-stage span medians of its ``measured`` step."""
    import dataclasses

    from conveyor.plan.predict import predict_step
    from conveyor.schedule.cost import costs_from_timeline

    sched = _schedule(case)
    costs = costs_from_timeline(measured, case.num_stages)
    return predict_step(sched, costs, dataclasses.replace(calibration, action_s=0.0)).makespan_s


def _record(case: lib.Case, prediction, before, profiled: dict, samples: list, run: dict, out: Path,
            calibration) -> dict:
    """One case's JSON record; draws its PNG (the prediction above the last measured step)."""
    from conveyor.plan.calibration import compute_makespan
    from conveyor.schedule.cost import costs_from_timeline
    from conveyor.schedule.render import side_by_side_png

    workload, times, measured = case.workload, run["steps"][case], run["timelines"][case]
    median = statistics.median(times)
    replay = _replay(case, measured, calibration)
    kind = "chosen-" if case.plan is not None else ""
    png = out / f"{workload.name}-P{case.num_ranks}-{kind}{case.schedule}-V{case.virtual}.png"
    side_by_side_png(prediction.timeline, measured, png)
    return {
        "workload": workload.name, "ranks": case.num_ranks, "schedule": case.schedule,
        "virtual": case.virtual, "microbatches": case.num_microbatches,
        "predicted_ms": prediction.step_s * 1e3, "predicted_makespan_ms": prediction.makespan_s * 1e3,
        "predicted_before_ms": before.step_s * 1e3,
        "ratio_to_before": median / before.step_s,
        "predicted_optimizer_ms": max(prediction.rank_extra_s, default=0.0) * 1e3,
        "measured_ms": median * 1e3, "measured_min_ms": min(times) * 1e3, "measured_max_ms": max(times) * 1e3,
        "steps_ms": [t * 1e3 for t in times],
        "ratio": median / prediction.step_s,
        "ratio_min": min(times) / prediction.step_s, "ratio_max": max(times) / prediction.step_s,
        "last_step_compute_makespan_ms": compute_makespan(measured) * 1e3,
        "steal_pct": run["steal"].get(case.label()),
        "load_average": statistics.median(run["loads"][case]),
        "cores": cores_for(case.workload),
        **_profile_fields(case, profiled, samples),
        # The last step's own median F, I, W per stage (I holds a whole B where it ran unsplit).
        "last_step_stage_costs_ms": [
            [c.forward * 1e3, c.backward_input * 1e3, c.backward_weight * 1e3]
            for c in costs_from_timeline(measured, case.num_stages).stages
        ],
        # The last step replayed: the simulator on that step's own per-stage span medians (which
        # hold the runtime's per-action time and any sharing of cores), with the calibration's
        # receive and latency; against that step's compute makespan. Near 1: the error is in the
        # profiled costs, not in what the simulator adds to them.
        "replay_makespan_ms": replay * 1e3,
        "replay_ratio": compute_makespan(measured) / replay,
        "png": png.name,
    }


def _profile_fields(case: lib.Case, profiled: dict, samples: list) -> dict:
    """The case's stage costs (sampled between the rounds, and before); a chosen plan's own figures too."""
    fields = {
        "chosen": case.plan is not None,
        "stage_costs_ms": [[x * 1e3 for x in row] for row in _rows_s([costs for costs, _ in samples])],
        "stage_split_costs_ms": [[x * 1e3 for x in row] for row in _split_rows_s([split for _, split in samples])],
        "stage_costs_before_ms": [[x * 1e3 for x in row] for row in profiled["rows_s"]],
        "message_bytes": profiled["message_bytes"],
    }
    if case.plan is not None:
        plan = case.plan
        fields.update({"plan": plan_chosen.describe(plan), "split_points": list(plan.split_points),
                       "blocks_per_stage": list(case.split), "planned_step_ms": plan.step_time * 1e3,
                       "planned_stage_times_ms": [t * 1e3 for t in plan.stage_times], "plan_outcome": plan.outcome,
                       "plan_alternatives": plan.alternatives, "costs_source": plan.costs.source})
    return fields


# ---------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------

COLUMNS = ("workload", "P", "schedule", "V", "M", "predicted ms", "profile-before ms", "uncalibrated ms",
           "measured ms (min-max)", "measured / predicted (min-max)", "measured / uncalibrated", "steal %", "load")


def table(records: list[dict]) -> str:
    """The markdown table of the records, one line per case.

    Example:
        >>> row = {"workload": "gpt", "ranks": 2, "schedule": "1f1b", "virtual": 1, "microbatches": 8,
        ...        "predicted_ms": 100.0, "measured_ms": 102.0, "measured_min_ms": 101.0,
        ...        "measured_max_ms": 110.0, "ratio": 1.02, "ratio_min": 1.01, "ratio_max": 1.1,
        ...        "steal_pct": 3.0, "load_average": 1.5, "uncalibrated_ms": 51.0, "ratio_to_uncalibrated": 2.0}
        >>> table([row]).splitlines()[-1]
        '| gpt | 2 | 1f1b | 1 | 8 | 100.0 | - | 51.0 | 102.0 (101.0-110.0) | 1.020 (1.010-1.100) | 2.000 | 3 | 1.5 |'
    """
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in records:
        steal = "-" if r.get("steal_pct") is None else f"{r['steal_pct']:.0f}"
        before = "-" if r.get("predicted_before_ms") is None else f"{r['predicted_before_ms']:.1f}"
        bare = ("-", "-") if r.get("uncalibrated_ms") is None else (f"{r['uncalibrated_ms']:.1f}",
                                                                    f"{r['ratio_to_uncalibrated']:.3f}")
        schedule = f"chosen: {r['plan']}" if r.get("chosen") else r["schedule"]
        lines.append(
            f"| {r['workload']} | {r['ranks']} | {schedule} | {r['virtual']} | {r['microbatches']} "
            f"| {r['predicted_ms']:.1f} | {before} | {bare[0]} "
            f"| {r['measured_ms']:.1f} ({r['measured_min_ms']:.1f}-{r['measured_max_ms']:.1f}) "
            f"| {r['ratio']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) | {bare[1]} | {steal} "
            f"| {r['load_average']:.1f} |"
        )
    return "\n".join(lines)


def fastest(records: list[dict]) -> list[str]:
    """Per (workload, P): the plan measured fastest, and whether the prediction picked the same.

    Example:
        >>> rows = [{"workload": "gpt", "ranks": 2, "schedule": s, "virtual": 1, "measured_ms": m,
        ...          "predicted_ms": p} for s, m, p in (("1f1b", 10, 9), ("zb-h1", 9, 8))]
        >>> fastest(rows)
        ['gpt P=2: fastest measured zb-h1 V=1 (9.0 ms); predicted fastest zb-h1 V=1: same']
    """
    lines = []
    cells = sorted({(r["workload"], r["ranks"]) for r in records}, key=lambda c: (c[0], c[1]))
    for workload, ranks in cells:
        rows = [r for r in records if r["workload"] == workload and r["ranks"] == ranks and not r.get("chosen")]
        best = min(rows, key=lambda r: r["measured_ms"])
        picked = min(rows, key=lambda r: r["predicted_ms"])
        verdict = "same" if picked is best else (
            f"differs ({picked['measured_ms'] / best['measured_ms']:.3f}x the fastest measured)")
        lines.append(
            f"{workload} P={ranks}: fastest measured {best['schedule']} V={best['virtual']} "
            f"({best['measured_ms']:.1f} ms); predicted fastest {picked['schedule']} V={picked['virtual']}: {verdict}"
        )
    return lines


def uncalibrated_line(records: list[dict]) -> str:
    """How far the step ``conveyor plan`` prints without ``--calibrate`` is from the measured one.

    Example:
        >>> uncalibrated_line([{"ratio_to_uncalibrated": 1.7}, {"ratio_to_uncalibrated": 3.3}])
        'measured / uncalibrated prediction (`conveyor plan` without --calibrate): median 2.500, from 1.700 to 3.300.'
    """
    ratios = [r["ratio_to_uncalibrated"] for r in records if r.get("ratio_to_uncalibrated") is not None]
    if not ratios:
        return "measured / uncalibrated prediction: not recorded."
    return (f"measured / uncalibrated prediction (`conveyor plan` without --calibrate): median "
            f"{statistics.median(ratios):.3f}, from {min(ratios):.3f} to {max(ratios):.3f}.")


def _steal_range(records: list[dict]) -> str:
    steals = [r["steal_pct"] for r in records if r.get("steal_pct") is not None]
    return f"{min(steals):.0f}-{max(steals):.0f}%" if steals else "not measured"


def _write(out: Path, meta: dict, records: list[dict]) -> None:
    (out / "plan.json").write_text(json.dumps({"meta": meta, "cases": records}, indent=1) + "\n")
    ratios = [r["ratio"] for r in records]
    text = [
        "# Predicted vs measured step time (`python -m benchmarks --plan`)", "",
        f"Started {meta['started']}, {meta['cpus']} CPUs, load average {meta['load_start']} at start, "
        f"{meta['load_end']} at end; {meta['elapsed_s']:.0f} s; CPU steal over the timed steps "
        f"{_steal_range(records)}.", "",
        f"Made by {provenance_line(meta)}.", "",
        *(f"Calibration at P={ranks} (this machine, 1F1B of sleeping blocks): " + ", ".join(
            f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
            for k, v in figures.items() if k != "samples") for ranks, figures in meta["calibration"].items()), "",
        table(records), "",
        f"|measured / predicted - 1| over all cases: median {statistics.median(abs(r - 1) for r in ratios):.3f}, "
        f"worst {max(abs(r - 1) for r in ratios):.3f}; within 5%: "
        f"{sum(abs(r - 1) <= 0.05 for r in ratios)} of {len(ratios)}.", "",
        uncalibrated_line(records), "",
        *[f"- {line}" for line in fastest(records)], "",
        "The planner's own plan (`conveyor.plan.plan(..., machine=Machine(calibration=...))`, no memory limit) "
        "against the fastest built-in with the default split, measured in the same run:", "",
        *[f"- {line}" for line in plan_chosen.verdicts(records)], "",
    ]
    (out / "plan.md").write_text("\n".join(text))


def run(args, argv: list[str] | None = None) -> int:
    """Calibrate, then every (workload, P) cell; print and write the table (``argv``: the command, recorded)."""
    import conveyor
    from conveyor.plan.calibration import calibrate

    if getattr(args, "quick", False):
        for key, value in QUICK.items():
            setattr(args, key, value)
        if args.predict_out == str(Path(__file__).resolve().parent / "results" / "plan"):
            args.predict_out = str(Path(args.predict_out).with_name("plan-quick"))
    started = time.monotonic()
    out = Path(args.predict_out)
    out.mkdir(parents=True, exist_ok=True)
    provenance = RunProvenance(argv).start()
    meta = {"started": provenance.started, "cpus": os.cpu_count(), "load_start": provenance.load_start[0]}
    rank_counts = [int(p) for p in args.predict_ranks.split(",")]
    # One calibration per rank count: P processes on this machine's cores wake and hand over
    # messages differently at P=2 and P=4.
    calibrations = {ranks: calibrate(conveyor.Pipeline, ranks=ranks) for ranks in rank_counts}
    meta["calibration"] = {str(ranks): c.as_dict() for ranks, c in calibrations.items()}
    print("calibration:", json.dumps(meta["calibration"]), flush=True)
    plans = parse_plans(args.predict_schedules)
    records: list[dict] = []
    for name in filter(None, args.predict_workloads.split(",")):
        for ranks in rank_counts:
            workload = build_workload(name, ranks)
            cases = [lib.Case(workload, s, v, args.predict_microbatches) for s, v in plans]
            cell = run_cell(workload, cases, calibrations[ranks], args, out, chosen=not args.predict_no_chosen)
            print(table(cell), flush=True)
            records.extend(cell)
    meta.update(provenance.record())
    meta.update(load_end=meta["load_average_end"][0], elapsed_s=time.monotonic() - started,
                steps_per_round=args.predict_steps, rounds=args.predict_rounds, warmup=args.predict_warmup)
    _write(out, meta, records)
    print(table(records))
    print(uncalibrated_line(records))
    print("\n".join(fastest(records)))
    print("\n".join(plan_chosen.verdicts(records)))
    print(f"wrote {out / 'plan.md'}, {out / 'plan.json'} and a PNG per case")
    return 0
