"""Checkpoints of tensor-parallel stages: saved at pp=2 x tp=2, loaded at pp=4, pp=2 x dp=2, pp=1 x tp=2.

A tiny GPT-2 (column, row and packed q|k|v shards, replicated norms, a tied embedding) trains
2 AdamW steps at pp=2 x tp=2 and is saved: DCP writes each DTensor shard by its holder, under
the unsplit model's names and global shapes. The checkpoint then loads, parameters and optimizer
state torch.equal to what was saved, at pp=4 (tp=1: whole tensors), at pp=2 x dp=2 (ddp
replicas) and at pp=1 x tp=2 (one stage, sharded); the one saved again at pp=4 loads at tp=2
too, and a checkpoint of a wider GPT-2 is refused on both ranks alike. Resume is bitwise:
2 steps, save, load, 2 steps gives the losses and parameters of 4 uninterrupted steps.
``to_state_dict`` and ``conveyor export`` give whole Hugging Face weights, torch.equal to the
trained pipeline's; ``from_pretrained`` on them gives the pipeline's logits within 1e-5
relative (tensor parallelism sums the row-parallel projections in another order: ~3e-7 here).
One launch of 4 ranks and one of 2.
"""

from __future__ import annotations

import pytest
import torch

import conveyor.checkpoint as ckpt
from conveyor.cli import main
from conveyor.testing import run_ranks
from conveyor.testing.rigs.checkpoint_models import assert_same_tensors
from conveyor.testing.rigs.checkpoint_tensor_parallel import (
    TIED,
    build_model,
    exported_logits,
    load_at_pp1_tp2,
    save_resume_and_reshard,
    trace_once_here,
)

pytestmark = pytest.mark.distributed

# Relative: the exported weights on one device against the TP pipeline's logits, the same products summed in
# another order (the row-parallel projections' halves); the longest sum is a projection's inner dim, under
# the vocabulary's: conveyor.testing.compare.reordered_sum_bound(96) = 7.0e-6 for two computations of it.
LOGITS_TOLERANCE = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _traced_once_here():
    trace_once_here()


def _merge(parts):
    """Every rank's (parameters, optimizer state) as one model's; copies of a tensor must be equal."""
    params, states = {}, {}
    for rank_params, rank_states in parts:
        for name, value in rank_params.items():
            assert name not in params or torch.equal(params[name], value), f"copies of {name} differ"
            params[name] = value
        for name, value in rank_states.items():
            assert name not in states or all(torch.equal(states[name][k], v) for k, v in value.items()), name
            states[name] = value
    return params, states


def _assert_same(got, want, what):
    assert_same_tensors(got[0], want[0], f"{what} parameters")
    assert_same_tensors(got[1], want[1], f"{what} optimizer state")


@pytest.mark.timeout(900)  # two launches of ranks, five GPT-2 pipelines traced and parallelized on each rank
def test_tp_shards_reshard_to_every_layout_resume_bitwise_and_export(tmp_path):
    paths = {name: str(tmp_path / name) for name in ("step_2", "step_4", "pp4", "dp2")}
    ranks = run_ranks(save_resume_and_reshard, 4, args=(paths,), timeout_s=480)
    saved = _merge([rank["saved"] for rank in ranks])
    assert set(saved[0]) == {TIED.get(n, n) for n, _ in build_model().named_parameters()}
    assert set(saved[1]) == set(saved[0])  # every parameter has AdamW state
    for rank, result in enumerate(ranks):
        assert result["extra"] == {"step": 2}, rank
        want, got = result["resume_losses"]
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (rank, got, want)
        _assert_same(result["resume_after"][1], result["resume_after"][0], f"rank {rank} after resuming")
    _assert_same(_merge([rank["resumed"] for rank in ranks]), saved, "pp=2 x tp=2 (a new pipeline)")
    _assert_same(_merge([rank["pp4"] for rank in ranks]), saved, "pp=4, tp=1")
    _assert_same(_merge([rank["dp2"] for rank in ranks]), saved, "pp=2 x dp=2 (ddp), tp=1")

    paths["wider"] = str(tmp_path / "wider")
    ckpt.save(paths["wider"], build_model(n_embd=64))  # another configuration, saved from one process
    pp1_tp2 = run_ranks(load_at_pp1_tp2, 2, args=(paths,), timeout_s=240)
    assert "transformer.h.0.attn.c_attn.weight" in pp1_tp2[0]["sharded"]  # a packed q|k|v shard
    refusals = {rank["refusal"] for rank in pp1_tp2}  # every rank raises the same error
    assert len(refusals) == 1 and "'transformer.wte.weight' has shape [96, 32] here but [96, 64]" in refusals.pop()
    for rank in pp1_tp2:
        _assert_same(rank["after refusal"], rank["pp4"], "after a refused load")
    _assert_same(_merge([rank["step_2"] for rank in pp1_tp2]), saved, "pp=1 x tp=2")
    _assert_same(_merge([rank["pp4"] for rank in pp1_tp2]), saved, "pp=1 x tp=2 from the pp=4 checkpoint")

    # One process: the trained pipeline's whole weights, by their Hugging Face names.
    trained = _merge([rank["resume_after"][0] for rank in ranks])[0]
    assert ckpt.check(paths["step_4"], build_model(), optimizer="AdamW", lr_scheduler=False).name == "step_4"
    state = ckpt.to_state_dict(paths["step_4"])
    assert list(state) == list(build_model().state_dict())
    assert state["lm_head.weight"] is state["transformer.wte.weight"]
    assert_same_tensors({n: t for n, t in state.items() if n in trained}, trained, "to_state_dict")
    out = tmp_path / "exported"
    assert main(["export", paths["step_4"], str(out)]) == 0
    from safetensors.torch import load_file

    exported = load_file(out / "model.safetensors")
    assert_same_tensors(exported, trained, "exported weights")  # the tie written once, as transformers does
    pipeline_logits = next(rank["logits"] for rank in ranks if rank["logits"] is not None)
    logits = exported_logits(out)
    difference = ((logits - pipeline_logits).abs().max() / pipeline_logits.abs().max()).item()
    assert difference <= LOGITS_TOLERANCE, difference
