"""The shared-memory transport on its own: rings that wrap and grow, out-of-order keys, structures, failures."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time

import pytest
import torch

import conveyor
import conveyor.schedule as cs
from conveyor.errors import CommTimeout, PeerFailure, PipelineConfigError
from conveyor.runtime.transport.process_group import DistTransport
from conveyor.runtime.transport.shm import SharedMemoryTransport
from conveyor.runtime.transport.wire import dense_strides
from conveyor.testing import run_ranks
from conveyor.testing.rigs.silent_peer import silent_until_answered


def _pair(rank, prefix, timeout_s=30.0):
    from torch.distributed.distributed_c10d import _get_default_store

    return SharedMemoryTransport(rank, {1 - rank}, _get_default_store(), prefix, 2, timeout_s)


def _exchange(rank, world_size, payloads):
    """Rank 0 sends every payload (key = its index); rank 1 receives them in reverse order."""
    transport = _pair(rank, "exchange")
    if rank == 0:
        for index, value in enumerate(payloads):
            transport.send(1, (0, 0, index), value)
        transport.finish_sends()
        return transport.structures_sent, transport.rings.outgoing[1].ring.capacity
    got = [None] * len(payloads)
    for index in reversed(range(len(payloads))):
        got[index] = transport.wait(transport.post_recv(0, (0, 0, index)), f"payload {index}")
    return got


def test_payloads_arrive_intact_whatever_order_they_are_waited_for():
    payloads = [
        torch.arange(6.0).reshape(2, 3),
        {"hidden": torch.ones(2, 2, dtype=torch.bfloat16), "mask": torch.tensor([True, False]), "n": 3},
        (torch.zeros(0), [torch.full((5,), 7, dtype=torch.int64)], None),
        torch.arange(6.0).reshape(2, 3) + 1,  # the first structure again: not sent twice
    ]
    (structures, _), got = run_ranks(_exchange, 2, args=(payloads,), timeout_s=60)
    assert structures == 3
    assert torch.equal(got[0], payloads[0])
    assert got[1]["n"] == 3 and torch.equal(got[1]["hidden"], payloads[1]["hidden"])
    assert got[1]["hidden"].dtype == torch.bfloat16 and torch.equal(got[1]["mask"], payloads[1]["mask"])
    assert got[2][0].shape == (0,) and torch.equal(got[2][1][0], payloads[2][1][0]) and got[2][2] is None
    assert torch.equal(got[3], payloads[3])


def test_bytes_are_taken_from_each_tensor_in_the_layout_it_is_sent_in():
    # The same channel (one key series) sees one structure in several memory layouts; the
    # send path copies dense CPU tensors straight from their memory and must not do so for
    # a view with gaps, a conjugate view or a tensor in the middle of its storage.
    base = torch.arange(48.0).reshape(6, 8)
    complex_base = torch.complex(torch.arange(4.0), torch.arange(4.0) + 10)
    payloads = [
        base[:4, :4].contiguous(),  # the channel's structure: row-major (4, 4)
        base[1:5, 2:6],  # same shape, gaps between rows
        base[2:6, :4].contiguous()[:, :],  # contiguous, new values
        base.view(48)[8:24].view(4, 4),  # contiguous, in the middle of its storage
        (base[:4, :4] * 2).requires_grad_(True),  # gradient-carrying, from an op
        complex_base.conj(),  # conjugate view: its memory holds the unconjugated values
        complex_base,
        complex_base.conj().imag,  # a real view with the negative bit: memory holds +10.., values -10..
        torch._neg_view(torch.arange(4.0)).reshape(2, 2),  # the same, contiguous
        base[:4, :4].contiguous().t(),  # dense, column-major: travels with its strides
        base[:4, :4].t(),  # column-major with gaps: arrives row-major, as clone() gives it
    ]
    (_, _), got = run_ranks(_exchange, 2, args=(payloads,), timeout_s=60)
    for sent, received in zip(payloads, got, strict=True):
        assert torch.equal(received.detach(), sent.detach().resolve_conj())
        assert received.stride() == (dense_strides(sent) or sent.contiguous().stride())
    assert got[4].requires_grad and got[4].is_leaf
    assert got[9].stride() == (1, 4) and got[10].is_contiguous()


def test_many_messages_wrap_the_ring_and_a_large_one_moves_the_channel_to_a_larger_ring():
    small = [torch.full((1000,), float(i)) for i in range(400)]  # 400 x 4 kB: the 64 kB ring wraps
    large = torch.arange(1_000_000, dtype=torch.float32)  # 4 MB: larger than the ring
    payloads = [*small, large, *small[:10]]
    (_, capacity), got = run_ranks(_exchange, 2, args=(payloads,), timeout_s=60)
    assert capacity >= 16 * 1024 * 1024
    assert all(torch.equal(g, w) for g, w in zip(got, payloads))


def _peer_process_gone(rank, world_size):
    transport = _pair(rank, "gone", timeout_s=60.0)
    if rank == 1:
        transport.send(0, (1, 1, 0), torch.ones(2))
        silent_until_answered(rank, "gone")  # alive, silent: rank 0 is told its peer's process is a finished one
        return "silent"
    transport.wait(transport.post_recv(1, (1, 1, 0)), "the first gradient")
    finished = subprocess.Popen(["true"])
    finished.wait()
    transport.rings.pids[1] = finished.pid  # as if rank 1 had been killed without a word
    return silent_until_answered(rank, "gone", lambda: _wait_for_a_gradient_that_fails(transport))


def _wait_for_a_gradient_that_fails(transport) -> str:
    """Rank 0's wait for a second gradient from rank 1: the PeerFailure's message.

    A PeerFailure, not the CommTimeout that the 60 s timeout would raise: the wait ended on what it
    learned of rank 1 (how soon is `python tools/kill_trials.py`'s figure, not a test's).
    """
    with pytest.raises(PeerFailure) as info:
        transport.wait(transport.post_recv(1, (1, 1, 1)), "the second gradient")
    return str(info.value)


def test_a_peer_whose_process_is_gone_is_noticed_not_waited_out():
    message, _ = run_ranks(_peer_process_gone, 2, timeout_s=60)
    assert "rank 0 waited for the second gradient from rank 1, but rank 1" in message and "has exited" in message


def _survivor_view(rank, world_size):
    transport = _pair(rank, "survivor", timeout_s=60.0)
    if rank == 1:
        transport.send(0, (1, 1, 0), torch.ones(2))
        time.sleep(0.3)
        transport.publish_failure("ValueError: broken stage")
        return "failed on purpose"
    transport.wait(transport.post_recv(1, (1, 1, 0)), "the first gradient")
    return _wait_for_a_gradient_that_fails(transport)


def test_a_failure_written_into_the_ring_reaches_the_waiting_peer_at_once():
    message, _ = run_ranks(_survivor_view, 2, timeout_s=60)
    assert message == "rank 1 failed: ValueError: broken stage"


def _timeout(rank, world_size):
    transport = _pair(rank, "timeout", timeout_s=1.0)
    if rank == 1:
        silent_until_answered(rank, "timeout")
        return "slept"

    def times_out():
        with pytest.raises(CommTimeout) as info:
            transport.wait(transport.post_recv(1, (1, 1, 0)), "stage 0's output gradient (0RECV_B0)")
        return str(info.value)

    return silent_until_answered(rank, "timeout", times_out)


def test_a_receive_that_never_comes_times_out_with_what_it_waited_for():
    message, _ = run_ranks(_timeout, 2, timeout_s=60)
    assert message.startswith("rank 0 waited 1 s for stage 0's output gradient (0RECV_B0) from rank 1")


def _chosen(rank, world_size, transport):
    schedule = cs.build("gpipe", ranks=2, microbatches=2)
    try:
        pipe = conveyor.Pipeline([torch.nn.Linear(2, 2)], schedule=schedule,
                                 transfer=conveyor.TransferOptions(transport=transport))
    except PipelineConfigError as exc:
        return str(exc)
    return type(pipe.ranks.transport).__name__


def test_auto_takes_shared_memory_when_every_rank_is_on_this_host_else_the_process_group():
    assert run_ranks(_chosen, 2, args=("auto",)) == [SharedMemoryTransport.__name__] * 2
    # A launcher that reports fewer local ranks than ranks in all: the ranks compare hosts
    # (tests/runtime/test_hybrid.py plays several), and here they share one.
    assert run_ranks(_chosen, 2, args=("auto",), env={"LOCAL_WORLD_SIZE": "1"}) == [SharedMemoryTransport.__name__] * 2
    assert run_ranks(_chosen_apart, 2, env={"LOCAL_WORLD_SIZE": "1"}) == [DistTransport.__name__] * 2
    assert run_ranks(_chosen, 2, args=("process_group",)) == [DistTransport.__name__] * 2
    message = run_ranks(_chosen, 2, args=("nccl",))[0]
    assert message == (
        "transport must be one of 'auto', 'shared_memory', 'process_group', 'hybrid', 'ordered'; got 'nccl'"
    )


def _chosen_apart(rank, world_size):
    os.environ["CONVEYOR_HOST_ID"] = f"host-{rank}"
    return _chosen(rank, world_size, "auto")


def _conveyor_descriptors() -> tuple[int, int]:
    """(ring descriptors, doorbell sockets) this process holds, told apart by their names."""
    rings = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            rings += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:conveyor-")
    with open("/proc/net/unix") as table:
        doorbells = sum(f"@conveyor-{os.getpid()}-" in line for line in table)
    return rings, doorbells


def _pipelines_come_and_go(rank, world_size):
    import gc

    schedule = cs.build("1f1b", ranks=2, microbatches=2)
    held = []
    for _ in range(5):
        pipe = conveyor.Pipeline([torch.nn.Linear(2, 2)], schedule=schedule, loss_fn=lambda y, t: y.sum(),
                                 transfer=conveyor.TransferOptions(transport="shared_memory"))
        pipe.step(torch.ones(2, 2), target=None)
        held.append(_conveyor_descriptors())
        del pipe
        gc.collect()
    return held, _conveyor_descriptors()


def test_a_dropped_pipeline_gives_its_rings_and_doorbell_back():
    for held, after in run_ranks(_pipelines_come_and_go, 2, timeout_s=60):
        # A live pipeline: its ring (its descriptor and its mapping's), the peer's ring (the
        # mapping's), its doorbell.
        assert held == [(3, 1)] * 5
        assert after == (0, 0)


def test_spin_is_long_only_when_every_local_process_has_a_core(monkeypatch):
    from conveyor.runtime.transport import shm_wait

    monkeypatch.delenv("CONVEYOR_SHM_SPIN_US", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(shm_wait, "_usable_cpus", lambda: 4)
    assert shm_wait._default_spin_s(4) == 1e-3
    assert shm_wait._default_spin_s(5) == 50e-6
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # two replicas of a 4-rank pipeline on this host
    assert shm_wait._default_spin_s(4) == 50e-6
    monkeypatch.setenv("CONVEYOR_SHM_SPIN_US", "300")
    assert shm_wait._default_spin_s(4) == 300e-6


def _in_process_pair(monkeypatch, prefix: str, spin_s=None):
    """Both ends of one boundary in this process (a HashStore stands in for the group's)."""
    import torch.distributed as dist

    monkeypatch.delenv("CONVEYOR_SHM_SPIN_US", raising=False)
    monkeypatch.setattr(SharedMemoryTransport, "_instances", {})
    store = dist.HashStore()
    sender = SharedMemoryTransport(0, {1}, store, prefix, 2, 10.0, spin_s=spin_s)
    monkeypatch.setattr(SharedMemoryTransport, "_instances", {})  # the receiver is "another rank"
    receiver = SharedMemoryTransport(1, {0}, store, prefix, 2, 10.0, spin_s=spin_s)
    return sender, receiver


def test_after_a_long_wait_the_next_wait_polls_briefly_unless_the_spin_was_given(monkeypatch):
    from conveyor.runtime.transport import shm_wait

    sender, receiver = _in_process_pair(monkeypatch, "adaptive")
    receiver.waiter.spin_s = 1e-3
    sender.send(1, (0, 0, 0), torch.ones(2))
    receiver.wait(receiver.post_recv(0, (0, 0, 0)), "m0")  # already there: no wait
    assert receiver.waiter.next_spin_s() == 1e-3
    receiver.waiter.last_wait_s = 0.2  # a neighbour computed for 200 ms
    assert receiver.waiter.next_spin_s() == shm_wait._SHORT_SPIN_S
    sender.send(1, (0, 0, 1), torch.ones(2))
    receiver.wait(receiver.post_recv(0, (0, 0, 1)), "m1")
    assert receiver.waiter.next_spin_s() == 1e-3  # the message was waiting: back to the long poll

    _, fixed = _in_process_pair(monkeypatch, "fixed", spin_s=2e-3)
    fixed.waiter.last_wait_s = 0.2
    assert fixed.waiter.next_spin_s() == 2e-3  # an explicit spin is kept as given


def test_a_structure_sent_again_reuses_its_cached_layout(monkeypatch):
    from conveyor.runtime.transport import shm_ring

    sender, receiver = _in_process_pair(monkeypatch, "layouts")
    shm_ring._LAYOUTS.clear()
    cached = []
    for microbatch in range(6):  # two structures, alternating: each is cached once per end
        value = torch.full((3,), float(microbatch)) if microbatch % 2 else {"h": torch.ones(2, 2)}
        sender.send(1, (0, 0, microbatch), value)
        got = receiver.wait(receiver.post_recv(0, (0, 0, microbatch)), f"m{microbatch}")
        expected = value if microbatch % 2 else value["h"]
        assert torch.equal(got if microbatch % 2 else got["h"], expected)
        cached.append(len(shm_ring._LAYOUTS))
    assert sender.structures_sent == 2
    assert cached == [2, 4, 4, 4, 4, 4]  # the sender's and the receiver's copy of each structure


def test_a_ring_outgrown_twice_before_its_receiver_looked_is_still_found(monkeypatch):
    # Each payload is too large for the ring before it: two SWITCHes in a row. The receiver
    # opens the middle ring only when it reads the first SWITCH, so the sender must keep it.
    sender, receiver = _in_process_pair(monkeypatch, "outgrown")
    payloads = [torch.arange(25_000.0), torch.arange(250_000.0), torch.ones(3)]
    for microbatch, value in enumerate(payloads):
        sender.send(1, (0, 0, microbatch), value)
    assert sender.rings.outgoing[1].generation == 2 and len(sender.outbox.retired) == 2
    got = [receiver.wait(receiver.post_recv(0, (0, 0, m)), f"m{m}") for m in range(len(payloads))]
    assert all(torch.equal(g, w) for g, w in zip(got, payloads))
    sender.finish_sends()
    assert sender.outbox.retired == []  # mapped by the receiver, then closed


def test_a_peer_that_failed_and_took_its_rings_along_is_reported_by_its_own_message(monkeypatch):
    sender, receiver = _in_process_pair(monkeypatch, "gone")
    sender.publish_failure("StageExecutionError: boom on rank 0")
    for outgoing in sender.rings.outgoing.values():
        outgoing.ring.close()  # what its process's exit does, before the receiver mapped the ring
    with pytest.raises(PeerFailure, match="rank 0 failed: StageExecutionError: boom on rank 0"):
        receiver.wait(receiver.post_recv(0, (0, 0, 0)), "stage 0's output")
