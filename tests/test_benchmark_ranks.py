"""The benchmark's rank groups: ranks forked from a library's zygote carry that library only."""

from __future__ import annotations

import os
import sys
import time

import pytest

from benchmarks.ranks import RankFailure, RankGroup, Zygote, place


def _imported(worker, names: list[str]) -> list[bool]:
    return [name in sys.modules for name in names]


def _parent_pid(worker) -> int:
    return os.getppid()


def test_ranks_forked_from_a_zygote_have_its_imports_and_not_the_parents_later_ones():
    sys.modules.pop("colorsys", None)
    with Zygote(["wave"]) as zygote:
        import colorsys  # noqa: F401 - imported by the parent after the zygote started

        with RankGroup(2, distributed=False, zygote=zygote) as group:
            assert group.call(place) == [(0, 2), (1, 2)]
            assert group.call(_imported, ["wave", "colorsys"]) == [[True, False], [True, False]]
            assert set(group.call(_parent_pid)) == {zygote._proc.pid}


def test_a_zygote_rank_group_runs_gloo_and_its_killed_ranks_are_gone():
    with Zygote([]) as zygote:
        group = RankGroup(2, zygote=zygote, timeout_s=60)
        assert group.call(place) == [(0, 2), (1, 2)]
        pids = group.pids
        group.kill()
        deadline = time.monotonic() + 5
        while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)  # killed and reaped


def test_a_zygote_that_cannot_import_says_which_module():
    with pytest.raises(RankFailure, match="no_such_module_for_conveyor"):
        Zygote(["no_such_module_for_conveyor"])
