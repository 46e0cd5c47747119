"""Balancing: the partition of a row of weights, and each split_method on real modules."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import conveyor.frontend as frontend
from conveyor.frontend.balance import min_max_partition, partition
from conveyor.testing.models import Stack


def _parts(weights, cuts):
    bounds = [0, *cuts, len(weights)]
    return [sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])]


def test_partition_examples():
    assert partition([1, 1, 1, 1], 2, [True] * 4) == [2]
    assert partition([1, 1, 1, 1, 1, 1, 1], 4, [True] * 7) == [1, 3, 5]
    assert partition([5, 1, 1, 1, 1, 1], 2, [True] * 6) == [1]
    # Zero-weight segments never start a stage: they stay with the stage before.
    assert partition([0, 1, 1, 0, 1, 1, 0], 2, [w > 0 for w in [0, 1, 1, 0, 1, 1, 0]]) == [4]
    assert partition([3.0], 1, [True]) == []
    with pytest.raises(ValueError, match="cannot cut 3 segments with 2 allowed cuts into 4 parts"):
        partition([1, 1, 1], 4, [True] * 3)


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.integers(0, 20), min_size=1, max_size=9),
    num_parts=st.integers(1, 4),
    data=st.data(),
)
def test_partition_is_optimal(weights, num_parts, data):
    allowed = [True] + data.draw(
        st.lists(st.booleans(), min_size=len(weights) - 1, max_size=len(weights) - 1)
    )
    starts = [j for j in range(1, len(weights)) if allowed[j]]
    if num_parts - 1 > len(starts):
        with pytest.raises(ValueError):
            partition(weights, num_parts, allowed)
        return
    cuts = partition(weights, num_parts, allowed)
    assert (
        len(cuts) == num_parts - 1 and cuts == sorted(set(cuts)) and all(allowed[c] for c in cuts)
    )
    best = min(
        (max(_parts(weights, list(c))), sum(p * p for p in _parts(weights, list(c))))
        for c in itertools.combinations(starts, num_parts - 1)
    )
    got = _parts(weights, cuts)
    assert (max(got), sum(p * p for p in got)) == best


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.integers(0, 20), min_size=1, max_size=8),
    num_parts=st.integers(1, 4),
    factors=st.lists(st.integers(1, 3), min_size=4, max_size=4),
    limit=st.integers(5, 60),
)
def test_the_planners_partition_weighs_each_part_its_own_way_and_may_forbid_some(weights, num_parts, factors,
                                                                                 limit):
    # The planner's use: a part's cost depends on the part (its in-flight activations), inf forbids it.
    def cost(part, first, end):
        total = sum(weights[first:end]) * factors[part]
        return float("inf") if total > limit else float(total)

    def costs_of(cuts):
        bounds = [0, *cuts, len(weights)]
        return [cost(p, a, b) for p, (a, b) in enumerate(zip(bounds, bounds[1:]))]

    scores = [(max(costs_of(list(c))), sum(x * x for x in costs_of(list(c))))
              for c in itertools.combinations(range(1, len(weights)), num_parts - 1)]
    if not scores or min(scores)[0] == float("inf"):
        with pytest.raises(ValueError):
            min_max_partition(len(weights), num_parts, cost)
        return
    got = costs_of(min_max_partition(len(weights), num_parts, cost))
    assert (max(got), sum(x * x for x in got)) == min(scores)


class Mixed(nn.Module):
    """Blocks of two classes with very different sizes."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Wide(), Wide(), Narrow(), Narrow(), Narrow(), Narrow()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 512)
        self.down = nn.Linear(512, 32)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Narrow(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(32, 32)

    def forward(self, x):
        return torch.relu(self.linear(x))


def test_split_methods_on_mixed_blocks():
    model = Mixed()
    x = (torch.randn(256, 32),)
    assert frontend.split_model(model, 3, example_args=x, split_method="uniform").split_points == (
        "blocks.2",
        "blocks.4",
    )
    by_parameters = frontend.split_model(model, 3, example_args=x, split_method="parameters")
    assert by_parameters.split_points == ("blocks.1", "blocks.2")
    assert by_parameters.stage_weights == (33312.0, 33312.0, 4 * 1056.0)
    by_type = frontend.split_model(model, 2, example_args=x, split_method="type:^Narrow$")
    assert by_type.split_points == ("blocks.4",)  # two Narrow blocks per stage; Wide ones weigh 0
    assert by_type.stage_weights == (2.0, 2.0)
    # Balancing by measured time is the planner's (tests/plan/test_time_split.py).


def test_balanced_split_of_a_plain_stack():
    split = frontend.split_model(
        Stack(num_layers=8), 4, example_args=(torch.randn(2, 8),), split_method="uniform"
    )
    assert split.split_points == ("2", "4", "6")
    assert split.stage_weights == (2.0, 2.0, 2.0, 2.0)
