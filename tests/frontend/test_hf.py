"""Hugging Face models built from tiny configs, split unchanged, bitwise equal to the unsplit model."""

from __future__ import annotations

import logging

import pytest
import torch

import conveyor.frontend as frontend
from conveyor.testing.models import gpt2, llama, token_batch
from conveyor.testing.references.unsplit import check_names, check_parity


@pytest.fixture(scope="module")
def gpt2_model():
    model_class, config = gpt2(num_layers=4, dropout=0.1)
    torch.manual_seed(0)
    return model_class(config).train()


@pytest.fixture(scope="module")
def llama_model():
    model_class, config = llama(num_layers=4)
    torch.manual_seed(0)
    return model_class(config).train()


@pytest.mark.parametrize("num_stages", [2, 4])
def test_gpt2_parity_with_tied_embedding(gpt2_model, num_stages):
    batch = token_batch()
    split = frontend.split_model(
        gpt2_model, num_stages, example_kwargs=batch, split_method="uniform"
    )
    expected_points = {
        2: ("transformer.h.2",),
        4: ("transformer.h.1", "transformer.h.2", "transformer.h.3"),
    }
    assert split.split_points == expected_points[num_stages]
    # Dropout is on (train mode): same seed, same operations in the same order -> same masks.
    stages = check_parity(gpt2_model, split, kwargs=batch, seed=3)
    check_names(gpt2_model, split, stages)

    (tied,) = split.tied_groups
    assert tied.names == ("transformer.wte.weight", "lm_head.weight")
    assert tied.uses == ((0, "transformer.wte.weight"), (num_stages - 1, "lm_head.weight"))
    assert tied.stages == (0, num_stages - 1)
    first = stages[0].get_parameter("transformer.wte.weight")
    last = stages[-1].get_parameter("lm_head.weight")
    # Each stage holds its own copy (as on separate ranks), equal in value.
    assert first is not last and torch.equal(first, last)
    assert first is not gpt2_model.transformer.wte.weight


@pytest.mark.parametrize("num_stages", [2, 4])
def test_llama_parity(llama_model, num_stages):
    batch = token_batch(seed=1)
    split = frontend.split_model(
        llama_model, num_stages, example_kwargs=batch, split_method="uniform"
    )
    assert split.tied_groups == ()
    stages = check_parity(llama_model, split, kwargs=batch)
    check_names(llama_model, split, stages)
    # labels are passed through to the last stage, which uses them.
    for stage in range(num_stages - 1):
        names = [spec.name for spec in split.stage_output_specs(stage)]
        assert "labels" in names
    last_inputs = split.stage_input_specs(num_stages - 1)
    hidden = [spec for spec in last_inputs if spec.requires_grad]
    assert len(hidden) == 1 and hidden[0].shape == (2, 12, 32)


def test_llama_parameters_balance_puts_embedding_and_head_on_the_ends(llama_model):
    batch = token_batch()
    split = frontend.split_model(llama_model, 2, example_kwargs=batch)  # split_method="parameters"
    counts = [
        sum(llama_model.get_parameter(name).numel() for name in split.stage_parameter_names(stage))
        for stage in range(2)
    ]
    assert split.split_points == ("model.layers.2",)
    embedding = 96 * 32
    layer = 2 * (32 * 32) + 2 * (32 * 16) + 3 * (32 * 48) + 2 * 32  # q, o; k, v (2 heads); mlp; norms
    assert counts == [embedding + 2 * layer, 2 * layer + 32 + embedding]
    assert split.stage_weights == tuple(float(count) for count in counts)


def _grouped_heads_llama(num_stages, batch, attn_implementation=None):
    model_class, config = llama(num_layers=4)  # 4 query heads over 2 key/value heads
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    model = model_class(config).train()
    split = frontend.split_model(model, num_stages, example_kwargs=batch, split_method="uniform")
    return model, split


def _attention_calls(split):
    """The stages' SDPA calls, as lines of their generated code."""
    return [line for stage in range(split.num_stages) for line in split.stage_module(stage).code.splitlines()
            if "aten.scaled_dot_product_attention.default(" in line]


@pytest.mark.parametrize("num_stages", [2, 4])
def test_grouped_kv_heads_llama_is_bitwise_and_runs_eager_attention(num_stages, caplog):
    """No mask given: the stages call SDPA as eager does (is_causal, the groups inside SDPA).

    Before, the trace built a causal mask and repeated the key/value heads (transformers'
    masking refuses to drop the mask under torch.export), whose backward sums each group's
    gradients in another order than SDPA's grouped kernel: gradients off by ~1e-8.
    """
    batch = token_batch(seed=1)
    with caplog.at_level(logging.WARNING, logger="conveyor.frontend.attention"):
        model, split = _grouped_heads_llama(num_stages, batch)
    assert "grouped key/value heads" not in caplog.text
    calls = _attention_calls(split)
    assert len(calls) == 4
    for line in calls:  # (query, key, value, attn_mask=None, dropout_p=0.0, is_causal=True, ...)
        assert ", None, 0.0, True, " in line and "enable_gqa = True" in line, line
    check_parity(model, split, kwargs=batch)


def test_grouped_kv_heads_with_a_mask_input_warn_once_and_match_on_padded_batches(caplog):
    """Given attention_mask, eager's path reads its values: the graph repeats the heads, and says so."""
    batch = token_batch(seed=1, attention_mask=True)
    with caplog.at_level(logging.WARNING, logger="conveyor.frontend.attention"):
        model, split = _grouped_heads_llama(2, batch)
        split.stage_modules(both_modes=True)  # a second trace (eval mode) says nothing new
    warnings = [r.getMessage() for r in caplog.records if "grouped key/value heads" in r.getMessage()]
    assert len(warnings) == 1
    assert "model.layers.0.self_attn and 3 more" in warnings[0] and "attention_mask is an input" in warnings[0]
    padded = {**batch, "attention_mask": batch["attention_mask"].clone()}
    padded["attention_mask"][0, -3:] = 0  # with padding eager repeats the heads too: bitwise
    check_parity(model, split, kwargs=padded)


def test_grouped_kv_heads_follow_the_attention_implementation_the_user_asks_for(caplog):
    """config._attn_implementation = "eager": transformers' own matmul attention, traced as it is."""
    batch = token_batch(seed=1)
    with caplog.at_level(logging.WARNING, logger="conveyor.frontend.attention"):
        model, split = _grouped_heads_llama(2, batch, attn_implementation="eager")
    assert _attention_calls(split) == [] and "grouped key/value heads" not in caplog.text
    check_parity(model, split, kwargs=batch)


class _Wrapper(torch.nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        return self.lm(input_ids).logits


def test_grouped_kv_heads_inside_a_wrapper_model_are_named_in_a_warning(caplog):
    """Only a Hugging Face model traced itself is known to take no mask: a wrapper is warned of."""
    model_class, config = llama(num_layers=2)
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="conveyor.frontend.attention"):
        frontend.split_model(_Wrapper(model_class(config)), 2, example_args=(token_batch()["input_ids"],))
    assert "lm.model.layers.0.self_attn and 1 more" in caplog.text
    assert "_Wrapper is not a Hugging Face model itself" in caplog.text
