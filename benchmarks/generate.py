"""``--generate``: decode tokens/s through the pipeline, one lane against P lanes, and the unsplit model's loop.

Two gloo ranks hold the two stages of a hand-built transformer (:mod:`conveyor.testing.models.tiny_lm`,
widened); :meth:`conveyor.Pipeline.generate` decodes greedily. Three sides, in rounds whose order
rotates, each timed on rank 0 with the host's CPU steal while it ran:

- ``1 lane``: a pipeline of one microbatch, ``rows`` prompts: one batch in flight, so each stage
  waits while the other works (at most 1/P of the ranks busy);
- ``2 lanes``: a pipeline of two microbatches, ``2 x rows`` prompts: while the last stage reads
  one lane's logits the first already runs the next. The goal: at least 0.9 x P x the one lane's
  tokens/s;
- ``unsplit``: rank 0 alone (rank 1 waits) runs the unsplit model's greedy loop
  (:func:`conveyor.testing.references.generation.reference_generate`) on ``rows`` prompts with
  ``--generate-unsplit-threads`` threads (default 2: the ranks' threads together).

Every side recomputes the whole window at each token (the pipeline has no key/value cache yet),
so the comparison is of the same work. Tokens/s counts generated tokens.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

import torch

import conveyor
import conveyor.schedule as cs
from benchmarks.steal import StealMeter
from conveyor.pipe.generation import Sampling
from conveyor.testing.models import TinyConfig, build_stage, reference_model
from conveyor.testing.multiprocess import run_ranks
from conveyor.testing.references.generation import reference_generate

CONFIG = TinyConfig(num_stages=2, blocks_per_stage=2, vocab_size=256, dim=256, num_heads=4, seq_len=64)
ROWS, PROMPT, NEW = 4, 32, 32
SIDES = ("1 lane", "2 lanes", "unsplit")


def _prompts(rows: int) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (rows, PROMPT), generator=torch.Generator().manual_seed(0))


def _rank(rank: int, world_size: int, rounds: int, unsplit_threads: int) -> dict[str, Any]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    pipes = {lanes: conveyor.Pipeline([build_stage(rank, CONFIG)], cs.build("1f1b", ranks=2, microbatches=lanes),
                                      transfer=conveyor.TransferOptions(timeout_s=300)) for lanes in (1, 2)}
    unsplit = reference_model(CONFIG) if rank == 0 else None  # train mode, as the stages: the same kernels
    record: dict[str, Any] = {side: {"seconds": [], "tokens": 0} for side in SIDES}
    meter = StealMeter()
    for round_index in range(rounds + 1):  # round 0 warms every side up, untimed
        order = SIDES[round_index % 3:] + SIDES[:round_index % 3]
        for side in order:
            dist.barrier()
            start = time.perf_counter()
            with meter.window(side) if round_index else contextlib.nullcontext():
                if side == "unsplit":
                    if rank == 0:
                        torch.set_num_threads(unsplit_threads)
                        reference_generate(unsplit, _prompts(ROWS), NEW, Sampling(), length=PROMPT + NEW)
                        torch.set_num_threads(1)
                    made = ROWS * NEW
                else:
                    lanes = 1 if side == "1 lane" else 2
                    made = int(pipes[lanes].generate(_prompts(ROWS * lanes), NEW).lengths.sum())
                dist.barrier()
            if round_index:
                record[side]["seconds"].append(time.perf_counter() - start)
                record[side]["tokens"] += made
    for pipe in pipes.values():
        pipe.close()
    record["steal"] = meter.percent()
    return record


def run(args: Any) -> int:
    """Measure the three sides and print the table and the lanes' ratio against the goal."""
    rounds = args.generate_rounds
    threads = args.generate_unsplit_threads
    record = run_ranks(_rank, 2, args=(rounds, threads), timeout_s=1800)[0]
    print(f"--generate: 2 ranks (1 thread each), tiny LM dim {CONFIG.dim} x {2 * CONFIG.blocks_per_stage} blocks, "
          f"{PROMPT} prompt + {NEW} new tokens, {ROWS} prompts per lane; {rounds} rounds, order rotating")
    print(f"{'side':<9} {'tokens/s':>9} {'median s':>9} {'steal %':>8}")
    rates = {}
    for side in SIDES:
        seconds = record[side]["seconds"]
        rates[side] = record[side]["tokens"] / sum(seconds)
        steal = record["steal"].get(side)
        print(f"{side:<9} {rates[side]:>9.1f} {statistics.median(seconds):>9.3f} "
              f"{'n/a' if steal is None else f'{steal:.0f}':>8}")
    ratio = rates["2 lanes"] / rates["1 lane"]
    print(f"2 lanes / 1 lane: {ratio:.2f}x (goal >= {0.9 * 2:.1f}x); 2 lanes / unsplit ({threads} threads): "
          f"{rates['2 lanes'] / rates['unsplit']:.2f}x")
    return 0
