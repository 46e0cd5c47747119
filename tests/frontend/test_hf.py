"""Hugging Face models built from tiny configs, split unchanged, bitwise equal to the unsplit model."""

from __future__ import annotations

import pytest
import torch

import conveyor.frontend as frontend

from .models import gpt2, llama, token_batch
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
    plan = frontend.split_model(
        gpt2_model, num_stages, example_kwargs=batch, split_method="uniform"
    )
    expected_points = {
        2: ("transformer.h.2",),
        4: ("transformer.h.1", "transformer.h.2", "transformer.h.3"),
    }
    assert plan.split_points == expected_points[num_stages]
    # Dropout is on (train mode): same seed, same operations in the same order -> same masks.
    stages = check_parity(gpt2_model, plan, kwargs=batch, seed=3)
    check_names(gpt2_model, plan, stages)

    (tied,) = plan.tied_groups
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
    plan = frontend.split_model(
        llama_model, num_stages, example_kwargs=batch, split_method="uniform"
    )
    assert plan.tied_groups == ()
    stages = check_parity(llama_model, plan, kwargs=batch)
    check_names(llama_model, plan, stages)
    # labels and attention_mask are passed through to the stages that use them.
    for stage in range(num_stages - 1):
        names = [spec.name for spec in plan.stage_output_specs(stage)]
        assert "labels" in names
    last_inputs = plan.stage_input_specs(num_stages - 1)
    hidden = [spec for spec in last_inputs if spec.requires_grad]
    assert len(hidden) == 1 and hidden[0].shape == (2, 12, 32)


def test_llama_parameters_balance_puts_embedding_and_head_on_the_ends(llama_model):
    batch = token_batch()
    plan = frontend.split_model(llama_model, 2, example_kwargs=batch)  # split_method="parameters"
    counts = [
        sum(llama_model.get_parameter(name).numel() for name in plan.stage_parameter_names(stage))
        for stage in range(2)
    ]
    assert plan.split_points == ("model.layers.2",)
    embedding = 96 * 32
    layer = 32 * 32 + 2 * (32 * 16) + 32 * 32 + 3 * (32 * 48) + 2 * 32  # attention, mlp, 2 norms
    assert counts == [embedding + 2 * layer, 2 * layer + 32 + embedding]
    assert plan.stage_weights == tuple(float(count) for count in counts)
