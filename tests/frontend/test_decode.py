"""A traced model's key/value cache: the decode program cut at the training split's points.

One tiny GPT-2 and one tiny Llama (grouped key/value heads), 2 layers, 2 stages in this process.
"""

from __future__ import annotations

import functools

import pytest
import torch

import conveyor
from conveyor.errors import PipelineConfigError
from conveyor.frontend import split_model
from conveyor.frontend.decode import decode_stages
from conveyor.testing.compare import reordered_sum_bound
from conveyor.testing.references.tensor_parallel import build

NEW, LENGTH, ROWS, PROMPT = 6, 16, 2, 5  # tokens generated, cache positions, rows per lane (2 lanes), prompt length



def _cached(model: torch.nn.Module) -> tuple[list, list]:
    split = split_model(model, 2, example_args=(torch.zeros(ROWS, 8, dtype=torch.long),))
    training = [split.stage_module(s) for s in range(2)]
    return decode_stages(split, rows=ROWS, length=LENGTH, stages=training, prefill=PROMPT), training


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_traced_models_decode_with_a_cache_per_stage_to_their_own_generate(family, one_thread):
    """One trace of each program per family serves every check (tracing is most of the cost): the prompts run
    through the prefill program, the new tokens through the decode program."""
    model = build(family).eval()
    stages, training = _cached(model)
    # Each stage keeps the keys and values of its own layer only; its weights are the training stage's.
    assert [stage.cached_layers for stage in stages] == [[0], [1]]
    assert all(any(p is q for q in training[s].parameters()) for s in range(2) for p in stages[s].parameters())
    assert all(p is q for s in range(2) for p, q in zip(stages[s].prefill[2].parameters(), stages[s].parameters()))
    prompts = torch.randint(1, 96, (2 * ROWS, PROMPT), generator=torch.Generator().manual_seed(3))
    pipe = conveyor.Pipeline(stages, "1f1b", microbatches=2, layout=conveyor.InProcessLayout())
    prefilled = []
    for stage in stages:  # each lane's prompt through each stage's prefill program once, not position by position
        stage._prefill = functools.partial(lambda run, number, *a: prefilled.append(number) or run(*a),
                                           stage._prefill, stage.stage)
    first = pipe.generate(prompts, NEW)
    assert sorted(prefilled) == [0, 0, 1, 1], prefilled
    again = pipe.generate(prompts, NEW)  # the caches start empty at each generation
    model.generation_config.eos_token_id = None  # its config's eos (0) would stop rows early
    with torch.no_grad():
        # The model's own cached decode (prefill, then a token per step): other kernel calls than the
        # stages' (a token at a time, masked slots), so this holds where no two logits are within rounding.
        expected = model.generate(prompts, max_new_tokens=NEW, do_sample=False, use_cache=True,
                                  attention_mask=torch.ones_like(prompts), pad_token_id=0)[:, prompts.shape[1]:]
    assert torch.equal(first.tokens, expected), (first.tokens, expected)
    assert torch.equal(again.tokens, expected)
    assert len(set(expected.flatten().tolist())) > 3  # a model that repeats one token would prove little
    _check_logits(model, stages)
    with pytest.raises(PipelineConfigError, match="do not fit the key/value cache of 16 positions"):
        stages[0](torch.ones(ROWS, 4, dtype=torch.long), 0, 14)
    with pytest.raises(PipelineConfigError, match="no full forward"):
        stages[0](torch.ones(ROWS, 4, dtype=torch.long), None, 0)
    with pytest.raises(PipelineConfigError, match="caches hold 16: pass max_new_tokens <= 11"):
        pipe.generate(prompts, 12)  # refused before any stage runs


def _check_logits(model: torch.nn.Module, stages: list) -> None:
    """The decode runs other kernel calls than the full forward: each projection on [rows, 1] instead of
    [rows, n] (another blocking of the same dot products), attention of one query over all LENGTH + 1 cache
    slots under an explicit mask (the full forward: every query under is_causal; masked slots add exact zeros
    but change the reduction's order), the grouped heads repeated (Llama). Each is a reordered fp32 sum of at most
    128 terms (GPT-2's MLP: 4 x 32; Llama's: 48), chained through at most 21 of them from the embedding to the
    logits (per layer: the norm's moments, q|k|v, scores, softmax, values, out projection, two MLP projections;
    then the final norm and the head): relative to the logits' largest magnitude, reordered_sum_bound(128, 21).
    The prefill program attends PROMPT queries over LENGTH + PROMPT slots under the model's causal mask and the
    written slots' mask: the same kinds of reordering, the same bound."""
    ids = torch.randint(1, 96, (ROWS, 12), generator=torch.Generator().manual_seed(4))
    # Position by position through the decode program (12 is not the prefill's length); the first PROMPT at
    # once through the prefill program, then the rest position by position, each stage's cache growing.
    for prefill in (False, True):
        for stage in stages:
            stage.reset_kv_cache()
        with torch.no_grad():
            full = model(ids).logits
            if prefill:
                cached = torch.cat([stages[1](*stages[0](ids[:, :PROMPT], 0, 0)),
                                    stages[1](*stages[0](ids[:, PROMPT:], 0, PROMPT))], dim=1)
            else:
                cached = stages[1](*stages[0](ids, 0, 0))
        assert cached.shape == full.shape and torch.isfinite(cached).all() and torch.isfinite(full).all()
        bound = reordered_sum_bound(128, depth=21) * full.abs().max().item()
        difference = (cached - full).abs().max().item()
        assert difference <= bound, (prefill, difference, bound)


def test_decode_stages_need_a_hugging_face_causal_lm_and_its_positions():
    headless = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8))
    split = split_model(headless, 2, example_args=(torch.zeros(2, 3, dtype=torch.long),))
    with pytest.raises(PipelineConfigError, match="needs a Hugging Face causal LM"):
        decode_stages(split, rows=2, length=8)
    model = build("gpt2")
    split = split_model(model, 2, example_args=(torch.zeros(2, 4, dtype=torch.long),))
    with pytest.raises(PipelineConfigError, match="outgrows the model's 32: pass length <= 32"):
        decode_stages(split, rows=2, length=33)


def _ranks_decode(rank: int, world_size: int, prompts: torch.Tensor) -> list:
    """On each rank: its own stage of the decode program, in one pipeline over gloo (Llama only: a launch
    traces twice per family, and GPT-2's decode runs the same code in process above)."""
    tokens = []
    for family in ("llama",):
        model = build(family).eval()
        split = split_model(model, world_size, example_args=(torch.zeros(ROWS, 8, dtype=torch.long),))
        stages = decode_stages(split, rows=ROWS, length=LENGTH, stages=[split.stage_module(rank)], which=[rank])
        with conveyor.Pipeline(stages, "1f1b", microbatches=2,
                               transfer=conveyor.TransferOptions(timeout_s=60)) as pipe:
            tokens.append(pipe.generate(prompts, NEW).tokens)
    return tokens


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_gloo_ranks_decode_a_traced_model_with_their_own_caches(one_thread):
    from conveyor.testing import run_ranks

    prompts = torch.randint(1, 96, (2 * ROWS, 5), generator=torch.Generator().manual_seed(5))
    by_rank = run_ranks(_ranks_decode, 2, args=(prompts,), timeout_s=240)
    for index, family in enumerate(("llama",)):
        model = build(family).eval()
        model.generation_config.eos_token_id = None
        with torch.no_grad():
            expected = model.generate(prompts, max_new_tokens=NEW, do_sample=False, use_cache=True,
                                      attention_mask=torch.ones_like(prompts), pad_token_id=0)[:, prompts.shape[1]:]
        for rank, tokens in enumerate(by_rank):
            assert torch.equal(tokens[index], expected), (family, rank, tokens[index], expected)
