"""The planner's expert-parallel search: one EP rank's unit costs, ep among the replicas' divisors, the reasons."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from conveyor.cli import main
from conveyor.errors import PlanError
from conveyor.plan.costs import synthetic_table
from conveyor.plan.expert_search import (
    ExpertParallelOption,
    expert_units,
    search_expert_parallel,
    search_tensor_and_expert_parallel,
)
from conveyor.plan.planner import format_plan
from conveyor.plan.result import Plan
from conveyor.plan.search import search
from conveyor.plan.settings import SearchSpace
from conveyor.plan.tensor_search import ModuleSplit, TensorParallelOption
from conveyor.train.config import TrainConfig, apply_plan

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
    # The two all-to-alls are noted apart, for the search to overlap; a forward in segments keeps what both sent
    # and received.
    assert (block.exchanges, block.exchange, block.exchange_bytes) == (2, pytest.approx(each), 2 * 2 * 2 * 1e6)
    assert (embed.exchanges, embed.exchange_bytes) == (0, 0.0)
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


MOVED = 2e9  # bytes per sample each all-to-all of a block dispatches


def _best(limit: float, schedules=("dualpipev",), overlap: bool = True):
    """The search's best candidate at ep=2, M=8, with all-to-alls of about 2 s (1 ms + half of 2 samples'
    2 GB over 1 GB/s) beside blocks of 8 s of compute per pass: with or without trying overlap."""
    result = search(TABLE, ranks=2, global_batch=16, memory_per_rank=limit, schedules=list(schedules),
                    expert_parallel=_option(2, moved=MOVED), microbatches=[8],
                    space=SearchSpace(expert_overlap=overlap))
    assert result.settings["expert_overlap"] is overlap  # the plan records whether overlap was tried
    return result.fitting[0]


def test_the_search_overlaps_the_all_to_alls_where_pairs_hide_them_and_counts_what_that_keeps():
    best, plain = _best(math.inf), _best(math.inf, overlap=False)
    assert best.expert_overlap and "all-to-alls overlapped" in best.describe()
    assert not plain.expert_overlap and plain.cuts == best.cuts
    # Faster than the same split with its all-to-alls waited for, as the pairs hide them (DualPipeV pairs
    # nearly every pass; 8 microbatches leave a warm-up and a cool-down unpaired).
    assert best.step_time < 0.95 * plain.step_time, (best.step_time, plain.step_time)
    # Its memory counts, per microbatch in flight, what each forward in segments keeps (2 all-to-alls sending and
    # receiving 2 GB x 2 samples each, a block): above the plain plan's by whole multiples of that.
    per_block = 2 * 2 * MOVED * 2
    rise = [(o - p) / per_block for o, p in zip(best.memory_per_rank, plain.memory_per_rank)]
    assert all(r >= 1 and r == pytest.approx(round(r)) for r in rise), rise
    # A limit the rise does not fit: the plain plan, its all-to-alls waited for.
    fitting = _best(max(plain.memory_per_rank) * 1.001)
    assert not fitting.expert_overlap and fitting.step_time == pytest.approx(plain.step_time)
    # One stage per rank has no pair that would not wait on itself: nothing to overlap.
    assert not _best(math.inf, ("1f1b",)).expert_overlap
    with pytest.raises(PlanError, match="expert_overlap must be True or False"):
        SearchSpace(expert_overlap="yes")


def test_a_plan_with_overlap_says_so_keeps_it_in_its_file_and_the_trainer_applies_it(tmp_path):
    plan = Plan("zbv", 2, 2, 4, 8, ("b0", "b1", "b2"), 1.0, 0.1, (1e6, 1e6), (0.1,) * 4, math.inf,
                expert_parallel=2, expert_overlap=True)
    assert "parallel.expert_overlap=true" in format_plan(plan)
    path = plan.save(tmp_path / "plan.json")
    assert Plan.load(path).expert_overlap
    assert not Plan.load(Plan("zbv", 2, 2, 4, 8, ("b0", "b1", "b2"), 1.0, 0.1, (1e6, 1e6), (0.1,) * 4,
                              math.inf).save(tmp_path / "plain.json")).expert_overlap
    cfg = TrainConfig()
    cfg.parallel.plan, cfg.parallel.ep = str(path), 2
    apply_plan(cfg)
    assert cfg.parallel.expert_overlap and cfg.parallel.schedule == "zbv"
    cfg = TrainConfig()
    cfg.parallel.plan = str(path)  # ep=1 shares no experts: nothing to overlap
    apply_plan(cfg)
    assert cfg.parallel.expert_overlap is False
    cfg = TrainConfig()
    cfg.parallel.plan, cfg.parallel.ep, cfg.parallel.expert_overlap = str(path), 2, False  # the user's own word wins
    apply_plan(cfg)
    assert cfg.parallel.expert_overlap is False
    cfg = TrainConfig()
    cfg.parallel.plan, cfg.parallel.ep = str(path), 2
    cfg.stage = dataclasses.replace(cfg.stage, recompute=True)  # overlap cannot take recomputation
    apply_plan(cfg)
    assert cfg.parallel.expert_overlap is False


def _tp_option(ep: int, tp: int, moved: float = 0.0, gathered: float = 0.0) -> ExpertParallelOption:
    # Each experts module: 48 parameters, top-2 of 8 experts (a token uses a quarter of them).
    return ExpertParallelOption(ep, tuple(ModuleSplit(f"b{i}.mlp.experts", 48.0, moved, moved, 2, 2) for i in range(4)),
                                tp=tp, active=0.25, gather_bytes=gathered)


def test_under_tp_each_rank_computes_its_rows_of_the_experts_tokens_and_gathers_the_output():
    units = expert_units(TABLE.units, _tp_option(4, 2, moved=1e6, gathered=4e6), 2, bandwidth=1e9, latency=1e-3,
                         tensor_bandwidth=1e10)
    embed, block = units[0], units[1]
    assert embed == TABLE.units[0] and block.parameters == 16 + 48 / 4
    # A token uses 12 of the experts' 48 parameters beside the block's 16 others: the experts' share of the block's
    # compute is 12 / 28, of which each of the 2 TP ranks computes half.
    compute = 1 - 12 / 28 + 12 / 28 / 2
    each = 1e-3 + 0.75 * 2 * 1e6 / 1e9  # an all-to-all of this TP rank's rows (the option's bytes are already its)
    gather = 1e-3 + 0.5 * 2 * 4e6 / 1e10  # the output rows all-gathered over the 2 TP ranks (their gradients in I)
    assert math.isclose(block.forward, 4 * compute + 2 * each + gather)
    assert math.isclose(block.backward_input, 4 * compute + 2 * each + gather)
    assert math.isclose(block.backward_weight, 4 * compute)
    # ep=1 under TP still splits the tokens by rows: the compute drops, no all-to-all moves anything but latency.
    alone = expert_units(TABLE.units, _tp_option(1, 2), 2, bandwidth=1e9, latency=0.0)[1]
    assert math.isclose(alone.forward, 4 * compute) and alone.parameters == 64


def test_tensor_and_expert_parallel_pairs_are_searched_each_ep_sized_for_its_tp():
    with pytest.raises(PlanError, match="sized for one of their tp"):
        SearchSpace(tensor_parallel=[TensorParallelOption(2)], expert_parallel=[_option(2)])
    with pytest.raises(PlanError, match="ExpertParallelOption"):
        SearchSpace(expert_parallel=[2])
    with pytest.raises(PlanError, match="sized for tp=2 cannot cost ranks of tp=1"):
        search(TABLE, ranks=2, global_batch=8, memory_per_rank=LIMIT, expert_parallel=_tp_option(2, 2))

    def search_one(table, ranks, pair):
        tensor, experts = pair
        return search(table, ranks=ranks, global_batch=8, memory_per_rank=LIMIT, schedules=["1f1b"],
                      tensor_parallel=tensor, expert_parallel=experts)

    pairs = [(TensorParallelOption(1), _option(1)), (TensorParallelOption(1), _option(2, moved=1e3)),
             (TensorParallelOption(2, tuple(ModuleSplit(f"b{i}.attn", 16.0) for i in range(4))),
              _tp_option(4, 2, moved=5e2)),
             (TensorParallelOption(2), ExpertParallelOption(8, refused="ep=8 does not divide dp x tp = 4", tp=2))]
    chosen, outcomes = search_tensor_and_expert_parallel(TABLE, pairs, ranks=2, search_one=search_one,
                                                         memory_per_rank=LIMIT)
    reasons = {(o.tp, o.ep): o.reason for o in outcomes}
    assert [(o.tp, o.pp, o.ep) for o in outcomes] == [(1, 2, 1), (1, 2, 2), (2, 1, 4), (2, 1, 8)]
    assert reasons[(1, 1)].startswith("over memory"), reasons
    assert reasons[(2, 2 * 4)] == "refused: ep=8 does not divide dp x tp = 4"
    assert chosen is not None and reasons[(chosen.tp, chosen.ep)].startswith("chosen"), reasons
    other = (2, 4) if chosen.tp == 1 else (1, 2)
    assert f"slower than tp={chosen.tp} x ep={chosen.ep}" in reasons[other], reasons
    assert chosen.result.settings.get("expert_parallel") == chosen.ep
    with pytest.raises(PlanError, match="sized for tp=1 was paired with tp=2"):
        search_tensor_and_expert_parallel(TABLE, [(TensorParallelOption(2), _option(2))], ranks=2,
                                          search_one=search_one, memory_per_rank=LIMIT)


MOE = ["--set", "model.layers=4", "--set", "model.width=128", "--set", "model.heads=4"]


def test_conveyor_plan_searches_ep_over_the_replicas_and_writes_it(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "moe", "--ranks", "2", "--global-batch", "8", "--dp", "4", "--ep", "auto", "--tp", "1",
                 "--analytic", "--memory-per-rank", "22MiB", "--out", str(out), *MOE]) == 0
    text = capsys.readouterr().out
    rows = {line.split()[0]: line for line in text.splitlines() if line[:4].strip() in {"1", "2", "4"}
            and "MiB" in line and ("chosen" in line or "fits" in line or "over memory" in line)}
    # ep=1 keeps every expert (over 22 MiB); ep=2 halves them and fits; ep=4 fits too, moving more tokens.
    assert "over memory" in rows["1"] and "chosen" in rows["2"] and "slower than ep=2" in rows["4"], text
    assert "chosen ep=2: each experts module's experts shared by 2 replicas (conveyor train parallel.ep=2)" in text
    saved = json.loads(out.read_text())
    assert saved["expert_parallel"] == 2 and saved["expert_parallel_report"][0].startswith("expert parallel:")


def test_conveyor_plan_refuses_an_ep_that_cannot_run(capsys):
    assert main(["plan", "moe", "--ranks", "2", "--global-batch", "8", "--dp", "3", "--ep", "2", "--tp", "1",
                 "--analytic", *MOE]) == 2
    assert "each size must divide --dp 3" in capsys.readouterr().err
    assert main(["plan", "moe", "--ranks", "2", "--global-batch", "8", "--dp", "2", "--ep", "0", "--tp", "2",
                 "--analytic", *MOE]) == 2
    assert "--ep '0': expected 'auto' or expert-parallel sizes >= 1" in capsys.readouterr().err
    assert main(["plan", "gpt", "--ranks", "2", "--global-batch", "8", "--dp", "2", "--ep", "2", "--analytic",
                 "--set", "model.layers=4"]) != 0
    captured = capsys.readouterr()
    assert "refused: the model has no experts modules" in captured.out + captured.err


def test_conveyor_plan_searches_tp_and_ep_together_and_writes_the_pair(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "moe", "--ranks", "2", "--global-batch", "8", "--dp", "2", "--ep", "auto", "--tp", "auto",
                 "--analytic", "--memory-per-rank", "17MiB", "--out", str(out), *MOE]) == 0
    text = capsys.readouterr().out
    rows = {tuple(int(cell) for cell in line.split()[:3]): line for line in text.splitlines()
            if len(line.split()) > 3 and all(cell.isdigit() for cell in line.split()[:3])}
    # Every ep dividing dp x tp, per tp (pp = 2 / tp): at tp=2, ep=4 takes the experts over both replicas' TP
    # ranks, the only pair whose lightest plan fits 17 MiB.
    assert sorted(rows) == [(1, 2, 1), (1, 2, 2), (2, 1, 1), (2, 1, 2), (2, 1, 4)], text
    assert "chosen" in rows[(2, 1, 4)] and all("over memory" in rows[k] for k in rows if k != (2, 1, 4)), text
    assert ("chosen tp=2 x ep=4: 1 pipeline ranks x 2 tensor-parallel ranks, each experts module's experts shared "
            "by 4 of the replicas' TP ranks (conveyor train parallel.pp=1 parallel.tp=2 parallel.ep=4)") in text
    saved = json.loads(out.read_text())
    assert (saved["tensor_parallel"], saved["expert_parallel"]) == (2, 4)
    assert saved["expert_parallel_report"][0].startswith("tensor x expert parallel:")
