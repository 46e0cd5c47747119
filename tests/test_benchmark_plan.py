"""`python -m benchmarks --plan`: conveyor.plan.plan()'s own plan is a case measured with the built-ins."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import libraries as lib
from benchmarks import plan as bench
from benchmarks import plan_chosen
from conveyor.plan.calibration import Calibration
from conveyor.testing.models import Emulated


def test_split_points_map_onto_blocks_or_refuse():
    units = ["token_embedding", "position_embedding", *[f"blocks.{k}" for k in range(4)], "final_norm", "head"]
    assert plan_chosen.split_of(("blocks.2", "final_norm"), num_blocks=4, units=units) == (2, 2, 0)
    with pytest.raises(ValueError, match="'head'"):
        plan_chosen.split_of(("head",), num_blocks=4, units=units)


@pytest.mark.timeout(120)
def test_a_cell_measures_the_chosen_plan_beside_the_built_ins(tmp_path):
    # Sleeps of 1 ms, one timed round of one step: wiring only, no timing is asserted.
    workload = Emulated(num_ranks=2, forward_ms=1.0, input_grad_ms=1.0, weight_grad_ms=1.0)
    args = argparse.Namespace(predict_microbatches=4, predict_rounds=1, predict_steps=1, predict_warmup=0,
                              step_timeout_s=60.0)
    cases = [lib.Case(workload, "1f1b", 1, 4)]
    records = bench.run_cell(workload, cases, Calibration(), args, tmp_path, chosen=True)
    chosen = [r for r in records if r["chosen"]]
    assert len(records) == 2 and len(chosen) == 1
    record = chosen[0]
    assert sum(record["blocks_per_stage"]) == workload.num_blocks
    # Predicted like the built-ins, from its own stages sampled between the rounds; the planner's
    # own step is the prediction made before the runs.
    assert record["predicted_before_ms"] == pytest.approx(record["planned_step_ms"])
    assert len(record["stage_costs_ms"]) == len(record["blocks_per_stage"]) and record["predicted_ms"] > 0
    assert (tmp_path / record["png"]).exists() and record["png"].startswith("emulated-P2-chosen-")
    assert plan_chosen.verdicts(records)[0].startswith("emulated P=2: chosen ")
    assert "chosen: " in bench.table(records)
    # What `conveyor plan` prints without --calibrate, beside each measurement.
    for r in records:
        assert 0 < r["uncalibrated_ms"] < float("inf"), r
        assert r["ratio_to_uncalibrated"] == pytest.approx(r["measured_ms"] / r["uncalibrated_ms"])
    assert bench.uncalibrated_line(records).startswith("measured / uncalibrated prediction (`conveyor plan` without")
