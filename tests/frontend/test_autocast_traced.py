"""Traced Hugging Face stages under autocast: the same loss and gradients as the eager model under it."""

from __future__ import annotations

import copy

import pytest
import torch

import conveyor.frontend as frontend
from conveyor.testing.models import gpt2, llama, token_batch


@pytest.mark.parametrize("maker", [gpt2, llama], ids=["gpt2", "llama"])
def test_split_model_under_bf16_autocast_is_bitwise_equal_to_the_eager_model(maker):
    model_class, config = maker(num_layers=4)
    torch.manual_seed(0)
    model = model_class(config).eval()  # no dropout: eager and traced draw no masks to compare
    batch = token_batch(seed=1)
    split = frontend.split_model(model, 2, example_kwargs=batch, split_method="uniform")
    reference = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(**batch)
    expected.loss.backward()
    stages = split.stage_modules()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = frontend.run_sequential(stages, (), batch, loss_fn=lambda out: out.loss)
    assert torch.equal(got.loss, expected.loss)
    # Tracing saw `logits.float()` return logits itself, so the traced logits are the fp32
    # cast: the same numbers, one dtype up.
    assert torch.equal(got.logits.float(), expected.logits.float())
    tied = {name for group in split.tied_groups for name in group.names}
    grads = {name: p.grad for stage in stages for name, p in stage.named_parameters() if name not in tied}
    for name, parameter in reference.named_parameters():
        if name not in tied:
            assert torch.equal(grads[name], parameter.grad), f"gradient of {name} differs"
