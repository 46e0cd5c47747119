"""verify(): the first violation in words a user can act on, with the step x rank grid."""

from __future__ import annotations

import doctest
import importlib
import sys

import pytest

import conveyor.schedule as cs
from conveyor.errors import ScheduleError
from conveyor.schedule.cost import CostModel
from conveyor.schedule.ir import Action, ActionKind, Placement, Schedule
from conveyor.schedule.lower import lower
from conveyor.schedule.simulate import step_timed as run
from conveyor.schedule.verify import verify

K = ActionKind
TWO = Placement.looped(2)
BUILTINS = ["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb-h1", "zb-h2", "zbv", "dualpipev"]


def rows(*programs: str) -> list[list[str]]:
    return [p.split() for p in programs]


def schedule(*programs: str, placement: Placement = TWO, microbatches: int = 1, name: str = "t") -> Schedule:
    return Schedule.from_programs(name, placement, microbatches, rows(*programs))


def raw(*programs, placement: Placement = TWO, microbatches: int = 1) -> Schedule:
    """A Schedule built around from_programs, so malformed actions reach its own checks."""
    return Schedule("t", placement, microbatches, tuple(tuple(p) for p in programs))


def error_of(sched: Schedule) -> ScheduleError:
    with pytest.raises(ScheduleError) as raised:
        verify(sched)
    return raised.value


# -- valid schedules --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILTINS)
def test_builtins_verify_compute_only_and_lowered(name):
    for num_ranks, num_microbatches in [(1, 1), (2, 3), (4, 8), (5, 4)]:
        sched = cs.build(name, ranks=num_ranks, microbatches=num_microbatches)
        verify(sched)
        verify(lower(sched))


def test_a_vshape_schedule_passes_tensors_between_folded_stages_in_memory():
    verify(schedule("0F0 3F0 3I0 3W0 0B0", "1F0 2F0 2B0 1B0", placement=Placement.vshape(2)))


# -- 1. shape --------------------------------------------------------------------------------------


def test_verify_wants_a_schedule():
    assert str(error_of("1f1b")).startswith("verify() expects a Schedule, got str; build one with")


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: Schedule("t", TWO, 1, 5), "schedule 't': programs must be one sequence of actions per rank, got 5"),
        (lambda: Schedule("t", TWO, 1, ("0F0 0B0", "1F0 1B0")), "schedule 't': programs must be one sequence"),
        (lambda: Schedule("t", (0, 1), 1, ((), ())), "schedule 't': placement must be a Placement"),
        (lambda: Schedule("t", TWO, 0, ((), ())), "num_microbatches must be a positive integer, got 0"),
        (lambda: Schedule("t", TWO, 1, ((),)), "schedule 't' has programs for 1 ranks but its placement has 2 ranks"),
        (lambda: Placement(2, (0, "1")), "stage_to_rank must hold int ranks, got '1'"),
        (lambda: Placement(2, (0, 0)), "placement leaves ranks [1] without any stage"),
        (lambda: Placement(2, (0, 2)), "placement maps stages to ranks [2], outside 0..1"),
    ],
)
def test_malformed_containers_are_rejected_when_built(make, expected):
    _refused_when_built(make, expected)


def _refused_when_built(make, expected: str) -> None:
    with pytest.raises(ScheduleError) as raised:
        make()
    assert str(raised.value).startswith(expected)


# -- 2. each action --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            lambda: raw([5], []),
            "rank 0, step 0: expected an Action such as F(2, 0) or Action.parse('2F0'), got 5 (int)",
        ),
        (
            lambda: raw([Action.parse("0F0"), "0B0"], []),
            "rank 0, step 1: found the string '0B0' where an Action belongs; build the schedule with "
            "Schedule.from_programs(...), which parses strings such as '2F0'",
        ),
        (
            lambda: raw([Action("F", 0, 0)], []),
            "rank 0, step 0: action kind must be an ActionKind (F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B), got 'F'",
        ),
        (
            lambda: raw([Action(K.F, 0.0, 0)], []),
            "rank 0, step 0: the stage of an action must be an int, got 0.0 (float) in "
            "Action(kind=F, stage=0.0, microbatch=0)",
        ),
        (
            lambda: raw([Action(K.F, 0, None)], []),
            "rank 0, step 0: the microbatch of an action must be an int, got None (NoneType) in "
            "Action(kind=F, stage=0, microbatch=None)",
        ),
        (
            lambda: raw([Action(K.F, -1, 0)], []),
            "rank 0, step 0: action -1F0 names stage -1, but the schedule has 2 stages (0..1)",
        ),
        (
            lambda: raw([Action(K.F, 2, 0)], []),
            "rank 0, step 0: action 2F0 names stage 2, but the schedule has 2 stages (0..1)",
        ),
        (
            lambda: raw([Action(K.F, 0, -1)], []),
            "rank 0, step 0: action 0F-1 names microbatch -1; microbatch ids run from 0 to num_microbatches - 1",
        ),
        (
            lambda: schedule("0F0 0B0 0F1", "1F0 1B0"),
            "rank 0, step 2: action 0F1 names microbatch 1, but the schedule has num_microbatches=1 (0..0); "
            "give num_microbatches=2 or more, or fix the action",
        ),
    ],
)
def test_malformed_actions_are_refused_when_built_named_by_rank_and_step(make, expected):
    _refused_when_built(make, expected)


@pytest.mark.parametrize(
    ("sched", "expected"),
    [
        (
            schedule("0F0 1F0 0B0", "1B0"),
            "rank 0, step 1: action 1F0 runs stage 1, which the placement puts on rank 1 (stage_to_rank=(0, 1)); "
            "move it to rank 1's program or change the placement",
        ),
        (
            schedule("0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1SEND_F0 1B0 1SEND_B0"),
            "rank 1, step 2: 1SEND_F0 sends the output of the last stage 1, which goes to the loss; remove it",
        ),
        (
            schedule("0RECV_F0 0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"),
            "rank 0, step 0: 0RECV_F0: stage 0 takes the microbatch itself and receives no forward input; remove it",
        ),
        (
            schedule(
                "0F0 0SEND_F0 3RECV_F0 3F0 3B0 3SEND_B0 0RECV_B0 0B0",
                "1RECV_F0 1F0 1SEND_F0 2F0 2B0 1B0 1SEND_B0",
                placement=Placement.vshape(2),
            ),
            "rank 1, step 2: 1SEND_F0 connects stages 1 and 2, which both run on rank 1 and pass tensors in memory; "
            "remove it (lower() adds only the sends and receives that cross ranks)",
        ),
    ],
)
def test_bad_actions_are_named_by_rank_and_step(sched, expected):
    error = error_of(sched)
    assert str(error).startswith(expected)


def test_an_action_error_marks_its_cell_in_the_grid():
    error = error_of(schedule("0F0 1F0 0B0", "1B0"))
    assert error.grid == "step  rank 0  rank 1\n   0  0F0     1B0\n   1  >1F0<\n   2  0B0"
    assert str(error).endswith("\n" + error.grid)


# -- 3. each action once, every pass present -----------------------------------------------------


@pytest.mark.parametrize(
    ("sched", "expected"),
    [
        (
            schedule("0F0 0F0 0B0", "1F0 1B0"),
            "rank 0 runs 0F0 twice, at steps 0 and 1; each action must appear exactly once",
        ),
        (
            schedule("0F0 0B0 0I0 0W0", "1F0 1B0"),
            "stage 0 microbatch 0 has two backward passes on rank 0: 0B0 at step 1 and 0I0 at step 2; "
            "use either B, or I followed by W",
        ),
        (
            schedule("0F0 0B0", "1F0 1B0", microbatches=2),
            "stage 0 microbatch 1 is never forwarded: add 0F1 to the program of rank 0, which runs stage 0",
        ),
        (
            schedule("0F0", "1F0 1B0"),
            "stage 0 microbatch 0 has no backward: add 0B0 (or 0I0 followed by 0W0) to the program of rank 0, "
            "which runs stage 0",
        ),
        (
            schedule("0F0 0B0 0W0", "1F0 1B0"),
            "rank 0, step 2: 0W0 computes a weight gradient, but stage 0 microbatch 0 has no 0I0 (it runs the full "
            "backward 0B0 at step 1); W only follows an I: remove 0W0, or split the backward into 0I0 and 0W0",
        ),
        (
            schedule("0F0 0I0", "1F0 1B0"),
            "rank 0, step 1: 0I0 computes only the input gradient and no 0W0 follows, so the weight gradient would "
            "be lost; add 0W0 after it on rank 0 (or use a full backward 0B0)",
        ),
        (
            schedule("0F0 0SEND_F0 0RECV_B0 0B0", "1F0 1B0 1SEND_B0"),
            "rank 0 has 0SEND_F0 at step 1, but rank 1 has no matching 1RECV_F0: add it before 1F0 (step 0) on rank 1",
        ),
        (
            schedule("0F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"),
            "rank 1 receives 1RECV_F0 at step 0, but rank 0 has no matching 0SEND_F0: add it after 0F0 (step 0) "
            "on rank 0",
        ),
        (
            schedule("0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"),
            "rank 1 sends 1SEND_B0 at step 3, but rank 0 has no matching 0RECV_B0: add it before 0B0 (step 2) on "
            "rank 0",
        ),
        (
            schedule(
                "0F0 0SEND_F0 0F1 0RECV_B0 0B0 0RECV_B1 0B1",
                "1RECV_F0 1F0 1F1 1B0 1SEND_B0 1B1 1SEND_B1",
                microbatches=2,
            ),
            "rank 0 runs 0F1 at step 2, whose output crosses to stage 1 on rank 1, but the lowered program has "
            "neither 0SEND_F1 on rank 0 nor 1RECV_F1 on rank 1; add both (lower() adds every missing send and receive)",
        ),
    ],
)
def test_missing_and_repeated_actions(sched, expected):
    assert str(error_of(sched)).startswith(expected)


# -- 5. order and deadlock -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sched", "expected", "grid"),
    [
        (
            schedule("0B0 0F0", "1F0 1B0"),
            "rank 0 runs 0B0 at step 0, before 0F0 at step 1, which it needs (a backward pass needs its forward "
            "pass); move 0F0 before 0B0",
            "step  rank 0  rank 1\n   0  >0B0<   1F0\n   1  [0F0]   1B0",
        ),
        (
            schedule("0F0 0W0 0I0", "1F0 1B0"),
            "rank 0 runs 0W0 at step 1, before 0I0 at step 2, which it needs (the weight gradient pass follows the "
            "input gradient pass); move 0I0 before 0W0",
            "step  rank 0  rank 1\n   0  0F0     1F0\n   1  >0W0<   1B0\n   2  [0I0]",
        ),
        (
            schedule("0F0 3F0 3B0 0B0", "2F0 1F0 2B0 1B0", placement=Placement.vshape(2)),
            "rank 1 runs 2F0 at step 0, before 1F0 at step 1, which it needs (stage 2 takes the output of stage 1); "
            "move 1F0 before 2F0",
            "step  rank 0  rank 1\n   0  0F0     >2F0<\n   1  3F0     [1F0]\n   2  3B0     2B0\n   3  0B0     1B0",
        ),
        (
            schedule("0F0 0SEND_F0 0RECV_B0 0B0", "1F0 1RECV_F0 1B0 1SEND_B0"),
            "rank 1 runs 1F0 at step 0, before 1RECV_F0 at step 1, which it needs (1RECV_F0 receives the input of "
            "1F0); move 1RECV_F0 before 1F0",
            "step  rank 0    rank 1\n   0  0F0       >1F0<\n   1  0SEND_F0  [1RECV_F0]\n   2  0RECV_B0  1B0\n"
            "   3  0B0       1SEND_B0",
        ),
    ],
)
def test_an_action_before_what_it_needs_on_its_own_rank(sched, expected, grid):
    error = error_of(sched)
    assert str(error) == f"{expected}\n{grid}"
    assert error.grid == grid


SWAP = schedule("0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0", microbatches=2, name="swap")
SWAP_MESSAGE = """\
schedule 'swap' deadlocks: ranks 0 and 1 wait for each other.
  rank 0 is stuck at step 1 (0B0): it waits for the input gradient of stage 1, microbatch 0, which 1B0 computes at step 3 of rank 1, which is stuck at step 0 (1F1).
  rank 1 is stuck at step 0 (1F1): it waits for the forward output of stage 0, microbatch 1, which 0F1 computes at step 2 of rank 0, which is stuck at step 1 (0B0).
  To break the cycle, one of these ranks must run the awaited action earlier: 0F1 before 0B0 on rank 0, or 1B0 before 1F1 on rank 1.
step x rank grid (>stuck<, [awaited]):
step  rank 0  rank 1
   0  0F0     >1F1<
   1  >0B0<   1B1
   2  [0F1]   1F0
   3  0B1     [1B0]"""  # noqa: E501


def test_a_deadlock_names_each_blocked_rank_what_it_waits_for_and_the_cycle():
    error = error_of(SWAP)
    assert str(error) == SWAP_MESSAGE
    assert error.grid == SWAP_MESSAGE[SWAP_MESSAGE.index("step x rank") :]


def test_a_deadlock_of_lowered_programs_names_the_receives_and_sends():
    error = error_of(schedule("0RECV_B0 0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"))
    assert str(error) == (
        "schedule 't' deadlocks: ranks 0 and 1 wait for each other.\n"
        "  rank 0 is stuck at step 0 (0RECV_B0): it waits for 1SEND_B0 at step 3 of rank 1, which is stuck at step 0 "
        "(1RECV_F0).\n"
        "  rank 1 is stuck at step 0 (1RECV_F0): it waits for 0SEND_F0 at step 2 of rank 0, which is stuck at step 0 "
        "(0RECV_B0).\n"
        "  To break the cycle, one of these ranks must run the awaited action earlier: 0SEND_F0 before 0RECV_B0 on "
        "rank 0, or 1SEND_B0 before 1RECV_F0 on rank 1.\n"
        "step x rank grid (>stuck<, [awaited]):\n"
        "step  rank 0      rank 1\n"
        "   0  >0RECV_B0<  >1RECV_F0<\n"
        "   1  0F0         1F0\n"
        "   2  [0SEND_F0]  1B0\n"
        "   3  0B0         [1SEND_B0]"
    )


def test_a_three_rank_cycle_and_the_ranks_waiting_on_it():
    sched = schedule("3F0 0F0 3B0 0B0", "1F0 4F0 4B0 1B0", "2F0 5F0 5B0 2B0", placement=Placement.looped(3, 2))
    assert str(error_of(sched)).splitlines()[:5] == [
        "schedule 't' deadlocks: ranks 0 -> 2 -> 1 -> 0 wait for one another in a cycle.",
        "  rank 0 is stuck at step 0 (3F0): it waits for the forward output of stage 2, microbatch 0, which 2F0 "
        "computes at step 0 of rank 2, which is stuck at that very action.",
        "  rank 2 is stuck at step 0 (2F0): it waits for the forward output of stage 1, microbatch 0, which 1F0 "
        "computes at step 0 of rank 1, which is stuck at that very action.",
        "  rank 1 is stuck at step 0 (1F0): it waits for the forward output of stage 0, microbatch 0, which 0F0 "
        "computes at step 1 of rank 0, which is stuck at step 0 (3F0).",
        "  To break the cycle, one of these ranks must run the awaited action earlier: 0F0 before 3F0 on rank 0.",
    ]
    behind = schedule(
        "0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0", "2F0 2B0 2F1 2B1", placement=Placement.looped(3), microbatches=2
    )
    lines = str(error_of(behind)).splitlines()
    assert lines[4:6] == [
        "  1 more rank(s) wait on these:",
        "    rank 2 is stuck at step 0 (2F0): it waits for the forward output of stage 1, microbatch 0, which 1F0 "
        "computes at step 2 of rank 1, which is stuck at step 0 (1F1).",
    ]


def test_a_deadlock_deep_in_a_big_schedule_is_found_fast_and_shown_in_a_window():
    sched = cs.build("interleaved-1f1b", ranks=32, microbatches=256, virtual=2)
    programs = [list(p) for p in sched.programs]
    # Rank 5 runs its last backward (5B255) before the forward 37F255, which that backward
    # needs through every later stage: ranks 5..31 and 0..5 wait in a cycle.
    last = programs[5].pop()
    assert str(last) == "5B255"
    programs[5].insert(programs[5].index(Action.parse("37F255")), last)
    bad = sched.with_programs(programs)
    # A search that grew with the square of the schedule would run into the suite's 300 s timeout; how
    # long the verifier takes at scale is `python -m benchmarks --schedule-scale`'s figure, not a test's.
    error = error_of(bad)
    text = str(error)
    assert text.startswith("schedule 'interleaved-1f1b' deadlocks")
    assert len(text.splitlines()) < 80  # a window of rows and the ranks involved, not 32 x 1024 cells
    assert "(showing ranks" in error.grid and ">" in error.grid


def test_a_huge_microbatch_count_is_reported_not_allocated():
    sched = schedule("0F0 0B0", "1F0 1B0", microbatches=10**12)  # allocated, it would never end
    assert str(error_of(sched)) == (
        "stage 0 microbatch 1 is never forwarded: add 0F1 to the program of rank 0, which runs stage 0"
    )
    with pytest.raises(ScheduleError, match="stage 0 microbatch 1 is never forwarded"):
        run(sched, lambda action: 1.0)


def test_a_schedule_keeps_nothing_but_its_provenance():
    sched = cs.build("1f1b", ranks=2, microbatches=2, check=False)
    verify(sched)
    assert sched.lowered_from is None and not hasattr(sched, "__dict__")  # no state hidden on it
    lowered = cs.lower(sched)
    assert lowered.lowered_from is sched and "lowered_from" not in repr(lowered)
    copy = lowered.with_programs(lowered.programs)
    assert copy == lowered and copy.lowered_from is None  # equal programs, no claimed source
    verify(copy)
    with pytest.raises(ScheduleError, match="lowered_from must be the Schedule"):
        Schedule("x", sched.placement, 2, sched.programs, lowered_from="1f1b")


def test_a_verdict_is_remembered_on_the_schedule_outside_its_equality(monkeypatch):
    """No module keeps verdicts: the schedule that passed carries its own, which equality ignores."""
    verify_module = sys.modules[verify.__module__]  # (the package's `verify` names the function)
    sched = cs.build("zbv", ranks=2, microbatches=4, check=False)
    verify(sched)
    same_content = sched.with_programs(sched.programs)  # made anew: no verdict of its own yet
    assert same_content == sched and hash(same_content) == hash(sched)
    monkeypatch.setattr(verify_module, "runs_clean", lambda schedule: pytest.fail("stepped again"))
    verify(sched)
    verify(cs.lower(sched))  # checked through its source, which passed
    with pytest.raises(pytest.fail.Exception, match="stepped again"):
        verify(same_content)
    with pytest.raises(pytest.fail.Exception, match="stepped again"):
        verify(cs.build("zbv", ranks=2, microbatches=6, check=False))  # another one is stepped


# -- engine -------------------------------------------------------------------------------------


def test_engine_times_with_latency_on_crossings_only():
    sched = schedule("0F0 3F0 3B0 0B0", "1F0 2F0 2B0 1B0", placement=Placement.vshape(2))
    costs = CostModel.uniform(4, 1.0, 2.0, 1.0, latency=0.5)
    spans = [(s.rank, str(s.action), s.start, s.end) for s in run(sched, costs.duration, costs.latency).spans]
    assert spans == [
        (0, "0F0", 0.0, 1.0),
        (0, "3F0", 4.0, 5.0),
        (0, "3B0", 5.0, 8.0),  # B = I + W
        (0, "0B0", 15.0, 18.0),
        (1, "1F0", 1.5, 2.5),
        (1, "2F0", 2.5, 3.5),  # stage 1 -> 2 on one rank: no latency
        (1, "2B0", 8.5, 11.5),
        (1, "1B0", 11.5, 14.5),
    ]
    lowered = run(lower(sched), costs.duration, costs.latency).spans
    assert [(s.rank, str(s.action), s.start, s.end) for s in lowered] == spans


def test_engine_calls_any_duration_function_per_action():
    sched = cs.build("1f1b", ranks=2, microbatches=2)
    result = run(sched, lambda action: 1.0 + action.microbatch)
    assert [(str(s.action), s.start, s.end) for s in result.spans if s.rank == 1] == [
        ("1F0", 1.0, 2.0),
        ("1B0", 2.0, 3.0),
        ("1F1", 3.0, 5.0),
        ("1B1", 5.0, 7.0),
    ]


def test_engine_reports_blocked_ranks_and_malformed_schedules_never_reach_it():
    result = run(SWAP, lambda action: 1.0)
    assert not result.completed
    assert [(b.rank, b.position, str(b.action), b.producer_rank, str(b.producer)) for b in result.blocked] == [
        (0, 1, "0B0", 1, "1B0"),
        (1, 0, "1F1", 0, "0F1"),
    ]
    with pytest.raises(ScheduleError, match="names stage 9"):
        run(raw([Action(K.F, 9, 0)], []), lambda action: 1.0)


# -- speed --------------------------------------------------------------------------------------


def test_a_quarter_million_actions_verify_lower_and_simulate():
    # About 1 s on an idle 2-core machine; a quadratic step would run into the suite's 300 s timeout.
    # The time itself: `python -m benchmarks --schedule-scale` (P=256, M=2048, target under 5 s).
    sched = cs.build("interleaved-1f1b", ranks=64, microbatches=1024, virtual=2, check=False)
    assert sum(map(len, sched.programs)) == 262_144
    verify(sched)
    lowered = lower(sched)
    verify(lowered)
    timeline = cs.simulate(sched)
    # Each rank busy V x M x (F + B) = 2 x 1024 x 3, plus the fill and drain (P - 1) x 3 / V x V.
    assert timeline.makespan == 2 * 1024 * 3 + 63 * 3


def test_module_examples_hold():
    for name in ("conveyor.schedule.verify", "conveyor.schedule.engine", "conveyor.schedule.simulate"):
        result = doctest.testmod(importlib.import_module(name))
        assert result.failed == 0 and result.attempted >= 1, name


@pytest.mark.parametrize("odd", [0.0, False], ids=["float", "bool"])
def test_ids_that_hash_like_ints_are_refused_even_in_an_otherwise_valid_schedule(odd):
    schedule = cs.build("1f1b", ranks=2, microbatches=2)
    rank0 = tuple(Action(a.kind, odd, a.microbatch) for a in schedule.programs[0])
    with pytest.raises(ScheduleError, match="the stage of an action must be an int"):
        Schedule(schedule.name, schedule.placement, 2, (rank0, schedule.programs[1]))


def test_look_alike_actions_are_refused_even_in_an_otherwise_valid_schedule():
    from collections import namedtuple

    fake = namedtuple("Fake", "kind stage microbatch")
    schedule = cs.build("1f1b", ranks=2, microbatches=2)
    rank0 = tuple(fake(a.kind, a.stage, a.microbatch) for a in schedule.programs[0])
    with pytest.raises(ScheduleError, match="expected an Action"):
        Schedule(schedule.name, schedule.placement, 2, (rank0, schedule.programs[1]))
