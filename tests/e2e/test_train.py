"""`conveyor train` as a user runs it: a real command, torch's elastic launcher, 2 local ranks.

One tiny run through the README's first command (`bash tools/train.sh`: 6 steps, checkpoints at
3 and 6) is shared by the tests: its files (metrics, config, checkpoints, loss and timeline
plots, the trace, the sample, TensorBoard events) and its summary. A second run resumes from
its step-3 checkpoint and must repeat steps 4-6 bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = ["train.steps=6", "model.layers=2", "model.width=32", "model.seq_len=64", "data.max_bytes=200000",
        "data.val_fraction=0.3", "parallel.pp=2", "train.batch_size=8", "parallel.microbatches=2",
        "optim.warmup_steps=1", "train.eval_interval=3", "train.eval_batches=2", "checkpoint.interval=3",
        "checkpoint.keep_last=0", "run.log_interval=1"]


def conveyor_train(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "conveyor.cli", "train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in metrics(run_dir) if "loss" in m}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The README's first command, `bash tools/train.sh`, with overrides that make it tiny."""
    where = tmp_path_factory.mktemp("train")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    done = subprocess.run(["bash", str(ROOT / "tools" / "train.sh"), *TINY, f"run.dir={where / 'run'}"],
                          cwd=where, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return where / "run", done


def test_tiny_run_trains_and_writes_its_files(tiny_run):
    run_dir, done = tiny_run
    assert "2 local ranks" in done.stdout and "done: 6 steps" in done.stdout
    assert (run_dir / "config.yaml").is_file()
    lines = metrics(run_dir)
    steps = [m for m in lines if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5, 6]
    assert all({"lr", "tokens_per_s", "elapsed"} <= set(m) for m in steps)
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.05
    val = [m["val_loss"] for m in lines if "val_loss" in m]
    assert len(val) == 3 and val[-1] < val[0]  # before training, at step 3 and at step 6
    assert (run_dir / "checkpoints" / "step_000003").is_dir() and (run_dir / "checkpoints" / "step_000006").is_dir()
    for png in ("loss.png", "timeline.png"):
        assert (run_dir / png).read_bytes()[:4] == b"\x89PNG", png
    trace = json.loads((run_dir / "timeline.json").read_text())
    assert trace["traceEvents"]
    assert "bubble (last step): measured" in done.stdout and "simulated" in done.stdout
    assert "peak memory (RSS): rank 0" in done.stdout and "rank 1" in done.stdout
    assert "step     6/6" in done.stdout and "ETA" in done.stdout  # the plain lines: stdout is a pipe


def test_tiny_run_shows_a_greedy_sample_and_logs_its_metrics_to_tensorboard(tiny_run):
    import re

    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from conveyor.train.config import DataConfig
    from conveyor.train.data import build_splits, load_tokenizer

    run_dir, done = tiny_run
    # The prompt is the validation text's start; 48 greedy tokens follow it.
    val = build_splits(DataConfig(max_bytes=200000, val_fraction=0.3), 64).val
    prompt = load_tokenizer("bytes").decode(val.tokens[:32])
    assert (run_dir / "sample.txt").read_text().startswith(prompt)
    assert f"sample (greedy, after training; {run_dir / 'sample.txt'}):" in done.stdout
    assert f"  | {prompt.splitlines()[0]}" in done.stdout and "⟨" in done.stdout
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    def scalars(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in events.Scalars(tag)]

    def f32(key: str) -> list[tuple[int, float]]:  # TensorBoard keeps float32
        return [(m["step"], float(np.float32(m[key]))) for m in metrics(run_dir) if key in m]

    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/tokens_per_s", "tokens_per_s"),
                     ("val/loss", "val_loss")):
        assert scalars(tag) == f32(key) and scalars(tag), tag
    measured = float(re.search(r"bubble \(last step\): measured ([0-9.]+)", done.stdout).group(1))
    [(step, bubble)] = scalars("bubble/measured")
    assert step == 6 and abs(bubble - measured) < 6e-4 and len(scalars("bubble/simulated")) == 1


def test_resumed_run_repeats_the_uninterrupted_steps_bitwise(tiny_run, tmp_path):
    run_dir, _ = tiny_run
    resumed = tmp_path / "resumed"
    done = conveyor_train(*TINY, f"run.dir={resumed}", f"checkpoint.resume={run_dir / 'checkpoints' / 'step_000003'}",
                          cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resumed from" in done.stdout and "at step 3" in done.stdout
    want, got = step_losses(run_dir), step_losses(resumed)
    assert sorted(got) == [4, 5, 6]
    assert [got[s] for s in (4, 5, 6)] == [want[s] for s in (4, 5, 6)]  # exact floats, from JSON


def test_a_bad_override_exits_2_naming_the_key_before_any_process(capsys, tmp_path, no_launch):
    code = main(["train", "train.stepz=5", f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("conveyor: error: unknown key 'train.stepz'") and "train.steps" in err
    assert not (tmp_path / "run").exists()
    assert main(["train", "parallel.pp=0"]) == 2
    assert "parallel.pp" in capsys.readouterr().err


def test_a_nonfinite_step_is_skipped_and_counted_or_stops_the_run(tmp_path):
    # A learning rate of 1e9 sends the parameters past what float32 holds after one step.
    blowup = [*TINY[:5], "train.batch_size=8", "parallel.microbatches=2", "train.steps=3", "optim.lr=1e9",
              "optim.warmup_steps=1", "train.eval_interval=0", "train.sample_tokens=0", "run.tensorboard=false"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    # A stop is on purpose: even with restarts allowed the launcher does not run it again.
    extra = {"skip": [], "stop": ["run.max_restarts=1"]}
    runs = {mode: subprocess.Popen([sys.executable, "-m", "conveyor.cli", "train", *blowup, *extra[mode],
                                    f"loss.on_nonfinite={mode}", f"run.dir={tmp_path / mode}"],
                                   cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for mode in ("skip", "stop")}  # side by side: each is mostly start-up
    (skip_out, skip_err), (stop_out, stop_err) = (runs[m].communicate(timeout=240) for m in ("skip", "stop"))
    assert runs["skip"].returncode == 0, skip_out + skip_err
    assert "done: 3 steps" in skip_out and "2 step(s) skipped (loss or gradients not finite)" in skip_out
    assert [m.get("skipped", False) for m in metrics(tmp_path / "skip") if "loss" in m] == [False, True, True]
    assert runs["stop"].returncode == 1, stop_out + stop_err
    assert "stopped at step 2:" in stop_out and "not finite" in stop_out
    assert stop_out.count("stopped at step") == 1 and "restart 1" not in stop_out + stop_err
    # A resumed run goes on counting from its checkpoint's: the parameters are still past float32, so step 4
    # is skipped as well, the third of the run.
    resumed = subprocess.run([sys.executable, "-m", "conveyor.cli", "train", *blowup, "train.steps=4",
                              "checkpoint.resume=true", "loss.on_nonfinite=skip", f"run.dir={tmp_path / 'skip'}"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout and "3 step(s) skipped (loss or gradients not finite)" in resumed.stdout
