"""Pipelines x tensor parallelism x data parallelism on 8 ranks (pp=2 x dp=2 x tp=2): parity.

For Llama with 1f1b and zbv, ``data_parallel="ddp"`` and ``"fsdp"``: after 3 AdamW steps the
pipeline's losses and parameters against the same traced stages under TP x DP without a pipeline
(torch's ``fully_shard`` / ``replicate`` over the mesh's "dp" sub-mesh on the TP-sharded
parameters, reduced once per step): "yes" where torch.equal, each rank's shards and the gathered
tensors alike. The clipping norm against torch's own norm of the DTensor gradients (relative).
GPT-2 (embedding on stage 0, its tied head on stage 1, summed across the pipeline) against the
whole model in one stage: the tied gradient is summed in another order, so equal to rounding,
and its four copies (two stages x two replicas, each a TP shard pair) equal after every step.

Every case runs on one launch of 8 ranks, one after the other. Run through the one benchmark
command:
    .venv/bin/python -m benchmarks --tp-parity
"""

from __future__ import annotations

import argparse
import time

from benchmarks.steal import StealMeter
from conveyor.testing.multiprocess import run_ranks
from conveyor.testing.references.tensor_data_parallel import cases_on_one_launch

SHAPE = (2, 2, 2)  # pp, dp, tp
CASES = [("llama", "1f1b", "ddp"), ("llama", "1f1b", "fsdp"), ("llama", "zbv", "ddp"), ("llama", "zbv", "fsdp"),
         ("gpt2", "1f1b", "ddp"), ("gpt2", "1f1b", "fsdp")]


def _yes(flags) -> str:
    return "yes" if all(flags) else "NO"


def run(args: argparse.Namespace) -> int:
    """Print the parity table (every rank's results folded: "yes" only where every rank agrees)."""
    meter = StealMeter()
    started = time.perf_counter()
    with meter.window("tp-parity"):
        per_rank = run_ranks(cases_on_one_launch, 8, args=(SHAPE, CASES), timeout_s=3000)
    print(f"pp=2 x dp=2 x tp=2 on 8 gloo ranks, 3 AdamW steps, M=4, every case on one launch "
          f"({time.perf_counter() - started:.0f} s):")
    print("| model | schedule | data_parallel | stages | losses equal | parameters equal (shards, gathered) | "
          "max loss rel | max param rel | clip norm rel | tied copies equal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    status = 0
    for case in CASES:
        results = [ranks[case] for ranks in per_rank]
        first = results[0]
        tied = _yes(r["tied_equal"] for r in results) if first["tied"] else "-"
        print(f"| {case[0]} | {case[1]} | {case[2]} | {first['stages']} | {_yes(r['losses_equal'] for r in results)} | "
              f"{_yes(r['shards_equal'] for r in results)}, {_yes(r['params_equal'] for r in results)} | "
              f"{max(r['loss_rel'] for r in results):.3g} | {max(r['param_rel'] for r in results):.3g} | "
              f"{max(r['norm_rel'] for r in results):.3g} | {tied} |", flush=True)
        bitwise = case[0] != "gpt2"  # GPT-2's reference holds the tied parameter once: rounding only
        if bitwise and not all(r["losses_equal"] and r["params_equal"] and r["shards_equal"] for r in results):
            status = 1
    print("\nCPU steal: " + ", ".join(f"{side} {value:.1f}%" for side, value in meter.percent().items()))
    return status
