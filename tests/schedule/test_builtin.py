"""The built-in schedules: registered as documented, valid for every size, docstrings true.

Pure Python and fast: the grid below builds and verifies a few thousand
schedules in seconds.
"""

from __future__ import annotations

import doctest
import importlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import conveyor.schedule as cs
from conveyor.errors import ScheduleError
from conveyor.schedule.builtin._program import microbatch_rounds
from conveyor.schedule.ir import ActionKind, Placement
from conveyor.testing.rigs.schedule_docs import example_block

MODULES = {
    "gpipe": "gpipe",
    "1f1b": "one_f_one_b",
    "interleaved-1f1b": "interleaved_1f1b",
    "looped-bfs": "looped_bfs",
    "zb-h1": "zb_h1",
    "zb-h2": "zb_h2",
    "zbv": "zbv",
    "dualpipev": "dualpipev",
}
# name: (default V, the V it takes: None = any V >= 1)
VIRTUAL = {
    "gpipe": (1, (1,)),
    "1f1b": (1, (1,)),
    "interleaved-1f1b": (2, None),
    "looped-bfs": (2, None),
    "zb-h1": (1, None),
    "zb-h2": (1, None),
    "zbv": (2, (2,)),
    "dualpipev": (2, (2,)),
}
SPLITS_BACKWARD = {"zb-h1", "zb-h2", "zbv"}  # dualpipev splits only part of its backwards


def module_of(name: str):
    return importlib.import_module(f"conveyor.schedule.builtin.{MODULES[name]}")


def grid_sizes(name: str):
    """(P, V, M) for P in 1..8, every M in 1..4P and two larger ones, V in 1..3 where taken."""
    choices = VIRTUAL[name][1] or (1, 2, 3)
    for num_ranks in range(1, 9):
        for virtual in choices:
            for num_microbatches in [
                *range(1, 4 * num_ranks + 1),
                6 * num_ranks + 1,
                8 * num_ranks,
            ]:
                yield num_ranks, virtual, num_microbatches


def test_every_builtin_is_registered_in_order_with_its_virtual_rules():
    available = cs.available()
    assert list(available)[: len(MODULES)] == list(MODULES)
    for name, (default_virtual, choices) in VIRTUAL.items():
        info = available[name]
        assert (info.default_virtual, info.virtual_choices) == (default_virtual, choices), name
        assert info.description, name
        assert cs.build(name, ranks=2, microbatches=4).virtual == default_virtual


@pytest.mark.parametrize("name", list(MODULES))
def test_grid_verifies_with_complete_ordered_programs(name):
    """Every size of the grid verifies (complete, no deadlock) and has the documented shape.

    Per stage, the passes that accumulate weight gradients (B, or W after I) run
    in microbatch order, as a single-device loop accumulates them: bitwise parity
    with gradient accumulation depends on it.
    """
    builder = cs.available()[name].builder
    checked = 0
    for num_ranks, virtual, num_microbatches in grid_sizes(name):
        schedule = builder(num_ranks, num_microbatches, virtual)
        cs.verify(schedule)
        assert schedule.name == name
        assert (schedule.num_ranks, schedule.virtual, schedule.num_microbatches) == (
            num_ranks,
            virtual,
            num_microbatches,
        )
        if name in ("zbv", "dualpipev"):
            assert schedule.placement == Placement.vshape(num_ranks)
        else:
            assert schedule.placement == Placement.looped(num_ranks, virtual)
        assert not schedule.is_lowered
        if name in SPLITS_BACKWARD:
            assert all(a.kind is not ActionKind.B for p in schedule.programs for a in p)
        if name in ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs"):
            assert not schedule.splits_backward
        for program in schedule.programs:
            accumulated: dict[int, list[int]] = {}
            for action in program:
                if action.kind in (ActionKind.B, ActionKind.W):
                    accumulated.setdefault(action.stage, []).append(action.microbatch)
            for stage, microbatches in accumulated.items():
                assert microbatches == list(range(num_microbatches)), (
                    name,
                    num_ranks,
                    num_microbatches,
                    stage,
                )
        checked += 1
    assert checked >= 144


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(list(MODULES)),
    num_ranks=st.integers(1, 24),
    num_microbatches=st.integers(1, 80),
    virtual=st.integers(1, 5),
)
def test_random_sizes_beyond_the_grid_verify(name, num_ranks, num_microbatches, virtual):
    choices = VIRTUAL[name][1]
    if choices is not None:
        virtual = choices[0]
    schedule = cs.build(
        name, ranks=num_ranks, microbatches=num_microbatches, virtual=virtual
    )  # verifies
    num_actions = sum(map(len, schedule.programs))
    stage_microbatches = num_ranks * virtual * num_microbatches
    if name in SPLITS_BACKWARD:
        assert num_actions == 3 * stage_microbatches
    elif name == "dualpipev":  # splits the backwards of its ramp-down only
        assert 2 * stage_microbatches <= num_actions <= 3 * stage_microbatches
    else:
        assert num_actions == 2 * stage_microbatches


@pytest.mark.parametrize("name", ["zbv", "dualpipev", "gpipe", "1f1b"])
def test_a_virtual_the_schedule_cannot_run_is_refused_with_the_rule(name):
    allowed = VIRTUAL[name][1][0]
    with pytest.raises(ScheduleError, match=f"runs exactly {allowed} stage.*got virtual=3"):
        cs.available()[name].builder(4, 8, 3)
    with pytest.raises(ScheduleError, match="not virtual=3"):
        cs.build(name, ranks=4, microbatches=8, virtual=3)


@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize(
    ("num_ranks", "num_microbatches", "virtual"), [(0, 4, 1), (2, 0, 1), (2, 4, 0), (-1, 4, 1)]
)
def test_sizes_that_are_not_positive_are_refused(name, num_ranks, num_microbatches, virtual):
    builder = cs.available()[name].builder
    with pytest.raises(ScheduleError, match="must be a positive integer"):
        builder(num_ranks, num_microbatches, virtual if virtual != 1 else VIRTUAL[name][0])


def test_interleaved_with_one_stage_per_rank_is_1f1b_and_looped_bfs_is_gpipe():
    for num_ranks in range(1, 7):
        for num_microbatches in range(1, 3 * num_ranks + 1):
            assert (
                cs.build(
                    "interleaved-1f1b", ranks=num_ranks, microbatches=num_microbatches, virtual=1
                ).programs
                == cs.build("1f1b", ranks=num_ranks, microbatches=num_microbatches).programs
            )
            assert (
                cs.build(
                    "looped-bfs", ranks=num_ranks, microbatches=num_microbatches, virtual=1
                ).programs
                == cs.build("gpipe", ranks=num_ranks, microbatches=num_microbatches).programs
            )


def test_1f1b_numbers_the_last_ranks_forwards_from_zero():
    # torch's Schedule1F1B action list numbers them 1..M on the last rank.
    last = cs.build("1f1b", ranks=4, microbatches=4).programs[3]
    assert [str(a) for a in last] == ["3F0", "3B0", "3F1", "3B1", "3F2", "3B2", "3F3", "3B3"]


def test_microbatch_rounds_cover_every_microbatch_larger_rounds_first():
    for num_ranks in range(1, 9):
        for num_microbatches in range(1, 6 * num_ranks):
            rounds = microbatch_rounds(num_ranks, num_microbatches)
            assert [m for r in rounds for m in r] == list(range(num_microbatches))
            sizes = [len(r) for r in rounds]
            assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1
            assert min(sizes) >= min(num_ranks, num_microbatches)
    assert [len(r) for r in microbatch_rounds(4, 10)] == [5, 5]
    assert [len(r) for r in microbatch_rounds(4, 11)] == [6, 5]


def test_the_hand_checked_4_rank_programs():
    """Programs checked by hand against Figure 3 of the ZB paper (ICLR 2024): rank 0 of ZB-H1
    runs each W right after its I; the last rank of ZB-H2 runs I only until 2(P-1) = 6 W
    are held back."""
    expected = {
        ("zb-h1", 0): "0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0F6 0I3 0W3 0F7 0I4 0W4 "
        "0I5 0W5 0I6 0W6 0I7 0W7",
        ("zb-h1", 3): "3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3F6 3I6 3W3 "
        "3F7 3I7 3W4 3W5 3W6 3W7",
        ("zb-h2", 3): "3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3F4 3I4 3F5 3I5 3F6 3I6 3W0 3F7 3I7 3W1 "
        "3W2 3W3 3W4 3W5 3W6 3W7",
    }
    for (name, rank), program in expected.items():
        schedule = cs.build(name, ranks=4, microbatches=8)
        assert " ".join(map(str, schedule.programs[rank])) == program, (name, rank)


@pytest.mark.parametrize("name", list(MODULES))
def test_module_docstring_shows_what_the_builder_produces(name):
    """Golden test: the rendered 4-rank programs and figures in each docstring are current.

    To refresh one: ``.venv/bin/python -m conveyor.testing.rigs.schedule_docs NAME``.
    """
    doc = module_of(name).__doc__
    block = example_block(name)
    assert block in doc, f"docstring of {MODULES[name]}.py is stale; it should contain:\n{block}"
    for heading in ("Phases", "Serves every"):
        assert heading in doc, (name, heading)


@pytest.mark.parametrize("name", list(MODULES))
def test_module_examples_run(name):
    module = module_of(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 1 and result.failed == 0, name


def test_shared_helpers_examples_run():
    module = importlib.import_module("conveyor.schedule.builtin._program")
    result = doctest.testmod(module)
    assert result.attempted >= 4 and result.failed == 0


def test_building_the_large_interleaved_plan_gives_every_action_once():
    """P=64, V=2, M=1024: 262,144 actions, each (stage, microbatch, F or B) once.

    A quadratic step would take minutes and run into the suite's 300 s timeout; how long a build
    takes at scale is `python -m benchmarks --schedule-scale`'s figure (target: under 5 s at P=256,
    M=2048), not a test's: wall-clock bounds flake on a shared machine.
    """
    schedule = cs.available()["interleaved-1f1b"].builder(64, 1024, 2)
    actions = [str(action) for program in schedule.programs for action in program]
    assert len(actions) == len(set(actions)) == 64 * 2 * 1024 * 2
