"""Tracing composes with tensor parallelism: traced stages of the unchanged model, sharded by its plan.

A traced stage has no Linear left (``conveyor.parallel.tensor.traced``), so its parameters are
distributed by the unchanged model's plan and its graph runs on DTensors. Against eager TP (the
same plan through ``parallelize_module``): the loss is bitwise equal; gradients agree to
rounding (~4e-7), because DTensor sums a replicated activation's partial gradients from its
several users (q, k and v) before the one all-reduce, where the eager styles all-reduce each
user's partial gradient and then add them.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.testing import run_ranks

from .tp_support import traced_parity, traced_pp_x_tp, traced_split_backward, traced_tp_alone

TOLERANCE = 1e-5


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["llama", "recipe:mpt"])
def test_traced_stages_match_eager_tensor_parallel(name):
    # MPT bakes its head count into the traced reshape and its ALiBi bias holds every head:
    # both stay right because a DTensor keeps the global shape.
    result = run_ranks(traced_parity, 2, args=(name,), timeout_s=240)[0]
    assert result["loss_equal"], result
    assert result["grads"] <= TOLERANCE, result
    assert "lm_head.weight" in result["sharded"]
    assert not any("embed" in n or "wte" in n for n in result["sharded"])  # kept whole in a traced stage


@pytest.mark.distributed
def test_a_traced_stage_holding_several_attention_layers():
    # Two decoder layers per stage: CPU attention's local output changes its memory layout after
    # the first call, which DTensor's reshape-as-view must not see (traced._keep_layouts_as_described).
    result = run_ranks(traced_parity, 2, args=("llama", 4), timeout_s=240)[0]
    assert result["loss_equal"] and result["grads"] <= TOLERANCE, result


@pytest.mark.distributed
def test_pp2_x_tp2_adds_nothing_to_tensor_parallel_alone():
    # The same traced TP stages, once on 2 ranks one after the other, once on 4 ranks as a
    # 2-stage pipeline whose TP ranks each talk to the matching TP rank: bitwise equal.
    alone = run_ranks(traced_tp_alone, 2, args=("llama",), timeout_s=240)
    piped = run_ranks(traced_pp_x_tp, 4, args=("llama",), timeout_s=240)
    for result in piped:
        want = alone[result["tp_rank"]]
        assert result["grads"] and all(torch.equal(g, want["grads"][n]) for n, g in result["grads"].items())
        if result["pp_rank"] == 1:
            assert torch.equal(result["loss"], want["loss"])


@pytest.mark.distributed
def test_weight_gradient_split_is_bitwise_on_a_traced_tensor_parallel_stage():
    result = run_ranks(traced_split_backward, 2, timeout_s=240)[0]
    assert result["inputs"] and result["names"] and result["unequal"] == [], result
