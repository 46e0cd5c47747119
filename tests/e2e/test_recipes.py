"""Each recipe in configs/ trained by ``conveyor train`` as a user runs it, shrunk by overrides.

Every run also takes one loop path no other test takes, so the suite stays short:

* gpt: ``configs/gpt.yaml`` is the defaults written out (tests/train/test_models.py checks it), and
  tests/e2e/test_train.py trains the defaults through the README's first command, so no launch of
  its own here; its former extra path, activation checkpointing, rides on the mpt run;
* llama: 4 ranks, ``parallel.pp=2 x parallel.dp=2`` with ``parallel.data_parallel=fsdp``;
* mpt: the ``zbv`` schedule (V=2: the tied embedding's first and last stage on one rank) with
  ``stage.recompute=true`` (recomputed stages under a split backward);
* moe: its own zbv, and the loss's language-model and auxiliary parts reported apart;
* a local pretrained directory (a ``hf:Qwen2ForCausalLM`` saved with ``save_pretrained``) with
  ``loss.normalize=tokens``, whose first loss must be the saved model's own loss on that batch.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.e2e.test_train import conveyor_train, metrics

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHRINK = ["train.steps=3", "model.layers=2", "model.width=32", "model.heads=4", "model.intermediate=64",
          "model.seq_len=32", "data.max_bytes=100000", "train.batch_size=8", "parallel.microbatches=2",
          "optim.warmup_steps=1", "train.eval_interval=0", "checkpoint.interval=0", "run.log_interval=1"]


def _trained(done, run_dir: Path, steps: int = 3) -> list[float]:
    assert done.returncode == 0, done.stdout + done.stderr
    losses = [m["loss"] for m in metrics(run_dir) if "loss" in m]
    assert len(losses) == steps and all(math.isfinite(loss) for loss in losses), losses
    assert f"done: {steps} steps" in done.stdout
    return losses


@pytest.mark.parametrize("recipe, path, extra", [
    ("llama", "pp=2 x dp=2 fsdp", ["parallel.dp=2", "parallel.data_parallel=fsdp"]),
    ("mpt", "zbv (V=2) with activation checkpointing",
     ["parallel.schedule=zbv", "model.layers=4", "stage.recompute=true"]),
    ("moe", "zbv with an auxiliary loss", ["model.layers=4", "model.kv_heads=2", "model.intermediate=32"]),
])
def test_recipe_trains(recipe, path, extra, tmp_path):
    run_dir = tmp_path / "run"
    done = conveyor_train(str(CONFIGS / f"{recipe}.yaml"), *SHRINK, *extra, f"run.dir={run_dir}", cwd=tmp_path)
    losses = _trained(done, run_dir)
    assert losses[-1] < losses[0], f"{recipe} with {path}: {losses}"
    if recipe == "llama":
        assert "4 local ranks (pp=2 x dp=2)" in done.stdout and "rank 3" in done.stdout
    steps = [m for m in metrics(run_dir) if "loss" in m]
    assert all(("aux_loss" in m) == (recipe == "moe") for m in steps), steps
    if recipe == "moe":
        assert all(m["aux_loss"] > 0 and m["lm_loss"] + m["aux_loss"] == pytest.approx(m["loss"], rel=1e-6)
                   for m in steps), steps
        first = steps[0]
        assert f"loss {first['loss']:.4f} (lm {first['lm_loss']:.4f} + aux {first['aux_loss']:.4f})" in done.stdout
        assert "; auxiliary loss " in done.stdout and (run_dir / "loss.png").is_file()


def test_training_from_a_pretrained_directory_starts_from_its_weights(tmp_path):
    from conveyor.train.config import load_config
    from conveyor.train.data import ResumableLoader, build_splits
    from conveyor.train.loop import lm_loss
    from conveyor.train.models import build_model

    # A small Qwen2 (a class no recipe names) as the user's pretrained model.
    sizes = ["model.layers=2", "model.width=32", "model.heads=4", "model.kv_heads=2", "model.seq_len=32"]
    torch.manual_seed(1)
    model = build_model(load_config(None, ["model.name=hf:Qwen2ForCausalLM", *sizes]), 256)
    pretrained = tmp_path / "qwen2"
    model.save_pretrained(pretrained, safe_serialization=True)

    run_dir = tmp_path / "run"
    overrides = [f"model.name={pretrained}", "model.seq_len=32", "train.steps=2", "data.max_bytes=100000",
                 "train.batch_size=4", "parallel.microbatches=2", "optim.warmup_steps=1", "train.eval_interval=0",
                 "checkpoint.interval=0", "loss.normalize=tokens", f"run.dir={run_dir}"]
    done = conveyor_train(*overrides, cwd=tmp_path)
    losses = _trained(done, run_dir, steps=2)
    assert "rank 0 loaded" in done.stdout and str(pretrained) in done.stdout

    # The first step's loss is the saved model's mean over the first batch's tokens, in one process.
    cfg = load_config(None, overrides)
    first_batch = next(ResumableLoader(build_splits(cfg.data, cfg.model.seq_len).train, 4, seed=cfg.train.seed))
    with torch.no_grad():
        expected = lm_loss()(model(first_batch[0]), first_batch[1]).item()
    assert losses[0] == pytest.approx(expected, rel=1e-5)
