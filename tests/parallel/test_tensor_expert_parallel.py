"""Tensor x expert parallelism: the traced Mixtral with ``tensor_parallel="auto"`` and ``expert_parallel="auto"``.

pp=1 x dp=2 x tp=2 on 4 gloo ranks, two virtual stages a rank (the rank functions:
``conveyor.testing.references.tensor_experts``): TP shards the attention and the LM head; EP borrows its ranks
from dp x tp (ep=2: a stage's two TP ranks form a group, each taking its rows of the tokens into the experts and
keeping half of them); with and without sequence parallelism (each MoE block then takes the sequence gathered
and gives back this rank's rows). Against one device within the bounds derived below; each TP rank's losses and
dense results bitwise its peer's; saved, then loaded whole at pp=1 x dp=4 with neither. The extended tier runs pp=2 x
dp=2 x tp=2 (8 ranks) against the same two stages on one rank: bitwise.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.testing import run_ranks
from conveyor.testing.compare import adamw_difference_bound, reordered_sum_bound
from conveyor.testing.models.moe import MOE_VOCAB
from conveyor.testing.references.experts import DP, EP, LENGTH, MICROBATCHES, ROWS, STEPS
from conveyor.testing.references.tensor_experts import tensor_x_expert_parallel

LAYERS = 2
# Against one device, two computations of the same products whose sums differ in order:
# - EP (tests/parallel/test_expert_parallel.py derives these): a loss is a sum of DP x M microbatch means in
#   another association, and each row's expert output a GEMM over other rows (up to 2 GEMMs a layer); a
#   gradient element sums the minibatch's DP x ROWS x LENGTH = 64 tokens in another grouping, chained once per
#   layer's attention and experts on the way down (depth 2 x LAYERS).
# - TP: each layer's row-parallel o_proj adds two 16-term partial sums (a reordered 32-term sum) on the way up;
#   on the way down the vocabulary-parallel head's input gradient sums the vocabulary's 64 terms as two sums of
#   32, and each replicated activation its users' partial gradients over the TP ranks.
# The two add (condition 1: the terms' magnitudes no larger than the largest result).
LOSS_BOUND = (reordered_sum_bound(DP * MICROBATCHES) + reordered_sum_bound(32, depth=4 * LAYERS)
              + reordered_sum_bound(32, depth=2 * LAYERS))
GRADIENT_BOUND = (reordered_sum_bound(DP * ROWS * LENGTH, depth=2 * LAYERS)
                  + reordered_sum_bound(MOE_VOCAB, depth=2 * LAYERS))
# After STEPS AdamW steps: where a gradient is at rounding level AdamW turns its rounding into a step of up to
# lr (conveyor.testing.references.tensor_pipeline says why no tighter bound holds).
PARAMETER_BOUND = adamw_difference_bound(1e-2, STEPS)


def _check(result: dict, pp: int, checkpointed: bool = True) -> None:
    assert result["tp_peers_equal"] and result["finite"], result["tp_rank"]
    shapes = result["expert_shapes"]
    assert shapes and all(local[0] * EP == whole[0] for local, whole in shapes.values()), shapes
    sharded = result["sharded_by_tp"]
    assert any("q_proj" in n for n in sharded) and ("lm_head.weight" in sharded) == (result["pp_rank"] == pp - 1)
    if checkpointed:
        assert result["loaded"] == {"names": True, "equal": True}, result["loaded"]


@pytest.mark.distributed
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_tensor_and_expert_parallel_compose_within_the_derived_bounds_of_one_device(tmp_path, sequence_parallel):
    # With sequence parallelism (the checkpoint is the same as without, so it is checked once) each row-parallel
    # projection's two partial sums are reduce-scattered instead of all-reduced, and each gathered activation's
    # gradient reduce-scattered: two-term sums, the same in any order, so the bounds below hold as they are.
    saved = None if sequence_parallel else str(tmp_path / "saved")
    results = run_ranks(tensor_x_expert_parallel, 4, args=(1, saved, sequence_parallel), timeout_s=300)
    for result in results:
        _check(result, 1, checkpointed=saved is not None)
        assert result["moe_blocks_on_rows"] == (["model.layers.0.mlp", "model.layers.1.mlp"] if sequence_parallel
                                                else []), result["moe_blocks_on_rows"]
        against = result["against one device"]
        assert against["grads_compared"], against
        assert against["loss_rel"] <= LOSS_BOUND, (against, LOSS_BOUND)
        assert against["grad_rel"] <= GRADIENT_BOUND, (against, GRADIENT_BOUND)
        assert against["param_abs"] <= PARAMETER_BOUND, (against, PARAMETER_BOUND)
    # A stage's TP ranks keep different halves of the experts (each computes its own rows' share, none twice).
    assert {(r["dp_rank"], r["tp_rank"]): r["place"] for r in results} == {(0, 0): 0, (0, 1): 1, (1, 0): 0, (1, 1): 1}


@pytest.mark.distributed
@pytest.mark.extended
def test_pipelined_tensor_and_expert_parallel_is_bitwise_the_unpipelined(tmp_path):
    """CI twin: test_tensor_and_expert_parallel_compose_within_the_derived_bounds_of_one_device (the same two stages
    on one rank, the same layout otherwise); traced TP stages on two ranks against the same stages in turn are
    bitwise in tests/parallel/test_tensor_parallel_traced.py, EP's in tests/parallel/test_expert_parallel.py."""
    alone = {(r["dp_rank"], r["tp_rank"]): r
             for r in run_ranks(tensor_x_expert_parallel, 4, args=(1, str(tmp_path / "one")), timeout_s=300)}
    for result in run_ranks(tensor_x_expert_parallel, 8, args=(2, str(tmp_path / "two")), timeout_s=600):
        _check(result, 2)
        want = alone[result["dp_rank"], result["tp_rank"]]
        assert all(torch.equal(a, b) for a, b in zip(result["losses"], want["losses"], strict=True))
        assert result["grads"] and all(torch.equal(g, want["grads"][n]) for n, g in result["grads"].items())
        assert all(torch.equal(p, want["params"][n]) for n, p in result["params"].items())
