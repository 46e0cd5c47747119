"""Overlapped forward/backward pairs: finding them, checking them, lowering them, timing and drawing them."""

from __future__ import annotations

import json

import pytest

import conveyor.schedule as cs
from conveyor.errors import CostError, ScheduleError
from conveyor.schedule.ir import Action, B, F, I, Placement, Schedule, W
from conveyor.schedule.ir import ActionKind as K
from conveyor.schedule.overlap import overlap_pair, pair_forward_backward, pair_timing, pairs_of, verify_overlapped
from conveyor.schedule.passes import Executable
from conveyor.schedule.posts import DISCIPLINES, check_posts
from conveyor.schedule.render import draw, headline, to_chrome_trace
from conveyor.schedule.timeline import CommSpan, Span, Timeline, measured_timeline

EXCHANGES = {"exchange": 0.5, "exchanges": 2}  # two all-to-alls per pass, each half a forward


def texts(actions) -> list[str]:
    return [str(a) for a in actions]


def with_pairs(schedule: Schedule, *rank_pairs) -> Schedule:
    return schedule.with_programs(schedule.programs, tuple(tuple(pairs) for pairs in rank_pairs))


# -- finding pairs ---------------------------------------------------------------------------------


def test_1f1b_pairs_each_forward_with_the_backward_right_after_it():
    sched = cs.build("1f1b", ranks=2, microbatches=4)
    paired = pair_forward_backward(sched)
    assert paired.programs == sched.programs
    assert {str(f): str(b) for f, b in pairs_of(paired, 0).items()} == {"0F1": "0B0", "0F2": "0B1", "0F3": "0B2"}
    assert pairs_of(paired, 1) == {}  # 1F0 1B0 1F1 1B1 ...: each backward is of its forward's own microbatch
    assert pairs_of(sched, 0) == {}
    assert paired != sched and paired.compute_only() == paired
    assert "rank 0 overlaps: 0F1+0B0 0F2+0B1 0F3+0B2" in str(paired)
    with pytest.raises(ScheduleError, match="outside"):
        pairs_of(paired, 2)


def test_a_backward_of_the_forwards_own_microbatch_is_never_paired():
    sched = Schedule.from_programs("own", Placement.looped(1), 2, [["0F0", "0B0", "0F1", "0I1", "0W1"]])
    assert pair_forward_backward(sched).overlapped == ()
    zbv = pair_forward_backward(cs.build("zbv", ranks=2, microbatches=6))
    assert all(f.microbatch != b.microbatch for pairs in zbv.overlapped for f, b in pairs)
    assert (F(3, 1), I(3, 1)) not in zbv.overlapped[0]  # adjacent in rank 0's program, same microbatch
    assert (F(0, 3), I(0, 0)) in zbv.overlapped[0]


def test_pairs_that_would_deadlock_are_not_kept():
    # GPipe's only F-then-B is the last forward then the first backward; paired, the rank would wait for
    # microbatch 0's gradient before sending the last forward output the next rank needs first.
    gpipe = cs.build("gpipe", ranks=2, microbatches=4)
    assert pair_forward_backward(gpipe).overlapped == ()
    with pytest.raises(ScheduleError) as caught:
        verify_overlapped(with_pairs(gpipe, [(F(0, 3), B(0, 0))], []))
    message = str(caught.value)
    assert "runs without its overlapped pairs but not with them" in message
    assert "schedule 'gpipe' deadlocks: ranks 0 and 1 wait for each other." in message
    assert "0RECV_B0" in message  # the pair waits in front of itself for microbatch 0's gradient


def test_a_lowered_schedule_is_paired_on_its_compute_actions():
    sched = cs.build("interleaved-1f1b", ranks=2, microbatches=8, virtual=2)
    assert pair_forward_backward(cs.lower(sched)) == cs.lower(pair_forward_backward(sched))
    hand = Schedule.from_programs("hand", Placement.looped(2), 2, [
        ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
        ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"]])
    paired = pair_forward_backward(hand)
    assert paired.programs == hand.programs and paired.overlapped == (((F(0, 1), B(0, 0)),), ())
    cs.verify(paired)  # its comms as placed: 0SEND_F1 before 0RECV_B0


# -- the Schedule field ------------------------------------------------------------------------------


def test_overlapped_is_checked_for_shape_when_made():
    sched = cs.build("1f1b", ranks=2, microbatches=4)
    with pytest.raises(ScheduleError, match=r"overlapped must have 2 entries, one per rank, got 1 entries; give"):
        sched.with_programs(sched.programs, (((F(0, 1), B(0, 0)),),))
    with pytest.raises(ScheduleError, match=r"overlapped\[0\] must hold \(Action, Action\) pairs, got .*'0F1'"):
        sched.with_programs(sched.programs, ((("0F1", "0B0"),), ()))
    with pytest.raises(ScheduleError, match="one per rank"):
        Schedule(sched.name, sched.placement, 4, sched.programs, overlapped="0F1+0B0")
    listed = Schedule(sched.name, sched.placement, 4, sched.programs, overlapped=[[[F(0, 1), B(0, 0)]], []])
    assert listed.overlapped == (((F(0, 1), B(0, 0)),), ())
    assert repr(listed) == repr(sched)  # repr() as before; str() shows the pairs


def test_the_pairs_travel_with_the_schedule():
    paired = pair_forward_backward(cs.build("1f1b", ranks=2, microbatches=4))
    lowered = cs.lower(paired)
    assert lowered.overlapped == paired.overlapped and lowered.lowered_from is paired
    assert lowered.compute_only() == paired and cs.lower(lowered) == lowered
    runs = Executable(paired)
    assert runs.compute.overlapped == runs.train.overlapped == paired.overlapped
    assert runs.eval.overlapped == ()  # evaluation runs no backward


def test_merging_an_I_with_its_W_names_the_pair_by_the_B_that_runs():
    paired = pair_forward_backward(cs.build("zb-h1", ranks=2, microbatches=4))
    assert (F(0, 1), I(0, 0)) in paired.overlapped[0]
    compute = Executable(paired).compute  # stage 0's I and W meet: one B
    assert (F(0, 1), B(0, 0)) in compute.overlapped[0]
    assert all(b.kind is I for _, b in compute.overlapped[1])  # stage 1 sends its input gradient between
    cs.verify(compute)


# -- lowering and posts --------------------------------------------------------------------------------


def test_lowering_puts_both_receives_before_a_pair_and_both_sends_after_it():
    paired = pair_forward_backward(cs.build("1f1b", ranks=4, microbatches=8))
    assert (F(1, 2), B(1, 0)) in paired.overlapped[1]
    program = texts(cs.lower(paired).programs[1])
    at = program.index("1F2")
    assert program[at - 2:at + 4] == ["1RECV_F2", "1RECV_B0", "1F2", "1B0", "1SEND_F2", "1SEND_B0"]
    first = texts(cs.lower(paired).programs[0])  # stage 0: no forward input, no gradient to send
    at = first.index("0F3")
    assert first[at - 1:at + 3] == ["0RECV_B0", "0F3", "0B0", "0SEND_F3"]
    unpaired = texts(cs.lower(cs.build("1f1b", ranks=4, microbatches=8)).programs[1])
    assert sorted(program) == sorted(unpaired) and program != unpaired


def test_the_executable_of_a_paired_schedule_posts_its_reordered_comms():
    paired = pair_forward_backward(cs.build("dualpipev", ranks=4, microbatches=16))
    runs = Executable(paired)
    for rank in range(4):
        program = runs.train_program(rank)
        for forward, backward in runs.compute.overlapped[rank]:
            at = program.index(forward)
            assert program[at + 1] == backward
            receives, sends = _crossings(paired.placement, forward, backward)
            assert program[at - len(receives):at] == receives and program[at + 2:at + 2 + len(sends)] == sends
        for discipline in DISCIPLINES:
            assert len(runs.train_posts(rank, discipline)) == len(program)
    for discipline in DISCIPLINES:
        assert check_posts(runs.train, discipline) is None


def _crossings(placement: Placement, forward: Action, backward: Action) -> tuple[tuple, tuple]:
    """The receives a pair needs and the sends it makes, in lowering's order (only those that cross ranks)."""
    rank, last = placement.rank_of(forward.stage), placement.num_stages - 1

    def crosses(stage: int) -> bool:
        return 0 <= stage <= last and placement.rank_of(stage) != rank

    f, b = forward, backward
    receives = tuple(a for a, peer in ((Action(K.RECV_F, f.stage, f.microbatch), f.stage - 1),
                                       (Action(K.RECV_B, b.stage, b.microbatch), b.stage + 1)) if crosses(peer))
    sends = tuple(a for a, peer in ((Action(K.SEND_F, f.stage, f.microbatch), f.stage + 1),
                                    (Action(K.SEND_B, b.stage, b.microbatch), b.stage - 1)) if crosses(peer))
    return receives, sends


# -- the verifier ------------------------------------------------------------------------------------


@pytest.mark.parametrize("pair, words", [
    ((F(0, 3), B(0, 1)), "its backward must directly follow its forward in the rank's compute program, but 0F3 is "
                         "at step 5 and 0B1 at step 4"),
    ((B(0, 0), F(0, 2)), "its first action must be a forward F, got B; write each pair as (forward, backward)"),
    ((F(0, 2), W(0, 0)), "its second action must be a backward B or I"),
    ((F(0, 1), B(0, 1)), "both work on microbatch 1, and a backward needs its own microbatch's forward done first"),
    ((F(1, 1), B(1, 0)), "1F1 runs stage 1, which the placement puts on rank 1; a pair runs on one rank"),
    ((F(0, 1), B(0, 9)), "0B9 is not in rank 0's program"),
])
def test_a_bad_pair_is_refused_naming_rank_pair_and_fix(pair, words):
    sched = cs.build("1f1b", ranks=2, microbatches=4)  # rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
    with pytest.raises(ScheduleError) as caught:
        cs.verify(with_pairs(sched, [pair], []))
    assert str(caught.value).startswith(f"schedule '1f1b', rank 0, pair ({pair[0]}, {pair[1]}): ")
    assert words in str(caught.value)


def test_a_pair_listed_twice_is_refused():
    sched = cs.build("1f1b", ranks=2, microbatches=4)
    with pytest.raises(ScheduleError, match="in another pair too; list each once"):
        cs.verify(with_pairs(sched, [(F(0, 1), B(0, 0)), (F(0, 1), B(0, 0))], []))


def test_a_schedule_broken_without_its_pairs_gets_the_usual_message():
    sched = Schedule.from_programs("short", Placement.looped(2), 2, [["0F0", "0F1", "0B0"], ["1F0", "1B0", "1F1",
                                                                                         "1B1"]])
    with pytest.raises(ScheduleError, match="stage 0 microbatch 1 has no backward"):
        cs.verify(with_pairs(sched, [(F(0, 1), B(0, 0))], []))


# -- every built-in schedule -------------------------------------------------------------------------

BUILTINS = {  # name: (virtual, has pairs at P=4, M=16)
    "gpipe": (1, False), "looped-bfs": (2, False),  # all forwards, then all backwards: no steady state
    "1f1b": (1, True), "interleaved-1f1b": (2, True), "zb-h1": (1, True), "zb-h2": (1, True),
    "zbv": (2, True), "dualpipev": (2, True), "zb-1p": (1, True), "zb-2p": (1, True),
}
# With V = 1 a pair's forward feeds the very rank its backward's gradient comes from, which
# then idles for the whole pair every microbatch (ping-pong): pairs slow these down.
SLOWER_WITH_PAIRS = {"1f1b", "zb-h1", "zb-1p"}


def test_the_table_covers_every_builtin():
    assert set(BUILTINS) == set(cs.available())


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_every_builtin_pairs_and_verifies(name):
    virtual, has_pairs = BUILTINS[name]
    for ranks, microbatches in ((2, 2), (2, 8), (4, 16)):
        paired = pair_forward_backward(cs.build(name, ranks=ranks, microbatches=microbatches, virtual=virtual))
        cs.verify(paired)
        cs.verify(Executable(paired).train)
    assert bool(paired.overlapped) == has_pairs


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.xfail(strict=True, reason="V=1 ping-pong: see SLOWER_WITH_PAIRS"))
    if name in SLOWER_WITH_PAIRS else name for name in sorted(BUILTINS)])
def test_pairs_hide_exchanges_where_the_schedule_has_a_steady_state(name):
    virtual, _ = BUILTINS[name]
    sched = cs.build(name, ranks=4, microbatches=16, virtual=virtual)
    costs = cs.CostModel.uniform(sched.num_stages, **EXCHANGES)
    paired, alone = cs.simulate(pair_forward_backward(sched), costs), cs.simulate(sched, costs)
    assert paired.makespan <= alone.makespan
    assert sum(paired.exposed_comm) <= sum(alone.exposed_comm)


def test_dualpipev_hides_its_exchanges():
    sched = cs.build("dualpipev", ranks=4, microbatches=16)
    costs = cs.CostModel.uniform(sched.num_stages, **EXCHANGES)
    paired, alone = cs.simulate(pair_forward_backward(sched), costs), cs.simulate(sched, costs)
    assert paired.makespan < 0.8 * alone.makespan  # 132.67 vs 169
    assert paired.summary()["exposed_comm_share"] < 0.6 * alone.summary()["exposed_comm_share"]


# -- timing one pair -----------------------------------------------------------------------------------


def test_a_pair_hides_each_exchange_behind_the_other_pass_when_compute_covers_it():
    # F: 3 pieces of 1, 2 exchanges of 1 (alone 5); B: 3 pieces of 2, 2 exchanges of 1 (alone 8): 13 in a row.
    # F1 0-1 | exF 1-2 | B1 1-3 | exB 3-4 | F2 3-4 (exF done at 2) | exF 4-5 | B2 4-6 (exB done at 4)
    # | exB 6-7 | F3 6-7 (exF done at 5) | B3 7-9 (exB done at 7): 9, the compute alone, nothing exposed.
    timing = overlap_pair([1, 1, 1], [1, 1], [2, 2, 2], [1, 1])
    assert (timing.duration, timing.exposed) == (9, 0)
    assert timing.exchanges == ((0, 1, 2), (1, 3, 4), (0, 4, 5), (1, 6, 7))


def test_a_pair_waits_where_exchanges_outlast_the_other_pass():
    # F1 0-1 | exF 1-4 | B1 1-2 | exB 4-7 (one all-to-all at a time) | F2 4-5 | B2 7-8: 8 (10 in a row), 4 exposed.
    timing = overlap_pair([1, 1], [3], [1, 1], [3])
    assert (timing.duration, timing.exposed, timing.exchanges) == (8, 4, ((0, 1, 4), (1, 4, 7)))
    # The second exchange queues behind the first: F1 0-1 | exF 1-3 | B1 1-1.5 | exB 3-5 | F2 3-4 | B2 5-5.5.
    timing = overlap_pair([1, 1], [2], [0.5, 0.5], [2])
    assert (timing.duration, timing.exposed) == (5.5, 2.5)
    # Only the forward exchanges: its exchange runs under the backward, F1 0-1 | exF 1-3 | B 1-4 | F2 4-5.
    assert overlap_pair([1, 1], [2], [3], []).duration == 5


def test_a_pair_without_exchange_time_takes_exactly_both_passes():
    assert overlap_pair([1, 1, 1], [0, 0], [2, 2, 2], [0, 0]).duration == 9
    assert overlap_pair([3], [], [6], []) == cs.PairTiming(9, 0, ())
    costs = cs.CostModel.per_stage([cs.StageCosts(0.1, 0.7, 0.3, exchanges=3), cs.StageCosts(0.3, 0.2, 0.6)])
    timing = pair_timing(costs, F(1, 1), B(0, 0))
    assert timing == cs.PairTiming(0.3 + (0.7 + 0.3), 0.0, ())  # bit for bit: one after the other
    with pytest.raises(ValueError, match="one exchange fewer than pieces"):
        overlap_pair([1, 1], [], [1], [])


def test_costs_of_exchanges():
    costs = cs.CostModel.uniform(2, forward=3.0, backward_input=5.0, backward_weight=1.0, exchange=1.0, exchanges=2)
    assert [costs.duration(a) for a in (F(0, 0), B(0, 0), I(0, 0), W(0, 0))] == [5.0, 8.0, 7.0, 1.0]
    assert pair_timing(costs, F(1, 1), B(0, 0)).duration == 9.0  # 13.0 one after the other
    assert costs.has_exchanges and not cs.CostModel.uniform(2, exchanges=2).has_exchanges
    with pytest.raises(CostError, match="exchanges"):
        cs.StageCosts(1, 1, 1, exchanges=-1)
    with pytest.raises(CostError, match="exchange must be >= 0"):
        cs.StageCosts(1, 1, 1, exchange=-1.0)


# -- simulating --------------------------------------------------------------------------------------


def test_a_pair_starts_once_both_inputs_are_in():
    # Rank 0 runs 0F1+0B0 once microbatch 0's gradient is back (rank 1: F0 1-2, B0 2-4), then rank 1
    # waits for 0F1's output until the pair's end: the V=1 ping-pong.
    timeline = cs.simulate(pair_forward_backward(cs.build("1f1b", ranks=2, microbatches=4)))
    rank0 = [(str(s.action), s.start, s.end) for s in timeline.spans_of(0)]
    assert rank0[:3] == [("0F0", 0.0, 1.0), ("0F1", 4.0, 5.0), ("0B0", 5.0, 7.0)]
    assert timeline.makespan == 24.0 and timeline.comm_spans == ()
    assert "exposed_comm_share" not in timeline.summary()


def test_exchanges_are_drawn_and_exposed_when_passes_run_alone():
    sched = cs.build("1f1b", ranks=2, microbatches=2)
    costs = cs.CostModel.uniform(2, 1.0, 1.0, 1.0, exchange=0.5, exchanges=1)
    timeline = cs.simulate(sched, costs)
    # F: compute 0.5 | exchange 0.5 | compute 0.5; B (compute 2): 1 | 0.5 | 1. Rank 0: F0 0-1.5, F1 1.5-3,
    # B0 5.5-8 (rank 1: F0 1.5-3, B0 3-5.5), B1 9.5-12 (rank 1: F1 5.5-7, B1 7-9.5).
    assert [(s.label, s.start, s.end) for s in timeline.comm_spans if s.rank == 0] == [
        ("0F0", 0.5, 1.0), ("0F1", 2.0, 2.5), ("0B0", 6.5, 7.0), ("0B1", 10.5, 11.0)]
    assert timeline.exposed_comm == (2.0, 2.0)  # every exchange waited for
    assert timeline.summary()["exposed_comm_share"] == 2.0 / timeline.makespan
    unexchanged = cs.simulate(sched, cs.CostModel.uniform(2, 1.5, 1.25, 1.25))  # the same durations
    assert [(s.start, s.end) for s in timeline.spans] == [(s.start, s.end) for s in unexchanged.spans]


def test_a_simulated_pair_counts_its_interval_once():
    paired = pair_forward_backward(cs.build("zbv", ranks=2, microbatches=8))
    costs = cs.CostModel.uniform(4, **EXCHANGES)
    timeline = cs.simulate(paired, costs)
    for rank in range(2):
        spans = timeline.spans_of(rank)
        assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))
        for forward, backward in paired.overlapped[rank]:
            f, b = (next(s for s in spans if s.action == a) for a in (forward, backward))
            timing = pair_timing(costs, forward, backward)
            assert f.end == b.start and b.end - f.start == pytest.approx(timing.duration)
            assert (f.end - f.start) / (b.end - b.start) == pytest.approx(costs.duration(forward) /
                                                                          costs.duration(backward))
    busy = sum(s.end - s.start for s in timeline.spans)
    assert timeline.bubble_ratio == pytest.approx(1 - busy / (2 * timeline.makespan))
    assert cs.simulate(cs.lower(paired), costs) == timeline
    merged = Executable(paired).train  # I+W merged into B where they meet: other pairs, other times
    assert cs.simulate(merged, costs).makespan <= cs.simulate(Executable(paired.with_programs(
        paired.programs, ())).train, costs).makespan


# -- timelines and drawings ----------------------------------------------------------------------------


def test_measured_timelines_take_comm_spans():
    sched = cs.build("1f1b", ranks=1, microbatches=1)
    plain = measured_timeline(sched, [[("0F0", 1.0, 1.5), ("0B0", 1.5, 2.5)]])
    assert plain.comm_spans == () and "exposed_comm_share" not in plain.summary()
    measured = measured_timeline(sched, [[("0F0", 1.0, 1.5), ("0B0", 2.0, 2.5)]],
                                 comm_events=[(0, "0F0", 1.25, 2.0)])
    assert measured.comm_spans == (CommSpan(0, "0F0", 0.25, 1.0),)
    assert measured.exposed_comm == (0.5,) and measured.summary()["exposed_comm_share"] == 0.5 / 1.5
    given = measured_timeline(sched, [[("0F0", 1.0, 2.5)]], comm_events=[(0, "0F0", 1.25, 2.0)], exposed_comm=[0.25])
    assert given.exposed_comm == (0.25,)


def _exchanging_timeline() -> Timeline:
    sched = pair_forward_backward(cs.build("dualpipev", ranks=2, microbatches=6))
    return cs.simulate(sched, cs.CostModel.uniform(4, **EXCHANGES))


def test_drawings_show_a_communication_lane_under_each_rank():
    timeline = _exchanging_timeline()
    figure = draw(timeline)
    assert [t.get_text() for t in figure.legends[0].get_texts()][-1] == "all-to-all"
    assert "exposed comm" in headline(timeline) and "exposed comm" not in headline(cs.simulate(cs.build(
        "dualpipev", ranks=2, microbatches=6)))
    labels = {round(t.get_position()[1], 3) for t in figure.axes[0].texts}
    assert labels == {-0.175, 0.825}  # each label in the middle of its rank's compute row, above the lane


def test_chrome_traces_put_the_exchanges_on_a_thread_per_rank():
    timeline = _exchanging_timeline()
    trace = json.loads(json.dumps(to_chrome_trace(timeline)))
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names[(0, 2)] == "rank 0 comm" and names[(1, 2)] == "rank 1 comm"
    exchanges = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 2]
    assert len(exchanges) == len(timeline.comm_spans) and exchanges[0]["cat"] == "all-to-all"
    plain = to_chrome_trace(cs.simulate(cs.build("dualpipev", ranks=2, microbatches=6)))
    assert all(e["tid"] != 2 for e in plain["traceEvents"])


def test_timelines_without_comm_spans_are_as_before():
    timeline = Timeline(1, (Span(0, F(0, 0), 0, 1), Span(0, B(0, 0), 1, 3)))
    assert timeline == Timeline(1, (Span(0, F(0, 0), 0, 1), Span(0, B(0, 0), 1, 3)), comm_spans=(), exposed_comm=())
    assert list(timeline.summary()) == ["title", "source", "time_unit", "ranks", "makespan", "bubble_ratio",
                                        "peak_activations", "peak_activation_bytes"]
    assert isinstance(Action.parse("0F0"), Action)
