"""split_method="time": the planner measures, the frontend cuts at the split points it is handed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import conveyor.frontend as frontend
from conveyor.errors import SplitError
from conveyor.plan.time_split import profile_stages, time_split
from conveyor.testing.models import Stack
from tests.frontend.test_balance import Mixed  # blocks of two very different costs


def test_a_time_split_gives_each_costly_block_its_own_stage():
    torch.manual_seed(0)
    model = Mixed()
    x = (torch.randn(256, 32),)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    chosen = time_split(model, 3, example_args=x, repeats=2)
    # A Wide block costs far more than a Narrow one (16x the multiply-adds), so each gets its own stage.
    assert chosen.split_points[0] == "blocks.1"
    assert len(chosen.stage_seconds) == 3 and all(seconds > 0 for seconds in chosen.stage_seconds)
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    split = frontend.split_model(model, 3, example_args=x, split_points=chosen.split_points)
    assert torch.equal(frontend.run_sequential(split, x), model(*x))


def test_profile_stages_leaves_the_model_unchanged():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 8)).train()
    x = torch.randn(4, 8)
    split = frontend.split_model(model, 2, example_args=(x,), split_points=["2"])
    before = {name: value.clone() for name, value in model.state_dict().items()}
    rng = torch.get_rng_state()
    costs = profile_stages(split, (x,), None, torch.device("cpu"))
    assert len(costs) == 2 and all(cost > 0 for cost in costs)
    assert all(parameter.grad is None for parameter in model.parameters())
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())


def test_a_time_split_needs_real_values():
    with torch.device("meta"):
        model = Stack()
    with pytest.raises(SplitError, match="example inputs must hold real values"):
        time_split(model, 2, example_args=(torch.randn(2, 8, device="meta"),))
    with pytest.raises(SplitError, match="parameters are on the meta device; build it on a real device"):
        time_split(model, 2, example_args=(torch.randn(2, 8),))
    with pytest.raises(SplitError, match="cannot split Stack into 9 stages with split_method='time'"):
        time_split(Stack(), 9, example_args=(torch.randn(2, 8),), repeats=1)


def test_a_pipeline_cut_by_time_runs_the_planner_s_split_points():
    import conveyor

    torch.manual_seed(0)
    model = Mixed()
    x, target = torch.randn(64, 32), torch.zeros(64, 32)
    options = conveyor.PipelineOptions(split=conveyor.SplitOptions(method="time"))
    pipe = conveyor.pipeline(model, example_args=(x[:16],), schedule="1f1b", microbatches=4,
                             loss_fn=nn.functional.mse_loss, layout=conveyor.InProcessLayout(ranks=2), options=options)
    assert "cut at ['blocks." in pipe.model.signature
    assert torch.isfinite(pipe.step(x, target=target))
