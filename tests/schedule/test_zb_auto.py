"""ZB-1p and ZB-2p: searched orders that verify, keep to the memory limit, never lose to ZB-H1,
reach the lower bound with equal costs, and build verified schedules at a planner's sizes."""

from __future__ import annotations

import pytest

import conveyor.schedule as cs
from conveyor.cli import main
from conveyor.errors import CostError, ScheduleError
from conveyor.schedule.builtin import zb_auto as za
from conveyor.schedule.ir import ActionKind
from conveyor.testing.rigs.schedule_docs import example_block

# (forward, input gradient, weight gradient): equal, and the paper's profiled shape T_W < T_F < T_I
COSTS = {
    "equal": (1.0, 1.0, 1.0),
    "w<f<i": (1.0, 1.5, 0.5),
    "w<<f<i": (1.0, 2.0, 0.3),
    "w<f=i": (1.0, 1.0, 0.6),
}
RANKS = (2, 3, 4, 8)


def _per_stage(num_ranks: int, name: str, latency: float, skew_last: bool = False) -> cs.CostModel:
    forward, backward_input, backward_weight = COSTS[name]
    stages = [(forward, backward_input, backward_weight)] * num_ranks
    if skew_last:  # the last stage also runs the head and the loss
        stages[-1] = (1.4 * forward, 1.4 * backward_input, 1.4 * backward_weight)
    return cs.CostModel.per_stage(stages, latency=latency)


def _check(schedule: cs.Schedule, costs: cs.CostModel, limit: int) -> cs.Timeline:
    cs.verify(schedule)
    num_ranks, num_microbatches = schedule.num_ranks, schedule.num_microbatches
    assert schedule.placement == cs.Placement.looped(num_ranks, 1)
    for program in schedule.programs:
        by_kind: dict[ActionKind, list[int]] = {}
        for action in program:
            by_kind.setdefault(action.kind, []).append(action.microbatch)
        # each pass in microbatch order: weight gradients accumulate as on one device (bitwise parity)
        assert by_kind == {kind: list(range(num_microbatches)) for kind in (ActionKind.F, ActionKind.I, ActionKind.W)}
    timeline = cs.simulate(schedule, costs)
    assert max(timeline.peak_activations()) <= limit
    executed = cs.simulate(cs.executable(schedule).compute, costs)  # what the ranks run: I+W merged into B
    assert executed.makespan == pytest.approx(timeline.makespan)
    assert max(executed.peak_activations()) <= limit
    return timeline


@pytest.mark.parametrize("num_ranks", RANKS)
def test_grid_verifies_fits_the_limit_and_never_loses_to_zb_h1(num_ranks):
    """Every M in P..4P, each cost shape, latency 0 and 0.2, equal and heavier last stages."""
    checked = 0
    microbatches = range(num_ranks, 4 * num_ranks + 1) if num_ranks < 8 else (8, 9, 12, 16, 23, 24, 31, 32)
    for num_microbatches in microbatches:
        for name in COSTS:
            for latency, skew_last in ((0.0, False), (0.2, False), (0.2, True)):
                costs = _per_stage(num_ranks, name, latency, skew_last)
                h1 = cs.simulate(cs.build("zb-h1", ranks=num_ranks, microbatches=num_microbatches), costs)
                for schedule_name, limit in (("zb-1p", num_ranks), ("zb-2p", 2 * num_ranks)):
                    schedule = cs.build(schedule_name, ranks=num_ranks, microbatches=num_microbatches, costs=costs)
                    timeline = _check(schedule, costs, limit)
                    assert timeline.makespan <= h1.makespan * (1 + 1e-9), (schedule_name, num_microbatches, name)
                    floor = za.lower_bound(num_ranks, num_microbatches, costs, limit)
                    assert timeline.makespan >= floor * (1 - 1e-9)
                    checked += 1
    assert checked == len(microbatches) * len(COSTS) * 3 * 2


@pytest.mark.parametrize("num_ranks", RANKS)
def test_equal_costs_and_2p_memory_leave_no_bubble_but_the_start_up_skew(num_ranks):
    """M >= 3P, F=I=W: the makespan is the lower bound (P-1) T_F + 3M T_F, so the paper's bubble
    rate (per-rank spans) is 0; simulate's idle fraction keeps the skew, (P-1) / (3M+P-1),
    which no schedule goes below (rank r cannot start before r forwards)."""
    for num_microbatches in range(3 * num_ranks, 4 * num_ranks + 1):
        timeline = cs.simulate(cs.build("zb-2p", ranks=num_ranks, microbatches=num_microbatches))
        assert timeline.makespan == (num_ranks - 1) + 3 * num_microbatches
        assert za.steady_bubble(timeline) <= 0.01
        skew_only = (num_ranks - 1) / (3 * num_microbatches + num_ranks - 1)
        assert timeline.bubble_ratio == pytest.approx(skew_only)
        assert max(timeline.peak_activations()) <= 2 * num_ranks


def test_the_search_beats_the_handcrafted_schedules_on_profiled_costs():
    # P=8, M=32, T_W < T_F < T_I with latency: the documented figures.
    costs = cs.CostModel.uniform(8, 1.0, 1.5, 0.5, latency=0.1)
    makespan = {name: cs.simulate(cs.build(name, ranks=8, microbatches=32, costs=costs), costs).makespan
                for name in ("1f1b", "zb-h1", "zb-h2", "zb-1p", "zb-2p")}
    assert makespan["zb-2p"] == pytest.approx(107.4) and makespan["zb-h2"] == pytest.approx(107.9)
    assert makespan["zb-1p"] <= makespan["zb-h1"] < makespan["1f1b"]
    found = za.search(8, 32, costs, 16)
    assert found.knobs is not None and found.makespan == pytest.approx(makespan["zb-2p"])


def test_the_searched_orders_times_are_the_simulators():
    costs = _per_stage(4, "w<f<i", 0.3, skew_last=True)
    for limit in (4, 6, 8):
        found = za.search(4, 11, costs, limit)
        timeline = cs.simulate(za._schedule_of("found", 4, 11, found), costs)
        assert timeline.makespan == pytest.approx(found.makespan)
        assert max(b - a for a, b in za._rank_spans(timeline)) == pytest.approx(found.span)


def test_small_sizes_and_tight_limits_still_verify():
    for num_ranks in range(1, 6):
        for num_microbatches in range(1, 2 * num_ranks + 2):
            for limit in (1, 2, num_ranks, 2 * num_ranks):
                costs = _per_stage(num_ranks, "w<<f<i", 0.1)
                schedule = za.zb_auto(num_ranks, num_microbatches, memory_limit=limit, costs=costs)
                _check(schedule, costs, limit)


def test_a_planner_sized_build_is_a_verified_schedule():
    # How long building takes is a benchmark figure (`python -m benchmarks --schedule-scale` times zb-1p and
    # zb-2p at P=256, M=2048), not an assertion here: this machine is shared and its wall times swing.
    costs = cs.CostModel.uniform(8, 1.0, 1.5, 0.5, latency=0.1)
    schedule = cs.build("zb-2p", ranks=8, microbatches=32, costs=costs)
    assert schedule.num_ranks == 8 and schedule.num_microbatches == 32
    cs.verify(schedule)


def test_registered_with_costs_and_listed(capsys):
    info = cs.available()["zb-2p"]
    assert info.uses_costs and info.virtual_choices == (1,) and not cs.available()["zb-h1"].uses_costs
    assert main(["schedules"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert {"zb-1p", "zb-2p"} <= set(listed)
    # a builder that plans for no costs ignores them
    assert cs.build("1f1b", ranks=2, microbatches=2, costs=cs.CostModel.uniform(2)).name == "1f1b"


def test_cli_simulate_plans_for_the_costs_it_is_given(capsys):
    args = ["simulate", "--schedule", "zb-2p", "--ranks", "4", "--microbatches", "12"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "makespan          39 units" in out and "peak activations  r0:7 r1:7 r2:7 r3:7" in out
    assert main([*args, "--costs", "1,1.5,0.5", "--latency", "0.1", "--json"]) == 0
    import json

    summary = json.loads(capsys.readouterr().out)
    costs = cs.CostModel.uniform(4, 1.0, 1.5, 0.5, latency=0.1)
    planned = cs.simulate(za.zb_2p(4, 12, costs=costs), costs)
    assert summary["makespan"] == pytest.approx(planned.makespan)
    assert planned.makespan < cs.simulate(za.zb_2p(4, 12), costs).makespan  # planned for other costs: slower


def test_wrong_sizes_costs_and_limits_are_refused_with_the_rule():
    with pytest.raises(ScheduleError, match="not virtual=2"):
        cs.build("zb-1p", ranks=4, microbatches=8, virtual=2)
    with pytest.raises(ScheduleError, match="runs exactly 1 stage"):
        za.zb_2p(4, 8, 2)
    with pytest.raises(ScheduleError, match="memory_limit must be a positive integer"):
        za.zb_auto(4, 8, memory_limit=0)
    with pytest.raises(CostError, match="costs given for 2 stages but the schedule has 4"):
        cs.build("zb-2p", ranks=4, microbatches=8, costs=cs.CostModel.uniform(2))
    with pytest.raises(ScheduleError, match="must be a positive integer"):
        za.zb_1p(0, 4)


@pytest.mark.parametrize("name", ["zb-1p", "zb-2p"])
def test_module_docstring_shows_what_the_builder_produces(name):
    doc = za.__doc__
    if name == "zb-2p":
        assert example_block(name) in doc
    for heading in ("Phases", "Serves every"):
        assert heading in doc
    # ZB-1p with equal costs is ZB-H1 (already at the lower bound), as the docstring says
    if name == "zb-1p":
        assert cs.build(name, ranks=4, microbatches=8).programs == cs.build("zb-h1", ranks=4, microbatches=8).programs
