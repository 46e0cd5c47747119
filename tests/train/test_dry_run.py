"""``conveyor train --dry-run``: the split and the memory per rank, on the meta device, nothing started.

The ~1B-parameter recipe runs through the real command in a fresh process, which must stay far
below the model's size in memory; the rest run in this process on small configs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.cli import main
from conveyor.train.config import load_config
from conveyor.train.dry_run import BYTES_PER_PARAMETER, run_layout

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model.layers=4", "model.width=32", "model.heads=4", "model.seq_len=32", "train.batch_size=8",
         "parallel.microbatches=4"]


def test_llama_1b_dry_run_prints_one_row_per_stage_and_allocates_nothing():
    code = ("import resource, sys\nfrom conveyor.cli import main\n"
            "status = main(['train', 'configs/llama-1b.yaml', '--dry-run'])\n"
            "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\nsys.exit(status)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    header = re.search(r"LlamaForCausalLM, ([\d,]+) parameters .*pp=8 x dp=1, schedule 1f1b, 8 stages", out)
    assert header, out
    assert 0.95e9 < int(header.group(1).replace(",", "")) < 1.1e9
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\d+)\s+([\d,]+)\s+[\d.]+ [MG]iB$", out, re.MULTILINE)
    assert [(int(s), int(r)) for s, r, *_ in rows] == [(i, i) for i in range(8)]
    assert rows[0][2] == "model.embed_tokens" and rows[-1][3] == "lm_head"
    assert all(int(blocks) == 2 for *_, blocks, _ in rows)
    assert sum(int(p.replace(",", "")) for *_, p in rows) == int(header.group(1).replace(",", ""))  # untied
    assert "with recomputation" in out and "no rank was started" in out
    peak_gib = int(out.split("peak_rss_kib")[1].split()[0]) / 2**20
    assert peak_gib < 1.5, f"the dry run of a 1B model peaked at {peak_gib:.2f} GiB"  # its fp32 weights: 3.75 GiB


def test_the_layout_follows_the_schedule_placement_and_the_tied_embedding():
    layout = run_layout(load_config(None, [*SMALL, "model.name=mpt", "parallel.schedule=zbv"]))
    assert [(row.stage, row.rank) for row in layout.stages] == [(0, 0), (1, 1), (2, 1), (3, 0)]  # the V
    assert layout.tied == ["transformer.wte.weight = lm_head.weight"]
    assert layout.stages[0].first == "transformer.wte" and layout.stages[-1].last == "lm_head"
    assert [row.blocks for row in layout.stages] == [1, 1, 1, 1]
    wte = 256 * 32
    assert sum(row.parameters for row in layout.stages) == layout.total_parameters + wte  # held by two stages
    rank0 = layout.ranks[0]
    assert rank0.state_bytes == BYTES_PER_PARAMETER * (layout.stages[0].parameters + layout.stages[3].parameters)
    assert rank0.in_flight >= 2 and rank0.activation_bytes > 0


def test_checkpointing_and_fsdp_shrink_the_prediction():
    base = [*SMALL, "model.name=llama", "parallel.dp=2", "parallel.microbatches=2"]
    plain = run_layout(load_config(None, base))
    checkpointed = run_layout(load_config(None, [*base, "stage.recompute=true"]))
    assert all(c.activation_bytes < p.activation_bytes for c, p in zip(checkpointed.stages, plain.stages))
    assert all(c.recompute_bytes == p.activation_bytes for c, p in zip(checkpointed.stages, plain.stages))
    # fsdp: 16 bytes per parameter sharded over dp, plus the rank's stages gathered with whole
    # gradients for the step (8 bytes per parameter): no saving at dp=2, a quarter at dp=4.
    for dp, share in ((2, 1.0), (4, 0.75)):
        wide = [*SMALL, "model.name=llama", f"parallel.dp={dp}", "parallel.microbatches=2"]
        replicated = run_layout(load_config(None, wide))
        sharded = run_layout(load_config(None, [*wide, "parallel.data_parallel=fsdp"]))
        assert all(s.state_bytes == share * p.state_bytes for s, p in zip(sharded.ranks, replicated.ranks))


def test_the_flag_goes_anywhere_and_starts_no_process(capsys, tmp_path, no_launch):
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  name: llama\n")
    assert main(["train", str(config), "--dry-run", *SMALL, f"run.dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    assert "conveyor train --dry-run: LlamaForCausalLM" in out and "params+grads+AdamW" in out
    assert not (tmp_path / "run").exists()
    assert main(["train", "--dry-run", "model.layers=1"]) == 2  # a bad config still fails as a usage error
    assert "model.layers=1" in capsys.readouterr().err


@pytest.mark.parametrize("recipe", ["gpt", "llama", "mpt", "moe"])
def test_every_recipe_dry_runs(recipe, capsys):
    assert main(["train", str(ROOT / "configs" / f"{recipe}.yaml"), "--dry-run"]) == 0
    assert capsys.readouterr().out.count(" MiB") >= 6
