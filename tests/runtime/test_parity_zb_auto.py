"""ZB-1p and ZB-2p searched for unequal costs (orders no handcrafted schedule has) run on
an in-process Pipeline bitwise like single-device gradient accumulation."""

from __future__ import annotations

import pytest
import torch

import conveyor.schedule as cs
from conveyor.schedule.builtin import zb_auto as za
from conveyor.testing.references.schedule_parity import NUM_STEPS, assert_same, reference_run

from .test_parity_local import run_local


# ZB-1p beats ZB-H1 once messages are slow (latency = T_F here); ZB-2p beats ZB-H2 sooner.
@pytest.mark.parametrize(
    ("name", "num_ranks", "num_microbatches", "latency"),
    [("zb-1p", 4, 8, 1.0), ("zb-2p", 2, 4, 0.2), ("zb-2p", 4, 8, 0.2)],
)
def test_searched_orders_are_bitwise_equal_to_one_device(name, num_ranks, num_microbatches, latency):
    costs = cs.CostModel.uniform(num_ranks, 1.0, 2.0, 0.3, latency=latency)  # T_W < T_F < T_I
    schedule = cs.build(name, ranks=num_ranks, microbatches=num_microbatches, costs=costs)
    limit = num_ranks if name == "zb-1p" else 2 * num_ranks
    assert za.search(num_ranks, num_microbatches, costs, limit).knobs is not None
    for handcrafted in ("zb-h1", "zb-h2"):  # a searched order, not a handcrafted one renamed
        assert schedule.programs != cs.build(handcrafted, ranks=num_ranks, microbatches=num_microbatches).programs
    want_losses, want_grads, want_params = reference_run(schedule)
    got_losses, got_grads, got_params = run_local(schedule)
    for step, (got, want) in enumerate(zip(got_losses, want_losses)):
        assert torch.equal(got, want), f"loss of step {step}: {got.item()} vs {want.item()}"
    for stage in range(schedule.num_stages):
        assert_same(f"stage {stage} grads after step 1", got_grads[stage], want_grads[stage])
        assert_same(f"stage {stage} params after {NUM_STEPS} AdamW steps", got_params[stage], want_params[stage])
