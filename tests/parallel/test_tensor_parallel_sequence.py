"""Sequence parallelism inside pipeline stages: pp=2 x tp=2 on 4 gloo ranks, 1f1b and zbv in CI (every
built-in schedule in the extended tier).

Hand-built stages of a small decoder under the "auto" plan with ``sequence_parallel=True``: norms
on sequence shards (torch's ``SequenceParallel``), each block gathering its input and
reduce-scattering its output. Across a stage boundary each TP rank sends its sequence shard only:
``[microbatch, seq / tp, hidden]`` instead of the whole ``[microbatch, seq, hidden]``, half the
bytes at tp=2 (and half for the gradient coming back). After 3 AdamW steps the losses and every
parameter are torch.equal to the same stages under TP+SP alone (chained directly, no pipeline).
"""

from __future__ import annotations

import pytest

import conveyor
from conveyor.testing import run_ranks
from conveyor.testing.references.tensor_sequence import LENGTH, WIDTH, every_schedule_sequence_parallel

# CI keeps 1f1b (one stage a rank) and zbv (its V: two stages a rank, one local hop, split backward);
# the extended tier runs all ten built-in schedules (44 s of 4 ranks in the last CI log).
CI_SCHEDULES = ("1f1b", "zbv")


@pytest.mark.distributed
def test_sequence_parallel_stages_under_1f1b_and_zbv_add_nothing_to_tp_and_sp_alone():
    _check(run_ranks(every_schedule_sequence_parallel, 4, args=(CI_SCHEDULES,), timeout_s=300), CI_SCHEDULES)


@pytest.mark.distributed
@pytest.mark.extended
@pytest.mark.timeout(900)
def test_every_schedule_with_sequence_parallel_stages_adds_nothing_to_tp_and_sp_alone():
    """CI twin: test_sequence_parallel_stages_under_1f1b_and_zbv_add_nothing_to_tp_and_sp_alone (this file; the
    same _check on two schedules)."""
    _check(run_ranks(every_schedule_sequence_parallel, 4, timeout_s=900), tuple(conveyor.schedule.available()))


def _check(results: list[dict], schedules: tuple[str, ...]) -> None:
    assert set(results[0]) == set(schedules)
    rows = 2  # each microbatch: 2 of the batch's 2 * MICROBATCHES rows
    for rank, by_schedule in enumerate(results):
        for name, result in by_schedule.items():
            assert result["sharded"] > 0 and result["params"] > 0, (rank, name, result)
            assert result["losses_equal"] and result["params_equal"] == [], (rank, name, result)
            if result["sent_shapes"]:  # this rank holds a stage that sends: its sequence shard, in fp32
                assert result["sent_shapes"] == [("Tensor", (rows, LENGTH // 2, WIDTH), 4)], (rank, name, result)
            fields = result["fields"]
            assert "sequence_parallel=True" in fields["tensor parallel"], fields
            assert "Shard(1) (each TP rank sends its 1/2 of the sequence)" in fields["stage boundaries"], fields
    # Every sending stage of every schedule sent its shard (ranks 0 and 1 hold stage 0 in all of them).
    assert all(results[0][name]["sent_shapes"] for name in results[0])
