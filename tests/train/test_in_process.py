"""`conveyor train`'s loop in one process (``parallel.in_process=true``: every pipeline rank in this
process, the in-process ranks backend) and on 2 ranks (torch.distributed): the same losses, bit for bit.

The two runs differ only in the ranks backend of the one ``Pipeline`` class; the config, the data
order, the model's initialisation, clipping and the optimizer are the same code.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from conveyor.testing import run_ranks

# llama: an untied head. GPT-2 ties its embedding to its head, and on 2 ranks the two copies' gradients
# are summed across the ranks (equal to rounding, as Pipeline documents), where one process holds one
# Parameter: its step-5 loss then differs in the last bits.
TINY = ["model.name=llama", "train.steps=5", "model.layers=2", "model.width=32", "model.heads=2", "model.seq_len=32",
        "data.max_bytes=100000", "data.val_fraction=0.1", "parallel.pp=2", "train.batch_size=4",
        "parallel.microbatches=2", "optim.warmup_steps=1", "train.eval_interval=0", "checkpoint.interval=0",
        "train.sample_tokens=0", "run.tensorboard=false", "run.device=cpu", "run.log_interval=1"]


def _train(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict:
    from conveyor.train.config import load_config
    from conveyor.train.loop import train

    torch.set_num_threads(1)
    cfg = load_config(None, [*TINY, *overrides, f"run.dir={run_dir}"], world_size=world_size)
    summary = train(cfg)
    if rank != 0:
        return {}
    lines = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {"losses": [m["loss"] for m in lines if "loss" in m], "steps": summary["steps"],
            "checkpoint": summary["checkpoint"]}


def test_the_training_loop_gives_the_same_losses_in_one_process_and_on_two_ranks(tmp_path):
    [alone] = run_ranks(_train, 1, args=(["parallel.in_process=true"], str(tmp_path / "one")), timeout_s=240)
    two = run_ranks(_train, 2, args=([], str(tmp_path / "two")), timeout_s=240)[0]
    assert alone["steps"] == two["steps"] == 5 and len(alone["losses"]) == 5
    assert torch.equal(torch.tensor(alone["losses"], dtype=torch.float64),
                       torch.tensor(two["losses"], dtype=torch.float64)), (alone["losses"], two["losses"])
    assert alone["checkpoint"] and two["checkpoint"]  # both saved their last step
