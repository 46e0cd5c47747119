"""Checkpoints of FSDP x TP stages: a tiny GPT-2 at pp=1 x dp=2 x tp=2 (FSDP2 over "dp"), on 4 gloo ranks.

GPT-2's fused ``c_attn.bias`` is then strided over both mesh dims, a placement torch 2.13's
``full_tensor()`` gathers wrong (``conveyor.checkpoint.shards`` gathers one mesh dim at a time and
cuts back by each element's gathered position). After 2 AdamW steps the checkpoint loads into a
new pipeline with every local shard torch.equal to the saved one; ``to_state_dict`` and ``conveyor
export`` give whole Hugging Face weights torch.equal to the pipeline's (gathered one mesh dim at a
time), and ``from_pretrained`` on them gives the pipeline's logits within 1e-5 relative (tensor
parallelism sums the row-parallel projections in another order). The same at pp=2 x dp=2 x tp=2
(8 ranks) is the extended tier.
"""

from __future__ import annotations

import pytest
import torch

import conveyor.checkpoint as ckpt
from conveyor.cli import main
from conveyor.testing import run_ranks
from conveyor.testing.rigs.checkpoint_models import assert_same_tensors
from conveyor.testing.rigs.checkpoint_tensor_data_parallel import distinct_model, save_load_and_gather
from conveyor.testing.rigs.checkpoint_tensor_parallel import exported_logits

pytestmark = pytest.mark.distributed

# Relative: the exported weights on one device against the TP pipeline's logits, the same products summed in
# another order (the row-parallel projections' halves); the longest sum is a projection's inner dim, under
# the vocabulary's: conveyor.testing.compare.reordered_sum_bound(96) = 7.0e-6 for two computations of it.
LOGITS_TOLERANCE = 1e-5
PACKED_BIAS = "transformer.h.0.attn.c_attn.bias"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("ranks", [4, pytest.param(8, marks=pytest.mark.extended)], ids=["pp1", "pp2"])
def test_fsdp_x_tp_checkpoint_loads_shard_for_shard_and_exports_the_trained_weights(tmp_path, ranks):
    """CI twin of ``[pp2]``: ``[pp1]`` (the same assertions on 4 ranks)."""
    path = str(tmp_path / "step_2")
    results = run_ranks(save_load_and_gather, ranks, args=(path,), timeout_s=800)
    assert results[0]["placements"][PACKED_BIAS] == "(_StridedShard(dim=0, sf=2), _StridedShard(dim=0, sf=3))"
    trained: dict = {}
    for rank, result in enumerate(results):
        assert result["loaded_unequal"] == [], (rank, result["loaded_unequal"])
        for name, value in result["whole"].items():  # every rank of a stage gathered the same whole tensors
            assert name not in trained or torch.equal(trained[name], value), (rank, name)
            trained[name] = value
    assert PACKED_BIAS in results[0]["differed_before"]  # the load had something to do
    assert set(trained) == {n for n, _ in distinct_model(0).named_parameters()}
    state = ckpt.to_state_dict(path)
    assert list(state) == list(distinct_model(0).state_dict())
    assert_same_tensors({n: t for n, t in state.items() if n in trained}, trained, "to_state_dict")
    out = tmp_path / "exported"
    assert main(["export", path, str(out)]) == 0
    from safetensors.torch import load_file

    assert_same_tensors(load_file(out / "model.safetensors"), trained, "exported weights")
    logits, want = exported_logits(out), results[-1]["logits"]  # the last rank holds the last stage
    difference = ((logits - want).abs().max() / want.abs().max()).item()
    assert difference <= LOGITS_TOLERANCE, difference
