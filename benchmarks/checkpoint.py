"""Checkpoint I/O on a ~100M-parameter GPT-2-like model: save / load time and size at pp=2, and
bytes each rank reads when loading pretrained safetensors at pp=4. Prints figures; asserts nothing.

The model is built from a config in code (no download): GPT-2's 50257-token vocabulary and
768-wide layers, 9 of them (about 103M parameters, tied embedding counted once). The
checkpoint holds the model and AdamW's two moments (after one step): about 3x the weights.

Run through the one benchmark command (CPU, gloo, local processes):
    .venv/bin/python -m benchmarks --checkpoint [--ckpt-layers 9] [--ckpt-out /tmp/conveyor-ckpt-bench]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

import conveyor
import conveyor.checkpoint as ckpt
from conveyor.testing import run_ranks


def _config(layers: int):
    from transformers import GPT2Config

    return GPT2Config(n_layer=layers, n_embd=768, n_head=12, vocab_size=50257, n_positions=128,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)


def _pipe(world_size: int, layers: int):
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(_config(layers))
    ids = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(0))
    per = layers // world_size
    split = [f"transformer.h.{per * i}" for i in range(1, world_size)]
    pipe = conveyor.pipeline(model, example_args=(ids[:1],), example_kwargs={"labels": ids[:1]},
                             split_points=split, schedule="1f1b", microbatches=2,
                             loss_fn=lambda out, labels: out.loss,
                             options=conveyor.PipelineOptions(transfer=conveyor.TransferOptions(timeout_s=600)))
    return pipe, ids


def _save_and_load(rank: int, world_size: int, layers: int, path: str) -> dict:
    import torch.distributed as dist

    pipe, ids = _pipe(world_size, layers)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    pipe.step(ids, labels=ids)
    optimizer.step()
    optimizer.zero_grad()
    dist.barrier()
    start = time.perf_counter()
    ckpt.save(path, pipe, optimizer, extra={"step": 1})
    saved = time.perf_counter() - start
    fresh_optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    dist.barrier()
    start = time.perf_counter()
    ckpt.load(path, pipe, fresh_optimizer)
    loaded = time.perf_counter() - start
    params = sum(p.numel() for p in pipe.parameters())
    pipe.close()
    return {"save_s": saved, "load_s": loaded, "params": params}


def _pretrained(rank: int, world_size: int, layers: int, hf_dir: str) -> dict:
    pipe, _ = _pipe(world_size, layers)
    start = time.perf_counter()
    report = pipe.load_pretrained(hf_dir)
    seconds = time.perf_counter() - start
    pipe.close()
    return {"bytes": report.bytes_read, "total": report.total_bytes, "files": len(report.files), "s": seconds}


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run(args: argparse.Namespace) -> int:
    """Save and load at pp=2, then read pretrained weights at pp=4; print the figures."""
    layers = args.ckpt_layers
    out = Path(args.ckpt_out or tempfile.mkdtemp(prefix="conveyor-ckpt-bench-"))
    try:
        ranks = run_ranks(_save_and_load, 2, args=(layers, str(out / "ckpt" / "step_1")), timeout_s=1200)
        params = sum(r["params"] for r in ranks) - 50257 * 768  # the tied embedding is held on both ends
        size = _size(out / "ckpt" / "step_1")
        print(f"model: {params / 1e6:.1f}M parameters (GPT-2-like, {layers} layers), pp=2, AdamW state")
        print(f"save: {max(r['save_s'] for r in ranks):.2f} s   load: {max(r['load_s'] for r in ranks):.2f} s   "
              f"on disk: {size / 1e6:.0f} MB ({size / (params * 4):.2f}x the fp32 weights)")

        from transformers import GPT2LMHeadModel

        hf_dir = out / "hf"
        GPT2LMHeadModel(_config(layers)).save_pretrained(hf_dir, max_shard_size="100MB")
        ranks = run_ranks(_pretrained, 4, args=(layers, str(hf_dir)), timeout_s=1200)
        total = ranks[0]["total"]
        print(f"pretrained at pp=4 from {len(list(hf_dir.glob('*.safetensors')))} shards, {total / 1e6:.0f} MB:")
        for rank, r in enumerate(ranks):
            print(f"  rank {rank}: read {r['bytes'] / 1e6:6.1f} MB ({r['bytes'] / total:5.1%}) "
                  f"from {r['files']} file(s) in {r['s']:.2f} s")
        print(f"  all ranks: {sum(r['bytes'] for r in ranks) / total:.2f}x the files "
              "(the tied embedding is read by the first and the last rank)")
    finally:
        if args.ckpt_out is None:
            shutil.rmtree(out, ignore_errors=True)
    return 0
