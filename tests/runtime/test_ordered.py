"""transport='ordered' (NCCL's) over gloo ranks: transfers matched by order, bitwise equal to one device.

Gloo matches by order too when every tag is the same, so these runs check the order logic
(receives posted in the sender's order, one process group per channel, data only after the
first structure) that NCCL relies on.
"""

from __future__ import annotations

import time

import pytest
import torch

import conveyor
import conveyor.schedule as cs
from conveyor.runtime.transport.ordered import OrderedTransport
from conveyor.testing import run_ranks
from conveyor.testing.references.schedule_parity import NUM_MICROBATCHES, assert_same, reference_run, schedule_grid

from .test_pipeline_dist import _raise_in_stage, _train


def _every_schedule(rank, world_size, cases):
    return [_train(rank, world_size, name, virtual, False, "ordered") for name, virtual in cases]


# P=4 over this transport is the extended tier: P=4 runs every schedule over the default transport
# in CI (test_pipeline_dist), and the in-order discipline is checked deadlock-free at P in {2, 4, 8}
# statically (tests/schedule).
@pytest.mark.parametrize("num_ranks", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_every_schedule_is_bitwise_equal_to_one_device_when_matched_by_order(num_ranks):
    """Every built-in schedule (V in {1, 2} where it takes it), one set of ranks building each in turn.

    CI twin of ``[4]``: ``[2]`` (the same assertions on 2 ranks)."""
    cases = [(name, virtual) for name, _, virtual in schedule_grid((num_ranks,))]
    results = run_ranks(_every_schedule, num_ranks, args=(cases,), timeout_s=240)
    for index, (name, virtual) in enumerate(cases):
        schedule = cs.build(name, ranks=num_ranks, microbatches=NUM_MICROBATCHES, virtual=virtual)
        want_losses, want_grads, want_params = reference_run(schedule)
        for rank in range(num_ranks):
            losses, grads, params, _ = results[rank][index]
            where = f"{name} P={num_ranks} V={virtual} rank {rank}"
            assert all(torch.equal(got, want) for got, want in zip(losses, want_losses)), where
            for stage in schedule.stages_of(rank):
                assert_same(f"{where} stage {stage} grads", grads[stage], want_grads[stage])
                assert_same(f"{where} stage {stage} params", params[stage], want_params[stage])


def _structures_then_data(rank, world_size):
    schedule = cs.build("1f1b", ranks=2, microbatches=2)
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 4)
    pipe = conveyor.Pipeline([module], schedule=schedule, loss_fn=lambda y, t: y.sum(),
                             transfer=conveyor.TransferOptions(timeout_s=30, transport="ordered"))
    sent = []
    for _ in range(3):
        pipe.step(torch.ones(4, 4))
        sent.append(pipe.ranks.transport.structures_sent)
    try:
        pipe.step(torch.ones(6, 4))  # microbatches of 3 rows, not 2
    except Exception as exc:
        return sent, f"{type(exc).__name__}: {exc}"
    return sent, "no error"


def test_structures_travel_once_then_data_only_and_a_change_is_named():
    results = run_ranks(_structures_then_data, 2, timeout_s=60)
    (sent0, error0), (sent1, _) = results
    assert sent0 == [2, 2, 2] and sent1 == [2, 2, 2]  # two microbatches' outputs / gradients, in step 1 only
    assert "SpecMismatchError" in error0 and "rank 0, stage 0, microbatch 0" in error0
    assert "transport='ordered'" in error0 and "(3, 4) float32" in error0


def test_peers_report_the_failing_ranks_message():
    results = run_ranks(_raise_in_stage, 4, args=("ordered",), timeout_s=60)
    messages = results
    assert "boom inside stage 2" in messages[2]
    for rank in (0, 1, 3):
        assert "PeerFailure" in messages[rank] and "rank 2 failed" in messages[rank], messages[rank]


def _watcher_aborts_on_a_published_failure(rank, world_size):
    import torch.distributed as dist

    schedule = cs.build("1f1b", ranks=2, microbatches=2)
    torch.manual_seed(0)
    pipe = conveyor.Pipeline([torch.nn.Linear(4, 4)], schedule=schedule, loss_fn=lambda y, t: y.sum(),
                             transfer=conveyor.TransferOptions(timeout_s=30, transport="ordered"))
    pipe.step(torch.ones(4, 4))
    life, seen = pipe.ranks.life, {}
    if rank == 0:
        aborted: list[list[int]] = []
        real_abort = dist.ProcessGroup.abort
        # Recorded, not done: gloo's groups must stay usable for the clean close below.
        dist.ProcessGroup.abort = lambda group: aborted.append(dist.get_process_group_ranks(group))
        life.transport.peer_failures = lambda: "rank 1 failed: boom (published by the test)"
        try:
            seen["gloo_setting"] = life.watch.abort_on_failure
            time.sleep(1.5)  # three polls of the watcher under gloo's setting: nothing aborted
            seen["aborted_under_gloo"] = list(aborted)
            life.watch.abort_on_failure = True  # NCCL's setting: the watcher thread acts by itself
            deadline = time.monotonic() + 10
            while not aborted and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.5)  # later polls abort nothing twice
            seen.update(aborted=aborted, groups=[dist.get_process_group_ranks(g) for g in life.groups.made],
                        because=life.watch.aborted_because)
        finally:
            dist.ProcessGroup.abort = real_abort
            del life.transport.peer_failures
            life.watch.abort_on_failure, life.watch.aborted_because = False, None
    dist.barrier()
    pipe.close()
    return seen


def test_the_watcher_aborts_every_communicator_once_a_peer_publishes_a_failure():
    """NCCL's waits are the streams': the pipeline's watcher thread, not a wait, must notice a failure
    on the store and abort the communicators (each once). Checked with gloo ranks under NCCL's setting."""
    seen = run_ranks(_watcher_aborts_on_a_published_failure, 2, timeout_s=60)[0]
    assert seen["gloo_setting"] is False and seen["aborted_under_gloo"] == []
    assert len(seen["groups"]) >= 2  # the pipeline's group and its channels' groups
    assert sorted(seen["aborted"]) == sorted(seen["groups"]), seen
    assert "boom (published by the test)" in seen["because"]


def _store_prefixes_of_two_pipelines_in_turn(rank, world_size):
    schedule = cs.build("1f1b", ranks=2, microbatches=2)
    prefixes = []
    for rows in (2, 3):  # the second pipeline's microbatches have another shape
        torch.manual_seed(0)
        pipe = conveyor.Pipeline([torch.nn.Linear(4, 4)], schedule=schedule, loss_fn=lambda y, t: y.sum(),
                                 transfer=conveyor.TransferOptions(timeout_s=30, transport="ordered"))
        pipe.step(torch.ones(2 * rows, 4))
        prefixes.append((pipe.ranks.life.groups.store_prefix(), pipe.ranks.transport.prefix))
        pipe.close()
    return prefixes


def test_each_pipeline_keys_the_store_with_a_token_its_ranks_agreed_on():
    """Under group=, a group's name comes back once a closed pipeline's groups are gone: the keys of
    the structures that travelled once (and the position board's) carry a token of the pipeline's
    own, so a later pipeline on the same ranks never sizes its buffers from a dead one's (gloo
    aborted the process on the size mismatch)."""
    results = run_ranks(_store_prefixes_of_two_pipelines_in_turn, 2, timeout_s=90)
    assert results[0] == results[1]  # every rank of a pipeline uses the same keys
    (first, first_transport), (second, second_transport) = results[0]
    assert first == first_transport and second == second_transport
    assert first != second and first.split("/")[-1] != second.split("/")[-1]


class _Work:
    """A send's work as NCCL's behaves: complete once its CUDA event is (here: when the test says)."""

    def __init__(self, done: set) -> None:
        self.done, self.waited = done, False

    def is_completed(self) -> bool:
        return self in self.done

    def wait(self) -> bool:
        assert self in self.done, "waited for a send that had not completed: that would block the host"
        self.waited = True
        return True


class _Dist:
    """torch.distributed's point-to-point as the ordered transport calls it, recording each batch's work."""

    P2POp = staticmethod(lambda op, tensor, peer, group: tensor)
    isend = irecv = None

    def __init__(self) -> None:
        self.done: set = set()
        self.works: list[_Work] = []

    def batch_isend_irecv(self, ops):
        self.works.append(_Work(self.done))
        return [self.works[-1]]


def test_a_send_lets_go_of_its_buffer_once_its_work_completed_not_at_the_end_of_the_step():
    """Under NCCL a send's work completes on the GPU; the transport asks (is_completed: a CUDA
    event query, no host sync) as later transfers post and at waits, and drops the work and its
    buffer then, instead of holding every send of the step until finish_sends. (gloo's send
    works complete only inside wait(): there they are held to the end of the step, as before.)"""
    import weakref

    transport = OrderedTransport(0, [0, 1], {(0, 1): "group"}, _Store(), "test", 30.0, torch.device("cpu"), "nccl")
    transport.dist = fake = _Dist()
    outputs = [torch.full((3, 5), float(m)) for m in range(4)]
    transport.post_sends(1, [(0, 0, 0)], [outputs[0]])
    transport.post_sends(1, [(0, 0, 1)], [outputs[1]])
    freed = weakref.ref(transport.pending_sends[0][1][0])
    assert len(transport.pending_sends) == 2
    fake.done.add(fake.works[0])  # the first send arrived
    outputs[0] = None  # the stage let go of its output: only the transport could hold it now
    transport.post_sends(1, [(0, 0, 2)], [outputs[2]])  # a later post looks
    assert len(transport.pending_sends) == 2 and freed() is None and fake.works[0].waited
    assert not fake.works[1].waited  # not complete: neither waited for nor dropped
    fake.done.update(fake.works[1:])
    transport.finish_sends()
    assert transport.pending_sends == []


class _Store(dict):
    def set(self, key, value):
        self[key] = value


def test_the_ordered_transport_packs_and_lays_out_on_its_device():
    """Under NCCL the bytes are made on the stage's GPU: the meta device stands in (a copy
    between it and the CPU raises)."""
    transport = OrderedTransport(0, [0, 1], {}, _Store(), "test", 30.0, torch.device("meta"), "nccl")
    x = torch.ones(3, 5, device="meta")
    assert transport._body(1, (0, 0, 0), (x, 2 * x)).device.type == "meta"  # the first time: packed
    assert transport._body(1, (0, 0, 1), x.t()).device.type == "meta"
    # Told "transposed" the first time, later given a row-major tensor: re-laid out on the device.
    assert transport._body(1, (0, 0, 1), x.t().contiguous()).device.type == "meta"
