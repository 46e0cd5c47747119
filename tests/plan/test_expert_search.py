"""The planner's expert-parallel search: one EP rank's unit costs, ep among the replicas' divisors, the reasons."""

from __future__ import annotations

import json
import math

import pytest

from conveyor.cli import main
from conveyor.errors import PlanError
from conveyor.plan.costs import synthetic_table
from conveyor.plan.expert_search import ExpertParallelOption, expert_units, search_expert_parallel
from conveyor.plan.search import search
from conveyor.plan.settings import SearchSpace
from conveyor.plan.tensor_search import ModuleSplit, TensorParallelOption

# An embedding, four blocks and a head; each block holds 64 parameters (256 bytes), 48 of them its experts'.
TABLE = synthetic_table([("embed", 1, 0, 1, 8, 64)] + [(f"b{i}", 4, 4, 4, 340, 256, True) for i in range(4)]
                        + [("head", 1, 1, 1, 8, 64)])


def _option(ep: int, moved: float = 0.0) -> ExpertParallelOption:
    return ExpertParallelOption(ep, tuple(ModuleSplit(f"b{i}.mlp.experts", 48.0, moved, moved, 2, 2) for i in range(4)))


def test_one_ep_rank_keeps_its_share_of_the_experts_and_pays_four_all_to_alls():
    units = expert_units(TABLE.units, _option(4, moved=1e6), 2, bandwidth=1e9, latency=1e-3)
    embed, block, head = units[0], units[1], units[-1]
    assert (embed, head) == (TABLE.units[0], TABLE.units[-1])  # no experts: as they were
    assert block.parameters == 16 + 48 / 4 and block.parameter_bytes == block.parameters * 4
    # Dispatch and combine in F, their gradients in I: each a latency and 3/4 of 2 samples' 1 MB over 1 GB/s.
    each = 1e-3 + 0.75 * 2 * 1e6 / 1e9
    assert math.isclose(block.forward, 4 + 2 * each) and math.isclose(block.backward_input, 4 + 2 * each)
    # The experts' compute stays (each rank runs a quarter of them on four times the tokens); W moves nothing.
    assert block.backward_weight == 4 and block.activation_bytes == 340 and block.output_bytes == 340
    assert expert_units(TABLE.units, _option(1, moved=1e6), 2, bandwidth=1e9, latency=1e-3) == TABLE.units


def _search_one(table, ranks, option):
    return search(table, ranks=ranks, global_batch=8, memory_per_rank=LIMIT, schedules=["1f1b"],
                  expert_parallel=option)


# ep=1 holds 64 parameters a block (x 16 bytes with gradients and AdamW's two moments) on each of 2 ranks: over the
# limit; ep=2 and ep=4 fit, ep=4 with more tokens moved.
LIMIT = 3000.0


def test_the_search_keeps_the_fastest_ep_that_fits_and_says_why_the_others_lost():
    options = [_option(1), _option(2, moved=1e3), _option(4, moved=1e3),
               ExpertParallelOption(8, refused="ep=8 does not divide --dp 4")]
    chosen, outcomes = search_expert_parallel(TABLE, options, ranks=2, search_one=_search_one, memory_per_rank=LIMIT)
    reasons = {o.ep: o.reason for o in outcomes}
    assert chosen is not None and chosen.ep == 2, reasons
    assert reasons[1].startswith("over memory: its lightest plan needs"), reasons
    assert reasons[2].startswith("chosen: the fastest plan that fits"), reasons
    assert reasons[4].startswith("fits, ") and "slower than ep=2" in reasons[4], reasons
    assert reasons[8] == "refused: ep=8 does not divide --dp 4"
    assert chosen.result.settings["expert_parallel"] == 2


def test_tensor_and_expert_parallel_sizes_are_not_searched_together():
    with pytest.raises(PlanError, match="not both"):
        SearchSpace(tensor_parallel=[TensorParallelOption(2)], expert_parallel=[_option(2)])
    with pytest.raises(PlanError, match="ExpertParallelOption"):
        SearchSpace(expert_parallel=[2])


MOE = ["--set", "model.layers=4", "--set", "model.width=128", "--set", "model.heads=4"]


def test_conveyor_plan_searches_ep_over_the_replicas_and_writes_it(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "moe", "--ranks", "2", "--global-batch", "8", "--dp", "4", "--ep", "auto", "--analytic",
                 "--memory-per-rank", "22MiB", "--out", str(out), *MOE]) == 0
    text = capsys.readouterr().out
    rows = {line.split()[0]: line for line in text.splitlines() if line[:4].strip() in {"1", "2", "4"}
            and "MiB" in line and ("chosen" in line or "fits" in line or "over memory" in line)}
    # ep=1 keeps every expert (over 22 MiB); ep=2 halves them and fits; ep=4 fits too, moving more tokens.
    assert "over memory" in rows["1"] and "chosen" in rows["2"] and "slower than ep=2" in rows["4"], text
    assert "chosen ep=2: each experts module's experts shared by 2 replicas (conveyor train parallel.ep=2)" in text
    saved = json.loads(out.read_text())
    assert saved["expert_parallel"] == 2 and saved["expert_parallel_report"][0].startswith("expert parallel:")


def test_conveyor_plan_refuses_an_ep_that_cannot_run(capsys):
    assert main(["plan", "moe", "--ranks", "2", "--global-batch", "8", "--dp", "3", "--ep", "2", "--analytic",
                 *MOE]) == 2
    assert "each size must divide --dp 3" in capsys.readouterr().err
    assert main(["plan", "moe", "--ranks", "2", "--global-batch", "8", "--dp", "2", "--ep", "2", "--tp", "2",
                 "--analytic", *MOE]) == 2
    assert "expert parallelism with tensor parallelism is not supported yet" in capsys.readouterr().err
    assert main(["plan", "gpt", "--ranks", "2", "--global-batch", "8", "--dp", "2", "--ep", "2", "--analytic",
                 "--set", "model.layers=4"]) != 0
    captured = capsys.readouterr()
    assert "refused: the model has no experts modules" in captured.out + captured.err
