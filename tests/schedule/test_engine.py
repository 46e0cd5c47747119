"""The engine's public surface: its tables, the checked step, stuck ranks; and the simulator's one-pass path."""

from __future__ import annotations

import pytest

import conveyor.schedule as cs
from conveyor.errors import ScheduleError
from conveyor.schedule.engine import describe_slot, key_tables, runs_clean, step, stuck_ranks
from conveyor.schedule.ir import KIND_INDEX, Action, ActionKind, Placement, Schedule
from conveyor.schedule.simulate import step_timed

K = ActionKind


def _merge_splits(schedule: Schedule, merged) -> Schedule:
    """Each I with ``merged(action)`` becomes a B in its place and its W goes (a merged lowered program)."""
    programs = []
    for program in schedule.programs:
        out = []
        for action in program:
            if action.kind in (K.I, K.W) and merged(action):
                if action.kind is K.I:
                    out.append(Action(K.B, action.stage, action.microbatch))
                continue
            out.append(action)
        programs.append(tuple(out))
    return Schedule(schedule.name, schedule.placement, schedule.num_microbatches, tuple(programs))


def _timed(timeline) -> dict:
    return {(s.rank, s.action): (s.start, s.end) for s in timeline.spans}


@pytest.mark.parametrize("name", ["zbv", "zb-h1"])
def test_a_stage_may_mix_full_backwards_with_split_ones_lowered_or_not(name):
    source = cs.build(name, ranks=4, microbatches=8, virtual=2)
    costs = cs.CostModel.per_stage([(1.0, 2.0, 0.5 + s % 2) for s in range(source.num_stages)], latency=0.25)
    even = _merge_splits(source, lambda action: action.microbatch % 2 == 0)
    merged_after_lowering = _merge_splits(cs.lower(source), lambda action: action.microbatch % 2 == 0)
    stage = source.programs[0][0].stage
    kinds = {a.kind for a in merged_after_lowering.programs[0] if a.stage == stage}
    assert {K.B, K.I, K.W} <= kinds  # one stage, both forms of backward
    for sched in (even, cs.lower(even), merged_after_lowering):
        cs.verify(sched)
    expected = _timed(cs.simulate(even, costs))
    assert _timed(cs.simulate(cs.lower(even), costs)) == expected
    assert _timed(cs.simulate(merged_after_lowering, costs)) == expected
    stepped = step_timed(merged_after_lowering, costs.duration, costs.latency)
    assert {(s.rank, s.action): (s.start, s.end) for s in stepped.spans} == expected
    spans = {str(s.action): s.duration for s in cs.simulate(even, costs).spans if s.action.stage == 1}
    assert spans["1B0"] == spans["1I1"] + spans["1W1"] == 2.0 + 1.5  # a B costs I + W


def test_a_w_matches_only_its_own_i():
    sched = cs.build("zbv", ranks=2, microbatches=2)
    assert runs_clean(sched)
    # An I turned into a B leaves its W behind: W follows a full backward.
    first_i = next(a for a in sched.programs[0] if a.kind is K.I)
    broken = Schedule(sched.name, sched.placement, 2, tuple(
        tuple(Action(K.B, a.stage, a.microbatch) if a == first_i else a for a in program)
        for program in sched.programs
    ))
    assert not runs_clean(broken)
    with pytest.raises(ScheduleError, match="computes a weight gradient, but stage"):
        cs.verify(broken)


def test_the_tables_say_what_runs_on_a_rank_and_slots_have_words():
    sched = cs.build("zbv", ranks=2, microbatches=3)  # stages 0..3 on ranks (0, 1, 1, 0)
    S, M = sched.num_stages, 3
    tables = key_tables(sched.placement.stage_to_rank, M, [0.0] * (4 * S), lowered=True)
    # Rank 1 runs stages 1 and 2: it receives from stage 0 and sends to stage 3, on other ranks;
    # stages 1 and 2 pass tensors in memory.
    assert {key for key, row in enumerate(tables[1]) if row is not None} == {KIND_INDEX[id(kind)] * S + stage for
        kind, stage in [(K.F, 1), (K.B, 1), (K.I, 1), (K.W, 1), (K.F, 2), (K.B, 2), (K.I, 2), (K.W, 2),
                        (K.RECV_F, 1), (K.SEND_B, 1), (K.SEND_F, 2), (K.RECV_B, 2)]}
    compute_only = key_tables(sched.placement.stage_to_rank, M, [0.0] * (4 * S))
    assert {key // S for key, row in enumerate(compute_only[1]) if row is not None} == {0, 1, 2, 3}
    SM = S * M
    assert describe_slot(sched, 2 * SM + 3 * M + 2) == "the weight gradient of stage 3, microbatch 2"
    # A W waits for its I's mark (what only an I writes), and says so as a B waiting on an I does.
    assert describe_slot(sched, SM + M) == describe_slot(sched, 3 * SM + M) == (
        "the input gradient of stage 1, microbatch 0"
    )
    assert describe_slot(cs.lower(sched), 5 * SM + M + 1) == "the receive 1RECV_F1"
    assert describe_slot(sched, 4 * SM) == "nothing"  # the always-done row


def test_stuck_ranks_and_the_checked_pass():
    swap = Schedule.from_programs(
        "swap", Placement.looped(2), 2, [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]]
    )
    assert [(b.rank, b.position, str(b.action), str(b.producer)) for b in stuck_ranks(swap)] == [
        (0, 1, "0B0", "1B0"),
        (1, 0, "1F1", "0F1"),
    ]
    run = step(swap)
    assert not run.clean and not run.completed and run.stopped_at == (1, 0) and not runs_clean(swap)
    run = step(cs.lower(cs.build("1f1b", ranks=2, microbatches=3)))
    assert run.clean and run.completed and run.lowered and run.starts == ()


def test_simulate_checks_and_times_an_unverified_schedule_in_one_pass():
    unchecked = cs.build("zbv", ranks=4, microbatches=8, virtual=2, check=False)
    timeline = cs.simulate(unchecked)
    assert _timed(timeline) == _timed(cs.simulate(cs.build("zbv", ranks=4, microbatches=8, virtual=2)))
    # A broken one is named by the verifier, whichever path finds it.
    programs = list(unchecked.programs)
    programs[0] = programs[0][1:]
    broken = unchecked.with_programs(programs)
    with pytest.raises(ScheduleError, match="is never forwarded"):
        cs.simulate(broken)
    with pytest.raises(ScheduleError, match="is never forwarded"):
        cs.simulate(broken, cs.CostModel.uniform(unchecked.num_stages, latency=0.5))


def test_a_lowered_schedule_is_checked_through_its_source_and_diagnosed_itself():
    source = cs.build("interleaved-1f1b", ranks=2, microbatches=4, virtual=2)
    lowered = cs.lower(source)
    assert lowered.lowered_from is source
    cs.verify(lowered)
    swap = Schedule.from_programs(
        "swap", Placement.looped(2), 2, [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]]
    )
    lowered_swap = cs.lower(swap)
    with pytest.raises(ScheduleError) as raised:
        cs.verify(lowered_swap)
    # The message names the lowered programs' own actions (the receives it waits in).
    assert "1RECV_F1" in str(raised.value) and "deadlocks" in str(raised.value)


def test_a_cost_model_whose_duration_reads_the_microbatch_is_asked_per_action():
    class FirstMicrobatchSlow(cs.CostModel):
        def duration(self, action: Action) -> float:
            return super().duration(action) * (3.0 if action.microbatch == 0 else 1.0)

    sched = cs.build("1f1b", ranks=2, microbatches=3)
    costs = FirstMicrobatchSlow.uniform(2, latency=0.5)
    timeline = cs.simulate(sched, costs)
    durations = {str(span.action): span.duration for span in timeline.spans}
    assert (durations["0F0"], durations["1B0"], durations["0F1"], durations["1B2"]) == (3.0, 6.0, 1.0, 2.0)
    assert _timed(cs.simulate(cs.lower(sched), costs)) == _timed(timeline)
    hand_lowered = Schedule(sched.name, sched.placement, 3, cs.lower(sched).programs)  # no lowered_from
    assert hand_lowered.lowered_from is None and _timed(cs.simulate(hand_lowered, costs)) == _timed(timeline)
    # 0F0 1F0 1B0 0B0 (3 + 3 + 6 + 6), then 0F2 1F2 1B2 0B2 (1 + 1 + 2 + 2), and four crossings of 0.5.
    assert timeline.makespan == 26.0
