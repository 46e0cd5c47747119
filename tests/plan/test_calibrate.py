"""The calibration's arithmetic and the prediction's plumbing (no assertion on how fast anything runs)."""

from __future__ import annotations

import math
import random

import pytest

import conveyor
import conveyor.schedule as cs
from conveyor.plan.calibration import (
    Calibration,
    calibration_from_timelines,
    compute_makespan,
    measure_steps,
)
from conveyor.plan.predict import predict_step, with_overheads
from conveyor.schedule.cost import CostModel
from conveyor.schedule.ir import Action
from conveyor.schedule.simulate import simulate_shared_cores
from conveyor.schedule.timeline import Span, Timeline

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("interleaved-1f1b", 2),
             ("looped-bfs", 2), ("zbv", 2), ("dualpipev", 2)]


def _measured(spans: list[tuple[int, str, float, float]]) -> Timeline:
    return Timeline.from_spans(2, [Span(r, Action.parse(a), s, e) for r, a, s, e in spans],
                               source="measured", time_unit="s")


def test_calibration_reads_receives_waits_actions_and_the_step():
    # Rank 1 waits for 0F0 (ends at 1.0) and starts 1F0 at 1.5; its receive of 1F1 finds the data.
    timeline = _measured([
        (0, "0F0", 0.0, 1.0), (0, "0F1", 1.0, 2.1),
        (1, "1RECV_F0", 0.0, 1.4), (1, "1F0", 1.5, 2.6),
        (1, "1RECV_F1", 2.6, 2.8), (1, "1F1", 2.8, 3.9),
    ])
    alone = {("F", 0): 1.0, ("F", 1): 1.0}
    cal = calibration_from_timelines([timeline], [4.4], transport="test", alone_s=alone)
    assert cal.receive_s == pytest.approx(0.2)
    assert cal.latency_s == pytest.approx(0.5 - 0.2)
    assert cal.action_s == pytest.approx(0.1)  # spans of 1.0, 1.1, 1.1, 1.1 over 1.0 alone
    assert cal.step_s == pytest.approx(4.4 - compute_makespan(timeline)) == pytest.approx(0.5)
    assert cal.samples == {"actions": 4, "receives": 1, "waits": 1, "steps": 1}
    assert cal.as_dict()["transport"] == "test"


def test_an_idle_calibration_predicts_the_simulator():
    sched = cs.build("zb-h1", ranks=4, microbatches=8)
    costs = CostModel.per_stage([(1.0, 1.2, 0.7), (1.1, 1.0, 0.8), (0.9, 1.1, 0.6), (1.3, 1.0, 0.9)])
    plain = cs.simulate(cs.executable(sched).compute, costs).makespan
    assert predict_step(sched, costs, Calibration()).step_s == pytest.approx(plain)
    busy = predict_step(sched, costs, Calibration(action_s=0.01, receive_s=0.02, latency_s=0.03,
                                                  seconds_per_byte=1e-6, step_s=0.5),
                        message_bytes=1000, rank_extra_s=[0.1, 0.4, 0.2, 0.3])
    assert busy.makespan_s > plain
    assert busy.step_s == pytest.approx(busy.makespan_s + 0.5 + 0.4)
    assert busy.timeline.time_unit == "s"


def test_weight_passes_pay_the_action_cost_only_where_they_run_alone():
    cal = Calibration(action_s=0.25, receive_s=0.5)
    merged = with_overheads(cs.build("1f1b", ranks=2, microbatches=4), CostModel.uniform(2), cal)
    split = with_overheads(cs.build("zb-h1", ranks=2, microbatches=4), CostModel.uniform(2), cal)
    assert [s.backward_weight for s in merged.stages] == [1.0, 1.0]
    # zb-h1's stage 0 sends no input gradient, so its I and W run as one B; stage 1's W runs alone.
    assert [s.backward_weight for s in split.stages] == [1.0, 1.25]
    # zbv keeps stages P-1 and P on one rank: no receive between them.
    zbv = with_overheads(cs.build("zbv", ranks=2, microbatches=4), CostModel.uniform(4), cal)
    assert [s.forward for s in zbv.stages] == [1.25, 1.75, 1.25, 1.75]


@pytest.mark.parametrize("name,virtual", SCHEDULES)
def test_shared_cores_with_a_core_per_rank_time_like_the_simulator(name, virtual):
    rng = random.Random(name)
    for ranks in (2, 4):
        sched = cs.build(name, ranks=ranks, microbatches=8, virtual=virtual)
        costs = CostModel.per_stage(
            [(rng.uniform(1, 2), rng.uniform(1, 2), rng.uniform(0.5, 1)) for _ in range(sched.num_stages)],
            latency=0.1,
        )
        expected = cs.simulate(cs.executable(sched).compute, costs).makespan
        assert simulate_shared_cores(sched, costs, cores=ranks).makespan == pytest.approx(expected)
        # Fewer cores than ranks never speeds a step up, and one core runs everything in turn.
        assert simulate_shared_cores(sched, costs, cores=2).makespan >= expected - 1e-9
        serial = sum(costs.duration(a) for p in cs.executable(sched).compute.programs for a in p)
        assert simulate_shared_cores(sched, costs, cores=1).makespan >= serial - 1e-9


def test_ranks_sharing_cores_share_their_optimizer_steps():
    sched = cs.build("1f1b", ranks=4, microbatches=4)
    costs = CostModel.uniform(4, 0.01, 0.01, 0.01)
    shared = predict_step(sched, costs, Calibration(), rank_extra_s=[0.1] * 4, cores=2)
    assert shared.step_s == pytest.approx(shared.makespan_s + 0.2)


@pytest.mark.timeout(60)
def test_a_real_run_gives_a_finite_calibration(one_thread):
    from conveyor.testing.models import Emulated

    workload = Emulated(2, 0.5, 0.5, 0.5, blocks_per_rank=1)
    timelines, walls, transport = measure_steps(conveyor.Pipeline, workload, ranks=2, microbatches=4, steps=2, warmup=1)
    assert len(timelines) == len(walls) == 2 and transport
    cal = calibration_from_timelines(timelines, walls, transport=transport)
    for value in (cal.receive_s, cal.latency_s, cal.step_s):
        assert math.isfinite(value) and value >= 0
    assert cal.samples["steps"] == 2


def test_the_benchmark_report_names_the_fastest_plan_and_the_predicted_one():
    from benchmarks.plan import fastest, parse_plans, table

    rows = [{"workload": "gpt", "ranks": 2, "schedule": name, "virtual": v, "microbatches": 8,
             "predicted_ms": p, "predicted_before_ms": p, "measured_ms": m, "measured_min_ms": m,
             "measured_max_ms": m, "ratio": m / p, "ratio_min": m / p, "ratio_max": m / p,
             "steal_pct": None, "load_average": 1.0, "uncalibrated_ms": p / 2, "ratio_to_uncalibrated": 2 * m / p}
            for (name, v), p, m in zip(parse_plans("1f1b,interleaved-1f1b:2"), (100.0, 90.0), (104.0, 103.0))]
    assert "| gpt | 2 | interleaved-1f1b | 2 | 8 | 90.0 | 90.0 | 45.0 | 103.0" in table(rows)
    assert fastest(rows) == [
        "gpt P=2: fastest measured interleaved-1f1b V=2 (103.0 ms); predicted fastest interleaved-1f1b V=2: same"
    ]


def test_the_planner_asks_for_a_measured_calibration_rather_than_starting_pipelines():
    import torch

    import conveyor
    from conveyor.errors import PlanError

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(PlanError, match=r"conveyor\.plan\.calibration\.calibrate\(conveyor\.Pipeline, ranks=2\)"):
        conveyor.plan.plan(model, torch.randn(2, 4), ranks=2, global_batch=4,
                           machine=conveyor.plan.Machine(calibration=True))
