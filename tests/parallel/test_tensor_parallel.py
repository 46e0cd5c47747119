"""Tensor parallelism (tp=2, gloo) on unchanged Hugging Face models, against the same model on one device.

Every rank computes the one-device reference itself from the same seed, then the TP model's
loss and gradients (``full_tensor()``). TP changes the summation order in three places only:
the row-parallel projections (o_proj/down_proj/c_proj: each rank sums its half of the inner
dim, then the all-reduce adds the halves), the replicated activations' gradients (the colwise
q/k/v, gate/up and head inputs: each rank's partial input gradient, all-reduced), and the
vocab-parallel embedding's gradient scatter. The forward loss is bitwise here; gradients agree
to ~5e-7 relative. The vocab-parallel embedding's forward is exact (one rank holds each row,
the others add zeros).
"""

from __future__ import annotations

import pytest

from conveyor.testing import run_ranks
from conveyor.testing.references.tensor_parallel import (
    MODELS,
    RECIPES,
    TP_ROUNDING,
    manual_stage_plan,
    mesh_layouts,
    meta_shards,
    split_backward_parity,
    tp_parity,
)

TOLERANCE = TP_ROUNDING  # derived in conveyor.testing.references.tensor_parallel
# What "auto" shards in each 2-layer model (parameters that become Shard/_StridedShard DTensors).
SHARDED = {
    "gpt2": 13,  # wte (tied lm_head), per layer c_attn w+b (q|k|v strided), c_proj w, c_fc w+b, mlp c_proj w
    "llama": 16,  # embed, head, per layer q/k/v/o + gate/up/down
    "qwen2": 22,  # as llama, plus q/k/v biases
    "mixtral": 10,  # embed, head, per layer q/k/v/o; router and experts stay whole
    "recipe:gpt": 13,  # conveyor train's recipes: GPT-2 as above
    "recipe:llama": 16,
    "recipe:mpt": 9,  # wte (tied head), per layer fused Wqkv (a Linear, strided), out_proj, up, down
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", MODELS + RECIPES)
def test_auto_plan_matches_one_device(name):
    result = run_ranks(tp_parity, 2, args=(name,), timeout_s=200)[0]
    assert result["values_equal"], "parallelizing changed a parameter's value"
    assert result["loss"] <= TOLERANCE, result
    assert result["grads"] <= TOLERANCE, result
    assert len(result["sharded"]) == SHARDED[name], result["sharded"]
    if name == "gpt2":  # the tied head is the embedding's parameter, named once; q|k|v packed per rank
        assert result["tied"] and "lm_head.weight" not in result["sharded"]
        assert {"transformer.wte.weight", "transformer.h.0.attn.c_attn.weight"} <= set(result["sharded"])


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["llama", "gpt2", "recipe:mpt"])
def test_sequence_parallel_matches_one_device(name):
    # Norms and dropout run on sequence shards; each block gathers its input and
    # reduce-scatters its output (the same sums as the all-reduce, another split of the work).
    result = run_ranks(tp_parity, 2, args=(name, True), timeout_s=200)[0]
    assert result["loss"] <= TOLERANCE and result["grads"] <= TOLERANCE, result
    assert len(result["sharded"]) == SHARDED[name]


@pytest.mark.distributed
def test_loss_parallel_keeps_the_logits_sharded_under_the_models_own_loss():
    result = run_ranks(tp_parity, 2, args=("llama", False, True), timeout_s=200)[0]
    assert result["loss"] <= TOLERANCE and result["grads"] <= TOLERANCE, result


@pytest.mark.distributed
def test_weight_gradient_split_is_bitwise_on_a_tensor_parallel_stage():
    result = run_ranks(split_backward_parity, 2, timeout_s=200)[0]
    assert result["input"] and result["names"]
    assert result["unequal"] == []
    assert result["sharded_grads"] == 15  # 16 sharded parameters; the embedding is unused (inputs_embeds)


@pytest.mark.distributed
def test_mesh_layout_reads_tp_innermost_and_refuses_what_cannot_work():
    results = run_ranks(mesh_layouts, 4, timeout_s=120)
    # (pp_ranks, dp_ranks, tp_ranks, pp_rank, dp_rank, tp_rank, tp_size, has tp mesh), per rank
    assert [r["pp_tp"] for r in results] == [
        ([0, 2], [0], [0, 1], 0, 0, 0, 2, True), ([1, 3], [1], [0, 1], 0, 0, 1, 2, True),
        ([0, 2], [2], [2, 3], 1, 0, 0, 2, True), ([1, 3], [3], [2, 3], 1, 0, 1, 2, True),
    ]
    assert [r["pp_dp_tp"] for r in results] == [r["pp_tp"] for r in results]
    assert [r["dp_pp"] for r in results] == [
        ([0, 1], [0, 2], [], 0, 0, 0, 1, False), ([0, 1], [1, 3], [], 1, 0, 0, 1, False),
        ([2, 3], [0, 2], [], 0, 1, 0, 1, False), ([2, 3], [1, 3], [], 1, 1, 0, 1, False),
    ]
    for result in results:  # every rank refuses alike
        assert "conveyor knows 'pp', 'dp' and 'tp' only (got ['ep'])" in result["unknown"]
        assert "'tp' must be the innermost (last) dim" in result["order"]
        assert "mesh_dim_names=('pp', 'tp')" in result["order"]
        assert "pp=1 x tp=2 covers 2 ranks but the job has 4" in result["world"]


@pytest.mark.distributed
def test_a_model_on_the_meta_device_materializes_only_each_ranks_shards():
    results = run_ranks(meta_shards, 2, timeout_s=120)
    assert results[0] == results[1] and len(results[0]) == 16
    shapes = {name: (whole_shape, local) for name, whole_shape, local, device in results[0]}
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == ((32, 32), (16, 32))
    assert shapes["model.layers.0.mlp.down_proj.weight"] == ((32, 48), (32, 24))
    assert shapes["model.embed_tokens.weight"] == ((96, 32), (48, 32))
    assert {device for *_, device in results[0]} == {"cpu"}


@pytest.mark.distributed
def test_a_manual_stage_takes_the_users_plan():
    result = run_ranks(manual_stage_plan, 2, timeout_s=120)[0]
    assert result["sharded"] == ["fc.bias", "fc.weight", "proj.bias", "proj.weight"]  # proj.bias: Replicate
    assert result["input"] <= TOLERANCE and result["grads"] <= TOLERANCE, result
