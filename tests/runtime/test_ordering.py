"""The order-matched posts (NCCL's) of every built-in schedule, checked statically: pure Python, no ranks."""

from __future__ import annotations

import pytest

import conveyor.schedule as cs
from conveyor.errors import ScheduleError
from conveyor.runtime.ordering import (
    check_first_step,
    check_posts,
    posting_of,
    sender_orders,
    transfer_of,
)
from conveyor.schedule.ir import Action, ActionKind, Placement
from conveyor.schedule.passes import executable


def _cases():
    for name, info in sorted(cs.available().items()):
        virtuals = info.virtual_choices if info.virtual_choices is not None else (1, 2, 3)
        for ranks in (2, 4, 8):
            for virtual in virtuals:
                for microbatches in sorted({1, 2, ranks, 2 * ranks + 1}):
                    yield name, ranks, virtual, microbatches


def _sends_in_programs(programs, placement, training):
    sent = {}
    for rank, program in enumerate(programs):
        for action in program:
            if action.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
                peer, key = transfer_of(action, placement, training)
                sent.setdefault((rank, peer), []).append(key)
    return sent


def _receives_in_programs(programs, placement, training):
    received = {}
    for rank, program in enumerate(programs):
        for action in program:
            if action.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                peer, key = transfer_of(action, placement, training)
                received.setdefault((peer, rank), []).append(key)
    return received


@pytest.mark.parametrize("name", sorted(cs.available()))
def test_every_builtin_schedule_posts_in_matching_order_and_cannot_deadlock(name):
    """For every pair of ranks the sends a -> b meet, in order, the receives b posts from a (same
    stage, microbatch, kind), and simulated posts and waits of every rank complete (model: one
    communicator per channel, in-order completion, batches complete together)."""
    checked = reordered = 0
    for case_name, ranks, virtual, microbatches in _cases():
        if case_name != name:
            continue
        try:
            schedule = cs.build(name, ranks=ranks, microbatches=microbatches, virtual=virtual)
        except ScheduleError:
            continue  # sizes this schedule does not serve
        runs = executable(schedule)
        for training, lowered in ((True, runs.train), (False, runs.eval)):
            orders = sender_orders(schedule, training)
            where = f"{name} P={ranks} V={virtual} M={microbatches} {'train' if training else 'eval'}"
            # The runtime's sender order is the lowered programs' (it has no lower() of its own).
            assert orders == _sends_in_programs(lowered.programs, schedule.placement, training), where
            received = _receives_in_programs(lowered.programs, schedule.placement, training)
            assert {pair: sorted(keys) for pair, keys in orders.items()} == \
                   {pair: sorted(keys) for pair, keys in received.items()}, where
            reordered += received != orders  # receivers that consume out of the sender's order
            postings = [posting_of(p, r, schedule.placement, orders, training) for r, p in enumerate(lowered.programs)]
            assert check_posts(lowered.programs, postings, schedule.placement, training) is None, where
            checked += 1
    assert checked >= 6, f"{name}: only {checked} sizes checked"
    if name in ("interleaved-1f1b", "zbv", "dualpipev"):
        assert reordered, f"{name}: expected some size whose receiver consumes out of the sender's order"


def _postings_for(rows, placement):
    programs = [tuple(map(Action.parse, row)) for row in rows]
    orders = {}
    for rank, program in enumerate(programs):
        for action in program:
            if action.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
                peer, key = transfer_of(action, placement, True)
                orders.setdefault((rank, peer), []).append(key)
    return programs, [posting_of(p, r, placement, orders, True) for r, p in enumerate(programs)]


def test_the_simulation_finds_ranks_that_wait_for_each_other():
    # Each rank receives before it sends what the other waits for: no order of posts helps.
    placement = Placement.looped(2, 1)
    programs, postings = _postings_for([["0RECV_B0", "0B0", "0F0", "0SEND_F0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]],
                             placement)
    problem = check_posts(programs, postings, placement)
    assert problem is not None and "rank 0 waits" in problem and "rank 1 waits" in problem


def test_the_simulation_finds_receives_posted_out_of_the_senders_order():
    placement = Placement.looped(2, 1)
    programs, postings = _postings_for([["0F0", "0SEND_F0", "0F1", "0SEND_F1"], ["1RECV_F1", "1F1", "1RECV_F0", "1F0"]],
                             placement)
    assert check_posts(programs, postings, placement) is None  # the posting posts F0's receive first
    swapped = [postings[0], {Action.parse("1RECV_F1"): ((Action.parse("1RECV_F1"), Action.parse("1RECV_F0")),)}]
    problem = check_posts(programs, swapped, placement)
    assert problem is not None and "rank 0 sends rank 1" in problem


def _first_steps():
    """Every built-in schedule's train and eval programs with their postings, P in 2..8, V in 1..2."""
    for name, info in sorted(cs.available().items()):
        for ranks in range(2, 9):
            for virtual in (v for v in info.virtual_choices or (1, 2) if v <= 2):
                for microbatches in sorted({ranks, ranks + 1, 2 * ranks}):
                    try:
                        schedule = cs.build(name, ranks=ranks, microbatches=microbatches, virtual=virtual)
                    except ScheduleError:
                        continue
                    runs = executable(schedule)
                    for training, lowered in ((True, runs.train), (False, runs.eval)):
                        orders = sender_orders(schedule, training)
                        postings = [posting_of(p, r, schedule.placement, orders, training)
                                 for r, p in enumerate(lowered.programs)]
                        key = (name, ranks, virtual, microbatches, training)
                        yield key, lowered.programs, postings, schedule.placement


def test_nccl_first_step_host_replay_of_every_builtin_schedule():
    """NCCL's host-blocking rules in a first step (a structure waits for its sender's post; a
    communicator created at its first use waits for both ranks): with communicators created
    lazily, zb-h1 at V=2, P>=3 and more microbatches than ranks deadlocks (rank 0 creating the
    wrap-around channel from the last rank, which waits for a structure down a chain that ends
    at rank 0); with communicators created when the pipeline is built (what the runtime does,
    see RankLifecycle.channel_groups), nothing does."""
    lazy, checked = [], 0
    for case, programs, postings, placement in _first_steps():
        training = case[-1]
        if check_first_step(programs, postings, placement, training, lazy_communicators=True) is not None:
            lazy.append(case)
        problem = check_first_step(programs, postings, placement, training, lazy_communicators=False)
        assert problem is None, f"{case}: {problem}"
        # Given structures (shapes=, or any later step), nothing blocks the host, whatever the communicators.
        assert check_first_step(programs, postings, placement, training, lazy_communicators=True,
                                structures_known=True) is None, case
        checked += 1
    print(f"NCCL first-step replay: {checked} programs checked; with lazy communicators {len(lazy)} deadlock: "
          f"{sorted(set(c[0] for c in lazy))}")
    assert checked > 350
    assert sorted(lazy) == sorted(("zb-h1", p, 2, m, True) for p in range(3, 9) for m in (p + 1, 2 * p))


def test_the_first_step_replay_names_who_blocks_on_what():
    placement = Placement.looped(2, 1)
    programs, postings = _postings_for([["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]],
                             placement)
    assert check_first_step(programs, postings, placement, lazy_communicators=True) is None
    # Rank 1 posts the gradient's send first: its channel's creation waits for rank 0, whose
    # receive of it comes after the forward's send, whose creation waits for rank 1.
    programs, postings = _postings_for([["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1SEND_B0", "1RECV_F0", "1F0", "1B0"]],
                             placement)
    problem = check_first_step(programs, postings, placement, lazy_communicators=True)
    assert problem is not None and "rank 0 blocks" in problem and "to create channel (0, 1)" in problem, problem
    assert "rank 1 blocks" in problem and "to create channel (1, 0)" in problem, problem
    assert check_first_step(programs, postings, placement, lazy_communicators=False) is None
