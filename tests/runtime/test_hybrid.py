"""Shared memory within a host, the process group across hosts: chosen per pair, bitwise equal.

Several hosts are played on this machine with ``CONVEYOR_HOST_ID``, which replaces a rank's
host identity; each rank sets its own before building its Pipeline.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from torch import nn

import conveyor
import conveyor.schedule as cs
from conveyor.errors import CommTimeout, PeerFailure
from conveyor.runtime.transport.hybrid import HybridTransport
from conveyor.runtime.transport.process_group import DistTransport
from conveyor.runtime.transport.shm import SharedMemoryTransport
from conveyor.testing import run_ranks
from conveyor.testing.references.schedule_parity import NUM_MICROBATCHES, assert_same, reference_run

from .test_pipeline_dist import _raise_in_stage, _train

TWO_HOSTS = ("node-a", "node-a", "node-b", "node-b")


def _chosen(rank, world_size, hosts, transport="auto", launcher_env=True):
    os.environ["CONVEYOR_HOST_ID"] = hosts[rank]
    if not launcher_env:  # a launcher that sets neither (mp.spawn, a custom one)
        os.environ.pop("WORLD_SIZE", None)
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    schedule = cs.build("1f1b", ranks=world_size, microbatches=world_size)
    pipe = conveyor.Pipeline([nn.Linear(2, 2)], schedule=schedule,
                             transfer=conveyor.TransferOptions(transport=transport))
    transport = pipe.ranks.transport
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
    # No launcher variables at all: the same comparison decides.
    unset = run_ranks(_chosen, 4, args=(TWO_HOSTS, "auto", False))
    assert [name for name, _ in unset] == [HybridTransport.__name__] * 4
    # Asked for by name on one host: every peer is local.
    forced = run_ranks(_chosen, 2, args=(("node-a", "node-a"), "hybrid"))
    assert forced == [(HybridTransport.__name__, [1]), (HybridTransport.__name__, [0])]


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


def _stage(stage: int, width: int, schedule: cs.Schedule) -> nn.Module:
    torch.manual_seed(stage)
    # Rank 1 sends an activation every 2 ms, the slow rank 3 takes one every 40 ms: rank 2,
    # between them, waits on rank 1 while its sends to rank 3 queue up. (With 5 and 20 ms a
    # loaded machine slowed rank 1 enough that rank 3 kept up and the rings never filled.)
    rank = schedule.placement.rank_of(stage)
    return _Slow(width, {1: 0.002, 3: 0.04}.get(rank, 0.0))


def _fill_the_ring(rank, world_size, name, virtual, width, batch):
    os.environ["CONVEYOR_HOST_ID"] = TWO_HOSTS[rank]
    microbatches = len(batch[0]) // 4
    schedule = cs.build(name, ranks=4, microbatches=microbatches, virtual=virtual)
    mine = schedule.stages_of(rank)
    modules = [_stage(s, width, schedule) for s in mine]
    pipe = conveyor.Pipeline(modules, schedule=schedule, loss_fn=lambda y, t: (y - t).pow(2).mean(),
                             transfer=conveyor.TransferOptions(timeout_s=60))
    first, last = schedule.placement.rank_of(0), schedule.placement.rank_of(schedule.num_stages - 1)
    x, y = batch
    loss = pipe.step(x if rank == first else None, target=y if rank == last else None)
    grads = {s: {n: p.grad for n, p in m.named_parameters()} for s, m in zip(mine, modules)}
    return loss, grads, pipe.ranks.transport.polled_waits


@pytest.mark.parametrize(("name", "virtual"), [("gpipe", 1), ("interleaved-1f1b", 2)])
def test_ranks_waiting_across_hosts_keep_their_local_sends_moving(name, virtual):
    # 28 KiB activations, 16 microbatches: two fill a ring (64 KiB), so rings towards slow
    # ranks fill while the ranks feeding them wait for data over the process group.
    # Interleaved has the cycle (0 -> 1 -> 2 -> 3 -> 0 across both hosts) in which blocking
    # there could stall a step.
    width, microbatches = 1792, 16
    generator = torch.Generator().manual_seed(0)
    batch = (torch.randn(4 * microbatches, width, generator=generator),
             torch.randn(4 * microbatches, width, generator=generator))
    # A stalled wait would end in the pipeline's own CommTimeout (60 s), failing the run: the results
    # below show it did not stall.
    results = run_ranks(_fill_the_ring, 4, args=(name, virtual, width, batch), env={"LOCAL_WORLD_SIZE": "2"},
                        timeout_s=120)
    assert sum(polled for _, _, polled in results) > 0, "no rank waited with sends queued: the path went untested"

    schedule = cs.build(name, ranks=4, microbatches=microbatches, virtual=virtual)
    stages = [_stage(s, width, schedule) for s in range(schedule.num_stages)]
    model = nn.Sequential(*stages)
    for stage in stages:
        stage.seconds = 0.0
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
        for stage in schedule.stages_of(rank):
            for param_name, p in stages[stage].named_parameters():
                assert torch.equal(grads[stage][param_name], p.grad), f"rank {rank} stage {stage} {param_name}"


class _FakeLocal:
    """A shared-memory side whose queued sends never drain (its peer is busy elsewhere).

    ``offered`` is set once the sends have been offered the CPU ``enough`` times.
    """

    def __init__(self, failure: str = "", enough: int = 10) -> None:
        self.calls = 0
        self.failure = failure
        self.enough = enough
        self.offered = threading.Event()

    def progress(self) -> bool:
        self.calls += 1
        if self.calls >= self.enough:
            self.offered.set()
        return True

    def check_health(self, src: int, what: str) -> None:
        if self.failure:
            raise PeerFailure(self.failure)


class _FakeRemote:
    """A process-group side whose receive arrives (or fails) once ``gate`` opens, seen only by waiting."""

    timeout_s = 5.0

    def __init__(self, gate: threading.Event, error: Exception | None = None) -> None:
        self.gate = gate
        self.error = error

    def ready(self, handle) -> bool:
        return False  # as gloo: a receive is never "completed" until waited for

    def wait(self, handle, what: str):
        self.gate.wait(timeout=120)  # a cut-off for a broken test, never reached when it passes
        if self.error is not None:
            raise self.error
        return f"payload of {what}"


def _hybrid(local, remote) -> HybridTransport:
    transport = HybridTransport.__new__(HybridTransport)
    transport.rank, transport.local, transport.remote = 1, local, remote
    transport.local_peers, transport.timeout_s, transport.polled_waits = frozenset({0}), 5.0, 0
    return transport


def test_a_process_group_receive_arrives_while_local_sends_stay_queued():
    # The receive arrives only after the queued sends were offered the CPU 10 times: the wait must
    # keep them moving meanwhile (else it never returns) and return once it arrives.
    local = _FakeLocal(enough=10)
    transport = _hybrid(local, _FakeRemote(local.offered))
    assert transport.wait((transport.remote, 2, None), "stage 1's input") == "payload of stage 1's input"
    assert local.calls >= 10
    # The receive's own error (here its timeout) reaches the caller unchanged.
    arrived = threading.Event()
    arrived.set()
    timed_out = _hybrid(_FakeLocal(), _FakeRemote(arrived, CommTimeout("rank 1 waited 5 s for x and it never came")))
    with pytest.raises(CommTimeout, match="never came"):
        timed_out.wait((timed_out.remote, 2, None), "x")


def test_a_failed_peer_ends_a_process_group_wait_that_keeps_local_sends_moving():
    never_yet = threading.Event()  # the receive is still pending when the failure must end the wait
    transport = _hybrid(_FakeLocal("rank 0 failed: boom"), _FakeRemote(never_yet))
    try:
        with pytest.raises(PeerFailure, match="boom"):
            transport.wait((transport.remote, 2, None), "stage 1's input")
        assert not never_yet.is_set()
    finally:
        never_yet.set()  # lets the helper thread's receive end


def _failing_on(rank, world_size):
    os.environ["CONVEYOR_HOST_ID"] = TWO_HOSTS[rank]
    return _raise_in_stage(rank, world_size, "auto")


def test_a_failure_on_one_host_reaches_every_rank_on_both_with_its_message():
    results = run_ranks(_failing_on, 4, env={"LOCAL_WORLD_SIZE": "2"}, timeout_s=60)
    messages = results
    assert "StageExecutionError" in messages[2] and "boom inside stage 2" in messages[2]
    for rank in (0, 1, 3):  # 3 hears through shared memory, 1 through the process group, 0 from 1's host
        assert "PeerFailure" in messages[rank] and "boom inside stage 2" in messages[rank], messages[rank]
