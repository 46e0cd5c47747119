"""Property tests: random valid schedules pass everything; every kind of damage is caught and named.

A random valid schedule is a random placement plus a random order of every
pass that respects the dependencies (a random topological sort of the whole
pipeline's passes), cut into one program per rank: it cannot deadlock, since
that global order is a run of it. Damaged copies (an action dropped,
duplicated, moved to a rank without its stage, two actions swapped, a send
dropped) must raise ScheduleError naming what is wrong, never hang or crash.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import conveyor.schedule as cs
from conveyor.errors import ScheduleError
from conveyor.schedule.cost import CostModel
from conveyor.schedule.ir import Action, ActionKind, Placement, Schedule
from conveyor.schedule.lower import lower
from conveyor.schedule.verify import verify

K = ActionKind
FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def placements(draw) -> Placement:
    num_ranks = draw(st.integers(1, 4))
    shape = draw(st.sampled_from(["looped", "vshape", "random"]))
    if shape == "vshape":
        return Placement.vshape(num_ranks)
    virtual = draw(st.integers(1, 3))
    if shape == "looped":
        return Placement.looped(num_ranks, virtual)
    # Any assignment that gives every rank at least one stage.
    count = num_ranks * (virtual - 1)
    extra = draw(st.lists(st.integers(0, num_ranks - 1), min_size=count, max_size=count))
    return Placement(num_ranks, tuple(draw(st.permutations(list(range(num_ranks)) + extra))))


@st.composite
def valid_schedules(draw) -> Schedule:
    placement = draw(placements())
    num_microbatches = draw(st.integers(1, 4))
    S = placement.num_stages
    split = draw(st.lists(st.booleans(), min_size=S * num_microbatches, max_size=S * num_microbatches))
    rng = draw(st.randoms(use_true_random=False))
    order = random_pass_order(S, num_microbatches, split, rng)
    programs: list[list[Action]] = [[] for _ in range(placement.num_ranks)]
    for action in order:
        programs[placement.stage_to_rank[action.stage]].append(action)
    return Schedule("random", placement, num_microbatches, tuple(map(tuple, programs)))


def random_pass_order(num_stages: int, num_microbatches: int, split: list[bool], rng: random.Random) -> list[Action]:
    """Every pass of every (stage, microbatch) in a random order that respects the dependencies."""
    needs: dict[Action, list[Action]] = {}
    for s in range(num_stages):
        for m in range(num_microbatches):
            backward = Action(K.I if split[s * num_microbatches + m] else K.B, s, m)
            needs[Action(K.F, s, m)] = [Action(K.F, s - 1, m)] if s > 0 else []
            needs[backward] = [Action(K.F, s, m)]
            if split[s * num_microbatches + m]:
                needs[Action(K.W, s, m)] = [backward]
    for action in list(needs):
        if action.kind in (K.B, K.I) and action.stage < num_stages - 1:
            after = next(
                a
                for a in needs
                if a.kind in (K.B, K.I) and (a.stage, a.microbatch) == (action.stage + 1, action.microbatch)
            )
            needs[action].append(after)
    waiting_on = {a: len(n) for a, n in needs.items()}
    unblocks: dict[Action, list[Action]] = {a: [] for a in needs}
    for action, prerequisites in needs.items():
        for prerequisite in prerequisites:
            unblocks[prerequisite].append(action)
    ready = sorted((a for a, n in waiting_on.items() if n == 0), key=str)
    order = []
    while ready:
        action = ready.pop(rng.randrange(len(ready)))
        order.append(action)
        for after in unblocks[action]:
            waiting_on[after] -= 1
            if waiting_on[after] == 0:
                ready.append(after)
    assert len(order) == len(needs)
    return order


def runs_to_the_end(schedule: Schedule) -> bool:
    """A plain reference: step each rank while its next compute action's inputs are done."""
    S = schedule.num_stages
    done: set[tuple[str, int, int]] = set()
    position = [0] * schedule.num_ranks
    progress = True
    while progress:
        progress = False
        for rank, program in enumerate(schedule.programs):
            while position[rank] < len(program):
                a = program[position[rank]]
                s, m = a.stage, a.microbatch
                if a.kind is K.F:
                    ok = s == 0 or ("F", s - 1, m) in done
                    made = [("F", s, m)]
                elif a.kind in (K.B, K.I):
                    ok = ("F", s, m) in done and (s == S - 1 or ("G", s + 1, m) in done)
                    made = [("G", s, m)] + ([("I", s, m)] if a.kind is K.I else [])
                else:
                    ok = ("I", s, m) in done
                    made = [("W", s, m)]
                if not ok:
                    break
                done.update(made)
                position[rank] += 1
                progress = True
    return all(position[r] == len(p) for r, p in enumerate(schedule.programs))


def error_of(schedule: Schedule) -> str:
    with pytest.raises(ScheduleError) as raised:
        verify(schedule)
    return str(raised.value)


def edited(schedule: Schedule, rank: int, program: list[Action]) -> Schedule:
    programs = list(schedule.programs)
    programs[rank] = tuple(program)
    return schedule.with_programs(programs)


# -- valid schedules ----------------------------------------------------------------------------------


@FAST
@given(valid_schedules())
def test_random_valid_schedules_verify_lower_and_simulate_alike(sched):
    verify(sched)
    assert runs_to_the_end(sched)
    lowered = lower(sched)
    verify(lowered)
    assert lower(lowered) == lowered
    assert lowered.compute_only() == sched
    costs = CostModel.uniform(sched.num_stages, 1.0, 1.5, 0.5, latency=0.25)
    plain, explicit = cs.simulate(sched, costs), cs.simulate(lowered, costs)
    assert explicit.makespan == plain.makespan
    assert plain.bubble_ratio >= 0
    assert cs.loads_csv(cs.dumps_csv(sched), name="random") == sched
    assert cs.loads_csv(cs.dumps_csv(sched, "compute_comms"), name="random") == lowered
    assert cs.parse_schedule(str(lowered)) == lowered


# -- damaged schedules ---------------------------------------------------------------------------------


@FAST
@given(valid_schedules(), st.data())
def test_a_dropped_action_is_named(sched, data):
    rank = data.draw(st.sampled_from([r for r, p in enumerate(sched.programs) if p]))
    program = list(sched.programs[rank])
    dropped = program.pop(data.draw(st.integers(0, len(program) - 1)))
    message = error_of(edited(sched, rank, program))
    assert str(dropped) in message


@FAST
@given(valid_schedules(), st.data())
def test_a_duplicated_action_is_named_with_its_rank(sched, data):
    rank = data.draw(st.sampled_from([r for r, p in enumerate(sched.programs) if p]))
    program = list(sched.programs[rank])
    copy = program[data.draw(st.integers(0, len(program) - 1))]
    program.insert(data.draw(st.integers(0, len(program))), copy)
    message = error_of(edited(sched, rank, program))
    assert f"rank {rank}" in message and str(copy) in message


@FAST
@given(valid_schedules().filter(lambda s: s.num_ranks > 1), st.data())
def test_an_action_on_a_rank_without_its_stage_is_named(sched, data):
    owner = data.draw(st.sampled_from([r for r, p in enumerate(sched.programs) if p]))
    source = list(sched.programs[owner])
    moved = source.pop(data.draw(st.integers(0, len(source) - 1)))
    target = data.draw(st.sampled_from([r for r in range(sched.num_ranks) if r != owner]))
    destination = list(sched.programs[target])
    step = data.draw(st.integers(0, len(destination)))
    destination.insert(step, moved)
    programs = list(sched.programs)
    programs[owner], programs[target] = tuple(source), tuple(destination)
    message = error_of(sched.with_programs(programs))
    assert message.startswith(
        f"rank {target}, step {step}: action {moved} runs stage {moved.stage}, which the placement puts on rank {owner}"
    )


@FAST
@given(valid_schedules(), st.data())
def test_swapping_an_action_with_one_it_needs_is_caught(sched, data):
    # Pairs on one rank where the later action needs the earlier one on that same rank.
    S = sched.num_stages
    to_rank = sched.placement.stage_to_rank
    pairs = []
    for rank, program in enumerate(sched.programs):
        step_of = {a: i for i, a in enumerate(program)}
        for j, a in enumerate(program):
            s, m = a.stage, a.microbatch
            before = []
            if a.kind is K.F and s > 0 and to_rank[s - 1] == rank:
                before.append(Action(K.F, s - 1, m))
            if a.kind in (K.B, K.I):
                before.append(Action(K.F, s, m))
                if s < S - 1 and to_rank[s + 1] == rank:
                    before += [Action(K.B, s + 1, m), Action(K.I, s + 1, m)]
            if a.kind is K.W:
                before.append(Action(K.I, s, m))
            pairs += [(rank, step_of[b], j) for b in before if b in step_of]
    rank, i, j = data.draw(st.sampled_from(pairs))
    program = list(sched.programs[rank])
    program[i], program[j] = program[j], program[i]
    message = error_of(edited(sched, rank, program))
    assert f"rank {rank}" in message


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_schedules(), st.data())
def test_any_swap_is_judged_as_a_plain_reference_run_judges_it(sched, data):
    rank = data.draw(st.sampled_from([r for r, p in enumerate(sched.programs) if len(p) > 1]) if any(
        len(p) > 1 for p in sched.programs) else st.just(0))
    program = list(sched.programs[rank])
    if len(program) > 1:
        i, j = sorted(data.draw(st.lists(st.integers(0, len(program) - 1), min_size=2, max_size=2, unique=True)))
        program[i], program[j] = program[j], program[i]
    swapped = edited(sched, rank, program)
    if runs_to_the_end(swapped):
        verify(swapped)
    else:
        message = error_of(swapped)
        assert message.startswith("rank ") or "deadlocks" in message.splitlines()[0]


@FAST
@given(valid_schedules().filter(lambda s: s.num_ranks > 1), st.data())
def test_a_dropped_send_or_receive_is_named(sched, data):
    lowered = lower(sched)
    comms = [(r, i) for r, p in enumerate(lowered.programs) for i, a in enumerate(p) if a.kind.is_comm]
    if not comms:  # every neighbour pair on one rank (possible with random placements)
        verify(lowered)
        return
    rank, step = data.draw(st.sampled_from(comms))
    program = list(lowered.programs[rank])
    dropped = program.pop(step)
    message = error_of(edited(lowered, rank, program))
    assert f"rank {rank}" in message and f"no matching {dropped}" in message


# -- garbage -------------------------------------------------------------------------------------------

KIND_OR_JUNK = st.one_of(st.sampled_from(list(ActionKind)), st.sampled_from(["F", None, 3]))
ID = st.one_of(st.integers(-2, 6), st.sampled_from([1.0, "1", None, True]))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(1, 3),
    st.integers(1, 3),
    st.lists(st.lists(st.tuples(KIND_OR_JUNK, ID, ID), max_size=8), min_size=1, max_size=3),
)
def test_arbitrary_programs_get_a_schedule_error_or_pass(num_ranks, num_microbatches, programs):
    programs = (programs + [[]] * num_ranks)[:num_ranks]
    try:  # a malformed action is refused when the schedule is made
        sched = Schedule(
            "junk",
            Placement.looped(num_ranks),
            num_microbatches,
            tuple(tuple(Action(*fields) for fields in p) for p in programs),
        )
    except ScheduleError as error:
        assert str(error)
        return
    for step in (verify, lower, cs.simulate):
        try:
            step(sched)
        except ScheduleError as error:
            assert str(error)
        else:
            assert step is lower or runs_to_the_end(sched)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.text(alphabet="0123456789FBIWSENDRCV_ -", max_size=6), max_size=5), max_size=3))
def test_arbitrary_strings_get_a_schedule_error_or_parse(rows):
    try:
        sched = Schedule.from_programs("strings", None, None, rows)
    except ScheduleError as error:
        assert str(error)
        return
    try:
        verify(sched)
    except ScheduleError as error:
        assert str(error)
    counts = Counter(a.kind for p in sched.programs for a in p)
    assert sum(counts.values()) == sum(map(len, sched.programs))
