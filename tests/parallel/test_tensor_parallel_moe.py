"""Tensor parallelism on a mixture of experts: traced Mixtral at pp=2 x tp=2 on 4 gloo ranks.

TP shards Mixtral's attention (q/k/v colwise, o rowwise), its token embedding (vocabulary-parallel)
and its LM head; the router and the
experts stay whole on every TP rank (no expert parallelism): their custom op runs on replicated
tensors. The model returns its router logits, so each step's loss carries the auxiliary
load-balancing part. After 3 AdamW steps under 1f1b and zbv (V=2, the I/W split): losses and
parameters torch.equal to the same traced stages under TP alone; against one device losses
within 1e-5 relative, parameters within AdamW's bound (test_tensor_parallel_pipeline says why).
"""

from __future__ import annotations

import pytest

from conveyor.testing import run_ranks
from conveyor.testing.references.tensor_moe import mixtral_schedules
from conveyor.testing.references.tensor_parallel import TP_ROUNDING
from conveyor.testing.references.tensor_pipeline import ADAMW_AFTER_STEPS

TOLERANCE = TP_ROUNDING  # derived in conveyor.testing.references.tensor_parallel


# Each schedule traces Mixtral three times (the pipeline, TP alone, one device): about a minute
# per schedule on 4 ranks over 2 busy cores. CI runs zbv (V=2: 4 stages, 3 boundaries, the I/W
# split); the extended tier adds 1f1b.
@pytest.mark.distributed
@pytest.mark.parametrize("schedules", [("zbv",), pytest.param(("1f1b", "zbv"), marks=pytest.mark.extended)],
                         ids=["zbv", "1f1b-zbv"])
def test_traced_mixtral_shards_attention_keeps_experts_whole_and_adds_nothing_to_tp_alone(schedules):
    """CI twin of ``[1f1b-zbv]``: ``[zbv]`` (the same assertions, one schedule)."""
    results = run_ranks(mixtral_schedules, 4, args=(schedules,), timeout_s=900)
    for rank, by_schedule in enumerate(results):
        assert set(by_schedule) == set(schedules)
        for name, result in by_schedule.items():
            ends = ("lm_head.weight", "model.embed_tokens.weight")
            assert result["sharded"] and all("self_attn" in n or n in ends for n in result["sharded"]), \
                (rank, name, result)
            assert result["experts"] and result["experts_whole"], (rank, name, result)
            assert result["losses_equal_tp"] and result["params_equal_tp"], (rank, name, result)
            assert result["loss_rel"] <= TOLERANCE, (rank, name, result)
            assert result["param_abs"] <= ADAMW_AFTER_STEPS, (rank, name, result)
