"""``--generate``'s second table: a traced Hugging Face Llama decoding through its key/value cache.

Two gloo ranks each hold one stage of the model's decode program
(:func:`conveyor.frontend.decode.decode_stages`, cut like the training program, each stage with its
layer's cache per lane). Three sides, as in :mod:`benchmarks.generate`: ``1 lane`` (one microbatch),
``2 lanes`` (two microbatches, twice the prompts), and ``unsplit``: rank 0 alone runs the model's own
``generate(use_cache=True)`` (prefill, then a token per step) with the unsplit side's threads.

The decode stages run each lane's prompt at once through their prefill program (``decode_stages(prefill=
PROMPT)``), as the unsplit side's ``generate()`` does, then a token per step; tokens/s counts generated tokens
only, prefill included in the time.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

import conveyor
import conveyor.schedule as cs
from benchmarks.steal import StealMeter
from conveyor.testing.multiprocess import run_ranks

ROWS, PROMPT, NEW, WIDTH = 4, 16, 48, 256
SIDES = ("1 lane", "2 lanes", "unsplit")


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=PROMPT + NEW,
                         use_cache=False, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def _prompts(rows: int) -> torch.Tensor:
    return torch.randint(1, 256, (rows, PROMPT), generator=torch.Generator().manual_seed(0))


def _pipes(rank: int, model: torch.nn.Module) -> dict[int, Any]:
    from conveyor.frontend import split_model
    from conveyor.frontend.decode import decode_stages

    split = split_model(model, 2, example_args=(torch.zeros(ROWS, PROMPT, dtype=torch.long),))
    training = [split.stage_module(rank)]
    return {lanes: conveyor.Pipeline(decode_stages(split, rows=ROWS, length=PROMPT + NEW, stages=training,
                                                   which=[rank], prefill=PROMPT),
                                     cs.build("1f1b", ranks=2, microbatches=lanes),
                                     transfer=conveyor.TransferOptions(timeout_s=300)) for lanes in (1, 2)}


def _rank(rank: int, world_size: int, rounds: int, unsplit_threads: int) -> dict[str, Any]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    model = _model()
    pipes = _pipes(rank, model)
    record: dict[str, Any] = {side: {"seconds": [], "tokens": 0} for side in SIDES}
    meter = StealMeter()
    same = True
    for round_index in range(rounds + 1):  # round 0 warms every side up, untimed
        order = SIDES[round_index % 3:] + SIDES[:round_index % 3]
        for side in order:
            dist.barrier()
            start = time.perf_counter()
            with meter.window(side) if round_index else contextlib.nullcontext(), torch.no_grad():
                if side == "unsplit":
                    if rank == 0:
                        torch.set_num_threads(unsplit_threads)
                        own = model.generate(_prompts(ROWS), max_new_tokens=NEW, do_sample=False, use_cache=True,
                                             attention_mask=torch.ones(ROWS, PROMPT, dtype=torch.long))
                        torch.set_num_threads(1)
                    made = ROWS * NEW
                else:
                    lanes = 1 if side == "1 lane" else 2
                    out = pipes[lanes].generate(_prompts(ROWS * lanes), NEW)
                    made = int(out.lengths.sum())
                    if lanes == 1 and rank == 0 and round_index == 0:
                        first = out.tokens
                dist.barrier()
            if round_index:
                record[side]["seconds"].append(time.perf_counter() - start)
                record[side]["tokens"] += made
    for pipe in pipes.values():
        pipe.close()
    if rank == 0:  # the pipeline's greedy tokens are the model's own cached generate()'s
        same = torch.equal(first, own[:, PROMPT:])
    record["steal"] = meter.percent()
    record["same_tokens"] = same
    return record


def run_traced(rounds: int, threads: int) -> dict[str, float]:
    """Measure the three sides; print the table; return tokens/s by side."""
    record = run_ranks(_rank, 2, args=(rounds, threads), timeout_s=1800)[0]
    print(f"--generate (traced): 2 ranks (1 thread each), Llama width {WIDTH} x 2 layers traced, decode_stages' "
          f"cache; {PROMPT} prompt + {NEW} new tokens, {ROWS} prompts per lane; greedy tokens = its generate(): "
          f"{record['same_tokens']}")
    from benchmarks.generate import print_rates  # generate.py calls this module's run_traced

    rates = print_rates(record)
    print(f"2 lanes / 1 lane: {rates['2 lanes'] / rates['1 lane']:.2f}x; 2 lanes / unsplit generate() "
          f"({threads} threads): {rates['2 lanes'] / rates['unsplit']:.2f}x")
    return rates
