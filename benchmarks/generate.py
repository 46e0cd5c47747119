"""``--generate``: decode tokens/s through the pipeline, one lane against P lanes, and the unsplit model's loop.

Two gloo ranks hold the two stages of a hand-built transformer whose stages keep a key/value cache per
lane (:mod:`conveyor.testing.models.cached_lm`, widened); :meth:`conveyor.Pipeline.generate` decodes
greedily: the prompts once (prefill), then one token per lane per step. Three sides, in rounds whose order
rotates, each timed on rank 0 with the host's CPU steal while it ran:

- ``1 lane``: a pipeline of one microbatch, ``rows`` prompts: one batch in flight, so each stage
  waits while the other works (at most 1/P of the ranks busy);
- ``2 lanes``: a pipeline of two microbatches, ``2 x rows`` prompts: while the last stage reads
  one lane's logits the first already runs the next. The goal: at least 0.9 x P x the one lane's
  tokens/s;
- ``unsplit``: rank 0 alone (rank 1 waits) runs the same stages one after the other in one
  process, with the same caches (prefill, then a token per step), on ``rows`` prompts with
  ``--generate-unsplit-threads`` threads (default 2: the ranks' threads together).

Tokens/s counts generated tokens (the time includes building the unrolled program's pipeline, once a
call). The pipeline decodes every step as one unrolled program (:mod:`conveyor.schedule.decode`): the last
stage hands each lane's token to stage 0 as a boundary value as soon as it is picked, so a lane's next step
starts while the other lane is still on the later stage, and with L >= P lanes no rank waits after the
first P - 1 stage times (one lane: each stage waits while the other works, at most 1/P of the ranks busy).

A second table (:mod:`benchmarks.generate_traced`) times the same sides on a traced Hugging Face Llama
whose stages keep its cache (:func:`conveyor.frontend.decode.decode_stages`), against its own
``generate(use_cache=True)``.
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
from conveyor.testing.models.cached_lm import CachedSizes, build_cached_stage
from conveyor.testing.multiprocess import run_ranks

SIZES = CachedSizes(dim=256, vocab=256, heads=4, positions=128)
ROWS, PROMPT, NEW = 4, 32, 64
SIDES = ("1 lane", "2 lanes", "unsplit")



def print_rates(record: dict) -> dict[str, float]:
    """Print each side's tokens/s, median seconds and steal from a rank's ``record``; returns the rates by side."""
    print(f"{'side':<9} {'tokens/s':>9} {'median s':>9} {'steal %':>8}")
    rates = {}
    for side in SIDES:
        seconds = record[side]["seconds"]
        rates[side] = record[side]["tokens"] / sum(seconds)
        steal = record["steal"].get(side)
        print(f"{side:<9} {rates[side]:>9.1f} {statistics.median(seconds):>9.3f} "
              f"{'n/a' if steal is None else f'{steal:.0f}':>8}")
    return rates

def _prompts(rows: int) -> torch.Tensor:
    return torch.randint(0, SIZES.vocab, (rows, PROMPT), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _unsplit_generate(stages: list[torch.nn.Module], prompts: torch.Tensor) -> torch.Tensor:
    """Greedy decoding through every stage in turn in this process, with the stages' caches (lane 0)."""
    for stage in stages:
        stage.reset_kv_cache()
    value, start, made = (prompts, 0, 0), 0, []
    for _ in range(NEW):
        for stage in stages:
            value = stage(*value)
        made.append(value[:, -1].argmax(dim=-1))
        start += prompts.shape[1] if start == 0 else 1
        value = (made[-1][:, None], 0, start)
    return torch.stack(made, dim=1)


def _rank(rank: int, world_size: int, rounds: int, unsplit_threads: int) -> dict[str, Any]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    pipes = {lanes: conveyor.Pipeline([build_cached_stage(rank, 2, SIZES)],
                                      cs.build("1f1b", ranks=2, microbatches=lanes),
                                      transfer=conveyor.TransferOptions(timeout_s=300)) for lanes in (1, 2)}
    unsplit = [build_cached_stage(s, 2, SIZES) for s in range(2)] if rank == 0 else None
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
                        _unsplit_generate(unsplit, _prompts(ROWS))
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
    print(f"--generate: 2 ranks (1 thread each), cached LM dim {SIZES.dim} x 2 blocks, {PROMPT} prompt + {NEW} new "
          f"tokens, {ROWS} prompts per lane; {rounds} rounds, order rotating")
    rates = print_rates(record)
    ratio = rates["2 lanes"] / rates["1 lane"]
    print(f"2 lanes / 1 lane: {ratio:.2f}x (goal >= {0.9 * 2:.1f}x); 2 lanes / unsplit ({threads} threads): "
          f"{rates['2 lanes'] / rates['unsplit']:.2f}x")
    from benchmarks.generate_traced import run_traced

    run_traced(rounds, threads)  # the same sides on a traced Hugging Face model's decode stages
    return 0
