"""The failure protocol under NCCL's setting, on gloo ranks: the watcher, not a wait, finds a dead peer.

Under NCCL a rank waiting for a peer waits on the GPU's streams, so no wait of the host ever
notices that the peer was killed (it publishes nothing) or froze; only the pipeline's watcher
thread can, from the store: the peer's process gone from this host, its heartbeat stopped, or a
call running past timeout_s. It then aborts every communicator of the pipeline, once, together,
and the waiting call raises what it saw. Here the ranks are gloo's with the watcher switched to
NCCL's setting; the peer's death is played by its data plane going silent, as a dead NCCL peer's
is (its sockets stay open), while its process in the store is a stand-in that is SIGKILLed, its
heartbeat stops and it publishes nothing. ``ProcessGroup.abort`` is recorded, not done (gloo
ignores it): the watcher's abort is what the survivor's test waits for.
"""

from __future__ import annotations

import subprocess
import threading
import time
import types

import pytest
import torch

import conveyor
import conveyor.schedule as cs
from conveyor.runtime.lifecycle import aborts, peers
from conveyor.runtime.lifecycle import rank as lifecycle
from conveyor.runtime.lifecycle.peers import host_identity
from conveyor.testing import run_ranks

SCENARIOS = ("killed", "frozen", "stuck", "queued")
_ABORTED_KEY = "test/aborted/{scenario}"
_GAVE_UP_KEY = "test/victim-gave-up/{scenario}"  # the victim left by itself: no watcher aborted first


class _Stage(torch.nn.Module):
    """A linear stage whose forward runs ``trap`` when armed (the victim's death or its stall)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.trap = None

    def forward(self, x):
        if self.trap is not None:
            trap, self.trap = self.trap, None
            trap()
        return self.linear(x)


class _KernelsThatNeverEnd:
    """torch.cuda.Event for the lifecycle: the call's GPU work never ends (a peer died after the host returned)."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return False


_GPU = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True,
                                                        Event=_KernelsThatNeverEnd))


def _play_dead(life, scenario: str) -> None:
    """Rank 1 as a killed (or frozen) NCCL peer: silent data plane, no heartbeat, nothing published."""
    if scenario == "killed":  # its process, as the store names it, is gone
        stand_in = subprocess.Popen(["sleep", "60"])
        stand_in.kill()  # SIGKILL
        stand_in.wait()
        life.store.set(peers._PROCESS_KEY.format(global_rank=1), f"{stand_in.pid} {host_identity()}")
    if scenario != "stuck":
        life.board.stop()  # the heartbeat stops
    life.transport.publish_failure = lambda message: None  # a killed process publishes nothing
    # Silent until the survivor's watcher aborted, or until a cut-off that fails the test (it says so
    # in the store before it leaves, so the survivor can tell); polled: a store.wait would hold the
    # store's connection, and with it this rank's heartbeat.
    deadline = time.monotonic() + 45
    while not life.store.check([_ABORTED_KEY.format(scenario=scenario)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not life.store.check([_ABORTED_KEY.format(scenario=scenario)]):
        life.store.set(_GAVE_UP_KEY.format(scenario=scenario), "1")
    if scenario != "stuck":
        raise RuntimeError("the victim leaves: its connections close")


def _scenario(rank, scenario):
    import torch.distributed as dist

    torch.manual_seed(0)
    stage = _Stage()
    pipe = conveyor.Pipeline([stage], schedule=cs.build("1f1b", ranks=2, microbatches=2),
                             loss_fn=lambda y, t: y.sum(),
                             transfer=conveyor.TransferOptions(timeout_s=60, transport="ordered"))
    pipe.step(torch.ones(4, 4))  # a normal step first: heartbeats beat, structures are known
    life, seen = pipe.ranks.life, {}
    if rank == 1 and scenario != "queued":
        stage.trap = lambda: _play_dead(life, scenario)
    elif rank == 1:
        pass
    else:
        aborted, real_abort = [], dist.ProcessGroup.abort

        def record(group):
            aborted.append((dist.get_process_group_ranks(group), threading.current_thread().name))
            life.store.set(_ABORTED_KEY.format(scenario=scenario), "1")

        dist.ProcessGroup.abort = record
        life.watch.abort_on_failure = True  # NCCL's setting
        # Short limits only where they are the point: a live peer's heartbeat may pause on a busy machine.
        life.peers.silence_s = 2.0 if scenario == "frozen" else 60.0
        life.watch.timeout_s = 3.0 if scenario == "stuck" else 60.0
        if scenario == "queued":
            lifecycle.torch = _GPU
        seen["groups"] = [dist.get_process_group_ranks(group) for group in life.groups.made]
    try:
        pipe.step(torch.ones(4, 4))
        seen["error"] = "no error"
    except Exception as exc:
        seen["error"] = f"{type(exc).__name__}: {exc}"
    # Read after the step ended: a victim that gave up wrote it before it left (which is what would
    # have ended this step had no watcher aborted).
    seen["victim_gave_up"] = life.store.check([_GAVE_UP_KEY.format(scenario=scenario)])
    if scenario == "queued":  # the host returned, the kernels wait on: the next call says why
        life.watch.timeout_s, deadline = 3.0, time.monotonic() + 60  # a cut-off, not a figure
        while rank == 0 and not aborted and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            pipe.step(torch.ones(4, 4))
            seen["then"] = "no error"
        except Exception as exc:
            seen["then"] = f"{type(exc).__name__}: {exc}"
    if rank == 0:
        lifecycle.torch = torch
        dist.ProcessGroup.abort = real_abort
        seen["aborted"] = aborted
    dist.barrier()  # the user's group is untouched
    pipe.close()
    return seen


def _peer_closes_then_exits(rank):
    """Rank 1 closes its pipeline and its process exits (a stand-in's), as at the end of a run:
    no death, though its heartbeat stops and its process is gone."""
    import torch.distributed as dist

    pipe = conveyor.Pipeline([_Stage()], schedule=cs.build("1f1b", ranks=2, microbatches=2),
                             loss_fn=lambda y, t: y.sum(),
                             transfer=conveyor.TransferOptions(timeout_s=60, transport="ordered"))
    pipe.step(torch.ones(4, 4))
    life, seen = pipe.ranks.life, {}
    if rank == 0:
        aborted, real_abort = [], dist.ProcessGroup.abort
        dist.ProcessGroup.abort = lambda group: aborted.append(dist.get_process_group_ranks(group))
        life.watch.abort_on_failure, life.peers.silence_s = True, 0.5
    dist.barrier()
    if rank == 1:
        pipe.close()
        stand_in = subprocess.Popen(["sleep", "60"])
        stand_in.kill()
        stand_in.wait()
        life.store.set(peers._PROCESS_KEY.format(global_rank=1), f"{stand_in.pid} {host_identity()}")
    dist.barrier()
    if rank == 0:
        time.sleep(2.0)  # four polls: past the silence allowed, with the peer's process gone
        dist.ProcessGroup.abort = real_abort
        seen.update(aborted=aborted, error=repr(life.watch.abort_error))
    dist.barrier()
    pipe.close()
    return seen


def _every_scenario(rank, world_size):
    # One pipeline after another on the same ranks: "closed" also checks that what earlier
    # pipelines' ranks published on the job's failure board is no failure of a later one.
    seen = {scenario: _scenario(rank, scenario) for scenario in SCENARIOS}
    return {**seen, "closed": _peer_closes_then_exits(rank)}


@pytest.fixture(scope="module")
def survivor():
    return run_ranks(_every_scenario, 2, timeout_s=150)[0]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_watcher_aborts_every_communicator_once_by_itself(survivor, scenario):
    seen = survivor[scenario]
    assert len(seen["groups"]) >= 2  # the pipeline's group and its channels' groups
    assert sorted(ranks for ranks, _ in seen["aborted"]) == sorted(seen["groups"]), seen
    assert {thread for _, thread in seen["aborted"]} == {"conveyor-where-0"}  # the watcher, by itself
    # The watcher aborted while the victim still waited for it (not when the victim left, nor at the 60 s timeout).
    assert not seen["victim_gave_up"], seen


def test_the_survivors_error_names_the_dead_or_silent_rank(survivor):
    assert survivor["killed"]["error"].startswith("PeerFailure: rank 1 (pid "), survivor["killed"]
    assert "has exited" in survivor["killed"]["error"]
    assert survivor["frozen"]["error"].startswith("PeerFailure: rank 1 stopped answering (no heartbeat for ")
    stuck = survivor["stuck"]["error"]
    assert stuck.startswith("CommTimeout: rank 0: a pipeline call has waited more than timeout_s=3 s"), stuck
    assert "where every rank of the pipeline stands" in stuck and "rank 1" in stuck.split("stands")[1]
    queued = survivor["queued"]
    assert queued["error"] == "no error", queued  # the step's host part went through
    assert queued["then"].startswith("CommTimeout: rank 0: a pipeline call has waited more than timeout_s=3 s")
    assert "where every rank of the pipeline stands" in queued["then"]


def test_a_peer_that_closed_its_pipeline_may_exit_without_being_taken_for_dead(survivor):
    assert survivor["closed"] == {"aborted": [], "error": "None"}


class _FakeNccl:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def _group_start(self) -> None:
        self.calls.append("start")

    def _group_end(self) -> None:
        self.calls.append("end")


class _FakeGroup:
    def __init__(self, name: str, calls: list[str]) -> None:
        self.group_name, self.calls = name, calls

    def abort(self) -> None:
        self.calls.append(f"abort {self.group_name}")


def test_communicators_are_aborted_together_in_one_nccl_group_call_and_each_once(monkeypatch):
    """pytorch#119797 / NCCL#1013: one abort after another can deadlock; inside ncclGroupStart/End
    NCCL aborts them together (torch's _abort_process_group does so for the whole job)."""
    calls: list[str] = []
    monkeypatch.setattr(aborts, "nccl_backend", lambda groups: _FakeNccl(calls) if groups else None)
    groups = [_FakeGroup(name, calls) for name in ("main", "0->1", "1->0")]
    aborter = aborts.GroupAborter(0)
    aborter.abort(groups[:2])  # the watcher
    aborter.abort(groups)  # the failing call's close: only what is left
    aborter.abort(groups)
    assert calls == ["start", "abort main", "abort 0->1", "end", "start", "abort 1->0", "end"]


def _close_after_the_watchers_abort(rank, world_size):
    import torch.distributed as dist

    life = lifecycle.RankLifecycle(None, timeout_s=30.0)
    life.groups.subgroup([0])  # a second group of the pipeline's (a tied parameter's)
    groups = list(life.groups.made)
    names = {id(group): f"group {index}" for index, group in enumerate(groups)}
    aborted, real_abort = [], dist.ProcessGroup.abort
    dist.ProcessGroup.abort = lambda group: aborted.append(names[id(group)])
    try:
        life.watch.aborter.abort(groups[:1])  # the watcher got to the first one
        life.backend, life.state = "nccl", lifecycle.STOPPED  # then the call failed under NCCL
        life._destroy_groups()
    finally:
        dist.ProcessGroup.abort = real_abort
    forgotten = all(group not in dist.distributed_c10d._world.pg_map for group in groups)
    return aborted, forgotten, len(groups)


def test_closing_after_a_failure_aborts_what_the_watcher_did_not_and_torch_forgets_every_group():
    aborted, forgotten, count = run_ranks(_close_after_the_watchers_abort, 1, timeout_s=60)[0]
    assert count == 2 and aborted == ["group 0", "group 1"] and forgotten
