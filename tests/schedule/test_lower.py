"""lower(): the sends and receives a compute-only schedule implies, and nothing else."""

from __future__ import annotations

import doctest
import importlib

import pytest

import conveyor.schedule as cs
from conveyor.errors import ScheduleError
from conveyor.schedule.cost import CostModel
from conveyor.schedule.ir import Action, ActionKind, Placement, Schedule
from conveyor.schedule.lower import lower

SIZES = [(1, 3), (2, 1), (3, 5), (4, 8)]


def programs_as_text(schedule: Schedule) -> list[str]:
    return [" ".join(map(str, program)) for program in schedule.programs]


def test_one_f_one_b_gets_a_send_after_and_a_receive_before_each_crossing():
    lowered = lower(cs.build("1f1b", ranks=3, microbatches=2))
    assert programs_as_text(lowered) == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 1RECV_B0 1B0 1SEND_B0 1RECV_B1 1B1 1SEND_B1",
        "2RECV_F0 2F0 2B0 2SEND_B0 2RECV_F1 2F1 2B1 2SEND_B1",
    ]


def test_stages_folded_onto_one_rank_exchange_nothing():
    # V placement on 2 ranks: stages 1 and 2 both run on rank 1, stages 0 and 3 on rank 0.
    schedule = Schedule.from_programs(
        "v", Placement.vshape(2), 1, [["0F0", "3F0", "3I0", "0B0", "3W0"], ["1F0", "2F0", "2B0", "1B0"]]
    )
    lowered = lower(schedule)
    assert programs_as_text(lowered) == [
        "0F0 0SEND_F0 3RECV_F0 3F0 3I0 3SEND_B0 0RECV_B0 0B0 3W0",
        "1RECV_F0 1F0 2F0 2SEND_F0 2RECV_B0 2B0 1B0 1SEND_B0",
    ]
    cs.verify(lowered)


def test_a_single_rank_needs_no_communication():
    schedule = cs.build("interleaved-1f1b", ranks=1, microbatches=3, virtual=3)
    assert lower(schedule) == schedule


def test_forward_only_programs_lower_too():
    schedule = Schedule.from_programs("eval", Placement.looped(2), 2, [["0F0", "0F1"], ["1F0", "1F1"]])
    assert programs_as_text(lower(schedule)) == ["0F0 0SEND_F0 0F1 0SEND_F1", "1RECV_F0 1F0 1RECV_F1 1F1"]


@pytest.mark.parametrize(
    "name", ["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb-h1", "zb-h2", "zbv", "dualpipev"]
)
def test_every_builtin_lowers_to_a_valid_program_with_the_same_timing(name):
    for num_ranks, num_microbatches in SIZES:
        schedule = cs.build(name, ranks=num_ranks, microbatches=num_microbatches)
        lowered = lower(schedule)
        cs.verify(lowered)
        assert lowered.compute_only() == schedule
        assert lower(lowered) == lowered  # idempotent
        # Each receive sits right before its consumer, each send right after its producer,
        # and sends never block: the lowered program runs exactly as the compute-only one.
        costs = CostModel.uniform(schedule.num_stages, 1.0, 2.0, 0.5, latency=0.25)
        plain, explicit = cs.simulate(schedule, costs), cs.simulate(lowered, costs)
        assert explicit.makespan == plain.makespan
        assert [(s.rank, str(s.action), s.start, s.end) for s in explicit.spans] == [
            (s.rank, str(s.action), s.start, s.end) for s in plain.spans
        ]


def test_every_crossing_has_one_send_and_one_receive_per_microbatch():
    schedule = cs.build("interleaved-1f1b", ranks=4, microbatches=8, virtual=3)
    lowered = lower(schedule)
    kinds = [a.kind for p in lowered.programs for a in p]
    crossings = schedule.num_stages - 1  # looped: every neighbour pair sits on two ranks
    for kind in (ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B):
        assert kinds.count(kind) == crossings * 8


def test_a_partly_lowered_schedule_gets_only_what_is_missing():
    full = lower(cs.build("1f1b", ranks=3, microbatches=4))
    rank1 = list(full.programs[1])
    send = rank1.index(Action.parse("1SEND_F2"))
    del rank1[send]
    partial = full.with_programs([full.programs[0], rank1, full.programs[2]])
    assert lower(partial) == full
    # Provenance: only a schedule lower() placed every send and receive of steps like its source.
    assert full.lowered_from is not None and lower(partial).lowered_from is None
    assert lower(full.compute_only()).lowered_from == full.compute_only()


def test_hand_placed_communication_stays_where_it_is():
    # torch's lowering posts a receive where the sender's send is, often well before its use.
    schedule = Schedule.from_programs(
        "early-receives",
        Placement.looped(2),
        2,
        [
            ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0RECV_B1", "0B0", "0B1"],
            ["1RECV_F0", "1RECV_F1", "1F0", "1B0", "1SEND_B0", "1F1", "1B1", "1SEND_B1"],
        ],
    )
    cs.verify(schedule)
    assert lower(schedule) == schedule


def test_lowering_a_big_schedule_keeps_every_action_and_adds_the_rest():
    schedule = cs.build("interleaved-1f1b", ranks=16, microbatches=64, virtual=2)
    lowered = lower(schedule)
    assert sum(map(len, lowered.programs)) == 3 * sum(map(len, schedule.programs)) - 4 * 64
    cs.verify(lowered)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: "1f1b", "lower() expects a Schedule, got str"),
        (
            lambda: Schedule(
                "odd",
                Placement.looped(2),
                1,
                ((Action.parse("0F0"), "0B0"), (Action.parse("1F0"), Action.parse("1B0"))),
            ),
            "rank 0, step 1: found the string '0B0' where an Action belongs",
        ),
        (
            lambda: Schedule(
                "odd", Placement.looped(2), 1, ((Action.parse("0F0"), Action(ActionKind.B, "0", 0)), ())
            ),
            "rank 0, step 1: the stage of an action must be an int, got '0' (str)",
        ),
        (
            lambda: Schedule("odd", Placement.looped(2), 1, ((Action.parse("0F0"), Action.parse("7B0")), ())),
            "rank 0, step 1: action 7B0 names stage 7, but the schedule has 2 stages (0..1)",
        ),
    ],
)
def test_malformed_schedules_raise_the_verifiers_message(make, expected):
    with pytest.raises(ScheduleError) as raised:
        lower(make())
    assert str(raised.value).startswith(expected)


def test_module_examples_hold():
    # (the package's `lower` is the function: fetch the module itself)
    result = doctest.testmod(importlib.import_module("conveyor.schedule.lower"))
    assert result.failed == 0 and result.attempted >= 2
