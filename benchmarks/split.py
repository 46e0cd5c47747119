"""Figures for conveyor.frontend: split cost on a big meta-device model, and time balancing.

Run: .venv/bin/python -m benchmarks --split [--quick]

1. A 32-layer Llama-style model (about 1.5B parameters) built on the meta device is
   split into 8 stages, and one stage is materialised on cpu, in a fresh process per
   measured stage (as one rank would): wall time of split_model and of stage_module,
   and the process's peak RSS (targets: split < 30 s, peak < 2 GiB per rank).
2. A model whose blocks differ in cost (MLP widths vary) is split into 4 stages with
   split_method="time" and with "uniform"; each stage's forward+backward is then
   measured on its own: slowest stage / mean (target for "time": within 10%).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA = dict(
    num_hidden_layers=32,
    hidden_size=2048,
    intermediate_size=5632,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=2048,
    use_cache=False,
    bos_token_id=0,
    eos_token_id=0,
)
NUM_STAGES = 8
SEQUENCE = 1024


def child_llama(stage: int) -> None:
    """One 'rank': split the meta model, build only `stage`, report times and peak RSS."""
    start = time.perf_counter()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import conveyor.frontend as frontend

    import_s = time.perf_counter() - start
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    num_parameters = sum(p.numel() for p in model.parameters())
    ids = torch.zeros(1, SEQUENCE, dtype=torch.long)
    start = time.perf_counter()
    split = frontend.split_model(
        model, NUM_STAGES, example_kwargs={"input_ids": ids, "labels": ids}, split_method="uniform"
    )
    split_s = time.perf_counter() - start
    rss_after_split = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    module = split.stage_module(stage, "cpu")
    build_s = time.perf_counter() - start
    stage_parameters = sum(p.numel() for p in module.parameters())
    assert all(p.device.type == "cpu" for p in module.parameters())
    print(
        json.dumps(
            {
                "import_s": import_s,
                "split_s": split_s,
                "build_s": build_s,
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "rss_after_split": rss_after_split,
                "num_parameters": num_parameters,
                "stage_parameters": stage_parameters,
                "split_points": list(split.split_points),
            }
        )
    )


def bench_llama(stages: list[int]) -> None:
    print(
        f"1. Llama-style, {LLAMA['num_hidden_layers']} layers, meta device -> {NUM_STAGES} stages "
        f"(one fresh process per measured stage, microbatch 1 x {SEQUENCE})"
    )
    for stage in stages:
        # A fresh interpreter, as a rank starts: its import time and peak RSS are a rank's.
        code = f"from benchmarks.split import child_llama; child_llama({stage})"
        result = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=False,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
        )
        if result.returncode != 0:
            print(result.stderr[-3000:])
            raise SystemExit(f"child for stage {stage} failed")
        figures = json.loads(result.stdout.strip().splitlines()[-1])
        if stage == stages[0]:
            print(
                f"   model: {figures['num_parameters'] / 1e9:.2f}B parameters; "
                f"split points: {', '.join(figures['split_points'])}"
            )
        gib = 1024**3
        print(
            f"   stage {stage}: split_model {figures['split_s']:.1f} s (target < 30 s), "
            f"stage_module {figures['build_s']:.1f} s for {figures['stage_parameters'] / 1e6:.0f}M parameters, "
            f"peak RSS {figures['peak_rss'] / gib:.2f} GiB (target < 2 GiB; "
            f"{figures['rss_after_split'] / gib:.2f} GiB before materialising; import torch+transformers "
            f"{figures['import_s']:.1f} s)"
        )


def bench_time_balance(repeats: int) -> None:
    import torch

    import conveyor.frontend as frontend
    from conveyor.plan.time_split import profile_stages, time_split
    from conveyor.testing.models import UnevenMLP

    # Blocks grow wider with depth (64 .. 2048): equal block counts put most work on the last stage.
    hiddens = [64 * (i + 1) for i in range(32)]
    # One intra-op thread: on a machine shared with other jobs, two threads meeting at
    # a barrier stall for a whole scheduler slice (~10-100 ms), swamping ms-long blocks.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = UnevenMLP(hiddens)
    x = torch.randn(256, 128)
    print(
        f"2. {len(hiddens)} blocks, MLP widths {hiddens[0]}..{hiddens[-1]} -> 4 stages, batch {tuple(x.shape)}, "
        f"cpu, 1 thread, best of {3 * repeats} runs per stage"
    )
    ratios = {}
    for method in ("uniform", "time"):
        start = time.perf_counter()
        if method == "time":  # the planner measures and chooses the split points; the frontend cuts there
            chosen = time_split(model, 4, example_args=(x,))
            split = frontend.split_model(model, 4, example_args=(x,), split_points=chosen.split_points)
        else:
            split = frontend.split_model(model, 4, example_args=(x,), split_method=method)
        split_s = time.perf_counter() - start
        # Measure the resulting stages a few times; keep each stage's best (noise only adds).
        costs = [
            min(values)
            for values in zip(
                *(
                    profile_stages(split, (x,), None, torch.device("cpu"), repeats=repeats)
                    for _ in range(3)
                )
            )
        ]
        ratio = max(costs) / statistics.mean(costs)
        ratios[method] = ratio
        predicted = (
            ""
            if method != "time"
            else (
                f" (measured while splitting: {', '.join(f'{w * 1e3:.1f}' for w in chosen.stage_seconds)})"
            )
        )
        print(
            f"   {method:>7}: split points {', '.join(split.split_points)}; split {split_s:.1f} s; "
            f"stage ms {', '.join(f'{c * 1e3:.1f}' for c in costs)}{predicted}; slowest / mean = {ratio:.3f}"
        )
    print(
        f"   slowest/mean: time {ratios['time']:.3f} (target <= 1.10) vs uniform {ratios['uniform']:.3f}; "
        f"uniform's slowest stage is {ratios['uniform'] / ratios['time']:.2f}x time's (relative to the mean)"
    )


def run(args: argparse.Namespace) -> int:
    """Both measurements; ``args.quick`` measures one Llama stage and repeats less."""
    logging.basicConfig(level=logging.ERROR)
    bench_llama([0] if args.quick else [0, NUM_STAGES // 2, NUM_STAGES - 1])
    bench_time_balance(repeats=3 if args.quick else 5)
    return 0
