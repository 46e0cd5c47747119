"""A pipeline's life on a rank: close() leaves nothing behind, a closed pipeline refuses calls, and a
caught conveyor error leaves the user's process groups usable (the pipeline only closes its own)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import conveyor
import conveyor.schedule as cs
from conveyor.errors import PeerFailure, PipelineClosed, PipelineConfigError, PipelineStopped
from conveyor.testing import run_ranks
from conveyor.testing.models import TinyConfig, build_stage, lm_loss, make_batch
from conveyor.testing.rigs.silent_peer import poll_until, silent_until_answered

TRANSPORTS = ("shared_memory", "process_group", "hybrid")


def _use_transport(rank: int, transport: str) -> None:
    if transport == "hybrid":
        os.environ["CONVEYOR_HOST_ID"] = f"host-{rank // 2}"  # ranks 0-1 and 2-3 play two hosts


def _held_by_process() -> dict[str, object]:
    """What a rank holds that a pipeline could leak: descriptors by kind, OS threads, Python threads."""
    kinds: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        kind = "memfd" if target.startswith("/memfd:") else target.split(":")[0] if ":" in target else "file"
        kinds[kind] = kinds.get(kind, 0) + 1
    return {"fds": kinds, "os_threads": len(os.listdir("/proc/self/task")),
            "python_threads": sorted(t.name for t in threading.enumerate()),
            # /dev/shm is the host's: Python's multiprocessing semaphores (sem.mp-*) of any other
            # process (a launcher, a compile worker, another test run) come and go there.
            "dev_shm": sorted(name for name in os.listdir("/dev/shm") if not name.startswith("sem.mp-"))}


def _tiny_pipeline_setting(rank, world_size, transport):
    """Schedule, model config and what the process holds before the pipeline is built."""
    import torch.distributed as dist

    _use_transport(rank, transport)
    dist.barrier()  # the default group's own threads and sockets exist before we look
    schedule = cs.build("1f1b", ranks=world_size, microbatches=4)
    cfg = TinyConfig(num_stages=world_size, blocks_per_stage=1, dim=16, seq_len=8)
    return schedule, cfg, _held_by_process()


def _train_then_close(rank, world_size, transport):
    import torch.distributed as dist

    schedule, cfg, before = _tiny_pipeline_setting(rank, world_size, transport)
    with conveyor.Pipeline([build_stage(rank, cfg)], schedule=schedule, loss_fn=lm_loss,
                           transfer=conveyor.TransferOptions(timeout_s=60, transport=transport)) as pipe:
        ids, targets = make_batch(cfg, 8, seed=0)
        pipe.step(ids if rank == 0 else None, target=targets if rank == world_size - 1 else None)
        pipe.clip_grad_norm_(1.0)
        pipe.timeline()
        during = _held_by_process()
    after = _held_by_process()
    refused = []
    for call in (lambda: pipe.step(None), lambda: pipe.forward(None), lambda: pipe.clip_grad_norm_(1.0),
                 pipe.timeline):
        try:
            call()
        except PipelineClosed as exc:
            refused.append(str(exc))
    pipe.close()  # a second close is a no-op
    dist.barrier()  # the user's group still works
    return before, during, after, refused, pipe.closed


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_close_releases_rings_sockets_threads_and_groups(transport):
    results = run_ranks(_train_then_close, 4, args=(transport,), timeout_s=90)
    for rank, (before, during, after, refused, closed) in enumerate(results):
        assert during["os_threads"] > before["os_threads"], "the pipeline's own process groups have threads"
        assert after == before, f"rank {rank} kept something after close: {before} -> {after}"
        assert len(refused) == 4 and all("this pipeline was closed" in m for m in refused), refused
        assert closed
    if transport != "process_group":
        assert any(r[1]["fds"].get("memfd", 0) > 0 for r in results), "shared memory rings were in use"


def _caught_error_then_user_collectives(rank, world_size, transport):
    """The first-contact script: a batch the microbatch count does not divide, caught and logged."""
    import torch.distributed as dist

    schedule, cfg, before = _tiny_pipeline_setting(rank, world_size, transport)
    pipe = conveyor.Pipeline([build_stage(rank, cfg)], schedule=schedule, loss_fn=lm_loss,
                             transfer=conveyor.TransferOptions(timeout_s=60, transport=transport))
    ids, targets = make_batch(cfg, 6, seed=0)
    try:
        pipe.step(ids if rank == 0 else None, target=targets[:4] if rank == world_size - 1 else None)
    except (PipelineConfigError, PeerFailure) as exc:
        caught = f"{type(exc).__name__}: {exc}"
    else:
        caught = "no error"
    try:
        pipe.step(ids[:4] if rank == 0 else None, target=targets[:4] if rank == world_size - 1 else None)
    except PipelineStopped as exc:
        again = str(exc)
    left_behind = {k: (before[k], v) for k, v in _held_by_process().items() if v != before[k]}
    # The user's own lines after the error: all of them work.
    global_rank = dist.get_rank()
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    dist.barrier()
    dist.destroy_process_group()
    return caught, again, global_rank, total.item(), dist.is_initialized(), left_behind


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_caught_error_leaves_the_users_process_group_usable(transport):
    """...and the stopped pipeline holds nothing any more (no close needed): rings, sockets, threads."""
    results = run_ranks(_caught_error_then_user_collectives, 4, args=(transport,), timeout_s=90)
    for rank, (caught, again, global_rank, total, initialized, left_behind) in enumerate(results):
        assert left_behind == {}, f"rank {rank} still holds after its failure: {left_behind}"
        if rank == 0:
            assert caught.startswith("PipelineConfigError") and "batch size 6" in caught, caught
        else:
            assert caught.startswith("PeerFailure") and "rank 0 failed" in caught and "batch size 6" in caught, caught
        assert "stopped after a failure" in again and "yours are untouched" in again
        assert (global_rank, total, initialized) == (rank, 4.0, False)


def test_a_pipeline_refuses_a_transport_it_does_not_know_before_building_anything():
    def build(rank, world_size):
        try:
            conveyor.Pipeline([torch.nn.Linear(2, 2)], schedule="1f1b", microbatches=2,
                              transfer=conveyor.TransferOptions(transport="carrier-pigeon"))
        except PipelineConfigError as exc:
            return str(exc)

    messages = run_ranks(build, 2, timeout_s=60)
    assert all("transport must be one of" in m and "'carrier-pigeon'" in m for m in messages)


def test_the_in_process_pipeline_closes_too():
    stages = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)]
    with conveyor.Pipeline(stages, schedule="1f1b", microbatches=2,
                           loss_fn=lambda y, t: (y - t).pow(2).mean(), layout=conveyor.InProcessLayout()) as pipe:
        pipe.step(torch.ones(4, 4), target=torch.zeros(4, 1))
    assert pipe.closed
    with pytest.raises(PipelineClosed, match="this pipeline was closed"):
        pipe.step(torch.ones(4, 4), target=torch.zeros(4, 1))


def _one_rank_never_comes(rank, world_size, transport):
    schedule = cs.build("1f1b", ranks=world_size, microbatches=2)
    pipe = conveyor.Pipeline([torch.nn.Linear(4, 4)], schedule=schedule, loss_fn=lambda y, t: y.sum(),
                             transfer=conveyor.TransferOptions(timeout_s=2, transport=transport))

    def step() -> str:
        try:
            pipe.step(torch.ones(2, 4))
        except Exception as exc:
            return str(exc)
        return "no error"

    # Rank 1 is alive, its watcher answering, but never in the step: until rank 0 has its answer, not a fixed 8 s.
    answer = silent_until_answered(rank, "never comes", step)
    return answer if rank == 0 else ""


@pytest.mark.parametrize("transport", ["shared_memory", "process_group"])
def test_a_timeout_shows_where_every_rank_stands(transport):
    message = run_ranks(_one_rank_never_comes, 2, args=(transport,), timeout_s=60)[0]
    assert "rank 0 waited 2 s for" in message
    assert "where every rank of the pipeline stands" in message, message
    assert "rank 0: action 4 of 8 in run 1" in message and "waits for 0RECV_B0" in message, message
    assert "rank 1: between steps (0 run(s) started)" in message, message
    assert ">0RECV_B0<" in message  # the grid, with rank 0's place marked


def _picture_on_request(rank, world_size, trigger):
    os.environ["CONVEYOR_WHERE_TRIGGER"] = trigger
    schedule = cs.build("1f1b", ranks=world_size, microbatches=2)
    pipe = conveyor.Pipeline([torch.nn.Linear(4, 4)], schedule=schedule, loss_fn=lambda y, t: y.sum(),
                             transfer=conveyor.TransferOptions(timeout_s=60))
    if rank == 0:
        threading.Timer(0.5, lambda: open(trigger, "w").close()).start()  # as `touch` from a shell would
    else:
        # Rank 0 waits for this rank meanwhile; it joins once the picture is written (within about a second).
        poll_until(lambda: os.path.exists(f"{trigger}.txt"), "the picture")
    pipe.step(torch.ones(2, 4) if rank == 0 else None)
    pipe.close()
    if rank == 0:
        with open(f"{trigger}.txt") as picture:
            return picture.read(), os.path.exists(trigger)
    return None


def test_the_picture_on_request_from_a_trigger_file(tmp_path):
    picture, trigger_left = run_ranks(_picture_on_request, 2, args=(str(tmp_path / "where"),), timeout_s=60)[0]
    assert "rank 0: action" in picture and "waits for 0RECV_B0" in picture, picture
    assert "rank 1: between steps" in picture and ">0RECV_B0<" in picture
    assert not trigger_left
