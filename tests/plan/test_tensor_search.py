"""The planner's tensor-parallel search: one TP rank's unit costs, tp among the divisors of the ranks, the reasons."""

from __future__ import annotations

import json
import math

import pytest

from conveyor.errors import ConfigError
from conveyor.plan.costs import synthetic_table
from conveyor.plan.search import search
from conveyor.plan.tensor_search import (
    BLOCK_SHARDED_ACTIVATIONS,
    ModuleSplit,
    TensorParallelOption,
    search_tensor_parallel,
    shard_units,
)

# An embedding, four blocks and a head; every block's parameters (16 of them, 64 bytes) are split by tp.
TABLE = synthetic_table([("embed", 1, 0, 1, 8, 64)] + [(f"b{i}", 4, 4, 4, 340, 64, True) for i in range(4)]
                        + [("head", 1, 1, 1, 8, 64)])


def _option(tp: int, forward_bytes: float = 0.0) -> TensorParallelOption:
    return TensorParallelOption(tp, tuple(ModuleSplit(f"b{i}.mlp.up", 16.0, forward_bytes=forward_bytes,
                                                      forward_collectives=1) for i in range(4)))


def test_one_tp_rank_holds_the_split_share_and_pays_the_collectives():
    units = shard_units(TABLE.units, _option(2, forward_bytes=1e6), 1, bandwidth=1e9, latency=1e-3)
    embed, block, head = units[0], units[1], units[-1]
    assert (embed.forward, embed.parameters, head.parameter_bytes) == (1.0, 16.0, 64.0)  # not split: as it was
    assert block.parameters == 8.0 and block.parameter_bytes == 32.0
    # Half the compute, plus one all-reduce of 1 MB: latency + 2 (tp-1)/tp x bytes / bandwidth.
    assert math.isclose(block.forward, 2.0 + 1e-3 + 1e6 / 1e9)
    assert (block.backward_input, block.backward_weight) == (2.0, 2.0)
    assert math.isclose(block.activation_bytes, 340 * (1 - BLOCK_SHARDED_ACTIVATIONS / 2))
    assert block.output_bytes == TABLE.units[1].output_bytes  # each TP rank sends its whole tensor on


def test_tp_is_chosen_among_the_divisors_for_speed_within_memory_and_each_says_why():
    def search_one(table, pipeline_ranks, option):
        return search(table, ranks=pipeline_ranks, global_batch=8, memory_per_rank=limit, schedules=["1f1b"],
                      tensor_parallel=option)

    # tp=2's all-reduces (10 GB a sample at the default 2 GB/s) cost more than the halved compute saves.
    options = [TensorParallelOption(1), _option(2, forward_bytes=1e10),
               TensorParallelOption(4, refused="tp=4 does not divide 2 heads")]
    limit = math.inf
    chosen, outcomes = search_tensor_parallel(TABLE, options, ranks=4, search_one=search_one, memory_per_rank=limit)
    assert [(o.tp, o.pp) for o in outcomes] == [(1, 4), (2, 2), (4, 1)]
    assert outcomes[2].best is None and outcomes[2].reason == "refused: tp=4 does not divide 2 heads"
    assert chosen.tp == 1 and chosen.reason == "chosen: the fastest plan that fits (1 other tp fit)"
    assert outcomes[1].reason.startswith("fits, ") and outcomes[1].reason.endswith("% slower than tp=1")
    # A limit under every plan's peak: no tp is chosen, and each says by how much it is over.
    limit = min(c.peak_memory for o in outcomes[:2] for c in o.result.candidates if c.memory_per_rank) / 2
    chosen, outcomes = search_tensor_parallel(TABLE, options, ranks=4, search_one=search_one, memory_per_rank=limit)
    assert chosen is None
    assert all(o.reason.startswith("over memory: its lightest plan needs") for o in outcomes[:2]), outcomes


def test_the_plan_command_searches_tp_and_train_checks_the_plans_tp(tmp_path, capsys):
    from conveyor.cli import main
    from conveyor.train.config import load_config

    out = tmp_path / "plan.json"
    sizes = ["--set", "model.layers=4", "--set", "model.width=32", "--set", "model.heads=2", "--set",
             "model.kv_heads=2", "--set", "model.seq_len=32"]
    status = main(["plan", "llama", "--ranks", "4", "--global-batch", "8", "--memory-per-rank", "1GiB", "--analytic",
                   "--schedules", "1f1b,gpipe", "--top", "2", *sizes, "--out", str(out)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    rows = {line.split()[0]: line for line in printed.splitlines() if line[:4].strip() in ("1", "2", "4")
            and len(line.split()) > 2 and line.split()[1] in ("4", "2", "1")}
    assert set(rows) == {"1", "2", "4"}, printed
    assert "refused: tensor parallel size tp=4 does not divide the number of attention heads" in rows["4"]
    assert sum("chosen:" in row for row in rows.values()) == 1
    saved = json.loads(out.read_text())
    tp, pp = saved["tensor_parallel"], saved["ranks"]
    assert tp * pp == 4 and len(saved["tensor_parallel_report"]) == 5
    assert f"chosen tp={tp}: {pp} pipeline ranks" in printed
    train = [f"parallel.plan={out}", "train.batch_size=8", "model.name=llama", "model.layers=4", "model.width=32",
             "model.heads=2", "model.kv_heads=2", "model.seq_len=32", f"parallel.pp={pp}"]
    other = 1 if tp != 1 else 2
    with pytest.raises(ConfigError, match=f"is for pipeline ranks of {tp} tensor-parallel ranks but "
                                          f"parallel.tp={other}; set parallel.tp={tp}"):
        load_config(None, [*train, f"parallel.tp={other}"])
    assert load_config(None, [*train, f"parallel.tp={tp}"]).parallel.tp == tp
    # The same 4 ranks split otherwise in the config (pp=4 x tp=1, or 1 x 4): the plan's split is taken.
    for config_pp, config_tp in ((4, 1), (1, 4)):
        cfg = load_config(None, [*train[:-1], f"parallel.pp={config_pp}", f"parallel.tp={config_tp}"])
        assert (cfg.parallel.pp, cfg.parallel.tp) == (pp, tp)
