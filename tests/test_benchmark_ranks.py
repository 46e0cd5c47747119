"""The benchmark's rank groups: ranks forked from a library's zygote carry that library only."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.ranks import RankFailure, RankGroup, Zygote, place

ROOT = Path(__file__).resolve().parents[1]


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


def _gone(pids: list[int], within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(os.path.exists(f"/proc/{pid}") for pid in pids)


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
    _gone([zygote.pid])
    started = time.monotonic()
    with pytest.raises(RankFailure, match="zygote"):
        RankGroup(2, distributed=False, zygote=zygote)
    assert time.monotonic() - started < 5
    zygote.close()


def test_a_zygote_and_its_ranks_die_with_the_process_that_made_them():
    script = (
        "import os, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from benchmarks.ranks import RankGroup, Zygote\n"
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
    with pytest.raises(RankFailure, match="no_such_module_for_conveyor"):
        Zygote(["no_such_module_for_conveyor"])
