"""The planner's bubble: the idle share of the ranks' time in the simulated step, so 0 <= bubble < 1 always.

It was once ``1 - M x sum(F + I + W) / (P x step)``: the busy time counted each stage's I and W as
timed split, while the ranks of a schedule that keeps no W on its own run one full backward B, which
costs less than I + W. Then the "busy" time exceeded P x step, and ``conveyor plan`` printed
``bubble -16.9%``.
"""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.plan.calibration import Calibration
from conveyor.plan.costs import CostTable, UnitCost
from conveyor.plan.planner import choose, format_plan
from conveyor.plan.search import search
from conveyor.plan.settings import Machine
from conveyor.plan.tensor_search import ModuleSplit, TensorParallelOption


def _uniform(blocks: int, backward: float) -> CostTable:
    # F = I = W = 1 s; one full backward B of ``backward`` s, less than I + W (the graph walked once); nothing
    # sent between the stages, so that with no latency the step is compute alone.
    units = [UnitCost(f"layers.{k}", 1.0, 1.0, 1.0, 8.0, 4.0, 16.0, 4.0, 0.0, True, backward=backward)
             for k in range(blocks)]
    return CostTable(tuple(units), 1, source="synthetic")


def test_a_full_backward_cheaper_than_i_plus_w_leaves_1f1b_its_textbook_bubble():
    # 1F1B runs F and one B per microbatch on each rank: its bubble is (P - 1) / (M + P - 1) whatever the
    # costs of a uniform split. The old figure counted I + W = 2 s where the ranks run B = 1.2 s: -9.1%.
    table = _uniform(2, backward=1.2)
    result = search(table, ranks=2, global_batch=4, memory_per_rank=math.inf,
                    schedules=["1f1b"], microbatches=[4], machine=Machine(latency=0.0))
    best = result.fitting[0]
    # The simulator's sums of 1.0 and 1.2 against the formula's division: equal but for rounding.
    assert math.isclose(best.bubble, 1 / 5, rel_tol=1e-12), best.bubble
    assert math.isclose(best.step_time, 5 * 2.2, rel_tol=1e-12), best.step_time
    printed = format_plan(choose(result, table))
    assert " 20.0% " in printed.splitlines()[2], printed
    assert "predicted step 11 s, uncalibrated: " in printed and "--calibrate" in printed, printed


def test_a_calibrated_step_says_so_and_keeps_its_bubble_in_0_1():
    table = _uniform(4, backward=1.5)
    calibration = Calibration(action_s=0.01, receive_s=0.02, latency_s=0.01, step_s=0.5)
    result = search(table, ranks=2, global_batch=8, memory_per_rank=math.inf, schedules=["1f1b", "zb-h1"],
                    machine=Machine(calibration=calibration), optimizer_s_per_parameter=1e-3)
    plan = choose(result, table)
    printed = format_plan(plan)
    assert f"predicted step {plan.step_time:.4g} s, calibrated on this machine" in printed, printed
    assert "uncalibrated" not in printed and 0.0 <= plan.bubble < 1.0, plan.bubble


@st.composite
def _tables(draw) -> CostTable:
    count = draw(st.integers(2, 7))
    units = []
    for k in range(count):
        forward = draw(st.floats(1e-3, 5.0))
        backward_input, backward_weight = draw(st.floats(0.0, 5.0)), draw(st.floats(0.0, 5.0))
        # 0: not measured (I + W stands for it); else anything up to I + W, as a walked-once backward is.
        merged = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0])) * (backward_input + backward_weight)
        activations = draw(st.floats(1.0, 1e6))
        units.append(UnitCost(f"layers.{k}", forward, backward_input, backward_weight, activations,
                              activations / 2, 4e3, 1e3, draw(st.floats(0.0, 1e6)), True, backward=merged))
    fixed = tuple((u.forward * 0.1, 0.0, u.backward_weight * 0.2) for u in units)
    return CostTable(tuple(units), draw(st.sampled_from([1, 2])), fixed, source="synthetic")


@st.composite
def _tensor_parallel(draw) -> TensorParallelOption | None:
    tp = draw(st.sampled_from([1, 2, 4]))
    if tp == 1:
        return None
    modules = tuple(ModuleSplit(f"layers.{k}.mlp", draw(st.floats(0.0, 1e3)), forward_bytes=draw(st.floats(0, 1e6)),
                                backward_bytes=draw(st.floats(0, 1e6)), forward_collectives=1, backward_collectives=1)
                    for k in range(7))
    return TensorParallelOption(tp, modules)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(table=_tables(), ranks=st.integers(1, 4), global_batch=st.sampled_from([1, 2, 4, 6, 8, 16]),
       tensor=_tensor_parallel(), calibrated=st.booleans(), cores=st.sampled_from([None, 1, 2]),
       tight=st.booleans(), data=st.data())
def test_every_simulated_candidate_has_a_bubble_in_0_1(table, ranks, global_batch, tensor, calibrated, cores, tight,
                                                      data):
    ranks = min(ranks, len(table.units))
    calibration = Calibration(action_s=1e-3, receive_s=2e-3, latency_s=1e-3, seconds_per_byte=1e-9, step_s=0.01)
    machine = Machine(calibration=calibration if calibrated else None, cores=cores)
    # A tight limit sends the search through its lighter splits and activation checkpointing.
    limit = data.draw(st.floats(1e4, 1e7)) if tight else math.inf
    result = search(table, ranks=ranks, global_batch=global_batch, memory_per_rank=limit, machine=machine,
                    optimizer_s_per_parameter=1e-6 if calibrated else 0.0, tensor_parallel=tensor)
    simulated = [c for c in result.candidates if c.verdict in ("fits", "over memory")]
    assert simulated, result.counts()
    for c in simulated:
        assert 0.0 <= c.bubble < 1.0, (c.describe(), c.bubble, c.recompute)  # a NaN fails both
        assert c.step_time > 0 and math.isfinite(c.step_time), c.describe()
