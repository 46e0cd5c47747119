"""conveyor.train.sample: greedy decoding through a pipeline equals plain greedy decoding with the model."""

from __future__ import annotations

import pytest
import torch

import conveyor
from conveyor.frontend import split_model
from conveyor.train.config import load_config
from conveyor.train.models import build_model
from conveyor.train.sample import greedy_reference, greedy_tokens, sample_lines

SEQ = 16


def split_pipeline(name: str, rows: int, microbatches: int):
    torch.manual_seed(0)
    model = build_model(load_config(None, [f"model.name={name}", "model.layers=2", "model.width=32",
                                           f"model.seq_len={SEQ}"]), 256)
    example = torch.zeros(rows // microbatches, SEQ, dtype=torch.long)
    split = split_model(model, 2, example_args=(example,))
    return model, conveyor.Pipeline([split.stage_module(s) for s in range(2)], "1f1b",
                                    microbatches=microbatches, layout=conveyor.InProcessLayout())


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_the_pipeline_decodes_what_the_unsplit_model_decodes(name):
    model, pipe = split_pipeline(name, rows=4, microbatches=2)
    prompt = list(b"def f(")
    # 30 tokens after 6: the context outgrows seq_len, so the window slides (and is no longer padded).
    got = greedy_tokens(pipe, prompt, 30, seq_len=SEQ, rows=4)
    want = greedy_reference(model, prompt, 30, seq_len=SEQ)
    assert torch.equal(torch.tensor(got), torch.tensor(want))
    assert len(set(got)) > 1  # not a degenerate constant: the comparison means something


def test_one_row_per_microbatch_and_a_prompt_longer_than_the_window():
    model, pipe = split_pipeline("gpt", rows=2, microbatches=2)
    prompt = list(range(40, 40 + SEQ + 5))
    got = greedy_tokens(pipe, prompt, 8, seq_len=SEQ, rows=2)
    assert torch.equal(torch.tensor(got), torch.tensor(greedy_reference(model, prompt, 8, seq_len=SEQ)))


def test_generation_stops_after_the_end_of_text_token():
    model, pipe = split_pipeline("gpt", rows=2, microbatches=2)
    prompt = [1, 2, 3]
    free = greedy_tokens(pipe, prompt, 6, seq_len=SEQ, rows=2)
    stopped = greedy_tokens(pipe, prompt, 6, seq_len=SEQ, rows=2, eos_id=free[2])
    assert stopped == free[: free.index(free[2]) + 1]
    with pytest.raises(ValueError, match="prompt"):
        greedy_tokens(pipe, [], 3, seq_len=SEQ, rows=2)


def test_the_summary_shows_prompt_and_continuation_apart():
    lines = sample_lines({"sample_prompt": "x = ", "sample": "1\n" + "\n" * 40 + "y", "sample_txt": "r/sample.txt"})
    assert lines[0] == "sample (greedy, after training; r/sample.txt):"
    assert lines[1] == "  | x = ⟨1" and lines[-1] == "  | y⟩" and len(lines) < 8
    escaped = sample_lines({"sample_prompt": "a", "sample": "\x06b\x1b[2J", "sample_txt": "s"})[1]
    assert escaped == "  | a⟨\\x06b\\x1b[2J⟩"
    assert sample_lines({"steps": 3}) == []


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_the_key_value_cache_decodes_what_the_unsplit_model_decodes(name):
    from conveyor.train.sample import cached_tokens

    torch.manual_seed(0)
    model = build_model(load_config(None, [f"model.name={name}", "model.layers=2", "model.width=32",
                                           f"model.seq_len={SEQ}"]), 256)
    pipe = conveyor.pipeline(model, example_args=(torch.zeros(1, SEQ, dtype=torch.long),), schedule="1f1b",
                             microbatches=2, layout=conveyor.InProcessLayout(ranks=2))
    prompt = list(b"def f(")
    got = cached_tokens(pipe, prompt, SEQ - len(prompt), length=SEQ)
    want = greedy_reference(model, prompt, SEQ - len(prompt), seq_len=SEQ)
    assert got is not None and torch.equal(torch.tensor(got), torch.tensor(want)), (got, want)
    assert len(set(got)) > 1  # not a degenerate constant: the comparison means something
    # A context that would outgrow the window takes the window loop instead; so do stages built by hand.
    assert cached_tokens(pipe, prompt, SEQ, length=SEQ) is None
    split = split_model(model, 2, example_args=(torch.zeros(1, SEQ, dtype=torch.long),))
    by_hand = conveyor.Pipeline([split.stage_module(s) for s in range(2)], "1f1b", microbatches=2,
                                layout=conveyor.InProcessLayout())
    assert cached_tokens(by_hand, prompt, SEQ - len(prompt), length=SEQ) is None
