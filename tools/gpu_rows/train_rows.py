"""``conveyor train`` as a user runs it, in a fresh process: pp=1 end to end (validation,
checkpoints, resume bitwise, bf16, per-token loss), and the default run (no parallel settings).

Example::

    ok, detail = train_pp1_row(Context(torch.device("cpu")))
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import Context

ROOT = Path(__file__).resolve().parents[2]
TINY = ["train.steps=6", "model.layers=2", "model.width=32", "model.seq_len=64", "data.max_bytes=200000",
        "data.val_fraction=0.3", "train.batch_size=8", "parallel.microbatches=2", "optim.warmup_steps=1",
        "train.eval_interval=3", "train.eval_batches=2", "checkpoint.interval=3", "checkpoint.keep_last=0",
        "run.log_interval=1", "train.sample_tokens=8"]


def conveyor_train(*args: str, cwd: Path, timeout_s: float = 240) -> subprocess.CompletedProcess:
    """``python -m conveyor.cli train ARGS`` with this interpreter (the CUDA torch the check runs on)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "conveyor.cli", "train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


def _failed(done: subprocess.CompletedProcess, what: str) -> str:
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return f"{what} exited {done.returncode}: {(errors or lines or ['no output'])[-1][:160]}"


def _losses(run_dir: Path) -> tuple[dict[int, float], list[float]]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m["loss"] for m in lines if "loss" in m}, [m["val_loss"] for m in lines if "val_loss" in m]


def train_pp1_row(ctx: Context) -> tuple[bool, str]:
    """6 steps at pp=1 (bf16, per-token loss, validation at 0/3/6, checkpoints at 3/6), then a run
    resumed from step 3 whose steps 4-6 must repeat the first run's losses exactly."""
    options = [*TINY, "parallel.pp=1", "stage.autocast=bf16", "loss.normalize=tokens"]
    with tempfile.TemporaryDirectory() as where:
        where = Path(where)
        done = conveyor_train(*options, f"run.dir={where / 'run'}", cwd=where)
        if done.returncode != 0:
            return False, _failed(done, "the pp=1 run")
        losses, validations = _losses(where / "run")
        checkpoint = where / "run" / "checkpoints" / "step_000003"
        if sorted(losses) != [1, 2, 3, 4, 5, 6] or len(validations) != 3 or not checkpoint.is_dir():
            return False, f"steps {sorted(losses)}, {len(validations)} validations, checkpoint {checkpoint.is_dir()}"
        again = conveyor_train(*options, f"run.dir={where / 'resumed'}", f"checkpoint.resume={checkpoint}", cwd=where)
        if again.returncode != 0:
            return False, _failed(again, "the resumed run")
        resumed, _ = _losses(where / "resumed")
    if sorted(resumed) != [4, 5, 6] or any(resumed[s] != losses[s] for s in (4, 5, 6)):
        return False, f"resumed steps {resumed} differ from the first run's {[losses[s] for s in (4, 5, 6)]}"
    return True, f"loss {losses[1]:.3f} -> {losses[6]:.3f}, val {validations[0]:.3f} -> {validations[-1]:.3f}; " \
                 f"resumed steps 4-6 exactly equal"


def train_default_row(ctx: Context) -> tuple[bool, str]:
    """The default run (no parallel or device settings; only shortened): it trains or says why, no traceback."""
    with tempfile.TemporaryDirectory() as where:
        where = Path(where)
        done = conveyor_train("train.steps=4", "train.eval_interval=2", "train.eval_batches=2",
                              "train.sample_tokens=8", "run.log_interval=1", f"run.dir={where / 'run'}", cwd=where)
    if done.returncode != 0 or "Traceback" in done.stderr + done.stdout:
        return False, _failed(done, "the default run")
    summary = next((line.strip() for line in done.stdout.splitlines() if line.startswith("done:")), "")
    return bool(summary), summary[:150] or "no 'done:' line in its output"
