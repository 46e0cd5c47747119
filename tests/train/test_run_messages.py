"""What a run says about itself: the tokens it trained, a resume at another layout, where a resumed run began.

Each run is `conveyor train`'s loop in one process (``parallel.in_process=true``, one rank of
torch.distributed): the lines are the ones a launched run prints on rank 0.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from types import SimpleNamespace

import torch

from conveyor.testing import run_ranks

TINY = ["model.name=llama", "model.layers=2", "model.width=32", "model.heads=2", "model.seq_len=32",
        "data.val_fraction=0.1", "train.batch_size=4", "parallel.microbatches=2", "optim.warmup_steps=1",
        "checkpoint.interval=0", "train.sample_tokens=0", "run.tensorboard=false", "run.device=cpu",
        "run.log_interval=1", "parallel.in_process=true", "train.eval_batches=1"]


def _train(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict:
    from conveyor.train.config import load_config
    from conveyor.train.loop import train

    torch.set_num_threads(1)
    cfg = load_config(None, [*TINY, *overrides, f"run.dir={run_dir}"], world_size=world_size)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        summary = train(cfg)
    metrics = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {"printed": printed.getvalue(), "metrics": metrics, "steps": summary["steps"]}


def test_batches_by_length_count_the_tokens_they_train_not_their_padding(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the pieces' cache: this test's own
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(60):  # documents of 40 to 453 bytes, each one piece (seq_len 512): rows of unequal lengths
        (corpus / f"doc{i:02d}.txt").write_text("".join(chr(97 + (i * j) % 26) for j in range(40 + 7 * i)))
    overrides = ["data.batching=by_length", f"data.source={corpus}/*.txt", "model.seq_len=512", "train.steps=3",
                 "train.eval_interval=0", "parallel.pp=2"]
    [run] = run_ranks(_train, 1, args=(overrides, str(tmp_path / "run")), timeout_s=300)
    logged = [record["tokens"] for record in run["metrics"] if "loss" in record]

    # The same steps drawn again, outside the run: the targets that are not padding (-100), step by step.
    from conveyor.train.config import load_config
    from conveyor.train.data import length_loader

    cfg = load_config(None, [*TINY, *overrides])
    reader = SimpleNamespace(needs_inputs=True, needs_target=True, dp_rank=0, dp_size=1, device=None)
    loader = length_loader(reader, cfg.data, cfg.model.seq_len, cfg.replica_batch_size, 2, seed=cfg.train.seed)
    steps = [next(loader) for _ in range(3)]
    want = [sum(int((targets != -100).sum()) for _, targets in step) for step in steps]
    padded = [sum(targets.numel() for _, targets in step) for step in steps]
    assert logged == want, (logged, want)
    assert all(0 < trained < slots for trained, slots in zip(want, padded)), (want, padded)  # padding left out
    lines = run["printed"].splitlines()
    shown = [line for line in lines if line.startswith(("step ", "done: "))]
    assert len(shown) == 4 and all("trained tokens/s" in line for line in shown), lines
    assert list((tmp_path / "cache" / "conveyor" / "pieces").glob("*.pt"))  # cut once, kept for the next run


def test_a_resume_at_another_layout_says_both_layouts_once_and_the_summary_says_where_it_resumed(tmp_path):
    run_dir = str(tmp_path / "run")
    saved = ["train.steps=2", "train.eval_interval=2", "checkpoint.interval=2", "parallel.pp=2"]
    [first] = run_ranks(_train, 1, args=(saved, run_dir), timeout_s=300)
    resumed = ["train.steps=3", "train.eval_interval=2", "checkpoint.resume=true", "parallel.pp=1"]
    [second] = run_ranks(_train, 1, args=(resumed, run_dir), timeout_s=300)
    lines = second["printed"].splitlines()
    said = [line for line in lines if "resumed from" in line]
    assert said == [f"conveyor train: resumed from {tmp_path}/run/checkpoints/step_000002 at step 2, resharded "
                    f"pp=2 x tp=1 -> pp=1 x tp=1; random generator states start fresh (from train.seed) because "
                    f"the saved ones belong to other ranks' stages"], lines
    first_val = [m["val_loss"] for m in first["metrics"] if "val_loss" in m][-1]  # the saved run's, at step 2
    last_val = [m["val_loss"] for m in second["metrics"] if "val_loss" in m][-1]
    done = next(line for line in lines if line.startswith("done: "))
    # The resumed run validates at step 2 again; pp=1 computes what pp=2 did (bitwise: the same order of sums).
    assert done.startswith("done: 3 steps, resumed at step 2; training loss ")
    assert "(step 3) -> " in done and f"; validation loss {first_val:.4f} (step 2) -> {last_val:.4f} (step 3);" in done
    # The log stays an uninterrupted run's: one validation at step 2 (the saved run's), one at the end.
    assert [m["step"] for m in second["metrics"] if "val_loss" in m] == [0, 2, 3]
