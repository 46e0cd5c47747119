"""Textbook results of the built-in schedules, checked exactly with the simulator.

Costs are per stage and pass: T_F (forward), T_I (input gradient, the ZB paper's
T_B), T_W (weight gradient); a full backward B costs T_I + T_W. Unless a test
says otherwise, ``CostModel.uniform``: T_F = T_I = T_W = 1 (B = 2), no latency.
"Idle time per rank" is makespan - busy time; every rank of these schedules
does the same work, so it is the same on every rank, and the idle fraction is
``Timeline.bubble_ratio``.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

import conveyor.schedule as cs
from conveyor.schedule.builtin._program import microbatch_rounds
from conveyor.schedule.cost import CostModel
from conveyor.schedule.ir import Action, ActionKind, Schedule

UNEQUAL_COSTS = [
    (2, 3, 1),
    (3, 2, 1),
    (2, 2, 1),
    (1, 2, 1),
]  # T_W <= T_F, T_I: the ZB paper's setting


def simulate(
    name: str, num_ranks: int, num_microbatches: int, virtual: int | None = None, costs=(1, 1, 1)
):
    schedule = cs.build(name, ranks=num_ranks, microbatches=num_microbatches, virtual=virtual)
    return cs.simulate(schedule, CostModel.uniform(schedule.num_stages, *costs))


def idle_per_rank(timeline, stages_per_rank: int, num_microbatches: int, costs) -> float:
    return timeline.makespan - stages_per_rank * num_microbatches * sum(costs)


def gaps(timeline, rank: int) -> float:
    """Idle time of ``rank`` between its first and its last action."""
    spans = timeline.spans_of(rank)
    return sum(later.start - earlier.end for earlier, later in zip(spans, spans[1:]))


def first_start(timeline, rank: int) -> float:
    return timeline.spans_of(rank)[0].start


# -- the reference table (FIELD.md): idle fractions with uniform costs ---------------------------


@pytest.mark.parametrize(
    ("num_ranks", "num_microbatches", "expected"),
    [
        (
            4,
            8,
            {
                "1f1b": (0.273, Fraction(3, 11)),
                "interleaved-1f1b": (0.158, Fraction(3, 19)),
                "zb-h1": (0.111, Fraction(3, 27)),
            },
        ),
        (
            8,
            16,
            {
                "1f1b": (0.304, Fraction(7, 23)),
                "interleaved-1f1b": (0.180, Fraction(7, 39)),
                "zb-h1": (0.127, Fraction(7, 55)),
            },
        ),
    ],
)
def test_reference_idle_fractions(num_ranks, num_microbatches, expected):
    """FIELD.md's table (interleaved with V = 2). 7/39 = 0.17949 is listed as 0.180."""
    for name, (listed, exact) in expected.items():
        ratio = simulate(name, num_ranks, num_microbatches).bubble_ratio
        assert Fraction(ratio).limit_denominator(1000) == exact, name
        assert abs(ratio - listed) < 0.0006, name


# -- GPipe and 1F1B ----------------------------------------------------------------------------


def test_gpipe_and_1f1b_idle_fraction_is_p_minus_1_over_m_plus_p_minus_1():
    """GPipe: Huang et al., NeurIPS 2019, Section 2 (bubble O((K-1)/(M+K-1)) for K stages);
    1F1B the same, Narayanan et al., ICML 2021, Section 3 (PipeDream-Flush), and the
    Megatron-LM paper, SC 2021, Section 2.2.1. Holds for every M, also M < P."""
    for name in ("gpipe", "1f1b"):
        for num_ranks in range(1, 9):
            for num_microbatches in range(1, 4 * num_ranks + 1):
                timeline = simulate(name, num_ranks, num_microbatches)
                expected = Fraction(num_ranks - 1, num_microbatches + num_ranks - 1)
                assert timeline.makespan == 3 * (num_microbatches + num_ranks - 1), (
                    name,
                    num_ranks,
                )
                assert Fraction(timeline.bubble_ratio).limit_denominator(1000) == expected


@pytest.mark.parametrize("costs", [(1, 1, 1), *UNEQUAL_COSTS])
def test_1f1b_idle_time_per_rank_is_p_minus_1_times_f_plus_b(costs):
    """ZB paper (Qi et al., ICLR 2024), Section 2, table of bubble sizes: 1F1B (p-1)(T_F+T_B+T_W)."""
    forward, backward_input, backward_weight = costs
    for num_ranks in range(1, 8):
        for num_microbatches in range(num_ranks, 3 * num_ranks + 1):
            timeline = simulate("1f1b", num_ranks, num_microbatches, costs=costs)
            assert idle_per_rank(timeline, 1, num_microbatches, costs) == (num_ranks - 1) * (
                forward + backward_input + backward_weight
            )


def test_peak_activations_1f1b_min_p_minus_r_and_m_gpipe_m():
    """1F1B keeps at most P-r microbatches in flight on rank r (Narayanan et al., ICML 2021,
    Section 3: "limits the number of in-flight microbatches to the pipeline depth");
    GPipe all M (Huang et al., Section 2.3)."""
    for num_ranks in range(1, 9):
        for num_microbatches in range(1, 3 * num_ranks + 1):
            peaks = simulate("1f1b", num_ranks, num_microbatches).peak_activations()
            assert peaks == [min(num_ranks - r, num_microbatches) for r in range(num_ranks)]
            peaks = simulate("gpipe", num_ranks, num_microbatches).peak_activations()
            assert peaks == [num_microbatches] * num_ranks


# -- interleaved 1F1B and looped BFS -----------------------------------------------------------


def test_interleaved_idle_fraction_is_p_minus_1_over_vm_plus_p_minus_1_when_p_divides_m():
    """Narayanan et al., SC 2021, Section 2.2.2: the bubble time fraction shrinks to
    (1/v)(p-1)/m of the ideal time, i.e. an idle fraction of (p-1)/(v m + p - 1)."""
    for num_ranks in range(1, 9):
        for virtual in (1, 2, 3, 4):
            for num_microbatches in range(num_ranks, 4 * num_ranks + 1, num_ranks):
                timeline = simulate("interleaved-1f1b", num_ranks, num_microbatches, virtual)
                expected = Fraction(num_ranks - 1, virtual * num_microbatches + num_ranks - 1)
                assert timeline.makespan == 3 * (virtual * num_microbatches + num_ranks - 1)
                assert Fraction(timeline.bubble_ratio).limit_denominator(10_000) == expected


def test_interleaved_peak_activations():
    """Rank r holds its warm-up forwards plus one: min((V-1)P + 2(P-1-r) + 1, VM) stage
    activations (P divides M), more than 1F1B (the SC 2021 paper, Section 2.2.2)."""
    for num_ranks in range(2, 8):
        for virtual in (2, 3):
            for num_microbatches in (num_ranks, 2 * num_ranks, 3 * num_ranks):
                peaks = simulate(
                    "interleaved-1f1b", num_ranks, num_microbatches, virtual
                ).peak_activations()
                assert peaks == [
                    min(
                        (virtual - 1) * num_ranks + 2 * (num_ranks - 1 - r) + 1,
                        virtual * num_microbatches,
                    )
                    for r in range(num_ranks)
                ]


def test_interleaved_with_m_not_a_multiple_of_p_still_beats_1f1b():
    for num_ranks in range(2, 9):
        for num_microbatches in range(num_ranks + 1, 4 * num_ranks):
            if num_microbatches % num_ranks == 0:
                continue
            interleaved = simulate("interleaved-1f1b", num_ranks, num_microbatches, 2).bubble_ratio
            one_f_one_b = simulate("1f1b", num_ranks, num_microbatches).bubble_ratio
            assert interleaved < one_f_one_b, (num_ranks, num_microbatches)


def test_looped_bfs_idle_fraction_and_memory():
    """Lamy-Poirier, MLSys 2023: breadth-first looping has interleaving's bubble,
    (p-1)/(v m + p - 1) once m >= p, and GPipe-like memory, all v m stage activations."""
    for num_ranks in range(1, 8):
        for virtual in (1, 2, 3):
            for num_microbatches in range(num_ranks, 3 * num_ranks + 1):
                timeline = simulate("looped-bfs", num_ranks, num_microbatches, virtual)
                assert timeline.makespan == 3 * (virtual * num_microbatches + num_ranks - 1)
                assert timeline.peak_activations() == [virtual * num_microbatches] * num_ranks


# -- zero bubble: ZB-H1, ZB-H2 (Qi et al., ICLR 2024, Section 2 and its table of bubble sizes) ---


@pytest.mark.parametrize("costs", [(1, 1, 1), *UNEQUAL_COSTS])
def test_zb_h1_idle_time_per_rank_is_p_minus_1_times_f_plus_i_minus_w(costs):
    """ZB-H1: (p-1)(T_F+T_B-T_W), the paper's T_B being our T_I, against 1F1B's
    (p-1)(T_F+T_B+T_W): a third of it when all three are equal. M >= P."""
    forward, backward_input, backward_weight = costs
    for num_ranks in range(1, 9):
        for num_microbatches in range(num_ranks, 3 * num_ranks + 1):
            timeline = simulate("zb-h1", num_ranks, num_microbatches, costs=costs)
            idle = idle_per_rank(timeline, 1, num_microbatches, costs)
            assert idle == (num_ranks - 1) * (forward + backward_input - backward_weight)
            one_f_one_b = simulate("1f1b", num_ranks, num_microbatches, costs=costs)
            assert (
                idle_per_rank(one_f_one_b, 1, num_microbatches, costs) - idle
                == 2 * (num_ranks - 1) * backward_weight
            )


def test_zb_h1_and_h2_peak_memory():
    """ZB paper, table of peak memory: ZB-H1 p M_B (1F1B's first-rank peak, now on every
    rank), ZB-H2 (2p-1) M_B; M_B = one microbatch's activations of a whole rank (V = 1)."""
    for num_ranks in range(1, 9):
        for num_microbatches in range(1, 4 * num_ranks + 1):
            assert (
                simulate("zb-h1", num_ranks, num_microbatches).peak_activations()
                == [min(num_ranks, num_microbatches)] * num_ranks
            )
            assert (
                simulate("zb-h2", num_ranks, num_microbatches).peak_activations()
                == [min(2 * num_ranks - 1, num_microbatches)] * num_ranks
            )


def test_zb_h2_with_equal_costs_has_no_gap_on_any_rank():
    """What "zero bubble" means here, exactly (M >= 2P-1, T_F = T_I = T_W = 1): every rank
    works without a gap from its first action to its last; rank r starts at r (its first
    input needs r forwards upstream) and ends at 3M + r. The makespan 3M + P - 1 leaves
    an idle fraction (P-1)/(3M+P-1), the start-up skew no single step can avoid (rank P-1
    cannot start before P-1 and has 3M of work); the paper overlaps it with the next step
    (its optimizer post-validation). ZB-H1 reaches the same makespan with equal costs, but
    with gaps inside the ranks."""
    for num_ranks in range(1, 9):
        for num_microbatches in range(2 * num_ranks - 1, 4 * num_ranks + 1):
            timeline = simulate("zb-h2", num_ranks, num_microbatches)
            assert timeline.makespan == 3 * num_microbatches + num_ranks - 1
            for rank in range(num_ranks):
                assert first_start(timeline, rank) == rank
                assert gaps(timeline, rank) == 0
            assert timeline.makespan == simulate("zb-h1", num_ranks, num_microbatches).makespan


@pytest.mark.parametrize("costs", UNEQUAL_COSTS + [(1, 1, 0.5), (1, 1, 2)])
def test_zb_h2_bubble_with_unequal_costs(costs):
    """The paper's ZB-H2 bubble (p-1)(T_F+T_B-2T_W) is rank 0's internal idle time (zero
    when negative); the makespan adds the start-up skew: M(F+I+W) + (P-1) max(F, F+I-2W)."""
    forward, backward_input, backward_weight = costs
    for num_ranks in range(2, 8):
        for num_microbatches in range(2 * num_ranks - 1, 4 * num_ranks + 1):
            timeline = simulate("zb-h2", num_ranks, num_microbatches, costs=costs)
            bubble = max(0, forward + backward_input - 2 * backward_weight)
            assert gaps(timeline, 0) == (num_ranks - 1) * bubble
            assert timeline.makespan == num_microbatches * sum(costs) + (num_ranks - 1) * max(
                forward, bubble
            )
            if bubble > 0:
                h1 = simulate("zb-h1", num_ranks, num_microbatches, costs=costs)
                assert timeline.makespan < h1.makespan


def test_interleaved_zero_bubble():
    """V > 1, interleaved as torch's ScheduleInterleavedZeroBubble (ZB-H1; ZB-H2 doubles the
    per-hop warm-up and the held-back W). With equal costs ZB-H1 reaches the lower bound
    3VM + P - 1 (rank P-1 starts at P-1 and has 3VM of work) with (V-1)G + P activations on
    every rank (G the first round's size, P when P divides M: V P);
    with T_W < T_F, T_I and M >= 2P, ZB-H2 is faster still. (With equal costs ZB-H2 gains
    nothing over that bound and, from P = 7 on, loses up to 2 units to gaps in its ramp-up.)"""
    for num_ranks in range(2, 8):
        for virtual in (2, 3):
            for num_microbatches in (num_ranks, 2 * num_ranks, 3 * num_ranks + 1):
                h1 = simulate("zb-h1", num_ranks, num_microbatches, virtual)
                assert h1.makespan == 3 * virtual * num_microbatches + num_ranks - 1
                first_round = len(
                    microbatch_rounds(num_ranks, num_microbatches)[0]
                )  # P when P divides M
                assert (
                    h1.peak_activations() == [(virtual - 1) * first_round + num_ranks] * num_ranks
                )
                interleaved = simulate("interleaved-1f1b", num_ranks, num_microbatches, virtual)
                assert h1.makespan < interleaved.makespan
                if num_microbatches < 2 * num_ranks:
                    continue
                for costs in UNEQUAL_COSTS:
                    h2 = simulate("zb-h2", num_ranks, num_microbatches, virtual, costs=costs)
                    h1_unequal = simulate(
                        "zb-h1", num_ranks, num_microbatches, virtual, costs=costs
                    )
                    assert h2.makespan < h1_unequal.makespan, (
                        num_ranks,
                        virtual,
                        num_microbatches,
                        costs,
                    )


# -- ZB-V (Qi et al., arXiv 2401.10241, Section 6) ----------------------------------------------


def test_zbv_with_equal_costs_has_no_gap_and_balanced_memory():
    """With T_F = T_I = T_W = 1 and M >= 2P-1: no rank has an internal gap; rank r starts at
    r and the makespan is 6M + P - 1 (each rank runs 2 stages x M x 3 passes), so only the
    start-up skew is idle, as in ZB-H2. Peak memory is balanced: 2P stage activations on
    every rank, i.e. P microbatches of a whole rank, 1F1B's first-rank peak."""
    for num_ranks in range(1, 9):
        for num_microbatches in range(2 * num_ranks - 1, 4 * num_ranks + 1):
            timeline = simulate("zbv", num_ranks, num_microbatches)
            assert timeline.makespan == 6 * num_microbatches + num_ranks - 1
            for rank in range(num_ranks):
                assert first_start(timeline, rank) == rank
                assert gaps(timeline, rank) == 0
            assert timeline.peak_activations() == [2 * num_ranks] * num_ranks


def test_zbv_beats_1f1b_on_the_same_stages_with_unequal_costs():
    for num_ranks in range(2, 8):
        for num_microbatches in (2 * num_ranks, 3 * num_ranks + 1, 4 * num_ranks):
            for costs in UNEQUAL_COSTS:
                zbv = simulate("zbv", num_ranks, num_microbatches, costs=costs)
                interleaved = simulate(
                    "interleaved-1f1b", num_ranks, num_microbatches, 2, costs=costs
                )
                assert zbv.makespan < interleaved.makespan


# -- DualPipeV (DeepSeek, github.com/deepseek-ai/DualPipe README, "Pipeline Bubbles and Memory
# Usage Comparison"): PP = number of stages = 2P here; F, B per stage, B a FULL backward;
# F&B = an overlapped forward-backward pair; bubble (PP/2-1)(F&B+B-3W), activation PP+1. --------


def overlapped_pairs_makespan(schedule: Schedule, costs: CostModel) -> float:
    """Makespan when each overlapped pair runs as DeepSeek's runtime runs it.

    A pair is an F immediately followed by a full B of the rank's other stage. It
    starts once BOTH its inputs arrived and sends both outputs when it ends (its
    duration is F + B: no speed-up from overlap). Zero latency.
    """
    num_stages = schedule.num_stages
    units = []
    for program in schedule.programs:
        rank_units, index = [], 0
        while index < len(program):
            action = program[index]
            following = program[index + 1] if index + 1 < len(program) else None
            if (
                action.kind is ActionKind.F
                and following is not None
                and following.kind is ActionKind.B
                and following.stage != action.stage
            ):
                rank_units.append((action, following))
                index += 2
            else:
                rank_units.append((action,))
                index += 1
        units.append(rank_units)

    def needs(action: Action):
        s, m = action.stage, action.microbatch
        if action.kind is ActionKind.F:
            return [("F", s - 1, m)] if s > 0 else []
        if action.kind in (ActionKind.B, ActionKind.I):
            return [("F", s, m)] + ([("G", s + 1, m)] if s < num_stages - 1 else [])
        return [("I", s, m)]

    def produces(action: Action):
        s, m = action.stage, action.microbatch
        return {
            ActionKind.F: [("F", s, m)],
            ActionKind.B: [("G", s, m)],
            ActionKind.I: [("G", s, m), ("I", s, m)],
        }.get(action.kind, [])

    done: dict[tuple[str, int, int], float] = {}
    position = [0] * len(units)
    clock = [0.0] * len(units)
    progressed = True
    while progressed:
        progressed = False
        for rank, rank_units in enumerate(units):
            while position[rank] < len(rank_units):
                unit = rank_units[position[rank]]
                inside = {key for action in unit for key in produces(action)}
                wanted = [key for action in unit for key in needs(action) if key not in inside]
                if any(key not in done for key in wanted):
                    break
                start = max([clock[rank], *(done[key] for key in wanted)])
                clock[rank] = start + sum(costs.duration(action) for action in unit)
                for action in unit:
                    for key in produces(action):
                        done[key] = clock[rank]
                position[rank] += 1
                progressed = True
    assert all(p == len(u) for p, u in zip(position, units)), "the pairs deadlock"
    return max(clock)


@pytest.mark.parametrize(
    "costs", [(1, 1, 1), (2, 3, 1), (2, 2, 1), (1, 2, 1), (1, 3, 2), (3, 2, 1), (2, 1, 1)]
)
def test_dualpipev_bubble_is_deepseeks_with_overlapped_pairs(costs):
    """(PP/2-1)(F&B+B-3W) with PP = 2P, B = I + W and F&B = F + B: exactly, per rank, when
    the pairs run as one unit (both inputs first), as in DeepSeek's runtime, M >= 2P, and
    T_F <= T_I (a forward no slower than its input-gradient pass, as in practice). With
    T_F > T_I the forward chain sets the pace and each hop adds T_F - T_I."""
    forward, backward_input, backward_weight = costs
    backward = backward_input + backward_weight
    for num_ranks in range(1, 8):
        for num_microbatches in range(2 * num_ranks, 4 * num_ranks + 1):
            schedule = cs.build("dualpipev", ranks=num_ranks, microbatches=num_microbatches)
            model = CostModel.uniform(schedule.num_stages, *costs)
            makespan = overlapped_pairs_makespan(schedule, model)
            idle = makespan - 2 * num_microbatches * sum(costs)
            deepseek = (num_ranks - 1) * ((forward + backward) + backward - 3 * backward_weight)
            assert idle == deepseek + (num_ranks - 1) * max(0, forward - backward_input)


def test_dualpipev_run_pair_by_pair_idles_less_and_keeps_2p_plus_1_activations():
    """Run as F then B (our runtime), a pair's forward need not wait for its backward's
    gradient: with equal costs the idle time per rank drops to (P-1) T_F, the start-up
    skew alone, and never exceeds DeepSeek's bound. Peak activations PP+1 = 2P+1 stage
    activations on every rank (the README's "Activation Per Device")."""
    for num_ranks in range(1, 8):
        for num_microbatches in range(2 * num_ranks, 4 * num_ranks + 1):
            timeline = simulate("dualpipev", num_ranks, num_microbatches)
            assert idle_per_rank(timeline, 2, num_microbatches, (1, 1, 1)) == num_ranks - 1
            assert timeline.peak_activations() == [2 * num_ranks + 1] * num_ranks
            for costs in UNEQUAL_COSTS:
                forward, backward_input, backward_weight = costs
                unequal = simulate("dualpipev", num_ranks, num_microbatches, costs=costs)
                bound = (num_ranks - 1) * (
                    forward + 2 * (backward_input + backward_weight) - 3 * backward_weight
                )
                assert idle_per_rank(unequal, 2, num_microbatches, costs) <= bound


def test_v_shaped_schedules_with_few_microbatches_keep_memory_bounded():
    """M below what the V schedules fill (2P-1, 2P): still valid, memory never above the full case."""
    for num_ranks in range(1, 8):
        for num_microbatches in range(1, 2 * num_ranks):
            zbv = simulate("zbv", num_ranks, num_microbatches)
            assert max(zbv.peak_activations()) <= min(2 * num_ranks, 2 * num_microbatches)
            dualpipev = simulate("dualpipev", num_ranks, num_microbatches)
            assert max(dualpipev.peak_activations()) <= min(2 * num_ranks + 1, 2 * num_microbatches)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_free_passes_hold_activations_as_long_as_costly_ones(name):
    # A pass of zero cost still allocates at its start and frees at its end, in program order.
    schedule = cs.build(name, ranks=4, microbatches=8)
    unit = cs.simulate(schedule).peak_activations()
    assert cs.simulate(schedule, CostModel.uniform(4, 0, 0, 0)).peak_activations() == unit
    last_free = CostModel.per_stage([(1, 1, 1)] * 3 + [(0, 0, 0)])
    assert cs.simulate(schedule, last_free).peak_activations() == unit


def test_cost_models_say_what_they_expected():
    from conveyor.errors import CostError

    with pytest.raises(CostError, match="the costs of stage 1 must be a StageCosts or"):
        CostModel.per_stage([(1, 1, 1), (1, 2)])
    with pytest.raises(CostError, match="latency must be a finite number >= 0, got '1'"):
        CostModel.uniform(2, latency="1")
    with pytest.raises(CostError, match="simulate\\(\\) takes costs as a CostModel"):
        cs.simulate(cs.build("1f1b", ranks=2, microbatches=2), (1, 1, 1))
