"""Tensor parallelism inside pipeline stages: pp=2 x tp=2 on 4 gloo ranks, every built-in schedule.

The pipeline adds nothing to tensor parallelism alone: after 3 AdamW steps its losses and
parameters are torch.equal to the same traced stages under TP alone (tp=2, run one after the
other with the same microbatch loop). Against one device TP changes the summation order
(row-parallel projections, replicated activations' gradients): losses within 1e-5 relative
(~1e-7 here), gradients within 1e-5 (test_tensor_parallel_pipeline_checks). Parameters after 3
AdamW steps at lr=1e-2 differ from one device's by up to ~6e-4 relative: AdamW divides each
update by the gradient's running RMS, so an element whose gradient is near zero moves by up to
lr either way on a rounding difference; the bound below says so rather than 1e-5.
"""

from __future__ import annotations

import pytest

import conveyor
from conveyor.testing import run_ranks
from conveyor.testing.references.tensor_parallel import TP_ROUNDING
from conveyor.testing.references.tensor_pipeline import ADAMW_AFTER_STEPS, every_schedule

TOLERANCE = TP_ROUNDING  # derived in conveyor.testing.references.tensor_parallel


# Traced stages under every schedule are the extended tier: each schedule re-traces a Llama and runs its own
# TP-alone and one-device references (about 20 s on 2 busy cores). CI runs zbv here (V=2, the I/W split, 4
# stages); the V=1 family's traced TP pipeline is test_tensor_parallel_traced.py's 1f1b pp=2 x tp=2 against TP
# alone (bitwise), and every schedule with TP stages (hand-built, sequence parallel) is in
# test_tensor_parallel_sequence.py.
CI_SCHEDULES = ("zbv",)


@pytest.mark.distributed
@pytest.mark.parametrize("names", [CI_SCHEDULES, pytest.param(None, marks=pytest.mark.extended)],
                         ids=["zbv", "every-schedule"])
def test_every_schedule_with_tensor_parallel_stages_adds_nothing_to_tp_alone(names):
    """CI twin of ``[every-schedule]``: ``[zbv]`` (the same assertions, one schedule)."""
    results = run_ranks(every_schedule, 4, args=(names,), timeout_s=900)
    assert set(results[0]) == set(names or conveyor.schedule.available())
    for rank, by_schedule in enumerate(results):
        for name, result in by_schedule.items():
            assert result["sharded"] > 0, (rank, name, result)
            assert result["losses_equal_tp"] and result["params_equal_tp"], (rank, name, result)
            assert result["loss_rel"] <= TOLERANCE, (rank, name, result)
            assert result["param_abs"] <= ADAMW_AFTER_STEPS, (rank, name, result)
