"""Tracing composes with tensor parallelism: traced stages of the unchanged model, sharded by its plan.

A traced stage has no Linear left (``conveyor.parallel.tensor.traced``), so its parameters are
distributed by the unchanged model's plan and its graph runs on DTensors. Against eager TP (the
same plan through ``parallelize_module``): the loss is within rounding (bitwise with AVX-512
kernels, not with ATen's AVX2 ones for MPT); gradients agree to rounding (~4e-7), because
DTensor sums a replicated activation's partial gradients from its several users (q, k and v)
before the one all-reduce, where the eager styles all-reduce each user's partial gradient and
then add them.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.testing import run_ranks
from conveyor.testing.compare import logsumexp_bound
from conveyor.testing.references.tensor_parallel import (
    TP_ROUNDING,
    VOCABULARY,
    traced_parity,
    traced_pp_x_tp,
    traced_split_backward,
    traced_tp_alone,
)
from conveyor.testing.references.tensor_pipeline import ADAMW_AFTER_STEPS, MICROBATCHES
from conveyor.testing.references.tied_tensor import TIED, tied_pp_x_tp, traced_loss_parallel

TOLERANCE = TP_ROUNDING  # derived in conveyor.testing.references.tensor_parallel
TOKENS_PER_MICROBATCH = 2 * 11  # 2 rows of 12 tokens, each predicting the next


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["llama", "recipe:mpt"])
def test_traced_stages_match_eager_tensor_parallel(name):
    # MPT bakes its head count into the traced reshape and its ALiBi bias holds every head:
    # both stay right because a DTensor keeps the global shape.
    result = run_ranks(traced_parity, 2, args=(name,), timeout_s=240)[0]
    # The traced graph and the eager modules reach different kernels for some ops: bitwise with this
    # machine's AVX-512 kernels, 1 ulp apart for MPT with ATen's AVX2 ones. Within TP's derived bound.
    assert result["loss"] <= TOLERANCE, result
    assert result["grads"] <= TOLERANCE, result
    # Both ends of the vocabulary sharded: the head colwise, the embedding vocab-parallel.
    assert "lm_head.weight" in result["sharded"]
    assert any(n.endswith(("embed_tokens.weight", "wte.weight")) for n in result["sharded"]), result["sharded"]


@pytest.mark.distributed
def test_a_traced_stage_holding_several_attention_layers():
    # Two decoder layers per stage: CPU attention's local output changes its memory layout after
    # the first call, which DTensor's reshape-as-view must not see (traced._keep_layouts_as_described).
    result = run_ranks(traced_parity, 2, args=("llama", 4), timeout_s=240)[0]
    assert result["loss"] <= TOLERANCE and result["grads"] <= TOLERANCE, result


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


@pytest.mark.distributed
@pytest.mark.parametrize("names", [("1f1b",), pytest.param(("1f1b", "zbv"), marks=pytest.mark.extended)],
                         ids=["1f1b", "1f1b-zbv"])
def test_tied_embedding_and_head_are_vocab_parallel_at_both_ends_of_the_pipeline(names):
    """CI twin of ``[1f1b-zbv]``: ``[1f1b]``, which checks the 1f1b half only; zbv's shared Parameter under TP
    has no smaller CI twin yet (its parts: tests/frontend/test_pipeline_models.py's GPT-2 under zbv, and
    test_tensor_parallel_pipeline.py's TP stages under zbv)."""
    # pp=2 x tp=2 traced GPT-2, 3 AdamW steps: 1f1b puts wte (stage 0) and lm_head (stage 1) on two
    # ranks, each TP shard's gradient summed with the matching TP rank's: bitwise TP alone. zbv puts
    # stages 0 and 3 on rank 0, where the two uses share one Parameter and accumulate in the
    # schedule's order (stage 3's and stage 0's backwards interleave), TP alone in microbatch
    # order: the losses stay bitwise, the parameters differ by rounding that AdamW's division by
    # the running RMS magnifies (as against one device, test_tensor_parallel_pipeline's bound).
    results = run_ranks(tied_pp_x_tp, 4, args=(names,), timeout_s=600)
    # On the meta device each TP rank draws the whole tp=1 value and keeps its rows (two halves of one
    # random matrix differ); the copy on stage 1 is drawn by the module owning the first name
    # (transformer.wte), so global ranks 0 and 2 (TP rank 0 of each stage) hold the same rows, as do
    # 1 and 3; equal again after a step.
    for shards in results[0]["meta"]["shards"]:
        (wte_0,), (wte_1,), (head_0,), (head_1,) = shards
        assert (wte_0[0], head_0[0]) == TIED and torch.equal(wte_0[1], head_0[1]) and torch.equal(wte_1[1], head_1[1])
        assert not torch.equal(wte_0[1], wte_1[1]) and wte_0[1].shape == (48, 32)
    assert len({result["meta"]["loss"] for result in results}) == 1
    by_position = {(r["1f1b"]["pp_rank"], r["1f1b"]["tp_rank"]): r for r in results}
    for (pp_rank, tp_rank), result in by_position.items():
        piped = result["1f1b"]
        assert piped["losses_equal_tp"] and piped["params_unequal_tp"] == [], piped
        assert piped["loss_rel"] <= TOLERANCE and piped["grad_rel"] <= TOLERANCE, piped  # one device
        assert piped["param_abs"] <= ADAMW_AFTER_STEPS, piped
        # Half the vocabulary's rows on each TP rank, at both ends.
        assert piped["tied_local_shapes"] == {TIED[pp_rank]: ((96, 32), (48, 32))}, piped
        # The tied group is per TP position: wte's shard gradient equals lm_head's of the same TP rank.
        partner = by_position[(1 - pp_rank, tp_rank)]["1f1b"]["tied_grads"][TIED[1 - pp_rank]]
        assert torch.equal(piped["tied_grads"][TIED[pp_rank]], partner)
        if "zbv" not in names:
            continue
        zbv = result["zbv"]
        assert zbv["shared"] and zbv["losses_equal_tp"] and zbv["grad_rel"] <= TOLERANCE, zbv
        assert zbv["param_abs_tp"] <= ADAMW_AFTER_STEPS and zbv["param_abs"] <= ADAMW_AFTER_STEPS, zbv
        assert zbv["tied_local_shapes"] == ({TIED[0]: ((96, 32), (48, 32))} if pp_rank == 0 else {}), zbv


@pytest.mark.distributed
def test_loss_parallel_on_traced_stages_keeps_the_logits_vocabulary_sharded():
    # The linears on a Shard(0) weight take their input whole (traced.colwise_linear), so the LM head's
    # logits leave sharded on the vocabulary, not Partial, and torch's loss_parallel() takes them: Llama's
    # own loss inside the traced graph, GPT-2's through a user loss_fn, which sees the sharded logits.
    # Against the gathered logits the cross-entropy is another computation: logsumexp's max, sum of exp and
    # log run shard by shard (loss_parallel) rather than over the whole vocabulary, so the loss is within
    # logsumexp_bound (derived in conveyor.testing.compare: 5e-6 at this loss, 22 tokens a microbatch) and
    # gradients within TP's rounding. (One CPU gave 0.0, an Intel AVX-512 one 1.04e-7.)
    results = run_ranks(traced_loss_parallel, 4, timeout_s=600)
    for rank, by_model in enumerate(results):
        for name, result in by_model.items():
            bound = logsumexp_bound(VOCABULARY, TOKENS_PER_MICROBATCH, result["loss"], MICROBATCHES)
            assert result["loss_rel_gathered"] <= bound, (rank, name, bound, result)
            assert result["grad_rel_gathered"] <= TOLERANCE and result["grad_rel_device"] <= TOLERANCE, result
        if rank >= 2:  # the last stage's ranks ran the loss
            assert by_model["gpt2"]["logits_placements"] == "(Shard(dim=2),)", by_model
