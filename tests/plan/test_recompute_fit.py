"""The planner recomputes blocks, stage by stage, where a plan would not fit its memory otherwise."""

from __future__ import annotations

import json
import math

import pytest

from conveyor.errors import PipelineConfigError, PlanError
from conveyor.plan.costs import CostTable, UnitCost
from conveyor.plan.planner import choose, format_plan
from conveyor.plan.result import Plan
from conveyor.plan.search import search
from conveyor.train.config import TrainConfig, apply_plan

MiB = 2**20


def _table() -> CostTable:
    # Blocks keep 8 MiB each for backward but hand on 1 MiB: recomputed, one keeps its 1 MiB input.
    units = [UnitCost("embed", 1.0, 0.0, 1.0, 1 * MiB, 0.5 * MiB, 4096, 1024, 1 * MiB)]
    units += [UnitCost(f"layers.{k}", 1.0, 1.0, 1.0, 8 * MiB, 4 * MiB, 4096, 1024, 1 * MiB, True) for k in range(8)]
    return CostTable(tuple(units), 1, source="synthetic")


def _best(limit: float):
    result = search(_table(), ranks=2, global_batch=8, memory_per_rank=limit, schedules=["1f1b"], microbatches=[8])
    return result.fitting[0] if result.fitting else None


def test_a_plan_over_memory_fits_by_recomputing_the_first_stage_first():
    free = _best(math.inf)
    assert free.recompute == () and free.verdict == "fits"
    limit = 0.6 * free.peak_memory
    tight = _best(limit)
    assert tight is not None and tight.peak_memory <= limit, tight
    assert tight.recompute and tight.recompute[0] is not None, tight.recompute  # tried once nothing fit
    # The first stage holds the most microbatches under 1F1B: it recomputes at least as much as the last.
    levels = [0 if p is None else 3 - p["every"] for p in tight.recompute]
    assert levels[0] >= levels[-1]
    assert tight.step_time > free.step_time  # the recomputations cost time
    assert _best(0.01 * free.peak_memory) is None  # below even every block recomputed: nothing fits
    result = search(_table(), ranks=2, global_batch=8, memory_per_rank=limit, schedules=["1f1b"], microbatches=[8])
    plan = choose(result, _table())
    assert plan.recompute == tight.recompute
    assert "recomputation to fit: stage 0: every=" in format_plan(plan)


def test_the_policies_travel_in_the_plan_file_and_into_the_config(tmp_path):
    plan = Plan("1f1b", 2, 1, 4, 8, ("layers.2",), 1.5, 0.2, (1e9, 9e8), (0.3, 0.3), 4e9,
                recompute=({"every": 1}, None))
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    assert loaded.recompute == ({"every": 1}, None)
    cfg = TrainConfig()
    cfg.parallel.plan = str(tmp_path / "plan.json")
    apply_plan(cfg)
    assert [str(p) for p in cfg.stage.recompute] == ["every=1", "None"]


def test_a_plan_file_with_a_bad_policy_is_refused_when_the_stage_options_are_made(tmp_path):
    plan = Plan("1f1b", 2, 1, 4, 8, ("layers.2",), 1.5, 0.2, (1e9, 9e8), (0.3, 0.3), 4e9,
                recompute=({"every": 0}, None))
    cfg = TrainConfig()
    cfg.parallel.plan = str(plan.save(tmp_path / "plan.json"))
    with pytest.raises(PipelineConfigError, match="every takes a positive whole number"):
        apply_plan(cfg)


def test_a_plan_file_that_names_its_policies_checkpoint_is_refused_with_the_new_key(tmp_path):
    plan = Plan("1f1b", 2, 1, 4, 8, ("layers.2",), 1.5, 0.2, (1e9, 9e8), (0.3, 0.3), 4e9,
                recompute=({"every": 1}, None))
    data = json.loads(plan.save(tmp_path / "plan.json").read_text())
    data["checkpoint"] = data.pop("recompute")
    with pytest.raises(PlanError, match='rename that key to "recompute"'):
        Plan.from_json(data)
