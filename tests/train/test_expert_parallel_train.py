"""`conveyor train` with ``parallel.ep``: the key's checks before any rank starts, the dry run's expert shards, and
configs/moe.yaml (tiny) trained at pp=2 x dp=2 with ep=2 on 4 ranks, each rank keeping half of every experts
module of its stages."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from conveyor.errors import ConfigError
from conveyor.testing import run_ranks
from conveyor.train.config import load_config

ROOT = Path(__file__).resolve().parents[2]
MOE = ROOT / "configs" / "moe.yaml"
TINY = ["train.steps=2", "model.layers=2", "model.width=32", "model.heads=2", "model.kv_heads=1",
        "model.intermediate=32", "model.seq_len=16", "data.max_bytes=50000", "data.val_fraction=0.2",
        "parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.schedule=1f1b", "train.batch_size=8",
        "parallel.microbatches=2", "optim.warmup_steps=1", "train.eval_interval=2", "train.eval_batches=1",
        "train.sample_tokens=0", "run.tensorboard=false", "run.device=cpu", "run.log_interval=1",
        "checkpoint.interval=0"]


@pytest.mark.parametrize("overrides, message", [
    (["parallel.ep=2"], "parallel.ep=2: expert parallelism spreads the experts over the data-parallel replicas, "
                        "which parallel.dp=1 does not divide into groups of 2; set parallel.dp to a multiple of 2"),
    (["parallel.ep=3", "parallel.dp=3", "train.batch_size=12"],
     "parallel.ep=3 (groups of 3) does not divide the model's 4 experts"),
    (["parallel.ep=many", "parallel.dp=2"], "parallel.ep='many': expected 'auto' (ep = parallel.dp) or a size"),
    (["parallel.expert_capacity=1.25"], "parallel.expert_capacity=1.25 caps what each expert takes"),
    (["parallel.ep=2", "parallel.dp=2", "parallel.expert_capacity=-1"], "expected a capacity factor > 0"),
])
def test_bad_expert_parallel_keys_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(MOE, ["model.layers=2", "model.width=32", *overrides])


def test_the_dry_run_shows_each_ranks_expert_shards():
    from conveyor.train.dry_run import format_layout, run_layout

    cfg = load_config(MOE, [*TINY, "parallel.dp=4"])
    text = format_layout(run_layout(cfg), cfg)
    assert "pp=2 x dp=4 (ep=2)" in text, text
    # ("pp", "dp") mesh, pp outermost: replica r's pipeline rank k is global rank k * 4 + r; places alternate over
    # the replicas.
    assert "pipeline rank 1, replicas [1, 3] (global ranks [5, 7]): experts 2-3 of each of 1 experts modules" in text
    assert re.search(r"model\.layers\.0\.mlp\.experts\.gate_up_proj\s+\(4, 64, 32\)\s+-> \(2, 64, 32\)", text), text


def _train_moe(rank: int, world_size: int, run_dir: str) -> dict:
    from conveyor.testing.rigs.trainer_pipelines import keep_built_pipelines
    from conveyor.train.loop import train

    torch.set_num_threads(1)
    built = keep_built_pipelines()  # this rank's process only (forked)
    import conveyor.train.loop
    from conveyor.parallel.experts import ExpertParallel

    # A capacity factor of 1: each expert takes its even share of a rank's slots, the rest are dropped and counted.
    # This rank's own count after each step, as the trainer reads it before summing it over the job.
    mine, job_count = [], conveyor.train.loop.dropped_slots

    def recorded(pipe):
        mine.append(sum(part.dropped_slots for part in pipe.ranks.parts if isinstance(part, ExpertParallel)))
        return job_count(pipe)

    conveyor.train.loop.dropped_slots = recorded  # this rank's process only (forked)
    cfg = load_config(MOE, [*TINY, f"run.dir={run_dir}", "parallel.expert_capacity=1.0"], world_size=world_size)
    summary = train(cfg)
    experts = {name: (tuple(p.shape), tuple(p.to_local().shape)) for name, p in built["pipe"].named_parameters()
               if ".experts." in name}
    return {"steps": summary["steps"], "losses": [summary["first_loss"], summary["last_loss"]],
            "val": summary["last_val_loss"], "experts": experts, "dropped": mine}


@pytest.mark.distributed
def test_moe_trains_at_pp2_x_dp2_with_ep2(tmp_path):
    results = run_ranks(_train_moe, 4, args=(str(tmp_path),), timeout_s=300)
    for rank, result in enumerate(results):
        assert result["steps"] == 2, (rank, result)
        assert all(math.isfinite(loss) for loss in (*result["losses"], result["val"])), (rank, result)
        # Each rank's one layer: its experts' two 3-D weights, 2 of the 4 experts kept.
        assert len(result["experts"]) == 2, (rank, result)
        assert all(whole[0] == 4 and local == (2, *whole[1:]) for whole, local in result["experts"].values()), result
    assert len({tuple(result["losses"]) for result in results}) == 1, results  # the step's loss on every rank
    # metrics.jsonl's dropped_slots: every rank's count of the step summed.
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    counts = [r["dropped_slots"] for r in records if "loss" in r]  # the steps (not the validations)
    assert len(counts) == 2 and counts == [sum(r["dropped"][step] for r in results) for step in range(2)], counts
    assert all(count > 0 for count in counts), counts


def test_the_capacity_factor_reaches_the_layout_only_with_expert_parallelism():
    from conveyor.train.config import ParallelConfig

    assert ParallelConfig(dp=2, ep=2, expert_capacity=1.25).layout().expert_capacity == 1.25
    assert ParallelConfig(dp=2, ep="auto", expert_capacity=1.0).layout().expert_capacity == 1.0


def test_the_dry_run_spreads_the_experts_over_each_stages_tp_ranks():
    from conveyor.train.dry_run import format_layout, run_layout

    cfg = load_config(MOE, [*TINY, "parallel.tp=2", "model.heads=4", "model.kv_heads=2"])
    text = format_layout(run_layout(cfg), cfg)
    # ("pp", "dp", "tp") mesh: TP rank t of replica r's pipeline rank k is global rank (k * 2 + r) * 2 + t; position
    # r * 2 + t keeps place (r * 2 + t) % 2 of the experts: a stage's two TP ranks keep different halves.
    line = "pipeline rank 1, replicas [0, 1] (global ranks [5, 7]): experts 2-3 of each of 1 experts modules"
    assert line in text, text
