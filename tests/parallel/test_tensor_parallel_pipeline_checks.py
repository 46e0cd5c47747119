"""Tensor parallelism in a pipeline: bad input refused on every rank alike, before any step; hand-built
stages under the user's plan; clipping over TP shards; GPT-2's tied embedding and head on two stages."""

from __future__ import annotations

import pytest
import torch

from conveyor.testing import run_ranks
from conveyor.testing.references.tensor_parallel import TP_ROUNDING
from conveyor.testing.references.tensor_pipeline import (
    clipping_and_ties,
    hand_built_parity,
    hand_built_refusals,
    meta_model_shards,
    traced_refusals,
)

TOLERANCE = TP_ROUNDING  # derived in conveyor.testing.references.tensor_parallel

REFUSALS = {
    # case: parts of the message every rank raises
    "tp mesh, another tp size": ["DistributedLayout(tp=4) but the mesh's 'tp' dim has 2 ranks",
                                 "give the mesh alone"],
    "tensor_parallel, no tp dim": ["tensor_parallel='auto' needs tensor-parallel ranks, got a mesh with dims ('pp',)",
                                   "give tp=", "mesh_dim_names=('pp', 'tp')"],
    "pattern matching nothing": ["pattern(s) ['mlp.up'] match no module of any stage"],
    "size tp does not divide (stage 1)": ["found on rank 2", "stage 1: tensor parallel size tp=2 does not divide "
                                          "the out_features of fc (Linear), 33, which ColwiseParallel splits"],
    "a plan that is not ParallelStyles": ["maps 'fc' to str; it takes module-name patterns to torch ParallelStyles"],
    "auto cannot place a module (stage 1)": ["found on rank 2", "stage 1: tensor_parallel='auto' cannot place pre.0 "
                                             "(Linear): a projection (32 -> 32)", "give parallelize_stage"],
    "intermediate tp does not divide, auto (stage 1)": ["found on rank 2", "does not divide the intermediate (hidden) "
                                                        "size of the module (_Stage): 33 is not a multiple of 2"],
    "unknown dim name": ["conveyor knows 'pp', 'dp' and 'tp' only (got ['ep'])"],
    "mesh covering 2 of 4 ranks": ["the mesh pp=1 x tp=2 covers 2 ranks but the job has 4"],
}

TRACED_REFUSALS = {
    # conveyor.pipeline on an unchanged Llama (traced stages): refused from the model, before any step
    "vocabulary 97": "does not divide the vocabulary (embedding rows) of model.embed_tokens (Embedding): 97 is not a "
                     "multiple of 2",
    "key/value heads 1": "does not divide the number of key/value heads of model.layers.0.self_attn (LlamaAttention): "
                         "1 is not a multiple of 2",
    "pattern matching nothing": "pattern 'model.layers.*.mlp.up' matches no module of this LlamaForCausalLM",
}


@pytest.mark.distributed
def test_bad_tensor_parallel_input_is_refused_alike_on_every_rank_before_any_step():
    results = run_ranks(hand_built_refusals, 4, timeout_s=300)
    for case, parts in REFUSALS.items():
        messages = {result[case] for result in results}
        assert len(messages) == 1, (case, messages)  # the same message on every rank
        (message,) = messages
        assert message is not None, case
        for part in parts:
            assert part in message, (case, message)
    # data-dependent: at the first forward on stage 0's ranks, passed on to every rank with the same words
    odd = [result["sequence length tp does not divide (first step)"] for result in results]
    assert all("sharded on the sequence (dim 1), and tp=2 does not divide its length 5" in m for m in odd), odd
    # built: a good plan, "auto" with sequence parallelism on hand-built stages, and "auto" where a tp mesh
    # comes without a plan (its TP ranks never each run the whole stage)
    assert all(result["good plan"] is None and result["sequence_parallel with hand-built stages"] is None
               and result["tp mesh, no tensor_parallel: auto"] is None for result in results)


@pytest.mark.distributed
def test_bad_input_to_traced_stages_is_refused_alike_on_every_rank_before_any_step():
    results = run_ranks(traced_refusals, 4, timeout_s=300)
    for case, part in TRACED_REFUSALS.items():
        messages = {result[case] for result in results}
        assert len(messages) == 1 and part in next(iter(messages)), (case, messages)


@pytest.mark.distributed
def test_hand_built_stages_take_the_users_plan_and_sequence_parallel():
    results = run_ranks(hand_built_parity, 4, timeout_s=300)
    for result in results:
        for name, found in result.items():
            assert found["sharded"] == ["fc.bias", "fc.weight", "proj.weight"], (name, found)  # proj.bias: Replicate
            assert found["loss"] <= TOLERANCE and found["grads"] <= TOLERANCE, (name, found)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_clipping_counts_every_tp_shard_once_and_tied_copies_stay_equal(name):
    results = run_ranks(clipping_and_ties, 4, args=(name,), timeout_s=400)
    for result in results:
        assert result["loss"] <= TOLERANCE, result
        assert result["settled"] and result["norm"] <= TOLERANCE and result["grads"] <= TOLERANCE, result
    if name == "gpt2":
        assert results[0]["tied"] == [["transformer.wte.weight", "lm_head.weight"]]
        assert all(result["tied_equal"] for result in results)


def test_traced_stages_refuse_what_is_not_wired_yet():
    # Checked on the unchanged model before any rank communicates: the same on every rank.
    from conveyor.errors import PipelineConfigError
    from conveyor.layout import DistributedLayout
    from conveyor.parallel.tensor.stages import model_placements
    from conveyor.testing.references.tensor_parallel import build

    model = build("llama")
    # sequence_parallel=True and loss_parallel=True are taken (test_tensor_sequence_traced, ..._traced), MoE models'
    # too (each MoE block takes the whole sequence: test_tensor_expert_parallel); what the sequence-parallel plan
    # cannot place is refused (test_tensor_parallel_errors).
    assert model_placements(model, DistributedLayout(tp=2, sequence_parallel=True), 2)
    assert model_placements(model, DistributedLayout(tp=2, loss_parallel=True), 2)
    assert model_placements(build("mixtral"), DistributedLayout(tp=2, sequence_parallel=True), 2)
    mixed = build("llama")
    mixed.model.mixer = _Mixer()  # a learned mix of sequence positions between the blocks
    with pytest.raises(PipelineConfigError, match="sequence_parallel=True cannot place model.mixer"):
        model_placements(mixed, DistributedLayout(tp=2, sequence_parallel=True), 2)


class _Mixer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2, 3))


@pytest.mark.distributed
def test_a_meta_model_is_split_first_then_each_rank_keeps_only_its_shards():
    results = run_ranks(meta_model_shards, 4, timeout_s=300)
    for rank, result in enumerate(results):
        stage = rank // 2
        # per layer q/k/v/o + gate/up/down; the vocab-parallel embed_tokens on stage 0, lm_head on stage 1
        assert len(result["sharded"]) == 8, (stage, result)
        # every tensor is drawn whole as at tp=1 and sliced, one owning module at a time (the peak: one module)
        assert set(result["sharded"]) <= set(result["whole"]) and result["owners_per_call"] == 1, result
        assert result["storage_is_local"] and result["local_is_half"], result
        assert result["finite"] and result["replicated_equal"] and result["shards_differ"], result
    assert len({result["loss"] for result in results}) == 1
