"""Sequence parallelism on traced stages: torch's sequence-parallel plan as redistributions in the stage graph.

A traced stage has no norm or block modules for ``SequenceParallel`` to hook, so
:mod:`conveyor.parallel.tensor.traced_sequence` places the same redistributions at the same module
boundaries (found by each node's ``nn_module_stack``): embeddings scattered onto the sequence, each
column-parallel projection's input gathered, each row-parallel projection's partial sums
reduce-scattered. Checked here:

* unchanged Hugging Face Llama and GPT-2 and the trainer's recipes, two traced stages on 2 ranks, one
  forward and backward (the vocabulary-parallel embedding's partial lookup reduce-scattered onto the
  sequence at once, as torch's ``RowwiseParallel(output_layouts=Shard(1))``): the loss and
  gradients within 1e-5 relative of one device's (bitwise on some CPUs, not all; TP
  sums the row-parallel projections' partial products, the replicated activations' partial gradients,
  and, under sequence parallelism, the norms' weight gradients over the sequence shards, in another
  order); across the boundary each TP rank sends the hidden states' ``seq / tp`` rows, the rotary
  tables and ALiBi biases whole;
* the collectives (torch's ``CommDebugMode``) of a stage of the embedding and 2 Llama blocks: forward,
  one all-gather and one reduce-scatter per projection pair (4 and 4) and the embedding's reduce-scatter,
  none of a weight; backward, the projections' transposes plus the embedding's gradient gathered once;
* a graph that mixes sequence positions between its blocks (``cumsum`` on dim 1) is refused when built,
  naming the node;
* pp=2 x tp=2 pipelines (4 ranks), 3 AdamW steps: losses and parameters torch.equal to the same traced
  TP+SP stages run one after the other without the pipeline; losses within 1e-5 of one device;
  parameters within AdamW's reach of one device (AdamW turns rounding differences in a near-zero gradient
  into steps of up to lr; conveyor.testing.references.tensor_pipeline.ADAMW_AFTER_STEPS derives it).
"""

from __future__ import annotations

import pytest

import conveyor
from conveyor.testing import run_ranks
from conveyor.testing.references.tensor_parallel import TP_ROUNDING
from conveyor.testing.references.tensor_pipeline import ADAMW_AFTER_STEPS
from conveyor.testing.references.tensor_sequence_traced import pipeline_against_alone, traced_sequence_checks

TOLERANCE = TP_ROUNDING  # derived in conveyor.testing.references.tensor_parallel
HIDDEN_ROWS = (2, 6, 32)  # a microbatch's [2, 12, 32] hidden states: this TP rank's 12 / 2 rows


@pytest.mark.distributed
@pytest.mark.parametrize("names", [("llama", "recipe:mpt"),
                                   pytest.param(("gpt2", "recipe:gpt", "recipe:llama"), marks=pytest.mark.extended)],
                         ids=["llama-mpt", "gpt2-recipes"])
def test_traced_stages_run_sequence_parallel_within_rounding_of_one_device(names):
    """CI twin of ``[gpt2-recipes]``: ``[llama-mpt]`` (the same assertions, two models)."""
    results = run_ranks(traced_sequence_checks, 2, args=(names,), timeout_s=600)
    for result in results:
        for name, model in result["models"].items():
            # TP+SP against one device is another computation (the row-parallel projections' partial sums
            # reduce-scattered): within TP's derived rounding, as test_tensor_parallel.py holds TP alone.
            assert model["loss"] <= TOLERANCE and model["grads"] <= TOLERANCE, (name, model)
            hidden = [shape for shape in model["sent"] if len(shape) == 3 and shape[-1] == 32 and shape[1] != 1]
            assert hidden and set(hidden) == {HIDDEN_ROWS}, (name, model["sent"])
            forward = model["comms"]["forward"]
            # the vocabulary-parallel embedding's lookup and one block's attn and mlp each reduce-scatter
            assert forward["c10d_functional.reduce_scatter_tensor"] == 3, (name, forward)
            assert "c10d_functional.all_reduce" not in forward, (name, forward)
        assert {(1, 12, 8)} <= set(result["models"].get("llama", {"sent": [(1, 12, 8)]})["sent"])  # rotary whole
        collectives = result["collectives"]
        assert collectives["forward"] == {"c10d_functional.all_gather_into_tensor": 4,
                                          "c10d_functional.reduce_scatter_tensor": 5}, collectives
        assert collectives["backward"] == {"c10d_functional.all_gather_into_tensor": 5,
                                           "c10d_functional.reduce_scatter_tensor": 4}, collectives
        assert collectives["sent"] == [HIDDEN_ROWS], collectives
        assert result["refused"].startswith("sequence_parallel=True cannot run stage 0's operation cumsum "
                                            "(aten.cumsum.default)"), result["refused"]
        assert "sharded on the sequence (dim 1)" in result["refused"] and "sequence_parallel=False" in result["refused"]


# CI runs zbv (V=2: 4 stages, the I/W split); each schedule adds its own TP+SP-alone and one-device references
# (about 25 s on 2 busy cores), so 1f1b runs with every other schedule in the extended tier. A 1f1b pipeline of
# traced TP+SP stages still trains in CI: tests/train/test_tensor_parallel.py's traced llama recipe with
# sequence parallelism (its first loss equal to TP alone's).
CI_SCHEDULES = ("zbv",)


@pytest.mark.distributed
@pytest.mark.parametrize("names", [CI_SCHEDULES, pytest.param(None, marks=pytest.mark.extended)],
                         ids=["zbv", "every-schedule"])
def test_pp2_x_tp2_traced_sequence_parallel_adds_nothing_to_tp_and_sp_alone(names):
    """CI twin of ``[every-schedule]``: ``[zbv]`` (the same assertions, one schedule)."""
    names = names or tuple(conveyor.schedule.available())
    results = run_ranks(pipeline_against_alone, 4, args=(names,), timeout_s=900)
    for rank, by_schedule in enumerate(results):
        assert set(by_schedule) == set(names)
        for name, result in by_schedule.items():
            assert result["losses_equal_alone"] and result["params_unequal_alone"] == [], (rank, name, result)
            assert result["loss_rel"] <= TOLERANCE and result["param_abs"] <= ADAMW_AFTER_STEPS, (rank, name, result)
            if result["sent"]:  # a sending stage: the hidden states' rows, the rotary tables whole
                assert result["sent"] == [(1, 12, 8), HIDDEN_ROWS], (rank, name, result)
            if "receives" in result["boundaries"]:
                assert f"Shard(1) local {list(HIDDEN_ROWS)}" in result["boundaries"], (rank, name, result)
    assert all(results[0][name]["sent"] for name in names)  # ranks 0 and 1 hold stage 0 in every schedule
