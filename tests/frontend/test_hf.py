"""Hugging Face models built from tiny configs, split unchanged, bitwise equal to the unsplit model."""

from __future__ import annotations

import copy

import pytest
import torch

import conveyor.frontend as frontend
from conveyor.testing.models import gpt2, llama, token_batch

from .parity import check_names, check_parity


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
    # labels and attention_mask are passed through to the stages that use them.
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
    layer = 4 * (32 * 32) + 3 * (32 * 48) + 2 * 32  # attention (q, k, v, o), mlp, 2 norms
    assert counts == [embedding + 2 * layer, 2 * layer + 32 + embedding]
    assert split.stage_weights == tuple(float(count) for count in counts)


def _grouped_heads_llama(num_stages):
    model_class, config = llama(num_layers=4, num_key_value_heads=2)  # 2 groups of 2 heads
    torch.manual_seed(0)
    model = model_class(config).train()
    batch = token_batch(seed=1)  # no padding: attention_mask is all ones
    split = frontend.split_model(model, num_stages, example_kwargs=batch, split_method="uniform")
    return model, split, batch


@pytest.mark.parametrize("num_stages", [2, 4])
def test_grouped_kv_heads_llama_trains_equal_to_rounding(num_stages):
    """Grouped key/value heads: equal to rounding, not bitwise, to the eager model.

    The traced graph must serve any attention_mask, so transformers' sdpa attention builds
    the causal mask in it and, with a mask, repeats the key/value heads (repeat_kv). Eager,
    with no padding in the batch, skips the mask (is_causal=True), and with no mask
    transformers' sdpa attention (5.0 and 5.24 checked) hands the groups to
    scaled_dot_product_attention(enable_gqa=True) instead. Forward values agree, but the
    key/value gradients are summed over each group in another order: about 1 ulp (6e-8 in
    the first step here), then carried by training. No traced graph can follow eager here:
    eager's path depends on the mask's values, which the graph may not read.
    """
    model, split, batch = _grouped_heads_llama(num_stages)
    reference = copy.deepcopy(model)
    stages = split.stage_modules()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    stage_optimizer = torch.optim.SGD([p for stage in stages for p in stage.parameters()], lr=0.1)
    for _ in range(3):
        reference_optimizer.zero_grad()
        stage_optimizer.zero_grad()
        expected = reference(**batch)
        expected.loss.backward()
        got = frontend.run_sequential(stages, (), batch, loss_fn=lambda out: out.loss)
        torch.testing.assert_close(got.loss, expected.loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got.logits, expected.logits, rtol=1e-6, atol=1e-6)
        stage_parameters = {n: p for stage in stages for n, p in stage.named_parameters()}
        for name, parameter in reference.named_parameters():
            torch.testing.assert_close(
                stage_parameters[name].grad, parameter.grad, rtol=1e-6, atol=1e-6,
                msg=lambda message, name=name: f"gradient of {name}: {message}",
            )
        reference_optimizer.step()
        stage_optimizer.step()
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(
            stage_parameters[name], parameter, rtol=1e-6, atol=1e-6,
            msg=lambda message, name=name: f"{name} after 3 steps: {message}",
        )


def test_grouped_kv_heads_llama_is_bitwise_when_eager_takes_the_traced_path():
    """With padding in the batch, eager builds the mask and repeats the heads too: bitwise."""
    model, split, batch = _grouped_heads_llama(2)
    padded = {**batch, "attention_mask": batch["attention_mask"].clone()}
    padded["attention_mask"][0, -3:] = 0
    check_parity(model, split, kwargs=padded)
