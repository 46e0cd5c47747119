"""How a pipeline makes its process groups: in one order on every rank, connected at once under NCCL.

NCCL creates a communicator at a group's first operation, blocking the host until every member
is there (which deadlocks zb-h1 V=2 in its first step: see test_ordering's replay); and under
``init_process_group(device_id=...)`` torch splits every new group from the default communicator,
which every rank of the parent must join. These runs put gloo ranks under each decision of
:func:`conveyor.runtime.lifecycle.groups.group_creation` (the CPU stands in for the GPU) and record the
calls that make the groups.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist

import conveyor
import conveyor.schedule as cs
from conveyor.runtime.lifecycle import groups as own_groups
from conveyor.runtime.lifecycle.groups import GroupCreation, group_creation
from conveyor.testing import run_ranks

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


def test_nccl_groups_are_connected_at_once_or_split_from_the_users_group():
    # Lazy NCCL communicators: connect each group as it is made, on the pipeline's GPU.
    assert group_creation("nccl", None, CUDA1) == GroupCreation(split=False, eager_device=CUDA1)
    assert group_creation("cpu:gloo,cuda:nccl", None, CUDA1) == GroupCreation(split=False, eager_device=CUDA1)
    # Bound default group: torch splits (eagerly) from the parent, which every rank of it must join.
    assert group_creation("nccl", CUDA0, CUDA0) == GroupCreation(split=True, eager_device=None)
    # gloo connects in its constructor; nothing to add.
    assert group_creation("gloo", None, torch.device("cpu")) == GroupCreation(split=False, eager_device=None)
    assert group_creation("nccl", None, None) == GroupCreation(split=False, eager_device=None)


def _recorded_groups(rank, world_size, how):
    """Build a 2-rank ordered pipeline under ``how`` ("job": the default group; "split" or
    "members": a group of the user's over ranks 1 and 2 of 3), recording each group-making call."""
    user = None if how == "job" else dist.new_group([1, 2])
    if how != "job" and rank == 0:
        return None  # not in the user's group: builds no pipeline
    calls, real_new_group = [], dist.new_group

    def new_group(ranks, timeout=None, use_local_synchronization=False, device_id=None):
        calls.append(("new_group", tuple(ranks), str(device_id), use_local_synchronization))
        return real_new_group(ranks, timeout=timeout, use_local_synchronization=use_local_synchronization)

    def split_group(parent_pg=None, split_ranks=None, timeout=None):
        # What torch's split does for its members (NCCL's ncclCommSplit needs a GPU): every rank
        # of the parent calls it; the members get the group, the others None.
        calls.append(("split_group", dist.get_process_group_ranks(parent_pg), tuple(split_ranks[0])))
        members = [dist.get_global_rank(parent_pg, r) for r in split_ranks[0]]
        return real_new_group(members, timeout=timeout, use_local_synchronization=True) if rank in members else None

    creation = GroupCreation(split=how == "split", eager_device=torch.device("cpu"))  # the CPU as "the GPU"
    with mock.patch.object(own_groups, "group_creation", lambda *_: creation), \
            mock.patch.object(dist, "new_group", new_group), mock.patch.object(dist, "split_group", split_group):
        torch.manual_seed(0)
        pipe = conveyor.Pipeline([torch.nn.Linear(4, 4)], schedule=cs.build("1f1b", ranks=2, microbatches=2),
                                 loss_fn=lambda y, t: y.sum(),
                                 transfer=conveyor.TransferOptions(timeout_s=30, transport="ordered"),
                                 layout=conveyor.DistributedLayout(group=user))
        loss = pipe.step(torch.ones(4, 4) if dist.get_rank(user) == 0 else None)
        pipe.close()
    return calls, loss


@pytest.mark.parametrize("how", ["job", "split", "members"])
def test_every_rank_makes_the_pipelines_groups_in_one_order_connected_as_made(how):
    world = 2 if how == "job" else 3
    results = [r for r in run_ranks(_recorded_groups, world, args=(how,), timeout_s=60) if r is not None]
    (calls_a, loss_a), (calls_b, loss_b) = results
    assert torch.equal(loss_a, loss_b) and bool(torch.isfinite(loss_a)), (loss_a, loss_b)  # the step ran
    if how == "split":
        # Every rank of the user's group takes part in every split, in one order: the main group
        # (group ranks 0 and 1), then each channel, (0, 1) before (1, 0); nothing else makes groups.
        assert calls_a == calls_b == [("split_group", [1, 2], pair) for pair in ((0, 1), (0, 1), (1, 0))], calls_a
        return
    a, b = (0, 1) if how == "job" else (1, 2)
    local = how == "members"
    # The main group, then the channels in sorted order, each connected at once on the pipeline's device.
    assert calls_a == calls_b == [("new_group", pair, "cpu", local) for pair in ((a, b), (a, b), (b, a))], calls_a
