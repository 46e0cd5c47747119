"""NCCL's host-blocking rules in a first step, replayed over every built-in's posts: pure Python, no ranks."""

from __future__ import annotations

import conveyor.schedule as cs
from conveyor.errors import ScheduleError
from conveyor.runtime.lifecycle.host_blocking import check_first_step
from conveyor.schedule.ir import Placement, Schedule
from conveyor.schedule.passes import executable
from conveyor.schedule.posts import EVAL_FORWARD, FORWARD, IN_ORDER, place_all_posts


def _first_steps():
    """Every built-in schedule's train and eval programs with their posts, P in 2..8, V in 1..2."""
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
                        posts = place_all_posts(lowered, IN_ORDER, forward=FORWARD if training else EVAL_FORWARD)
                        yield (name, ranks, virtual, microbatches, training), lowered, posts


def test_nccl_first_step_host_replay_of_every_builtin_schedule():
    """With communicators created lazily, zb-h1 at V=2, P>=3 and more microbatches than ranks
    deadlocks (rank 0 creating the wrap-around channel from the last rank, which waits for a
    structure down a chain that ends at rank 0); with communicators created when the pipeline is
    built (what the runtime does, see OwnGroups.channel_groups), nothing does."""
    lazy, checked = [], 0
    for case, lowered, posts in _first_steps():
        if check_first_step(lowered, posts, lazy_communicators=True) is not None:
            lazy.append(case)
        problem = check_first_step(lowered, posts, lazy_communicators=False)
        assert problem is None, f"{case}: {problem}"
        # Given structures (shapes=, or any later step), nothing blocks the host, whatever the communicators.
        assert check_first_step(lowered, posts, lazy_communicators=True, structures_known=True) is None, case
        checked += 1
    print(f"NCCL first-step replay: {checked} programs checked; with lazy communicators {len(lazy)} deadlock: "
          f"{sorted(set(c[0] for c in lazy))}")
    assert checked > 350
    assert sorted(lazy) == sorted(("zb-h1", p, 2, m, True) for p in range(3, 9) for m in (p + 1, 2 * p))


def test_the_first_step_replay_names_who_blocks_on_what():
    def case(rows):
        lowered = Schedule.from_programs("hand", Placement.looped(2, 1), 1, rows)
        return lowered, place_all_posts(lowered, IN_ORDER)

    lowered, posts = case([["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]])
    assert check_first_step(lowered, posts, lazy_communicators=True) is None
    # Rank 1 posts the gradient's send first: its channel's creation waits for rank 0, whose
    # receive of it comes after the forward's send, whose creation waits for rank 1.
    lowered, posts = case([["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1SEND_B0", "1RECV_F0", "1F0", "1B0"]])
    problem = check_first_step(lowered, posts, lazy_communicators=True)
    assert problem is not None and "rank 0 blocks" in problem and "to create channel (0, 1)" in problem, problem
    assert "rank 1 blocks" in problem and "to create channel (1, 0)" in problem, problem
    assert check_first_step(lowered, posts, lazy_communicators=False) is None
