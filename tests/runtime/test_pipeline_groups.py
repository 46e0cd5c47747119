"""Several pipeline groups in one job (data parallel x pipeline parallel), as on a 2-D mesh.

Each group is a ``dist.new_group`` of two ranks; a Pipeline is given its group. Group ranks
repeat across groups, so anything keyed by group rank alone (the failure board) would mix
the replicas up.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import conveyor
import conveyor.schedule as cs
from conveyor.testing import run_ranks
from conveyor.testing.models import (
    build_stage,
    lm_loss,
    make_batch,
    reference_model,
    reference_step,
)
from conveyor.testing.references.schedule_parity import BATCH_SIZE, NUM_MICROBATCHES, NUM_STEPS, assert_same, config_for

TRANSPORTS = ("shared_memory", "process_group")
PIPELINE_RANKS = 2


def _replica_groups(rank: int, world_size: int):
    """Every rank creates every group (new_group is collective); returns this rank's group and replica."""
    groups = [dist.new_group(list(range(start, start + PIPELINE_RANKS)))
              for start in range(0, world_size, PIPELINE_RANKS)]
    return groups[rank // PIPELINE_RANKS], rank // PIPELINE_RANKS


def _train_in_replica(rank, world_size, transport):
    group, replica = _replica_groups(rank, world_size)
    schedule = cs.build("1f1b", ranks=PIPELINE_RANKS, microbatches=NUM_MICROBATCHES)
    cfg = config_for(schedule)
    pipeline_rank = dist.get_rank(group)
    stage = build_stage(pipeline_rank, cfg)
    pipe = conveyor.Pipeline([stage], schedule=schedule, loss_fn=lm_loss,
                             transfer=conveyor.TransferOptions(timeout_s=60, transport=transport),
                             layout=conveyor.DistributedLayout(group=group))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses = []
    for step in range(NUM_STEPS):
        # Each replica trains on its own data, as data parallelism would give it.
        ids, targets = make_batch(cfg, BATCH_SIZE, seed=100 * replica + step)
        losses.append(pipe.step(ids if pipeline_rank == 0 else None,
                                target=targets if pipeline_rank == PIPELINE_RANKS - 1 else None))
        optimizer.step()
        optimizer.zero_grad()
    params = {n: p.detach().clone() for n, p in stage.named_parameters()}
    return replica, pipeline_rank, losses, params


def _one_device(cfg, replica: int):
    """Losses and per-stage parameters of the unsplit model trained on ``replica``'s data, one thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' count: some CPU kernels reduce in a thread-dependent order
    try:
        model = reference_model(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(NUM_STEPS):
            ids, targets = make_batch(cfg, BATCH_SIZE, seed=100 * replica + step)
            losses.append(reference_step(model, ids, targets, NUM_MICROBATCHES, lm_loss))
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(previous)
    return losses, [{n: p.detach().clone() for n, p in stage.named_parameters()} for stage in model.stages]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_pipeline_groups_train_side_by_side_each_bitwise_equal_to_one_device(transport):
    results = run_ranks(_train_in_replica, 2 * PIPELINE_RANKS, args=(transport,), timeout_s=120)
    cfg = config_for(cs.build("1f1b", ranks=PIPELINE_RANKS, microbatches=NUM_MICROBATCHES))
    for replica in range(2):
        want_losses, want_params = _one_device(cfg, replica)
        mine = [r for r in results if r[0] == replica]
        assert sorted(r[1] for r in mine) == [0, 1]
        for _, pipeline_rank, losses, params in mine:
            for step, (got, want) in enumerate(zip(losses, want_losses, strict=True)):
                assert torch.equal(got, want), f"replica {replica} step {step}: {got.item()} vs {want.item()}"
            assert_same(f"replica {replica} stage {pipeline_rank}", params, want_params[pipeline_rank])


class _Boom(torch.nn.Module):
    def forward(self, x):
        raise ValueError("boom in the second replica")


class _Slow(torch.nn.Linear):
    def forward(self, x):
        time.sleep(2.0)  # keeps its peer waiting while the other replica fails
        return super().forward(x)


def _fail_in_second_replica(rank, world_size, transport):
    group, replica = _replica_groups(rank, world_size)
    schedule = cs.build("1f1b", ranks=PIPELINE_RANKS, microbatches=2)
    pipeline_rank = dist.get_rank(group)
    if replica == 1 and pipeline_rank == 1:
        module = _Boom()
    elif replica == 0 and pipeline_rank == 1:
        module = _Slow(4, 4)
    else:
        module = torch.nn.Linear(4, 4)
    pipe = conveyor.Pipeline([module], schedule=schedule, loss_fn=lambda y, t: y.sum(),
                             transfer=conveyor.TransferOptions(timeout_s=60, transport=transport),
                             layout=conveyor.DistributedLayout(group=group))
    try:
        pipe.step(torch.ones(2, 4) if pipeline_rank == 0 else None)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_failure_is_named_by_the_group_it_happened_in(transport):
    messages = run_ranks(_fail_in_second_replica, 2 * PIPELINE_RANKS, args=(transport,), timeout_s=60)
    # Global rank 3 is rank 1 of the second group: it fails, its group's rank 0 says who and why.
    assert messages[3].startswith("StageExecutionError") and "boom in the second replica" in messages[3]
    assert messages[2].startswith("PeerFailure"), messages[2]
    assert "rank 1 (global rank 3) failed: StageExecutionError" in messages[2]
    # The first group's rank 1 is healthy (only slow): nobody may blame it. (The second group's
    # messages, relayed, may quote "rank 1 (global rank 3)": each cause line is read alone.)
    for rank in (0, 1):
        for line in messages[rank].removeprefix("PeerFailure: ").splitlines():
            assert not line.startswith(("rank 1 failed", "rank 1 (global")), messages[rank]
    if transport == "shared_memory":
        # Its waits look at the board: the first group stops too, told where the failure was.
        assert messages[0].startswith("PeerFailure"), messages[0]
        assert "global rank 3, in another pipeline group of this job, failed: StageExecutionError" in messages[0]
        assert "global rank 3, in another pipeline group" in messages[1], messages[1]
    else:
        # gloo's waits only look at the board when a wait fails; nothing failed in the first group.
        assert messages[0] == messages[1] == "no error"
