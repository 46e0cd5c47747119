"""register()/build(): user schedules as Schedules, rows, strings or generators, verified on build."""

from __future__ import annotations

import doctest
import importlib
from collections.abc import Iterator

import pytest

import conveyor.schedule as cs
from conveyor.errors import ScheduleError
from conveyor.schedule.ir import Action, ActionKind, Placement, Schedule
from conveyor.schedule.registry import ScheduleInfo


@pytest.fixture
def registered() -> Iterator[list[str]]:
    """Names registered by a test, forgotten afterwards (the registry is process-wide)."""
    names: list[str] = []
    yield names
    for name in names:
        cs.unregister(name)


def gpipe_rows(num_ranks: int, num_microbatches: int) -> list[list[str]]:
    return [
        [f"{rank}F{m}" for m in range(num_microbatches)] + [f"{rank}B{m}" for m in range(num_microbatches)]
        for rank in range(num_ranks)
    ]


def test_the_original_signature_still_registers_a_schedule_builder(registered):
    def builder(num_ranks, num_microbatches, virtual):
        return Schedule.from_programs(
            "mine", Placement.looped(num_ranks), num_microbatches, gpipe_rows(num_ranks, num_microbatches)
        )

    registered.append("mine")
    assert cs.register("mine", builder, description="d", default_virtual=1, virtual_choices=(1,), replace=False) is None
    info = cs.available()["mine"]
    assert info == ScheduleInfo("mine", builder, "d", 1, (1,), "looped")
    assert cs.build("mine", ranks=3, microbatches=2) == builder(3, 2, 1)


def test_a_builder_may_return_rows_of_strings_or_actions(registered):
    registered.append("rows")
    cs.register("rows", lambda p, m, v: gpipe_rows(p, m))
    sched = cs.build("rows", ranks=2, microbatches=2)
    assert sched.name == "rows" and sched.placement == Placement.looped(2)
    assert [[str(a) for a in p] for p in sched.programs] == gpipe_rows(2, 2)
    cs.register("rows", lambda p, m, v: [[Action.parse(t) for t in row] for row in gpipe_rows(p, m)], replace=True)
    assert cs.build("rows", ranks=2, microbatches=2) == sched


def test_a_generator_yields_one_rank_at_a_time_and_the_decorator_registers_it(registered):
    registered.append("interleaved-by-hand")

    @cs.register("interleaved-by-hand", default_virtual=2, virtual_choices=None)
    def by_hand(num_ranks, num_microbatches, virtual):
        # Looped BFS: every forward of each local stage in turn, backwards in reverse.
        for rank in range(num_ranks):
            stages = [rank + local * num_ranks for local in range(virtual)]
            yield [Action(ActionKind.F, s, m) for s in stages for m in range(num_microbatches)] + [
                f"{s}B{m}" for s in reversed(stages) for m in range(num_microbatches)
            ]

    assert callable(by_hand)
    sched = cs.build("interleaved-by-hand", ranks=2, microbatches=2)
    assert sched.placement == Placement.looped(2, 2)
    assert [str(a) for a in sched.programs[1]] == ["1F0", "1F1", "3F0", "3F1", "3B0", "3B1", "1B0", "1B1"]
    assert cs.build("interleaved-by-hand", ranks=2, microbatches=2, virtual=3).num_stages == 6


def test_placement_vshape_infer_or_a_callable_decides_who_runs_each_stage(registered):
    def v_rows(p, m, v):
        return [
            [f"{r}F{k}" for k in range(m)]
            + [f"{2 * p - 1 - r}F{k}" for k in range(m)]
            + [f"{2 * p - 1 - r}B{k}" for k in range(m)]
            + [f"{r}B{k}" for k in range(m)]
            for r in range(p)
        ]

    registered.extend(["v", "v-inferred", "v-callable"])
    cs.register("v", v_rows, placement="vshape", default_virtual=2, virtual_choices=(2,))
    cs.register("v-inferred", v_rows, placement="infer", default_virtual=2, virtual_choices=(2,))
    cs.register(
        "v-callable", v_rows, placement=lambda p, v: Placement.vshape(p), default_virtual=2, virtual_choices=(2,)
    )
    built = [cs.build(name, ranks=3, microbatches=2) for name in ("v", "v-inferred", "v-callable")]
    assert {b.placement for b in built} == {Placement.vshape(3)}
    assert built[0].programs == built[1].programs == built[2].programs


def test_an_invalid_user_schedule_raises_the_verifiers_message(registered):
    registered.append("swapped")
    cs.register("swapped", lambda p, m, v: [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]])
    with pytest.raises(ScheduleError) as raised:
        cs.build("swapped", ranks=2, microbatches=2)
    message = str(raised.value)
    assert message.startswith(
        "schedule 'swapped' (ranks=2, microbatches=2, virtual=1) is invalid: schedule 'swapped' deadlocks: "
        "ranks 0 and 1 wait for each other.\n  rank 0 is stuck at step 1 (0B0)"
    )
    assert raised.value.grid is not None and message.endswith(raised.value.grid)
    assert message.count("step x rank grid") == 1
    unchecked = cs.build("swapped", ranks=2, microbatches=2, check=False)
    assert str(unchecked.programs[1][0]) == "1F1"


@pytest.mark.parametrize(
    ("builder", "kwargs", "expected"),
    [
        (
            lambda p, m, v: None,
            {},
            "the builder of schedule 'bad' returned NoneType for ranks=2, microbatches=1, virtual=1; return a "
            "Schedule, or one sequence of actions (or strings such as '2F0') per rank, or yield them rank by rank",
        ),
        (
            lambda p, m, v: [["0F0", "0B0"]],
            {},
            "the builder of schedule 'bad' gave programs for 1 ranks, but ranks=2, microbatches=1, virtual=1 asks "
            "for 2",
        ),
        (
            lambda p, m, v: [["0F0", "0B0"], ["1F0", "1Q0"]],
            {},
            "schedule 'bad': rank 1, column 1: cannot read action '1Q0'",
        ),
        (
            lambda p, m, v: [["0F0", "0B0"], ["1F0", 1.5]],
            {},
            "schedule 'bad': rank 1, column 1: expected an Action or a string such as '2F0', got 1.5 (float)",
        ),
        (
            lambda p, m, v: {}["missing"],
            {},
            "the builder of schedule 'bad' failed for ranks=2, microbatches=1, virtual=1: KeyError: 'missing'",
        ),
        (
            lambda p, m, v: cs.build("1f1b", ranks=p, microbatches=m + 1),
            {},
            "the builder of schedule 'bad' returned a schedule for ranks=2, microbatches=2, but ranks=2, "
            "microbatches=1, virtual=1 was asked",
        ),
        (
            lambda p, m, v: gpipe_rows(p, m),
            {"placement": "vshape"},
            "schedule 'bad' uses placement='vshape', which runs 2 stages on each rank, but virtual=1; register it "
            "with virtual_choices=(2,), default_virtual=2",
        ),
        (
            lambda p, m, v: gpipe_rows(p, m),
            {"placement": lambda p, v: (0, 1)},
            "the placement callable of schedule 'bad' returned tuple, not a Placement",
        ),
        (
            lambda p, m, v: gpipe_rows(p, m),
            {"placement": lambda p, v: Placement.looped(p, 2)},
            "schedule 'bad' (ranks=2, microbatches=1, virtual=1) is invalid: stage 2 microbatch 0 is never forwarded",
        ),
    ],
)
def test_builders_that_go_wrong_get_a_message(registered, builder, kwargs, expected):
    registered.append("bad")
    cs.register("bad", builder, **kwargs)
    with pytest.raises(ScheduleError) as raised:
        cs.build("bad", ranks=2, microbatches=1)
    assert str(raised.value).startswith(expected)


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        (("", lambda p, m, v: None), {}, "a schedule's name must be a non-empty string on one line, got ''"),
        (
            ("x", "not callable"),
            {},
            "schedule 'x': builder must be callable as builder(num_ranks, num_microbatches, virtual)",
        ),
        (
            ("x", lambda p, m, v: None),
            {"placement": "diagonal"},
            "schedule 'x': placement must be one of 'looped', 'vshape', 'infer'",
        ),
        (
            ("x", lambda p, m, v: None),
            {"default_virtual": 0},
            "schedule 'x': default_virtual must be a positive integer, got 0",
        ),
        (("x", lambda p, m, v: None), {"virtual_choices": [1]}, "schedule 'x': virtual_choices must be a tuple"),
        (
            ("x", lambda p, m, v: None),
            {"default_virtual": 2},
            "schedule 'x': default_virtual=2 is not among virtual_choices=(1,)",
        ),
        (
            ("1f1b", lambda p, m, v: None),
            {},
            "a schedule named '1f1b' is already registered; pass replace=True to override it",
        ),
    ],
)
def test_bad_registrations_are_refused(args, kwargs, expected):
    cs.available()  # the built-ins are in
    with pytest.raises(ScheduleError) as raised:
        cs.register(*args, **kwargs)
    assert str(raised.value).startswith(expected)
    assert cs.available()["1f1b"].description.startswith("one forward one backward")


def test_build_names_what_it_cannot_serve():
    with pytest.raises(ScheduleError, match="unknown schedule 'nope'; known schedules: "):
        cs.build("nope", ranks=2, microbatches=2)
    with pytest.raises(ScheduleError, match=r"schedule 'zbv' runs 2 stage\(s\) per rank, not virtual=3"):
        cs.build("zbv", ranks=2, microbatches=2, virtual=3)
    with pytest.raises(ScheduleError, match="ranks must be a positive integer, got 0"):
        cs.build("1f1b", ranks=0, microbatches=2)


def test_module_examples_hold():
    result = doctest.testmod(importlib.import_module("conveyor.schedule.registry"))
    assert result.failed == 0 and result.attempted >= 4


def test_a_built_in_name_replaced_before_the_built_ins_load_stays_replaced():
    # A fresh interpreter: here the built-ins are loaded already.
    import subprocess
    import sys

    script = """
import conveyor.schedule as cs
def mine(p, m, v):
    return cs.build("gpipe", ranks=p, microbatches=m).programs
cs.register("1f1b", mine, replace=True, description="mine")
cs.unregister("zb-h2")
assert cs.build("gpipe", ranks=2, microbatches=2).name == "gpipe"
names = list(cs.available())
assert names[0] == "gpipe" and "zb-h2" not in names, names
assert cs.available()["1f1b"].description == "mine"
assert [str(a) for a in cs.build("1f1b", ranks=2, microbatches=2).programs[0]] == ["0F0", "0F1", "0B0", "0B1"]
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr
