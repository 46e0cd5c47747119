"""Packed programs (integer codes) are read-only sequences of Actions of their own type, and a
rank's runtime lowers only its own program."""

import pytest

import conveyor.schedule as cs
from conveyor.errors import ScheduleError
from conveyor.schedule.engine import step
from conveyor.schedule.ir import B, F, I, PackedProgram, Placement, Schedule, W
from conveyor.schedule.passes import executable
from conveyor.schedule.posts import EVAL_FORWARD, IN_ORDER, place_posts, rank_channels
from conveyor.schedule.simulate import packed_spans
from conveyor.schedule.timeline import PackedSpans


def test_a_rank_lowers_and_merges_only_its_own_program_and_reads_its_peers_sends():
    sched = cs.build("zbv", ranks=8, microbatches=16)
    runs = executable(sched)
    program = list(runs.train_program(3))
    runs.gradients_final(3)
    runs.train.programs, runs.eval.programs  # noqa: B018 - what Pipeline hands its failure report
    assert [p.made for p in runs.train.programs] == [r == 3 for r in range(8)]
    assert [p.made for p in runs.compute.programs] == [r == 3 for r in range(8)]
    assert not any(p.made for p in runs.eval.programs)
    # Its posts and channels read its peers' programs (stages 3 and 12: ranks 2 and 4), no other.
    train_posts, eval_posts, channels = runs.train_posts(3, IN_ORDER), runs.eval_posts(3, IN_ORDER), \
        runs.in_order_channels(3)
    assert [p.made for p in runs.train.programs] == [r in (2, 3, 4) for r in range(8)]
    assert [p.made for p in runs.eval.programs] == [r in (2, 3, 4) for r in range(8)]
    # The same as lowering every rank's program and reading them.
    lowered = cs.lower(runs.compute)
    assert program == list(lowered.programs[3])
    assert train_posts == place_posts(lowered, 3, IN_ORDER)
    assert eval_posts == place_posts(runs.eval, 3, IN_ORDER, forward=EVAL_FORWARD)
    assert channels == rank_channels(lowered, 3).in_order | rank_channels(runs.eval, 3, EVAL_FORWARD).in_order


def test_a_packed_program_is_a_sequence_of_actions_not_a_tuple():
    actions = (F(0, 0), F(0, 1), I(0, 0), W(0, 0), B(0, 1))
    program = PackedProgram.of(actions, num_stages=2, num_microbatches=2)
    assert tuple(program) == actions and list(program) == list(actions)
    assert program != actions and program != list(actions)  # its own type: no tuple impersonation
    assert program == PackedProgram.of(actions, 2, 2) and hash(program) == hash(PackedProgram.of(actions, 2, 2))
    assert program != PackedProgram.of(actions, 2, 3)  # other sizes: other codes
    assert len(program) == 5 and program[2] == I(0, 0) and program[-1] == B(0, 1)
    assert tuple(program[1:3]) == (F(0, 1), I(0, 0)) and type(program[1:3]) is PackedProgram
    assert list(reversed(program)) == list(reversed(actions))
    assert I(0, 0) in program and B(0, 0) not in program and "0F0" not in program
    assert program.index(W(0, 0)) == 3 and program.count(F(0, 1)) == 1
    with pytest.raises(TypeError):
        program + (F(1, 0),)  # noqa: B018 - concatenation is a tuple's, not a program's
    assert repr(program) == repr(PackedProgram.of(actions, 2, 2))
    assert PackedProgram.of([F(2, 0)], num_stages=2, num_microbatches=1) is None  # out of range: no code


def test_a_schedule_holds_packed_programs_and_refuses_what_it_cannot_pack():
    sched = Schedule.from_programs("t", Placement.looped(2), 1, [["0F0", "0B0"], ["1F0", "1B0"]])
    assert {type(p) for p in sched.programs} == {PackedProgram} and tuple(sched.programs[1]) == (F(1, 0), B(1, 0))
    with pytest.raises(ScheduleError, match="rank 0, step 1: found the string '0B0'"):
        Schedule("t", Placement.looped(2), 1, ((F(0, 0), "0B0"), (F(1, 0), B(1, 0))))


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zbv", "dualpipev", "interleaved-1f1b"])
def test_one_loop_times_alike_by_kind_and_stage_per_action_and_lowered(name):
    sched = cs.build(name, ranks=3, microbatches=5, check=False)
    costs = cs.CostModel.per_stage([(0.5 + s, 0.25, 0.75 + 0.5 * s) for s in range(sched.num_stages)], latency=0.25)
    took = [costs.duration(a) for a in (k(s, 0) for k in (F, B, I, W) for s in range(sched.num_stages))]
    by_key = step(sched, took, costs.latency, record=True)
    asked = []
    per_action = step(sched, latency=costs.latency, duration=lambda a: asked.append(a) or costs.duration(a),
                      record=True)
    assert by_key.clean and per_action.clean and len(asked) == sum(map(len, sched.programs))
    assert by_key.starts == per_action.starts and by_key.ends == per_action.ends
    # Lowered: the SEND/RECV take no time and a receive ends `latency` after its send, so every compute
    # action starts and ends as in the compute-only programs, where a crossing need adds the latency.
    lowered = cs.lower(sched)
    stepped = step(lowered, took, costs.latency, record=True)
    assert stepped.clean and stepped.lowered
    assert tuple(packed_spans(lowered, stepped)) == tuple(packed_spans(sched, by_key))


def test_packed_spans_are_the_spans():
    tl = cs.simulate(cs.build("zb-h1", ranks=2, microbatches=3))
    assert isinstance(tl.spans, PackedSpans)
    spans = tuple(tl.spans)
    assert tl.spans == spans and spans == tl.spans and hash(tl.spans) == hash(spans)
    assert tl.spans[-1] == spans[-1] and tl.spans[1:3] == spans[1:3]
    assert {*spans} == {tl.spans[i] for i in range(len(spans))}
    assert tl.makespan == max(s.end for s in spans) - min(s.start for s in spans)
