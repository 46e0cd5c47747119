"""Pipelines x tensor parallelism x data parallelism on one ("pp", "dp", "tp") mesh of 4 gloo ranks.

pp=1 x dp=2 x tp=2: the one 4-rank shape in which replicas of TP-sharded stages meet (pp=2 x dp=2
leaves tp=1, pp=2 x tp=2 leaves dp=1). The one-rank pipelines still run the whole pipeline
machinery: 1f1b with one stage, zbv with two stages on the rank (its V), zero-bubble I/W split
included; pp=2 x dp=2 x tp=2 on 8 ranks is ``python -m benchmarks --tp-parity``.

After 3 AdamW steps the pipeline's losses and parameters (each rank's shards and the gathered
tensors) are torch.equal to the same traced stages under TP x DP without a pipeline (torch's
``fully_shard`` / ``replicate`` over "dp" on the TP-sharded parameters, reduced once per step);
``clip_grad_norm_``'s total matches torch's own norm of the DTensor gradients to rounding (it
combines shard norms in float64: each shard counted once across dp and tp; a parameter TP left
whole is sharded over "dp" only). GPT-2's embedding and head, tied within the one stage, stay one
Parameter. Hand-built stages under the user's plan
(``Pipeline(..., layout=DistributedLayout(tp=2, tensor_parallel={...}))``) are
compared with ``parallelize_module`` then ``fully_shard`` / ``replicate``. Every case runs on one
launch of ranks (a module fixture), followed by the refusals of bad input.
"""

from __future__ import annotations

import pytest

from conveyor.testing import run_ranks
from conveyor.testing.references.tensor_data_parallel import cases_and_refusals

SHAPE = (1, 2, 2)  # pp, dp, tp
# CI holds ddp and fsdp, 1f1b and zbv, traced and hand-built, and the tied embedding, each once (three cases
# on the one launch); the extended tier adds the other pairings.
CASES = [("llama", "zbv", "fsdp"), ("gpt2", "1f1b", "fsdp"), ("hand-built", "zbv", "ddp")]
EXTENDED_CASES = [("llama", "1f1b", "ddp"), ("llama", "1f1b", "fsdp"), ("llama", "zbv", "ddp"),
                  ("hand-built", "1f1b", "fsdp")]
# clip_grad_norm_'s total (shard norms combined in float64) against torch's norm of the DTensor gradients
# (fp32): the same sum of positive squares in other orders and precisions. ATen reduces a float norm either
# in double or by its cascade sum (log2(n) u of the sum, n < 2**13 here: 13 u); the square root halves a
# relative error, and each side rounds its shard norms, their squares and the root (~4 u): 10.5 u = 6.3e-7
# at worst; 1e-6 leaves 1.6x.
NORM_ROUNDING = 1e-6


@pytest.fixture(scope="module")
def launched():
    return run_ranks(cases_and_refusals, 4, args=(SHAPE, CASES), timeout_s=900)


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_pipeline_adds_nothing_to_tp_x_dp(launched):
    _assert_equal_to_tp_x_dp(launched, CASES)


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.timeout(900)
def test_the_other_pairings_add_nothing_either():
    """CI twin: tests/parallel/test_tensor_data_parallel.py::test_pipeline_adds_nothing_to_tp_x_dp (same checks)."""
    _assert_equal_to_tp_x_dp(run_ranks(cases_and_refusals, 4, args=(SHAPE, EXTENDED_CASES), timeout_s=900),
                             EXTENDED_CASES)


def _assert_equal_to_tp_x_dp(launched, cases):
    for rank, (by_case, _) in enumerate(launched):
        assert list(by_case) == cases
        for case, result in by_case.items():
            assert result["wrapped"] > 0 and result["tp_sharded"] > 0, (rank, case, result)  # 2-D: dp x tp
            assert result["losses_equal"], (rank, case, result)
            assert result["shards_equal"] and result["params_equal"], (rank, case, result)
            assert result["norm_rel"] <= NORM_ROUNDING, (rank, case, result)
            assert result["whole_tied"], (rank, case, result)
            assert result["stages"] == (2 if case[1] == "zbv" else 1), (rank, case, result)


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("case", "message"), [
    ("sizes do not multiply to the world", "covers 2 ranks but the job has 4"),
    ("tp not innermost", "'tp' must be the innermost"),
    ("no pp dim", "no 'pp' dim"),
    ("unknown data_parallel", "data_parallel must be 'ddp', 'fsdp' or None"),
    ("tied uses on one rank (zbv), fsdp", "cannot hold the tied parameter"),
    ("tied uses on one rank (zbv), ddp", "cannot hold the tied parameter"),
])
def test_bad_tp_x_dp_input_is_refused_before_the_first_step_on_every_rank(launched, case, message):
    for rank, (_, refused) in enumerate(launched):
        assert refused[case] is not None and message in refused[case], (rank, case, refused[case])
    assert all(refused["good"] is None for _, refused in launched)
