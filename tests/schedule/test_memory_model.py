"""The simulator's activation-memory model: what a split backward's I frees and its W keeps."""

from __future__ import annotations

import pytest

import conveyor.schedule as cs
from conveyor.errors import CostError


@pytest.mark.parametrize("name", sorted(cs.available()))
def test_weight_bytes_equal_to_the_activation_bytes_is_the_unit_model(name):
    compute = cs.executable(cs.build(name, ranks=4, microbatches=8)).compute
    costs = cs.CostModel.uniform(compute.num_stages, activation_bytes=3.0, weight_activation_bytes=3.0)
    unit_peaks = cs.simulate(compute).peak_activations()
    assert cs.simulate(compute, costs).peak_activation_bytes() == [3.0 * p for p in unit_peaks]


def test_i_frees_what_w_does_not_keep():
    # zb-h1, P=2, rank 1 runs F0 I0 F1 W0 I1 W1 ...: at F1, microbatch 0 holds only what W keeps.
    compute = cs.executable(cs.build("zb-h1", ranks=2, microbatches=4)).compute
    costs = cs.CostModel.per_stage([(1, 1, 1, 10.0), (1, 1, 1, 10.0, 4.0)])
    assert cs.simulate(compute, costs).peak_activation_bytes() == [20.0, 14.0]
    assert cs.simulate(compute).peak_activations() == [2, 2]  # counted whole until W: the bound


def test_w_cannot_keep_more_than_the_forward_saved():
    with pytest.raises(CostError, match="weight_activation_bytes"):
        cs.StageCosts(1, 1, 1, activation_bytes=2.0, weight_activation_bytes=3.0)
    assert cs.StageCosts(1, 1, 1, activation_bytes=2.0).weight_kept == 2.0
