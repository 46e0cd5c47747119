"""The pass chain from a schedule to what its ranks run (conveyor.schedule.passes).

An I directly followed by its own W runs as one B and every other action stays where it was;
the chain's programs verify and simulate as they are (checked afresh, not from what the chain
recorded); evaluation runs the forward actions; in-order channels are exactly those whose
receiver consumes in the sender's order.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

import conveyor.schedule as cs
from conveyor.errors import ScheduleError
from conveyor.schedule.ir import Action, ActionKind, PackedProgram, Placement, Schedule
from conveyor.schedule.lower import lower
from conveyor.schedule.passes import (
    executable,
    forward_only,
    merge_adjacent_backward_halves,
)
from conveyor.schedule.posts import BACKWARD, DISCIPLINES, EVAL_FORWARD, FORWARD, place_posts
from conveyor.schedule.verify import verify

from .test_properties import valid_schedules

K = ActionKind
BUILT_INS = [("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved-1f1b", 2, 2), ("looped-bfs", 2, 2),
             ("zb-h1", 4, 1), ("zb-h1", 2, 2), ("zb-h2", 4, 1), ("zbv", 4, 2), ("dualpipev", 4, 2)]


def _merged(*texts: str) -> list[str]:
    return [str(a) for a in merge_adjacent_backward_halves(PackedProgram.of(map(Action.parse, texts), 2, 3))]


def _in_order_reference(lowered: Schedule) -> frozenset:
    """Channels (send kind, sending stage) whose receiver consumes in the sender's order, read off every
    rank's lowered program at once (what the posts pass finds rank by rank)."""
    sent: dict = {}
    received: dict = {}
    for program in lowered.programs:
        for a in program:
            if a.kind is K.SEND_F or a.kind is K.SEND_B:
                sent.setdefault((a.kind, a.stage), []).append(a.microbatch)
            elif a.kind is K.RECV_F:
                received.setdefault((K.SEND_F, a.stage - 1), []).append(a.microbatch)
            elif a.kind is K.RECV_B:
                received.setdefault((K.SEND_B, a.stage + 1), []).append(a.microbatch)
    return frozenset(c for c, order in sent.items() if received.get(c) == order)


def test_only_a_w_right_after_its_own_i_merges():
    assert _merged("0I0", "0W0") == ["0B0"]
    assert _merged("1I0", "1SEND_B0", "1W0") == ["1I0", "1SEND_B0", "1W0"]  # the send goes first
    assert _merged("0I0", "0W1") == ["0I0", "0W1"]  # another microbatch
    assert _merged("0I0", "1W0") == ["0I0", "1W0"]  # another stage
    assert _merged("0W0", "0I0") == ["0W0", "0I0"]
    assert _merged("0I0", "0W0", "0I1", "0W1", "0B2") == ["0B0", "0B1", "0B2"]
    assert _merged() == []


@pytest.mark.parametrize(("name", "num_ranks", "virtual"), [
    ("zb-h1", 2, 1), ("zb-h1", 4, 2), ("zb-h2", 4, 1), ("zbv", 2, 2), ("zbv", 4, 2), ("dualpipev", 4, 2),
    ("1f1b", 4, 1),
])
def test_merging_keeps_every_other_action_in_order(name, num_ranks, virtual):
    lowered = lower(cs.build(name, ranks=num_ranks, microbatches=8, virtual=virtual))
    for program in lowered.programs:
        merged = merge_adjacent_backward_halves(program)
        expanded = []
        for action in merged:
            if action.kind is ActionKind.B and action not in program:
                expanded += [Action(ActionKind.I, action.stage, action.microbatch),
                             Action(ActionKind.W, action.stage, action.microbatch)]
            else:
                expanded.append(action)
        assert tuple(expanded) == tuple(program)
        # Stage 0 sends no input gradient, so its I and W always meet.
        assert not any(a.kind in (ActionKind.I, ActionKind.W) and a.stage == 0 for a in merged)


def _fresh(schedule: Schedule) -> Schedule:
    """The same programs without what the chain recorded on them (lowered_from)."""
    # Evaluation programs hold forwards only, which verify() rightly calls incomplete.
    return Schedule(schedule.name, schedule.placement, schedule.num_microbatches, schedule.programs)


def _check_chain(schedule: Schedule) -> None:
    runs = executable(schedule)
    lowered = lower(schedule)
    # Merging before lowering (only where lowering leaves I and W side by side) gives what
    # merging the lowered programs gives; the compute actions alone are that, less the comms.
    assert runs.train.programs == tuple(merge_adjacent_backward_halves(p) for p in lowered.programs)
    assert runs.compute.programs == _fresh(runs.train).compute_only().programs
    assert cs.simulate(runs.compute).spans == cs.simulate(_fresh(runs.compute)).spans
    verify(_fresh(runs.compute))
    assert runs.eval == lower(forward_only(schedule))
    verify(_fresh(runs.train))  # what the chain marks as verified verifies from scratch
    # The fast path the chain lets simulate() take times exactly like the full program.
    assert cs.simulate(runs.train).spans == cs.simulate(_fresh(runs.train)).spans
    assert runs.train_in_order == _in_order_reference(runs.train)
    assert runs.eval_in_order == _in_order_reference(runs.eval)
    for rank in range(schedule.num_ranks):  # a rank's posts are the pass's on the whole lowered schedule
        for discipline in DISCIPLINES:
            assert runs.train_posts(rank, discipline) == place_posts(lower(runs.compute), rank, discipline)
            assert runs.eval_posts(rank, discipline) == place_posts(runs.eval, rank, discipline, forward=EVAL_FORWARD)


@pytest.mark.parametrize(("name", "num_ranks", "virtual"), BUILT_INS)
def test_every_built_in_goes_through_the_chain(name, num_ranks, virtual):
    schedule = cs.build(name, ranks=num_ranks, microbatches=8, virtual=virtual)
    _check_chain(schedule)
    runs = executable(schedule)
    # B takes as long as I and W together in the simulator: merging moves no other action.
    assert cs.simulate(runs.train).makespan == cs.simulate(schedule).makespan
    for rank in range(num_ranks):
        assert [a for a in runs.eval_program(rank) if a.kind.is_compute] == [
            a for a in schedule.programs[rank] if a.kind is K.F]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_schedules())
def test_random_valid_schedules_go_through_the_chain(sched):
    _check_chain(sched)


def test_the_chain_refuses_a_broken_schedule_with_the_verifier_message():
    broken = Schedule("broken", Placement.looped(2, 1), 1, ((Action.parse("0F0"),), (Action.parse("1F0"),)))
    with pytest.raises(ScheduleError, match="stage 0 microbatch 0 has no backward: add 0B0"):
        executable(broken)
    with pytest.raises(ScheduleError, match="expects a Schedule, got str"):
        executable("1f1b")


def test_in_order_channels_leave_out_a_channel_consumed_out_of_order_at_both_ends():
    # Rank 1 takes microbatch 1 before microbatch 0 (it may: both were sent before).
    programs = (tuple(map(Action.parse, ["0F0", "0F1", "0B1", "0B0"])),
                tuple(map(Action.parse, ["1F1", "1F0", "1B1", "1B0"])))
    # Placement V=1, 2 ranks: rank 0 holds stage 0, rank 1 stage 1.
    schedule = Schedule("swapped", Placement.looped(2, 1), 2, programs)
    runs = executable(schedule)
    for rank in (0, 1):  # the sender and the receiver of each channel agree
        channels = runs.in_order_channels(rank)
        assert (FORWARD, 0) not in channels  # sent 0 then 1, received 1 then 0
        assert (BACKWARD, 1) in channels  # sent 1 then 0, received 1 then 0
        assert (EVAL_FORWARD, 0) not in channels  # the evaluation keeps the forwards' order
    assert runs.train_in_order == {(K.SEND_B, 1)} and runs.eval_in_order == frozenset()
