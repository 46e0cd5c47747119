"""Graphs that are not a plain chain: late meeting encoders, skip connections, odd counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import conveyor.frontend as frontend
from conveyor.errors import PipelineConfigError
from conveyor.testing.models import SkipNet, Stack, TwoEncoders, two_encoder_batch
from conveyor.testing.references.unsplit import check_names, check_parity


def test_two_encoders_on_different_stages_bitwise():
    torch.manual_seed(0)
    model = TwoEncoders()
    batch = two_encoder_batch()
    split = frontend.split_model(model, 3, example_args=batch, split_points=["embed", "text.2"])
    assert split.stage_parameter_names(0) == (
        "image.0.weight",
        "image.0.bias",
        "image.2.weight",
        "image.2.bias",
    )
    assert all(
        name.startswith(("embed.", "text.0.", "text.1.")) for name in split.stage_parameter_names(1)
    )
    # The image features cross stage 1 untouched; mask and labels are inputs used late.
    image_features = split.stage_output_specs(0)[-1]
    assert image_features.shape == (3, 16) and image_features.requires_grad
    assert image_features in split.stage_output_specs(1)
    assert [spec.name for spec in split.stage_output_specs(0)] == [
        "tokens",
        "mask",
        "labels",
        image_features.name,
    ]
    stages = check_parity(model, split, batch, loss_fn=lambda out: out["loss"])
    check_names(model, split, stages)


def test_skip_connections_train_mode_bitwise():
    torch.manual_seed(0)
    model = SkipNet().train()  # BatchNorm updates its statistics, Dropout draws masks
    x = torch.randn(6, 8)
    split = frontend.split_model(model, 4, example_args=(x,), split_method="uniform")
    # Blocks are down.0-2 and up.0-2; ties go to the split with lighter early stages.
    assert split.split_points == ("down.1", "down.2", "up.1")
    assert split.stage_weights == (1.0, 1.0, 2.0, 2.0)
    # Every skip made before a cut is carried to the up block that uses it.
    carried = [[spec.name for spec in split.stage_output_specs(stage)] for stage in range(3)]
    assert carried == [["relu"], ["relu", "relu_1"], ["relu", "relu_1", "add"]]
    stages = check_parity(model, split, (x,), loss_fn=lambda out: out[0].sum() + out[1], seed=7)
    check_names(model, split, stages)
    assert torch.equal(stages[-1].get_buffer("norm.num_batches_tracked"), torch.tensor(1))


def test_in_place_op_on_a_received_tensor():
    torch.manual_seed(0)
    model = SkipNet().train()
    x = torch.randn(6, 8)
    # middle.1 is ReLU(inplace=True): right after this cut it updates a received leaf,
    # which autograd forbids; the stage clones it first (values and gradients unchanged).
    split = frontend.split_model(model, 2, example_args=(x,), split_points=["middle.1"])
    assert "aten.clone" in split.stage_module(1).code
    check_parity(model, split, (x,), loss_fn=lambda out: out[0].sum() + out[1], seed=7)


def test_seven_layers_into_four_stages_drops_nothing():
    model = Stack(num_layers=7)
    x = torch.randn(2, 8)
    for method in ("uniform", "parameters", "type:Linear"):
        split = frontend.split_model(model, 4, example_args=(x,), split_method=method)
        per_stage = [len(split.stage_parameter_names(stage)) // 2 for stage in range(4)]
        assert sorted(per_stage) == [1, 2, 2, 2], method
        held = [name for stage in range(4) for name in split.stage_parameter_names(stage)]
        assert sorted(held) == sorted(model.state_dict()), method
        assert torch.equal(frontend.run_sequential(split, (x,)), model(x))


def test_unused_modules_and_eval_buffers_still_land_on_a_stage():
    class WithSpare(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
            self.norm = nn.BatchNorm1d(4)
            self.spare = nn.Linear(4, 4)  # never called
            self.register_buffer("scale", torch.tensor(2.0), persistent=False)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.norm(x) * self.scale

    model = WithSpare().eval()  # in eval mode BatchNorm does not read num_batches_tracked
    x = torch.randn(3, 4)
    split = frontend.split_model(model, 3, example_args=(x,), split_method="uniform")
    held = {
        name
        for stage in range(3)
        for name in split.stage_parameter_names(stage) + split.stage_buffer_names(stage)
    }
    assert held == {name for name, _ in model.named_parameters()} | {
        name for name, _ in model.named_buffers()
    }
    assert "norm.num_batches_tracked" in split.stage_buffer_names(2)
    assert "spare.weight" in split.stage_parameter_names(2)  # next to the tensor before it (norm)
    stages = split.stage_modules()
    assert "scale" not in stages[-1].state_dict()  # non-persistent stays non-persistent
    assert torch.equal(frontend.run_sequential(stages, (x,)), model(x))


def test_module_called_on_two_stages_is_reported_tied():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = nn.Linear(4, 4)
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, x):
            x = self.shared(x)
            for block in self.blocks:
                x = block(x)
            return F.mse_loss(self.shared(x), torch.zeros_like(x))

    torch.manual_seed(0)
    model = Shared()
    x = torch.randn(3, 4)
    split = frontend.split_model(model, 2, example_args=(x,), split_points=["blocks.1"])
    assert [(group.names, group.uses) for group in split.tied_groups] == [
        (("shared.weight",), ((0, "shared.weight"), (1, "shared.weight"))),
        (("shared.bias",), ((0, "shared.bias"), (1, "shared.bias"))),
    ]
    check_parity(model, split, (x,), loss_fn=lambda out: out)


def test_stage_module_builds_one_stage_on_demand():
    model = Stack(num_layers=4)
    x = torch.randn(2, 8)
    split = frontend.split_model(model, 2, example_args=(x,))
    stage = split.stage_module(1)
    assert isinstance(stage, frontend.StageModule) and (stage.stage, stage.num_stages) == (1, 2)
    assert sorted(stage.state_dict()) == ["2.bias", "2.weight", "3.bias", "3.weight"]
    # Untied tensors already on the stage's device are the model's own (no copy).
    assert stage.get_parameter("2.weight") is model[2].weight
    assert "aten.linear" in stage.code
    hidden = split.stage_module(0)(x)
    assert isinstance(hidden, tuple) and len(hidden) == 1
    assert torch.equal(stage(*hidden), model(x))


def test_eval_mode_needs_its_own_trace():
    torch.manual_seed(0)
    model = SkipNet().train()
    x = torch.randn(6, 8)
    split = frontend.split_model(model, 2, example_args=(x,), split_points=["up"])
    stages = split.stage_modules()
    stages[1].eval()
    with pytest.raises(
        PipelineConfigError,
        match=r"traced with the model in train mode and is now in eval mode.*split.with_mode\(training=False\)",
    ):
        stages[1](*stages[0](x))
    evaluation = split.with_mode(training=False)
    assert model.training and not evaluation.training
    assert evaluation.split_points == ("up",) and evaluation.stage_parameter_names(
        1
    ) == split.stage_parameter_names(1)
    eval_stages = evaluation.stage_modules()
    assert not eval_stages[0].training
    model.eval()
    try:
        expected = model(x)
    finally:
        model.train()
    got = frontend.run_sequential(eval_stages, (x,))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_in_place_op_on_a_view_of_a_received_tensor():
    class ScaleFirstColumn(nn.Module):
        def forward(self, x):
            x[:, 0].mul_(2)  # in place, through a view of the input
            return x

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(4, 4)
            self.scale = ScaleFirstColumn()
            self.last = nn.Linear(4, 4)

        def forward(self, x):
            return self.last(self.scale(self.first(x))).sum()

    torch.manual_seed(0)
    model = Model()
    x = torch.randn(3, 4)
    split = frontend.split_model(model, 2, example_args=(x,), split_points=["scale"])
    assert "aten.clone" in split.stage_module(1).code
    check_parity(model, split, (x,), loss_fn=lambda out: out)


def test_single_stage_keeps_both_names_of_a_tied_tensor():
    from conveyor.testing.models import gpt2, token_batch

    model_class, config = gpt2(num_layers=2)
    model = model_class(config)
    batch = token_batch()
    split = frontend.split_model(model, 1, example_kwargs=batch)
    assert split.tied_groups == () and split.split_points == ()
    (stage,) = check_parity(model, split, kwargs=batch)
    assert {"lm_head.weight", "transformer.wte.weight"} <= set(stage.state_dict())
    assert stage.get_parameter("lm_head.weight") is stage.get_parameter("transformer.wte.weight")
    check_names(model, split, [stage])


class _ReturnsItsState(nn.Module):
    """Returns a learned temperature and a buffer as they are, beside the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
        self.log_temperature = nn.Parameter(torch.zeros(()))
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> dict:
        for layer in self.layers:
            x = layer(x)
        return {"logits": x, "log_temperature": self.log_temperature, "scale": self.scale}


@pytest.mark.parametrize("num_stages", [1, 2])
def test_a_parameter_or_buffer_returned_as_it_is_lands_on_the_last_stage(num_stages):
    torch.manual_seed(0)
    model = _ReturnsItsState()
    x = torch.randn(4, 4)
    split = frontend.split_model(model, num_stages, example_args=(x,),
                                split_points=["layers.2"] if num_stages == 2 else None)
    assert {"log_temperature", "scale"} <= set(split.stage_module(num_stages - 1).state_dict())

    def loss(out):
        return (out["logits"] * out["log_temperature"].exp() * out["scale"]).sum()

    check_parity(model, split, (x,), loss_fn=loss)


class _MadeInForward(nn.Module):
    """Multiplies by a tensor made inside forward (torch.export lifts it as ``lifted_tensor_0``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * torch.tensor([1.0, 2.0, 3.0, 4.0]))


def test_a_constant_made_inside_forward_is_held_once_under_the_reserved_name():
    torch.manual_seed(0)
    model = _MadeInForward()
    x = torch.randn(3, 4)
    split = frontend.split_model(model, 2, example_args=(x,), split_points=["b"])
    first, second = split.stage_modules()
    # One buffer, not a second copy under the exported name beside it.
    assert [name for name, _ in first.named_buffers()] == ["_conveyor_constants.lifted_tensor_0"]
    assert list(second.named_buffers()) == []
    check_parity(model, split, (x,), loss_fn=lambda out: out.sum())


class _SharedNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.norm = nn.Linear(8, 8), nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.b(self.norm(self.a(x))))


@pytest.mark.parametrize("training", [True, False])
def test_running_statistics_updated_on_two_stages_are_named_in_a_warning(caplog, training):
    import logging

    model = _SharedNorm().train(training)
    with caplog.at_level(logging.WARNING, logger="conveyor.frontend.split"):
        frontend.split_model(model, 2, example_args=(torch.randn(4, 8),), split_points=["b"])
    warned = "norm.running_mean (stages 0, 1), norm.running_var (stages 0, 1)" in caplog.text
    assert warned == training  # in eval mode nothing is updated: nothing to warn of
