"""`conveyor train stage.autocast=fp16`: trained with loss scaling; the scale and the skipped steps shown.

The first scale here, 2**30, overflows fp16 for sure (each logit's gradient is about 2**30 / 256 tokens,
above fp16's 65504): the first step must be skipped and the scale backed off (by 2**-8 here, to reach a
scale that trains within 3 steps), and both must show in the progress line and metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import torch

from conveyor.testing import run_ranks

TINY = ["model.name=llama", "train.steps=3", "model.layers=2", "model.width=32", "model.heads=2", "model.seq_len=32",
        "data.max_bytes=100000", "data.val_fraction=0.1", "parallel.pp=2", "train.batch_size=4",
        "parallel.microbatches=2", "optim.warmup_steps=1", "train.eval_interval=0", "checkpoint.interval=0",
        "train.sample_tokens=0", "run.tensorboard=false", "run.device=cpu", "run.log_interval=1",
        "parallel.in_process=true", "stage.autocast=fp16",
        "stage.loss_scaling={init_scale: 1073741824.0, backoff_factor: 0.00390625}"]


def _train(rank: int, world_size: int, run_dir: str) -> dict:
    from conveyor.train.config import load_config
    from conveyor.train.loop import train

    torch.set_num_threads(1)
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        summary = train(load_config(None, [*TINY, f"run.dir={run_dir}"], world_size=world_size))
    lines = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {"steps": [m for m in lines if "loss" in m], "summary": summary, "shown": shown.getvalue()}


def test_fp16_trains_with_loss_scaling_and_shows_the_scale_and_the_skipped_steps(tmp_path):
    [got] = run_ranks(_train, 1, args=(str(tmp_path),), timeout_s=240)
    steps = got["steps"]
    assert [m["step"] for m in steps] == [1, 2, 3] and steps[0].get("skipped") is True
    assert steps[0]["loss_scale"] == 2.0**22 and steps[0]["skipped_steps"] == 1
    assert all(m["loss_scale"] <= 2.0**22 and m["skipped_steps"] <= got["summary"]["skipped_steps"] for m in steps)
    assert got["summary"]["skipped_steps"] < 3 and got["summary"]["stopped"] is None, got["summary"]
    assert all(math.isfinite(m["loss"]) for m in steps), steps  # the loss reported is never the scaled one
    assert "loss scale 4.1943e+06 (1 skipped)" in got["shown"], got["shown"]
