"""Stages traced in both modes follow train() / eval() as the model does, on one set of tensors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import conveyor
import conveyor.frontend as frontend
from conveyor.errors import PipelineConfigError
from conveyor.testing import run_ranks
from conveyor.testing.models import SkipNet


def test_stages_of_both_modes_match_the_model_in_each_mode():
    torch.manual_seed(0)
    model = SkipNet().train()
    reference = copy.deepcopy(model)
    x = torch.randn(6, 8)
    split = frontend.split_model(model, 2, example_args=(x,), split_points=["up"])
    stages = split.stage_modules(both_modes=True)
    assert [stage.modes for stage in stages] == [(True, False), (True, False)]
    # Train mode: BatchNorm normalises by the batch and updates the model's running statistics.
    for stage in stages:
        stage.train()
    torch.manual_seed(1)
    got = frontend.run_sequential(stages, (x,))
    torch.manual_seed(1)
    want = reference(x)
    assert torch.equal(got[0], want[0]) and torch.equal(model.norm.running_mean, reference.norm.running_mean)
    # Eval mode: running statistics, no dropout; the same tensors (the stages hold the model's own).
    for stage in stages:
        stage.eval()
    reference.eval()
    got = frontend.run_sequential(stages, (x,))
    want = reference(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert "0.2, False)" in stages[1].code and torch.equal(frontend.run_sequential(stages, (x,))[0], got[0])
    stages[1].train()
    assert "0.2, True)" in stages[1].code
    assert stages[1].get_parameter("norm.weight") is model.norm.weight


def test_one_mode_only_by_default_and_the_error_says_how_to_get_both():
    model = SkipNet().train()
    x = torch.randn(6, 8)
    stages = frontend.split_model(model, 2, example_args=(x,), split_points=["up"]).stage_modules()
    assert stages[1].modes == (True,)
    stages[1].eval()
    with pytest.raises(PipelineConfigError, match=r"both_modes=True"):
        stages[1](*stages[0](x))


class _NormThenDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.mid = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(16, 2)

    def forward(self, x):
        return self.out(self.drop(torch.relu(self.mid(torch.relu(self.norm(self.inp(x)))))))


def _model_and_batch():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(3)
    return _NormThenDrop(), torch.randn(8, 8, generator=generator), torch.randn(8, 2, generator=generator)


def _train_then_evaluate(rank, world_size):
    torch.set_num_threads(1)
    model, x, y = _model_and_batch()
    pipe = conveyor.pipeline(model, example_args=(x[:2],), split_points=["mid"], schedule="1f1b",
                             microbatches=4, loss_fn=nn.functional.mse_loss,
                             options=conveyor.PipelineOptions(transfer=conveyor.TransferOptions(timeout_s=60), split=conveyor.SplitOptions(both_modes=True)))
    pipe.step(x, target=y)
    pipe.eval()
    evaluated = pipe.forward(x)
    pipe.train()
    pipe.step(x, target=y)  # back in train mode: dropout and batch statistics again
    return evaluated, {name: buffer.clone() for name, buffer in pipe.state_dict().items() if "running" in name}


def test_a_pipeline_of_both_modes_evaluates_as_the_model_does_after_training():
    torch.set_num_threads(1)
    model, x, y = _model_and_batch()
    for part in x.chunk(4):  # a step's forwards, microbatch by microbatch: the running statistics
        model(part)
    model.eval()
    with torch.no_grad():
        want = torch.cat([model(part) for part in x.chunk(4)])
    model.train()
    for part in x.chunk(4):
        model(part)
    (_, stats0), (evaluated, _) = run_ranks(_train_then_evaluate, 2, timeout_s=60)
    assert torch.equal(evaluated, want)
    assert torch.equal(stats0["norm.running_mean"], model.norm.running_mean)
    assert torch.equal(stats0["norm.running_var"], model.norm.running_var)
