"""Where ranks post their transfers (both disciplines) for every built-in schedule, checked by the engine."""

from __future__ import annotations

import pytest

import conveyor.schedule as cs
from conveyor.errors import ScheduleError
from conveyor.schedule.ir import Action, ActionKind, Placement, Schedule
from conveyor.schedule.passes import executable
from conveyor.schedule.posts import (
    EVAL_FORWARD,
    FORWARD,
    IN_ORDER,
    LOOKAHEAD,
    Batch,
    check_posts,
    place_all_posts,
    place_posts,
    rank_channels,
    transfer_of,
)


def _cases():
    for name, info in sorted(cs.available().items()):
        virtuals = info.virtual_choices if info.virtual_choices is not None else (1, 2, 3)
        for ranks in (2, 4, 8):
            for virtual in virtuals:
                for microbatches in sorted({1, 2, ranks, 2 * ranks + 1}):
                    yield name, ranks, virtual, microbatches


def _receives_in_programs(lowered, forward):
    received = {}
    for rank, program in enumerate(lowered.programs):
        for action in program:
            if action.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                peer, key = transfer_of(action, lowered.placement, forward)
                received.setdefault((peer, rank), []).append(key)
    return received


@pytest.mark.parametrize("name", sorted(cs.available()))
def test_every_builtin_schedule_posts_in_matching_order_and_cannot_deadlock(name):
    """For every pair of ranks the sends a -> b meet, in order, the receives b posts from a (same
    stage, microbatch, kind), and the engine steps every rank's posts and waits to the end, under
    both disciplines (in order: one communicator per channel, batches complete together)."""
    checked = reordered = 0
    for case_name, ranks, virtual, microbatches in _cases():
        if case_name != name:
            continue
        try:
            schedule = cs.build(name, ranks=ranks, microbatches=microbatches, virtual=virtual)
        except ScheduleError:
            continue  # sizes this schedule does not serve
        runs = executable(schedule)
        for forward, lowered in ((FORWARD, runs.train), (EVAL_FORWARD, runs.eval)):
            where = f"{name} P={ranks} V={virtual} M={microbatches} {'train' if forward == FORWARD else 'eval'}"
            orders = {(peer, rank): list(keys) for rank in range(ranks)
                      for peer, keys in rank_channels(lowered, rank, forward).orders.items() if keys}
            received = _receives_in_programs(lowered, forward)
            assert {pair: sorted(keys) for pair, keys in orders.items()} == \
                   {pair: sorted(keys) for pair, keys in received.items()}, where
            reordered += received != orders  # receivers that consume out of the sender's order
            ranked = runs.train_posts if forward == FORWARD else runs.eval_posts  # what the runtime reads
            for discipline in (IN_ORDER, LOOKAHEAD):
                posts = [ranked(rank, discipline) for rank in range(ranks)]
                assert check_posts(lowered, discipline, forward=forward, posts=posts) is None, (where, discipline)
            checked += 1
    assert checked >= 6, f"{name}: only {checked} sizes checked"
    if name in ("interleaved-1f1b", "zbv", "dualpipev"):
        assert reordered, f"{name}: expected some size whose receiver consumes out of the sender's order"


def _lowered(rows):
    return Schedule.from_programs("hand", Placement.looped(2, 1), 2, rows)


def test_the_engine_finds_ranks_that_wait_for_each_other():
    # Each rank receives before it sends what the other waits for: no order of posts helps.
    lowered = _lowered([["0RECV_B0", "0B0", "0F0", "0SEND_F0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]])
    for discipline in (IN_ORDER, LOOKAHEAD):
        problem = check_posts(lowered, discipline)
        assert problem is not None and "rank 0 waits" in problem and "rank 1 waits" in problem, problem


def test_in_order_posts_follow_the_senders_order_and_a_swapped_plan_is_caught():
    lowered = _lowered([["0F0", "0SEND_F0", "0F1", "0SEND_F1"], ["1RECV_F1", "1F1", "1RECV_F0", "1F0"]])
    posts = place_all_posts(lowered, IN_ORDER)
    assert [str(a) for a in posts[1][0][0].actions] == ["1RECV_F0", "1RECV_F1"]  # F0's receive first
    assert check_posts(lowered, IN_ORDER) is None
    swapped = (Batch(0, False, tuple(map(Action.parse, ["1RECV_F1", "1RECV_F0"])), ((0, 0, 1), (0, 0, 0))),)
    problem = check_posts(lowered, IN_ORDER, posts=[posts[0], (swapped, (), (), ())])
    assert problem is not None and "rank 0 sends rank 1" in problem, problem


def test_look_ahead_posts_receives_a_few_ahead_and_sends_where_they_stand():
    lowered = cs.lower(cs.build("gpipe", ranks=2, microbatches=6))
    program, posts = lowered.programs[1], place_posts(lowered, 1, LOOKAHEAD, receives_ahead=2)
    receives = [i for i, a in enumerate(program) if a.kind is ActionKind.RECV_F]
    assert receives[0] == 0  # so before it: the first two, then (reaching it) the third
    assert [b.actions[0] for b in posts[0]] == [program[i] for i in receives[:3]]
    assert [b.actions[0] for b in posts[receives[1]] if not b.sends] == [program[receives[3]]]
    sends = [i for i, a in enumerate(program) if a.kind is ActionKind.SEND_B]
    assert all([b.actions for b in posts[i]] == [(program[i],)] for i in sends)


def test_a_wait_for_what_nobody_sends_is_named():
    lowered = _lowered([["0F0", "0F1"], ["1RECV_F0", "1F0", "1F1"]])
    problem = check_posts(lowered, IN_ORDER)
    assert problem is not None and "1RECV_F0" in problem and "never sends it" in problem, problem
