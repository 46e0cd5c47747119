"""Models built on the meta device: each stage allocates and initialises only its own tensors."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import conveyor.frontend as frontend
from conveyor.testing.models import gpt2, llama, token_batch
from conveyor.testing.references.unsplit import check_parity


@pytest.mark.parametrize("family", [gpt2, llama])
def test_meta_stages_load_into_a_real_model_bitwise(family):
    model_class, config = family(num_layers=4)
    with torch.device("meta"):
        meta_model = model_class(config)
    batch = token_batch()
    split = frontend.split_model(meta_model, 4, example_kwargs=batch, split_method="uniform")
    assert split.device == torch.device("cpu")
    stages = split.stage_modules()
    state = {}
    for stage in stages:
        for name, value in stage.state_dict().items():
            assert value.device.type == "cpu" and torch.isfinite(value).all(), name
            if name in state:  # a tied tensor: every copy has the same value
                assert torch.equal(state[name], value)
            state[name] = value
    assert (
        meta_model.get_parameter(split.stage_parameter_names(0)[0]).device.type == "meta"
    )  # untouched
    # Initialised like the model's own init: Hugging Face's std for weights, ones for norms.
    embedding = next(
        value for name, value in state.items() if "wte" in name or "embed_tokens" in name
    )
    assert 0.015 < embedding.std().item() < 0.025
    # The stages' tensors, loaded into a real model, give the same loss and gradients.
    real = model_class(config)
    real.load_state_dict(state, strict=True)
    for group in split.tied_groups:
        values = [stages[stage].get_parameter(name) for stage, name in group.uses]
        assert all(torch.equal(values[0], value) for value in values[1:])
    plan_real = frontend.split_model(real, 4, example_kwargs=batch, split_method="uniform")
    check_parity(real, plan_real, kwargs=batch)
    loss_meta = frontend.run_sequential(stages, (), batch).loss
    assert torch.equal(loss_meta, real(**batch).loss)


def test_meta_init_does_not_depend_on_the_split():
    model_class, config = llama(num_layers=4)
    with torch.device("meta"):
        meta_model = model_class(config)
    batch = token_batch()
    torch.manual_seed(11)
    two = frontend.split_model(meta_model, 2, example_kwargs=batch)
    torch.manual_seed(11)
    four = frontend.split_model(meta_model, 4, example_kwargs=batch, split_method="uniform")
    assert two.seed == four.seed == 11
    layer_in_two = two.stage_module(1).get_parameter("model.layers.3.mlp.up_proj.weight")
    layer_in_four = four.stage_module(3).get_parameter("model.layers.3.mlp.up_proj.weight")
    assert torch.equal(layer_in_two, layer_in_four)
    # Only that stage's tensors exist in the stage module.
    assert set(dict(four.stage_module(3).named_parameters())) == set(four.stage_parameter_names(3))


def test_meta_tensor_without_init_method_is_left_nan_with_a_warning(caplog):
    class HandInit(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
            self.gain = nn.Parameter(
                torch.ones(4)
            )  # set by hand in __init__: no init method knows it

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x * self.gain

    with torch.device("meta"):
        model = HandInit()
    split = frontend.split_model(model, 2, example_args=(torch.randn(3, 4),), split_method="uniform")
    with caplog.at_level(logging.WARNING, logger="conveyor.frontend.materialize"):
        last = split.stage_module(1)
    assert torch.isnan(last.get_parameter("gain")).all()
    assert torch.isfinite(last.get_parameter("layers.1.weight")).all()  # nn.Linear.reset_parameters
    assert "gain" in caplog.text and "left NaN (integers: their lowest value; bools: False) for loading" in caplog.text


def test_integer_and_bool_buffers_no_init_method_sets_are_left_loud_with_a_warning(caplog):
    class Positions(nn.Module):
        def __init__(self, n: int = 6, width: int = 4):
            super().__init__()
            self.register_buffer("position_ids", torch.arange(n)[None])  # computed in __init__
            self.register_buffer("keep", torch.tril(torch.ones(n, n, dtype=torch.bool)))
            self.positions = nn.Embedding(n, width)
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(2))

        def forward(self, x):
            x = x + self.positions(self.position_ids)
            x = (x @ x.transpose(1, 2)).masked_fill(~self.keep, float("-inf")).softmax(-1) @ x
            for layer in self.layers:
                x = layer(x)
            return x

    with torch.device("meta"):
        model = Positions()
    split = frontend.split_model(model, 2, example_args=(torch.randn(2, 6, 4),), split_points=["layers.1"])
    with caplog.at_level(logging.WARNING, logger="conveyor.frontend.materialize"):
        first = split.stage_module(0)
    # An index nobody set fails when used, instead of reading position 0 everywhere.
    assert (first.get_buffer("position_ids") == torch.iinfo(torch.int64).min).all()
    assert "position_ids, keep" in caplog.text
    with pytest.raises(IndexError):
        first(torch.randn(2, 6, 4))
