"""Regions traced as one operation (``torch.no_grad()``, autocast) take their modules' names along.

Before, the operations inside such a region carried no module path of the region's node, so a
split point naming its second module was moved past the whole region without a word, and one
naming its first module was "a module that never ran".
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import conveyor.frontend as frontend
from conveyor.layout import InProcessLayout
from conveyor.pipe import Pipeline


class FrozenMiddle(nn.Module):
    """``pre``, then two frozen linears under ``torch.no_grad()``, then ``head`` over both paths."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.pre = nn.Linear(width, width)
        self.f1 = nn.Linear(width, width)
        self.f2 = nn.Linear(width, width)
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.pre(x).relu()
        with torch.no_grad():
            frozen = self.f2(self.f1(hidden))
        return self.head(frozen + hidden)


def _parameter_names(stages) -> list[list[str]]:
    return [sorted(name for name, _ in stage.named_parameters()) for stage in stages]


def test_a_stage_may_start_at_the_region_and_runs_bitwise_as_the_model():
    torch.manual_seed(0)
    model = FrozenMiddle()
    x = torch.randn(4, 8)
    stages = frontend.split_model(model, 2, example_args=(x,), split_points=["f1"]).stage_modules()
    assert _parameter_names(stages) == [
        ["pre.bias", "pre.weight"],
        ["f1.bias", "f1.weight", "f2.bias", "f2.weight", "head.bias", "head.weight"],
    ]
    assert torch.equal(frontend.run_sequential(stages, (x,)), model(x))


def test_a_split_point_inside_the_region_is_refused_with_where_to_cut():
    model = FrozenMiddle()
    with pytest.raises(frontend.SplitError) as caught:
        frontend.split_model(model, 2, example_args=(torch.randn(4, 8),), split_points=["f2"])
    assert str(caught.value) == (
        "split point 'f2' runs inside a torch.no_grad() / torch.enable_grad() region, which is traced "
        "as one operation and cannot be cut; start the stage at the region (before 'f1') or after it."
    )


def test_the_balancer_keeps_the_region_in_one_stage():
    model = FrozenMiddle()
    x = torch.randn(4, 8)
    for num_stages in (2, 3):
        names = _parameter_names(frontend.split_model(model, num_stages, example_args=(x,)).stage_modules())
        holding = [i for i, stage in enumerate(names) if "f1.weight" in stage or "f2.weight" in stage]
        assert len(holding) == 1, names


def test_training_through_the_region_matches_one_device():
    torch.manual_seed(1)
    model = FrozenMiddle()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    stages = frontend.split_model(model, 2, example_args=(x[:4],), split_points=["f1"]).stage_modules()
    pipe = Pipeline(stages, "1f1b", nn.functional.mse_loss, microbatches=2, layout=InProcessLayout())
    pipe.step(x, target=y)
    for x_m, y_m in zip(x.chunk(2), y.chunk(2)):
        (nn.functional.mse_loss(reference(x_m), y_m) / 2).backward()
    got = dict(p for stage in stages for p in stage.named_parameters())
    for name, want in reference.named_parameters():
        if name.startswith(("f1.", "f2.")):
            assert want.grad is None and got[name].grad is None, name  # under no_grad: no gradient
        else:
            assert torch.equal(got[name].grad, want.grad), name


class _RootOpFirst(nn.Module):
    """The region starts with an operation of the model's own forward, then runs ``f1``."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.f1 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.pre(x)
        with torch.no_grad():
            frozen = self.f1(hidden * 2)
        return self.head(frozen + hidden)


def test_the_first_module_of_a_region_opened_by_the_models_own_code_may_start_a_stage():
    model = _RootOpFirst()
    x = torch.randn(4, 8)
    balanced = frontend.split_model(model, 2, example_args=(x,))
    named = frontend.split_model(model, 2, example_args=(x,), split_points=list(balanced.split_points))
    assert balanced.split_points == named.split_points == ("f1",)
    assert torch.equal(frontend.run_sequential(named.stage_modules(), (x,)), model(x))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(x).relu()


class _FrozenBottom(nn.Module):
    """Six blocks, the first three under one ``torch.no_grad()``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for block in self.blocks[:3]:
                x = block(x)
        for block in self.blocks[3:]:
            x = block(x)
        return x


def test_uniform_splitting_counts_every_block_a_region_holds():
    stages = frontend.split_model(_FrozenBottom(), 2, example_args=(torch.randn(4, 8),),
                                  split_method="uniform").stage_modules()
    blocks = [sorted({name.split(".")[1] for name, _ in stage.named_parameters()}) for stage in stages]
    assert blocks == [["0", "1", "2"], ["3", "4", "5"]]  # it was 4 / 2: the region counted as one block
