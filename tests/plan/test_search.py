"""The planner's search on synthetic unit costs: uneven stages, memory limits, plan files, scale."""

from __future__ import annotations

import pytest

import conveyor.plan as cp
from conveyor.errors import PlanError
from conveyor.plan.balance import bounds_of, cut_units

MB = 2**20


def llama_like(blocks: int = 16):
    """A Llama-style model of large vocabulary and small width: the head costs three blocks (time and
    memory), the embedding one (its weight gradient scatters into a large dense table)."""
    rows = [("model.embed_tokens", 0.5, 0.0, 2.5, 1 * MB, 10 * MB)]
    rows += [(f"model.layers.{i}", 1.0, 1.0, 1.0, 4 * MB, 10 * MB, True) for i in range(blocks)]
    rows += [("model.norm", 0.01, 0.01, 0.01, 1 * MB, 0.01 * MB), ("lm_head", 3.0, 3.0, 3.0, 8 * MB, 30 * MB)]
    return cp.synthetic_table(rows)


def blocks_per_stage(plan) -> list[int]:
    names = plan.costs.names
    cuts = [names.index(name) for name in plan.split_points]
    return [sum(plan.costs.units[k].is_block for k in range(i, j)) for i, j in bounds_of(cuts, len(names))]


def test_heavy_embedding_and_head_get_fewer_blocks_and_the_stages_stay_even():
    table = llama_like()
    plan = cp.choose(cp.search(table, ranks=4, global_batch=8, memory_per_rank=cp.parse_size("1GiB")), table)
    blocks = blocks_per_stage(plan)
    assert plan.virtual == 1, plan
    assert blocks[0] < max(blocks[1:-1]) and blocks[-1] < max(blocks[1:-1]), blocks
    times, memory = plan.stage_times, plan.memory_per_rank
    assert max(times) <= 1.05 * sum(times) / len(times), times
    assert memory[0] <= 1.1 * sum(memory) / len(memory), memory


def test_a_tight_memory_limit_rejects_candidates_and_names_the_fastest_that_did_not_fit():
    table = llama_like()
    free = cp.choose(cp.search(table, ranks=4, global_batch=8, memory_per_rank=float("inf")), table)
    limit = 0.95 * max(free.memory_per_rank)
    plan = cp.choose(cp.search(table, ranks=4, global_batch=8, memory_per_rank=limit), table)
    assert max(plan.memory_per_rank) <= limit
    assert plan.step_time >= free.step_time
    assert plan.outcome.get("over memory", 0) >= 1 and plan.best_over_memory
    with pytest.raises(PlanError, match="no plan fits"):
        cp.choose(cp.search(table, ranks=4, global_batch=8, memory_per_rank=100 * MB), table)


def test_the_plan_file_round_trips_with_what_the_pipeline_takes_from_it(tmp_path):
    table = llama_like(8)
    plan = cp.choose(cp.search(table, ranks=2, global_batch=8, memory_per_rank=float("inf"),
                               schedules=["1f1b", "zb-h1"]), table)
    loaded = cp.Plan.load(plan.save(tmp_path / "plan.json"))
    runs = [(p.schedule_spec(), p.microbatches, p.virtual, p.split_points) for p in (loaded, plan)]
    assert runs[0] == runs[1]
    assert loaded.costs == plan.costs and loaded.memory_per_rank == plan.memory_per_rank
    assert loaded.schedule in ("1f1b", "zb-h1") and len(loaded.split_points) == loaded.num_stages - 1
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(PlanError, match="not a conveyor plan"):
        cp.Plan.load(tmp_path / "bad.json")


def test_schedules_and_microbatch_counts_come_from_the_registry_and_the_batch():
    table = llama_like(8)
    result = cp.search(table, ranks=2, global_batch=8, memory_per_rank=float("inf"))
    tried = {(c.schedule, c.virtual, c.microbatches) for c in result.candidates}
    names = set(cp.search.__globals__["cs"].available())
    assert {name for name, _, _ in tried} == names
    assert {m for _, _, m in tried} == {2, 4, 8}
    assert ("zbv", 2, 8) in tried and ("1f1b", 1, 8) in tried


def test_min_max_partition_and_sizes():
    weights = [5, 1, 1, 1, 1, 1, 1, 5]
    assert cut_units(8, 3, lambda s, i, j: sum(weights[i:j])) == [1, 6]  # 5 | 5 | 6, squares 86 < 88
    assert cp.parse_size("1.5GiB") == 1.5 * 2**30
    with pytest.raises(PlanError, match="4GiB"):
        cp.parse_size("4 gigs")


def test_a_32_stage_plan_of_a_large_llama_is_found():
    """CI's size: 32 ranks over 40 blocks (64 ranks of a 70B Llama: benchmarks/plan_70b.py, ~15 s)."""
    rows = [("embed", 0.001, 0.0, 0.002, 1e6, 2e9)]
    rows += [(f"layers.{i}", 0.02, 0.02, 0.02, 1e9, 1.7e9, True) for i in range(40)]
    rows += [("norm", 1e-4, 1e-4, 1e-4, 6e7, 1.6e4), ("lm_head", 0.02, 0.02, 0.02, 6e7, 2e9)]
    table = cp.synthetic_table(rows)
    # How quick is benchmarks/plan_70b.py's figure; a search that blew up would meet the suite's 300 s timeout.
    plan = cp.choose(cp.search(table, ranks=32, global_batch=128, memory_per_rank=cp.parse_size("80GiB")), table)
    assert plan.num_stages == 32 and len(plan.memory_per_rank) == 32


def _orders(schedule) -> list[list[str]]:
    return [[str(action) for action in program] for program in schedule.programs]


def test_a_cost_planned_schedule_runs_the_order_the_planner_simulated(tmp_path):
    # Skewed costs (W light, I heavy) where zb-2p's searched order differs from its uniform-cost one:
    # the plan file must rebuild the simulated order, not the name's default.
    rows = [(f"layers.{i}", 1.0, 1.5, 0.5, 4 * MB, 10 * MB, True) for i in range(8)]
    table = cp.synthetic_table(rows)
    plan = cp.choose(cp.search(table, ranks=4, global_batch=16, memory_per_rank=float("inf"),
                               schedules=["zb-2p"], space=cp.SearchSpace(virtual=[1]),
                               machine=cp.Machine(latency=0.1)), table)
    assert plan.schedule == "zb-2p" and plan.schedule_costs is not None
    import conveyor.schedule as cs

    simulated = cs.build("zb-2p", ranks=4, microbatches=plan.microbatches, costs=plan.schedule_costs)
    uniform = cs.build("zb-2p", ranks=4, microbatches=plan.microbatches)
    loaded = cp.Plan.load(plan.save(tmp_path / "plan.json"))
    assert loaded.schedule_costs == plan.schedule_costs
    assert _orders(loaded.schedule_spec()) == _orders(simulated)
    assert _orders(simulated) != _orders(uniform)  # else the test would prove nothing
    step = cs.simulate(loaded.schedule_spec(), plan.schedule_costs, time_unit="s").spans
    assert max(span.end for span in step) == pytest.approx(plan.step_time)
