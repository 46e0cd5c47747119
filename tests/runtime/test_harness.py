"""The multi-process harness: results come back, failures and hangs are reported, never hidden.

Rank functions live at module level so that the spawn test can import them.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from conveyor.errors import ConveyorError
from conveyor.processes import group as rank_group
from conveyor.testing import (
    HarnessConfigError,
    RankFailure,
    RankTimeout,
    run_ranks,
)

pytestmark = pytest.mark.distributed


# --- rank functions -------------------------------------------------------------------


def _sum_of_ranks(rank: int, world_size: int) -> dict[str, object]:
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return {
        "sum": value.item(),
        "dist_rank": dist.get_rank(),
        "dist_world_size": dist.get_world_size(),
        "env": [os.environ[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")],
        "port": int(os.environ["MASTER_PORT"]),
        "threads": torch.get_num_threads(),
    }


def _ring_exchange(rank: int, world_size: int) -> list[float]:
    outgoing = torch.full((3,), 10.0 * rank)
    incoming = torch.empty(3)
    send = dist.isend(outgoing, dst=(rank + 1) % world_size)
    receive = dist.irecv(incoming, src=(rank - 1) % world_size)
    send.wait()
    receive.wait()
    return incoming.tolist()


def _scaled(rank: int, world_size: int, base: torch.Tensor, *, scale: float) -> torch.Tensor:
    assert not dist.is_initialized()
    return base * scale + rank


def _raise_on_two(rank: int, world_size: int) -> None:
    if rank == 2:
        raise ValueError("boom on 2")
    dist.barrier()


def _blocked_in_recv_while_peer_raises(rank: int, world_size: int) -> str:
    if rank == 0:
        return "done"
    if rank == 1:
        dist.recv(torch.empty(1), src=2)
    time.sleep(0.3)
    raise ValueError("rank 2 gives up before sending")


def _stuck_in_recv() -> None:
    dist.recv(torch.empty(1), src=2)


def _stuck_in_barrier() -> None:
    dist.barrier()


def _hang(rank: int, world_size: int) -> None:
    if rank == 0:
        _stuck_in_recv()
    else:
        _stuck_in_barrier()


def _exit_three_on_one(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _segfault_on_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        ctypes.string_at(0)  # reads address 0: SIGSEGV


def _return_lock(rank: int, world_size: int) -> threading.Lock:
    return threading.Lock()


def _return_bytes(rank: int, world_size: int, size: int) -> bytes:
    return bytes(size)


# --- results --------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_all_reduce_of_rank_ids(world_size: int) -> None:
    results = run_ranks(_sum_of_ranks, world_size, timeout_s=60)

    expected_sum = float(sum(range(world_size)))
    assert [result["sum"] for result in results] == [expected_sum] * world_size
    assert [result["dist_rank"] for result in results] == list(range(world_size))
    assert {result["dist_world_size"] for result in results} == {world_size}
    assert [result["env"] for result in results] == [
        [str(rank), str(world_size), str(rank), "127.0.0.1"] for rank in range(world_size)
    ]
    assert len({result["port"] for result in results}) == 1
    assert {result["threads"] for result in results} == {1}
    assert not dist.is_initialized()  # the pytest process stays out of the process group


@pytest.mark.parametrize("world_size", [2, 4])
def test_send_recv_around_a_ring(world_size: int) -> None:
    results = run_ranks(_ring_exchange, world_size, timeout_s=60)

    assert results == [[10.0 * ((rank - 1) % world_size)] * 3 for rank in range(world_size)]


def test_args_kwargs_reach_every_rank_and_tensors_come_back() -> None:
    base = torch.arange(4, dtype=torch.float64)

    results = run_ranks(
        _scaled, 3, args=(base,), kwargs={"scale": 2.0}, init_process_group=False, timeout_s=60
    )

    for rank, result in enumerate(results):
        assert result.dtype == torch.float64
        assert result.tolist() == [0.0 + rank, 2.0 + rank, 4.0 + rank, 6.0 + rank]


def test_env_is_set_in_every_rank() -> None:
    def read_env(rank: int, world_size: int) -> str:
        return os.environ["CONVEYOR_TEST_VALUE"]

    results = run_ranks(
        read_env, 2, env={"CONVEYOR_TEST_VALUE": "set"}, init_process_group=False, timeout_s=60
    )

    assert results == ["set", "set"]


# --- failures -------------------------------------------------------------------------


def test_exception_in_one_rank_reports_its_traceback_and_kills_the_rest() -> None:
    # The others never finish by themselves: a RankFailure naming them killed (not a RankTimeout after
    # 60 s) is what shows the harness stopped them when rank 2 failed.
    with pytest.raises(RankFailure) as caught:
        run_ranks(_raise_on_two, 4, timeout_s=60)

    failure = caught.value
    message = str(failure)
    assert isinstance(failure, ConveyorError) and not isinstance(failure, RankTimeout)
    assert failure.failed == (2,)
    assert failure.killed == (0, 1, 3)
    assert failure.finished == ()
    assert failure.errors[0].kind == "exception"
    assert failure.errors[0].summary == "ValueError: boom on 2"
    assert message.startswith("1 of 4 ranks failed: rank 2 (ValueError); ")
    assert "killed while still running: ranks 0, 1, 3." in message
    assert "--- rank 2: ValueError: boom on 2 ---" in message
    assert 'raise ValueError("boom on 2")' in message
    assert ", in _raise_on_two\n" in message


def test_rank_blocked_in_recv_is_killed_when_its_peer_raises() -> None:
    with pytest.raises(RankFailure) as caught:
        run_ranks(_blocked_in_recv_while_peer_raises, 3, timeout_s=60)

    failure = caught.value
    assert not isinstance(failure, RankTimeout)  # killed when rank 2 failed, not at the 60 s timeout
    assert failure.failed == (2,)
    assert failure.killed == (1,)
    assert failure.finished == (0,)
    assert "ValueError: rank 2 gives up before sending" in str(failure)
    assert "killed while still running: rank 1; finished: rank 0." in str(failure)


def test_rank_exiting_without_exception_is_reported_with_its_exit_code() -> None:
    with pytest.raises(RankFailure) as caught:
        run_ranks(_exit_three_on_one, 2, timeout_s=60)

    failure = caught.value
    # Rank 0 may see "connection reset" before being killed; the dead rank still comes first.
    assert failure.errors[0].rank == 1
    assert failure.errors[0].kind == "exit"
    assert failure.errors[0].exit_code == 3
    assert str(failure).startswith("1 of 2 ranks failed: rank 1 (exit code 3)") or str(
        failure
    ).startswith("2 of 2 ranks failed: rank 1 (exit code 3), rank 0 (RuntimeError)")
    assert "--- rank 1: died with exit code 3, no Python exception" in str(failure)


def test_segfault_is_reported_with_signal_and_stack() -> None:
    with pytest.raises(RankFailure) as caught:
        run_ranks(_segfault_on_zero, 1, timeout_s=60)

    error = caught.value.errors[0]
    assert (error.rank, error.kind, error.exit_code) == (0, "exit", -11)
    assert "killed by SIGSEGV (exit code -11)" in str(caught.value)
    assert "Fatal Python error: Segmentation fault" in error.details
    assert " in _segfault_on_zero" in error.details


def test_unpicklable_result_is_a_clear_failure() -> None:
    with pytest.raises(RankFailure) as caught:
        run_ranks(_return_lock, 2, init_process_group=False, timeout_s=60)

    failure = caught.value
    assert failure.failed in ((0,), (0, 1), (1, 0), (1,))
    assert {error.kind for error in failure.errors} == {"result"}
    assert "returned a lock that cannot be pickled" in str(failure)


def test_oversized_result_is_a_clear_failure() -> None:
    with pytest.raises(RankFailure) as caught:
        run_ranks(_return_bytes, 1, args=(5000,), max_result_bytes=1000, init_process_group=False)

    message = str(caught.value)
    assert (
        "--- rank 0: returned 5,018 bytes once pickled, more than max_result_bytes=1,000;"
        in message
    )


def test_port_taken_before_rank_zero_listens_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken_port = squatter.getsockname()[1]
        offered = [taken_port]
        free_port = rank_group.free_port
        monkeypatch.setattr(
            rank_group, "free_port", lambda: offered.pop() if offered else free_port()
        )

        results = run_ranks(_sum_of_ranks, 2, timeout_s=60)

    assert [result["sum"] for result in results] == [1.0, 1.0]
    assert results[0]["port"] != taken_port


# --- hangs ----------------------------------------------------------------------------


def test_hang_times_out_with_each_ranks_stack() -> None:
    started = time.monotonic()
    with pytest.raises(RankTimeout) as caught:
        run_ranks(_hang, 3, timeout_s=5)
    elapsed = time.monotonic() - started

    timeout = caught.value
    message = str(timeout)
    assert elapsed >= 5.0  # not before its timeout (how long after it is the machine's load, not a promise)
    assert timeout.unfinished == (0, 1, 2)
    assert message.startswith("run_ranks timed out after 5 s: ranks 0, 1, 2 of 3 had not finished")
    assert " in _stuck_in_recv\n" in timeout.stacks[0]
    assert " in _stuck_in_barrier\n" in timeout.stacks[1]
    assert " in _stuck_in_barrier\n" in timeout.stacks[2]
    assert " in _hang" in timeout.stacks[0]
    for rank in range(3):
        assert f"--- rank {rank} ---\n{timeout.stacks[rank]}" in message
        assert "_call_user_function" not in timeout.stacks[rank]  # harness frames are trimmed
        assert "rank_main" not in timeout.stacks[rank]


# --- start methods and arguments ------------------------------------------------------


def test_spawn_start_method_runs_importable_functions() -> None:
    results = run_ranks(_sum_of_ranks, 2, start_method="spawn", timeout_s=90)

    assert [result["sum"] for result in results] == [1.0, 1.0]
    assert [result["env"][0] for result in results] == ["0", "1"]
    assert {result["threads"] for result in results} == {1}


def test_spawn_refuses_functions_it_cannot_import() -> None:
    with pytest.raises(HarnessConfigError, match="Define the rank function at module level"):
        run_ranks(lambda rank, world_size: rank, 2, start_method="spawn")


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"world_size": 0}, "world_size must be an int >= 1; got 0"),
        ({"world_size": 2, "timeout_s": 0}, "timeout_s must be > 0 seconds; got 0"),
        (
            {"world_size": 2, "start_method": "forkserver"},
            "start_method must be one of ('fork', 'spawn'); got 'forkserver'",
        ),
    ],
)
def test_bad_arguments_are_refused_before_any_process_starts(
    arguments: dict[str, object], expected: str
) -> None:
    with pytest.raises(HarnessConfigError) as caught:
        run_ranks(_sum_of_ranks, **arguments)  # type: ignore[arg-type]

    assert str(caught.value) == expected
    assert isinstance(caught.value, ValueError)
