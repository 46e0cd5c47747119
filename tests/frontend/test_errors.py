"""Every user mistake and every untraceable model gets a message that names it and says the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import conveyor.frontend as frontend
from conveyor.errors import PipelineConfigError, SpecMismatchError
from conveyor.testing.models import Stack, gpt2, token_batch


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # Python branch on a tensor value: cannot be traced
            return self.linear(x)
        return x


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.before = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.before(x))


class MaskedSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x[x > 0].sum()  # shape depends on the data


def test_trace_failure_names_module_line_and_fix():
    with pytest.raises(frontend.TracingError) as caught:
        frontend.split_model(Gated(), 2, example_args=(torch.randn(2, 4),))
    message = str(caught.value)
    assert "could not trace Gated" in message
    assert "failed in module 'gate' (Gate)" in message
    assert "test_errors.py" in message and "if x.sum() > 0:" in message
    assert "branches on tensor values" in message and "torch.where" in message
    assert "build the stages by hand" in message
    assert isinstance(caught.value, PipelineConfigError) and isinstance(caught.value, ValueError)


def test_data_dependent_shape_names_operation_and_module():
    with pytest.raises(frontend.TracingError) as caught:
        frontend.split_model(MaskedSum(), 2, example_args=(torch.randn(2, 4),))
    message = str(caught.value)
    assert "operation aten.index.Tensor in module '<root>' (MaskedSum)" in message
    assert "return x[x > 0].sum()" in message
    assert "boolean indexing" in message


def test_hugging_face_cache_asked_for_in_example_kwargs_names_the_field_and_the_fix():
    # The config's use_cache is turned off for tracing; one the user passes is theirs to keep.
    model_class, config = gpt2(num_layers=1)
    with torch.device("meta"):
        model = model_class(config)
    batch = {"input_ids": token_batch()["input_ids"], "use_cache": True}
    with pytest.raises(frontend.TracingError) as caught:
        frontend.split_model(model, 2, example_kwargs=batch)
    message = str(caught.value)
    assert "returns a Hugging Face key/value cache (the past_key_values or cache field" in message
    assert "pass use_cache=False in example_kwargs" in message


class GatedLogits(nn.Module):
    """A Hugging Face model, then a Python branch on a tensor value: tracing fails after it."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids):
        logits = self.inner(input_ids=input_ids).logits
        if logits.sum() > 0:
            return logits
        return -logits


def test_failed_trace_puts_the_hugging_face_config_back():
    model_class, config = gpt2(num_layers=1)
    config.use_cache = True
    with torch.device("meta"):
        model = GatedLogits(model_class(config))
    with pytest.raises(frontend.TracingError, match="branches on tensor values"):
        frontend.split_model(model, 2, example_args=(token_batch()["input_ids"],))
    assert model.inner.config.use_cache is True


def test_split_point_typo_lists_close_names():
    with pytest.raises(frontend.SplitError) as caught:
        frontend.split_model(Gated(), 2, example_args=(torch.randn(2, 4),), split_points=["gat"])
    assert "split point 'gat' names no module of Gated. Close names: gate" in str(caught.value)


def test_split_point_errors():
    model = Stack(num_layers=4)
    x = (torch.randn(2, 8),)
    with pytest.raises(
        frontend.SplitError, match=r"3 stages need 2 split points .* got 1: \['2'\]"
    ):
        frontend.split_model(model, 3, example_args=x, split_points=["2"])
    with pytest.raises(
        frontend.SplitError, match=r"execution order: '1' \(operation 1\) does not start after '3'"
    ):
        frontend.split_model(model, 3, example_args=x, split_points=["3", "1"])
    with pytest.raises(frontend.SplitError, match="stage 0 would be empty"):
        frontend.split_model(model, 2, example_args=x, split_points=["0"])
    with pytest.raises(frontend.SplitError, match="never ran"):
        frontend.split_model(WithUnused(), 2, example_args=x, split_points=["unused"])


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        return self.first(x)


def test_more_stages_than_units():
    with pytest.raises(frontend.SplitError) as caught:
        frontend.split_model(Stack(num_layers=3), 4, example_args=(torch.randn(2, 8),))
    assert (
        "cannot split Stack into 4 stages with split_method='parameters': "
        "only 2 unit(s) can start a stage (1, 2), so at most 3 stages"
        in str(caught.value)
    )
    assert "pass split_points naming finer modules" in str(caught.value)


def test_unsplittable_keeps_cuts_out():
    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(8, 8)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

        def forward(self, x):
            x = self.embed(x)
            for block in self.blocks:
                x = block(x)
            return x

    x = (torch.randn(2, 8),)
    with pytest.raises(
        frontend.SplitError, match="cuts inside 'blocks', which is marked unsplittable"
    ):
        frontend.split_model(
            Blocks(), 2, example_args=x, split_points=["blocks.2"], unsplittable=["blocks"]
        )
    with pytest.raises(frontend.SplitError, match=r"only 1 unit\(s\) can start a stage \(blocks\)"):
        frontend.split_model(Blocks(), 3, example_args=x, unsplittable=["blocks"])
    split = frontend.split_model(Blocks(), 2, example_args=x, unsplittable=["blocks"])
    assert split.split_points == ("blocks",)
    with pytest.raises(
        frontend.SplitError,
        match="unsplittable module .block. names no module of Blocks. Close names: blocks",
    ):
        frontend.split_model(Blocks(), 2, example_args=x, unsplittable=["block"])


def test_bad_split_methods():
    x = (torch.randn(2, 8),)
    with pytest.raises(
        frontend.SplitError,
        match="split_method must be one of uniform, parameters, type:<regex>; got 'size'",
    ):
        frontend.split_model(Stack(), 2, example_args=x, split_method="size")
    with pytest.raises(frontend.SplitError, match="bad regular expression"):
        frontend.split_model(Stack(), 2, example_args=x, split_method="type:(")
    with pytest.raises(
        frontend.SplitError, match="no module class matches; classes that ran: Linear"
    ):
        frontend.split_model(Stack(), 2, example_args=x, split_method="type:Decoder")
    with pytest.raises(frontend.SplitError, match="num_stages must be a positive int; got 0"):
        frontend.split_model(Stack(), 0, example_args=x)
    # Measuring is the planner's: the frontend says where the time split lives.
    with pytest.raises(frontend.SplitError, match=r"conveyor\.plan\.time_split\.time_split"):
        frontend.split_model(Stack(), 2, example_args=x, split_method="time")


def test_stage_inputs_are_checked_against_the_example():
    split = frontend.split_model(Stack(num_layers=4), 2, example_args=(torch.randn(2, 8),))
    first, second = split.stage_modules()
    with pytest.raises(SpecMismatchError) as caught:
        first(torch.randn(3, 8))
    assert (
        "stage 0 input 'input': the model was split for tensor[2, 8] float32, got tensor[3, 8]"
        in str(caught.value)
    )
    assert "split with an example like this one" in str(caught.value)
    with pytest.raises(
        SpecMismatchError,
        match=r"split for 1 positional argument\(s\) and keyword arguments \[\]; got 1 positional and \['extra'\]",
    ):
        first(torch.randn(2, 8), extra=1)
    with pytest.raises(
        SpecMismatchError, match=r"stage 1 expects 1 values from stage 0 \(linear_1\); got 2"
    ):
        second(torch.randn(2, 8), torch.randn(2, 8))
    with pytest.raises(
        SpecMismatchError,
        match=r"stage 1 input 'linear_1': expected linear_1: \[2, 8\] float32, grad, got \[2, 8\] torch.float64",
    ):
        second(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(frontend.SplitError, match=r"stage must be in \[0, 2\); got 2"):
        split.stage_module(2)


def test_a_model_that_enters_autocast_in_forward_splits_and_matches_eager():
    # torch.export guards the `.float()` after the region with the dtype it saw on meta
    # tensors; the stages drop that guard and keep the cast, so the region works as in eager.
    class Autocast(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                x = self.layers[0](x)
            return self.layers[1](x.float())

    model = Autocast()
    x = torch.randn(2, 4)
    split = frontend.split_model(model, 2, example_args=(x,), split_points=["layers.1"])
    first, second = split.stage_modules()
    assert torch.equal(second(*first(x)), model(x))
