"""`torchrun -m conveyor.cli train`: each process torchrun starts is a rank and trains in place (no second launch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["train.steps=6", "model.layers=2", "model.width=32", "model.heads=2", "model.seq_len=32",
        "data.max_bytes=100000", "data.val_fraction=0.3", "parallel.pp=2", "train.batch_size=4",
        "parallel.microbatches=2", "optim.warmup_steps=1", "train.eval_interval=3", "train.eval_batches=1",
        "checkpoint.interval=3", "run.log_interval=1", "train.sample_tokens=0", "run.tensorboard=false"]


@pytest.mark.timeout(150)
def test_torchrun_runs_conveyor_train_as_its_ranks(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run_dir = tmp_path / "run"
    # --standalone: a rendezvous on a free port (the default 29500 may be another job's).
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "conveyor.cli", "train", *TINY, f"run.dir={run_dir}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-6000:]
    assert "local ranks" not in done.stdout  # conveyor's own launcher did not start
    assert done.stdout.count("done: 6 steps") == 1  # rank 0's summary
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in records if "loss" in m] == [1, 2, 3, 4, 5, 6]
    assert [m["step"] for m in records if "val_loss" in m] == [0, 3, 6]
    assert (run_dir / "checkpoints" / "step_000006" / "conveyor.json").is_file()
