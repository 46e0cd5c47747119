"""After the first step, a step makes no object collective and reads no tensor on the host.

Proved on the CPU by patching the calls that would synchronise a GPU (see
``conveyor/testing/rigs/host_syncs.py``): every built-in schedule, both transports, clipping and
the non-finite check in every step, and with data-parallel replicas.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import conveyor
import conveyor.schedule as cs
from conveyor.testing.models import lm_loss
from conveyor.testing.multiprocess import run_ranks
from conveyor.testing.references.data_parallel import MLPStage, make_batch
from conveyor.testing.rigs import host_syncs


def test_the_counter_sees_every_kind_of_read_and_puts_everything_back():
    before = (torch.Tensor.item, dist.all_gather_object)
    t = torch.ones(2)
    with host_syncs.HostSyncCounter() as counter:
        assert dist.all_gather_object is not before[1]
        t.sum().item(), t.tolist(), t.cpu(), bool(t[0]), int(t[0]), float(t[0])
        assert f"{t.sum():.1f}" == "2.0"  # formatting reads the tensor once (item inside is not counted again)
    assert counter.host_syncs == 7 and counter.object_collectives == 0
    assert (torch.Tensor.item, dist.all_gather_object) == before
    assert "__bool__" not in vars(torch.Tensor)


def _assert_quiet(rows: list[dict]) -> None:
    print(host_syncs.table(rows))
    for row in rows:
        assert row["unexpected"] == [], row
        assert (row["object_collectives"], row["host_syncs"]) == (0, 0), row
        assert row["asked_reads"] == 1 and row["generator_draws"] == 1, row  # on_nonfinite's read; the CPU draw


# CI: NCCL's discipline ("ordered", here on gloo, where a host read would cost the most) under every schedule, and
# the two other transports under one schedule of each kind (1f1b: one stage a rank; zbv: two, a local hop, the
# I/W split); the extended tier runs those two under every schedule.
SMALL_GRID = ["1f1b", "zbv"]


@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize(("transports", "names"), [
    (["ordered"], None),
    (["process_group", "shared_memory"], SMALL_GRID),
    pytest.param(["process_group", "shared_memory"], None, marks=pytest.mark.extended),
], ids=["ordered-every-schedule", "other-transports-1f1b-zbv", "other-transports-every-schedule"])
def test_no_host_round_trip_after_the_first_step_under_every_schedule_and_transport(transports, names):
    """The extended case's CI twin: ``[other-transports-1f1b-zbv]`` (same assertions, two schedules)."""
    names = names or sorted(cs.available())
    results = run_ranks(host_syncs.count_rank, 2, args=(names, transports), timeout_s=180)
    rows = [row for ranks in results for row in ranks]
    assert len(rows) == 2 * len(transports) * len(names)
    _assert_quiet(rows)


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_no_host_round_trip_after_the_first_step_with_replicas():
    # fsdp: its norms also combine shards over the replicas; ddp takes the same path with less.
    results = run_ranks(host_syncs.count_rank, 4, args=(["1f1b"], ["shared_memory"], 2, "fsdp"), timeout_s=90)
    _assert_quiet([row for ranks in results for row in ranks])


def test_local_pipeline_steps_read_nothing_either():
    for name, info in sorted(cs.available().items()):
        schedule = cs.build(name, ranks=2, microbatches=4, virtual=info.default_virtual)
        pipe = conveyor.Pipeline([MLPStage(s, schedule.num_stages) for s in range(schedule.num_stages)],
                                 schedule, lm_loss, layout=conveyor.InProcessLayout())
        counter = host_syncs.HostSyncCounter()
        for step in range(2):
            ids, targets = make_batch(seed=step)
            with counter if step else contextlib.nullcontext():
                pipe.step(ids, target=targets, on_nonfinite="raise")
                pipe.clip_grad_norm_(1.0)
            for param in pipe.parameters():
                param.grad = None
        assert counter.unexpected() == [] and counter.asked_reads == 1, name
