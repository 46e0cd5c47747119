"""Shared memory within a host, the process group across hosts: chosen per pair, bitwise equal.

Several hosts are played on this machine with ``CONVEYOR_HOST_ID``, which replaces a rank's
host identity; each rank sets its own before building its Pipeline.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

import conveyor
import conveyor.schedule as cs
from conveyor.runtime.hybrid import HybridTransport
from conveyor.runtime.shm import SharedMemoryTransport
from conveyor.runtime.transport import DistTransport
from conveyor.testing import run_ranks

from .parity import NUM_MICROBATCHES, assert_same, reference_run
from .test_pipeline_dist import _raise_in_stage, _train

TWO_HOSTS = ("node-a", "node-a", "node-b", "node-b")


def _chosen(rank, world_size, hosts):
    os.environ["CONVEYOR_HOST_ID"] = hosts[rank]
    schedule = cs.build("1f1b", ranks=world_size, microbatches=world_size)
    pipe = conveyor.Pipeline([nn.Linear(2, 2)], schedule=schedule)
    transport = pipe.transport
    local = sorted(transport.local_peers) if isinstance(transport, HybridTransport) else None
    return type(transport).__name__, local


def test_auto_uses_shared_memory_exactly_between_ranks_of_one_host():
    # The launcher says 2 ranks per host (torchrun on two nodes): the ranks compare hosts.
    chosen = run_ranks(_chosen, 4, args=(TWO_HOSTS,), env={"LOCAL_WORLD_SIZE": "2"})
    assert chosen == [
        (HybridTransport.__name__, [1]),  # rank 0 talks to 1 only, on its host
        (HybridTransport.__name__, [0]),  # rank 1: 0 by shared memory, 2 by the process group
        (HybridTransport.__name__, [3]),
        (HybridTransport.__name__, [2]),
    ]
    # Every rank on its own host: nothing to share.
    alone = run_ranks(_chosen, 2, args=(("node-a", "node-b"),), env={"LOCAL_WORLD_SIZE": "1"})
    assert alone == [(DistTransport.__name__, None)] * 2
    # A launcher that undercounts its local ranks does not cost the shared memory.
    together = run_ranks(_chosen, 2, args=(("node-a", "node-a"),), env={"LOCAL_WORLD_SIZE": "1"})
    assert together == [(SharedMemoryTransport.__name__, None)] * 2


def _train_on(rank, world_size, hosts, name, virtual):
    os.environ["CONVEYOR_HOST_ID"] = hosts[rank]
    return _train(rank, world_size, name, virtual, False)


@pytest.mark.parametrize(("name", "virtual"), [("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2)])
def test_two_hosts_train_bitwise_equal_to_one_device(name, virtual):
    schedule = cs.build(name, ranks=4, microbatches=NUM_MICROBATCHES, virtual=virtual)
    want_losses, want_grads, want_params = reference_run(schedule)
    results = run_ranks(_train_on, 4, args=(TWO_HOSTS, name, virtual), env={"LOCAL_WORLD_SIZE": "2"},
                        timeout_s=120)
    for rank, (losses, grads, params, _) in enumerate(results):
        assert all(torch.equal(got, want) for got, want in zip(losses, want_losses)), f"rank {rank} losses"
        for stage in schedule.stages_of(rank):
            assert_same(f"stage {stage} grads", grads[stage], want_grads[stage])
            assert_same(f"stage {stage} params", params[stage], want_params[stage])


class _Slow(nn.Module):
    """A linear stage whose forward takes at least ``seconds``."""

    def __init__(self, width: int, seconds: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.linear(x)


def _stage(stage: int, width: int) -> nn.Module:
    torch.manual_seed(stage)
    # Rank 1 sends an activation every 5 ms, the slow rank 3 takes one every 20 ms: rank 2,
    # between them, always waits on rank 1 while its sends to rank 3 queue up.
    return _Slow(width, {1: 0.005, 3: 0.02}.get(stage, 0.0))


def _fill_the_ring(rank, world_size, width, microbatches, batch):
    os.environ["CONVEYOR_HOST_ID"] = TWO_HOSTS[rank]
    schedule = cs.build("gpipe", ranks=4, microbatches=microbatches)
    pipe = conveyor.Pipeline([_stage(rank, width)], schedule=schedule,
                             loss_fn=lambda y, t: (y - t).pow(2).mean(), timeout_s=60)
    x, y = batch
    loss = pipe.step(x if rank == 0 else None, target=y if rank == 3 else None)
    grads = {name: p.grad for name, p in pipe.runners[rank].module.named_parameters()}
    return loss, grads, pipe.transport.polled_waits


def test_a_rank_waiting_across_hosts_keeps_its_local_sends_moving():
    # 16 KiB activations, 16 microbatches: rank 2's ring towards the slow rank 3 (64 KiB) fills
    # while rank 2 waits for rank 1's next activation over the process group.
    width, microbatches = 1024, 16
    generator = torch.Generator().manual_seed(0)
    batch = (torch.randn(4 * microbatches, width, generator=generator),
             torch.randn(4 * microbatches, width, generator=generator))
    results = run_ranks(_fill_the_ring, 4, args=(width, microbatches, batch), env={"LOCAL_WORLD_SIZE": "2"},
                        timeout_s=120)
    assert results[2][2] > 0, "rank 2 never waited with sends queued: the test no longer covers that path"

    stages = [_stage(s, width) for s in range(4)]
    model = nn.Sequential(*stages)
    expected_loss = torch.zeros(())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: a matmul's reduction order depends on it
    try:
        for x, y in zip(batch[0].tensor_split(microbatches), batch[1].tensor_split(microbatches)):
            loss = (model(x) - y).pow(2).mean() / microbatches
            loss.backward()
            expected_loss += loss.detach()
    finally:
        torch.set_num_threads(threads)
    for rank, (loss, grads, _) in enumerate(results):
        assert torch.equal(loss, expected_loss)
        for name, p in stages[rank].named_parameters():
            assert torch.equal(grads[name], p.grad), f"rank {rank} {name}"


def _failing_on(rank, world_size):
    os.environ["CONVEYOR_HOST_ID"] = TWO_HOSTS[rank]
    return _raise_in_stage(rank, world_size, "auto")


def test_a_failure_on_one_host_reaches_every_rank_on_both_with_its_message():
    results = run_ranks(_failing_on, 4, env={"LOCAL_WORLD_SIZE": "2"}, timeout_s=60)
    messages = [message for message, _ in results]
    assert "StageExecutionError" in messages[2] and "boom inside stage 2" in messages[2]
    for rank in (0, 1, 3):  # 3 hears through shared memory, 1 through the process group, 0 from 1's host
        assert "PeerFailure" in messages[rank] and "boom inside stage 2" in messages[rank], messages[rank]
    assert max(seconds for _, seconds in results) < 30
