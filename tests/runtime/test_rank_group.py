"""Rank groups that live between calls: ranks forked from a zygote carry its imports only, and
a failure or a hang reads as it does in run_ranks (traceback, stacks), with the group gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conveyor.errors import GroupClosed, RankFailure, RankTimeout, ZygoteFailure
from conveyor.processes import RankGroup, Zygote, place

ROOT = Path(__file__).resolve().parents[2]


def _imported(worker, names: list[str]) -> list[bool]:
    return [name in sys.modules for name in names]


def _parent_pid(worker) -> int:
    return os.getppid()


def test_ranks_forked_from_a_zygote_have_its_imports_and_not_the_parents_later_ones():
    sys.modules.pop("colorsys", None)
    sys.modules.pop("wave", None)
    with Zygote(["wave"]) as zygote:
        assert "wave" not in sys.modules  # the zygote imported it, not this process
        import colorsys  # noqa: F401 - imported by the parent after the zygote started

        with RankGroup(2, distributed=False, zygote=zygote) as group:
            assert group.call(place) == [(0, 2), (1, 2)]
            assert group.call(_imported, ["wave", "colorsys"]) == [[True, False], [True, False]]
            assert set(group.call(_parent_pid)) == {zygote._proc.pid}


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs: a zombie (exited, not yet reaped by its parent, this process
    for a zygote) has exited, though its /proc entry stays until it is reaped."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _gone(pids: list[int], within_s: float = 60.0) -> bool:
    """Whether the processes have exited; waits up to ``within_s`` (a cut-off for a hang, not a figure)."""
    deadline = time.monotonic() + within_s
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_running(pid) for pid in pids)


def test_a_zygote_rank_group_runs_gloo_and_its_ranks_are_gone_after_close_or_kill():
    with Zygote([]) as zygote:
        with RankGroup(2, zygote=zygote, timeout_s=60) as group:
            assert group.call(place) == [(0, 2), (1, 2)]
            closed = group.pids
        assert _gone(closed)  # left their group and exited, reaped by the zygote's kernel
        group = RankGroup(2, zygote=zygote, timeout_s=60)
        killed = group.pids
        group.kill()
        group.kill()  # again: the pids are gone, which is not an error
        assert _gone(killed)


def test_a_dead_zygote_fails_the_next_group_at_once():
    zygote = Zygote([])
    os.kill(zygote.pid, 9)
    assert _gone([zygote.pid])
    # A ZygoteFailure, not a RankTimeout at the group's timeout: the dead zygote was noticed.
    with pytest.raises(ZygoteFailure, match="zygote"):
        RankGroup(2, distributed=False, zygote=zygote, timeout_s=600)
    zygote.close()


def test_a_zygote_and_its_ranks_die_with_the_process_that_made_them():
    script = (
        "import os, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from conveyor.processes import RankGroup, Zygote\n"
        "zygote = Zygote([])\n"
        "group = RankGroup(2, distributed=False, zygote=zygote)\n"
        "print(zygote.pid, *group.pids, flush=True)\n"
        "os._exit(0)  # no clean-up at all, as if killed\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 3, out.stderr
    assert _gone(pids)


def test_a_zygote_that_cannot_import_says_which_module():
    with pytest.raises(ZygoteFailure, match="no_such_module_for_conveyor"):
        Zygote(["no_such_module_for_conveyor"])


def _fail_on_rank_one(worker, message: str) -> int:
    if worker.rank == 1:
        raise ValueError(message)
    return worker.rank


def _remember(worker, value: int) -> None:
    worker.state["value"] = value


def _recall(worker) -> int:
    return worker.state["value"] + worker.rank


def test_calls_find_the_state_the_last_call_left():
    with RankGroup(2, distributed=False) as group:
        group.call(_remember, 10)
        assert group.call(_recall) == [10, 11]


def test_a_rank_that_raises_fails_the_call_with_its_traceback_and_kills_the_group():
    group = RankGroup(2, distributed=False, timeout_s=60)
    pids = group.pids
    with pytest.raises(RankFailure) as caught:
        group.call(_fail_on_rank_one, "no such stage")
    failure = caught.value
    assert failure.failed == (1,)
    assert "ValueError: no such stage" in str(failure).splitlines()[-1]
    assert "_fail_on_rank_one" in failure.errors[0].details
    assert _gone(pids)
    with pytest.raises(GroupClosed):
        group.call(place)


def _sleep_on_rank_zero(worker, seconds: float) -> None:
    if worker.rank == 0:
        time.sleep(seconds)


def test_a_call_that_hangs_reports_where_each_stuck_rank_was():
    with Zygote([]) as zygote:
        group = RankGroup(2, distributed=False, zygote=zygote, timeout_s=60)
        pids = group.pids
        with pytest.raises(RankTimeout) as caught:
            group.call(_sleep_on_rank_zero, 600.0, timeout_s=1.0)
        timeout = caught.value
        assert "timed out after 1 s" in str(timeout)  # the call's own timeout, not the group's 60 s
        assert (timeout.unfinished, timeout.finished) == ((0,), (1,))
        assert "_sleep_on_rank_zero" in timeout.stacks[0]
        assert "_serve_calls" not in timeout.stacks[0]  # the harness's own frames are trimmed
        assert "_sleep_on_rank_zero on a rank group timed out" in str(timeout)
        assert _gone(pids)


def _exit_hard(worker) -> None:
    if worker.rank == 1:
        os._exit(3)


def test_a_rank_that_dies_is_named_as_dead():
    with RankGroup(2, distributed=False, timeout_s=60) as group, pytest.raises(RankFailure) as caught:
        group.call(_exit_hard)
    error = caught.value.errors[0]
    assert (error.rank, error.kind, error.exit_code) == (1, "exit", 3)


def _print_then_fail(worker) -> None:
    print(f"rank {worker.rank} was here", flush=False)
    if worker.rank == 0:
        raise RuntimeError("after printing")
    time.sleep(60)


def test_a_failed_ranks_output_is_not_lost_when_the_group_is_killed(capfd: pytest.CaptureFixture[str]):
    group = RankGroup(2, distributed=False, timeout_s=60)
    with pytest.raises(RankFailure) as caught:
        group.call(_print_then_fail)
    assert caught.value.failed == (0,)
    assert caught.value.killed == (1,)
    assert "rank 0 was here" in capfd.readouterr().out


def _fail_everywhere(worker) -> None:
    raise KeyError(f"missing on rank {worker.rank}")


def test_every_rank_that_fails_is_in_the_report():
    with RankGroup(3, distributed=False, timeout_s=60) as group, pytest.raises(RankFailure) as caught:
        group.call(_fail_everywhere)
    failure = caught.value
    assert sorted(failure.failed) == [0, 1, 2]
    assert failure.killed == failure.finished == ()
    for rank in range(3):
        assert f"KeyError: 'missing on rank {rank}'" in str(failure)


def _read_env(worker) -> str:
    return os.environ["CONVEYOR_GROUP_TEST"]


def test_a_spawned_group_keeps_state_and_sets_the_callers_env():
    with RankGroup(
        2, start_method="spawn", env={"CONVEYOR_GROUP_TEST": "seen"}, timeout_s=90
    ) as group:
        group.call(_remember, 5)
        assert group.call(_recall) == [5, 6]
        assert group.call(_read_env) == ["seen", "seen"]
        pids = group.pids
    assert _gone(pids)


def test_bad_options_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="start_method must be one of"):
        RankGroup(2, start_method="forkserver")
    with Zygote([]) as zygote, pytest.raises(ValueError, match="a zygote forks its ranks"):
        RankGroup(2, zygote=zygote, start_method="spawn")
