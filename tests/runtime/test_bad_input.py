"""The bad-input catalogue: every bad input a pipeline can meet, with the exact error each rank gets.

Each case runs on real gloo ranks and returns what every rank raised; none may hang. Cases
that every rank can see for itself are refused when the pipeline is built, before any step.
"""

from __future__ import annotations

import logging

import pytest
import torch

import conveyor
import conveyor.schedule as cs
from conveyor.errors import ConveyorError
from conveyor.testing import run_ranks


def _linear_pipeline(rank, schedule):
    torch.manual_seed(rank)
    return conveyor.Pipeline([torch.nn.Linear(4, 4)], schedule=schedule, loss_fn=lambda y, t: (y - t).pow(2).mean(),
                             transfer=conveyor.TransferOptions(timeout_s=30))


def _error(call) -> str:
    try:
        call()
    except (ConveyorError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# --- built differently on different ranks: refused when built ---------------------------------
def _different_schedules(rank, world_size, differs):
    names = {"name": ("1f1b", "gpipe"), "microbatches": ("1f1b", "1f1b")}
    microbatches = 2 if differs == "microbatches" and rank == 1 else 4
    schedule = cs.build(names[differs][rank], ranks=world_size, microbatches=microbatches)
    return _error(lambda: _linear_pipeline(rank, schedule))


@pytest.mark.parametrize(("differs", "detail"), [
    ("name", "rank(s) [0]: 1f1b P=2 V=1 M=4"),
    ("microbatches", "rank(s) [1]: 1f1b P=2 V=1 M=2"),
])
def test_ranks_given_different_schedules_are_refused_when_built(differs, detail):
    for message in run_ranks(_different_schedules, 2, args=(differs,), timeout_s=60):
        assert message.startswith("PipelineConfigError: the ranks of this pipeline were not built alike: "
                                  "their schedule differs"), message
        assert detail in message


def _traced(rank, world_size, differs):
    width = 5 if differs == "model" and rank == 1 else 4
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Linear(width, 4),
                                torch.nn.ReLU(), torch.nn.Linear(4, 4))
    split = ["2"] if differs == "split" and rank == 1 else ["4"]
    return _error(lambda: conveyor.pipeline(model, example_args=(torch.ones(2, 4),), split_points=split,
                                            schedule="1f1b", microbatches=2, loss_fn=lambda y, t: y.sum()))


@pytest.mark.parametrize(("differs", "detail"), [
    ("model", "Sequential with 6 tensors cut at ['4']"),
    ("split", "cut at ['2']"),
])
def test_ranks_given_different_models_or_split_points_are_refused_when_built(differs, detail):
    for message in run_ranks(_traced, 2, args=(differs,), timeout_s=90):
        assert "their model differs" in message and detail in message, message


def _hand_built_stages_that_do_not_fit(rank, world_size):
    schedule = cs.build("1f1b", ranks=world_size, microbatches=2)
    pipe = conveyor.Pipeline([torch.nn.Linear(4, 4) if rank == 0 else torch.nn.Linear(5, 4)],
                             schedule=schedule, loss_fn=lambda y, t: y.sum(),
                             transfer=conveyor.TransferOptions(timeout_s=30))
    return _error(lambda: pipe.step(torch.ones(4, 4) if rank == 0 else None))


def test_hand_built_stages_that_do_not_fit_are_named_at_the_first_microbatch():
    messages = run_ranks(_hand_built_stages_that_do_not_fit, 2, timeout_s=60)
    assert "forward failed on rank 1, stage 1, microbatch 0: RuntimeError" in messages[1], messages[1]
    assert "rank 1 failed: StageExecutionError: forward failed on rank 1, stage 1, microbatch 0" in messages[0]


def _deadlocking_schedule(rank, world_size):
    good = cs.build("1f1b", ranks=world_size, microbatches=2)
    programs = [list(p) for p in good.programs]
    programs[1] = programs[1][::-1]  # the last rank backwards before it forwards
    return _error(lambda: _linear_pipeline(rank, good.with_programs(programs)))


def test_a_user_schedule_that_cannot_run_gets_the_verifiers_message_before_any_communication():
    for message in run_ranks(_deadlocking_schedule, 2, timeout_s=60):
        assert message.startswith("ScheduleError"), message


def _default_group_meant_per_pipeline(rank, world_size):
    schedule = cs.build("1f1b", ranks=2, microbatches=2)  # two pipelines of 2 in a job of 4, no group=
    return _error(lambda: _linear_pipeline(rank, schedule))


def test_the_default_group_used_where_a_group_was_meant_is_refused():
    for message in run_ranks(_default_group_meant_per_pipeline, 4, timeout_s=60):
        assert "has 2 ranks but the process group has 4" in message and "group=" in message, message


# --- bad input at a step ----------------------------------------------------------------------------
def _step_with(rank, world_size, case):
    schedule = cs.build("1f1b", ranks=world_size, microbatches=2)
    pipe = _linear_pipeline(rank, schedule)
    x, y = torch.ones(4, 4), torch.zeros(4, 4)
    if case == "batch":
        return _error(lambda: pipe.step(torch.ones(3, 4) if rank == 0 else None, target=y if rank == 1 else None))
    if case == "inputs":
        return _error(lambda: pipe.step(None, target=y if rank == 1 else None))
    if case == "target missing":
        return _error(lambda: pipe.step(x if rank == 0 else None))
    if case == "target elsewhere":
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("conveyor.pipe").addHandler(handler)
        for _ in range(2):
            pipe.step(x if rank == 0 else None, target=y)  # rank 0 does not run the last stage
        return [r.getMessage() for r in records]
    raise AssertionError(case)


@pytest.mark.parametrize(("case", "rank", "expected"), [
    ("batch", 0, "batch size 3 on dim 0, which 2 microbatches do not divide"),
    ("batch", 1, "rank 0 failed: PipelineConfigError"),
    ("inputs", 0, "inputs are missing on the rank that runs stage 0"),
    ("inputs", 1, "rank 0 failed"),
    ("target missing", 1, "loss_fn failed on rank 1, stage 1, microbatch 0: TypeError"),
    ("target missing", 1, "the target was None here: pass target= to pipe.step on the rank that runs the last stage"),
    ("target missing", 0, "rank 1 failed: StageExecutionError: loss_fn failed"),
])
def test_bad_step_input_is_named_on_its_rank_and_reported_to_the_peers(case, rank, expected):
    assert expected in run_ranks(_step_with, 2, args=(case,), timeout_s=60)[rank]


def test_a_target_on_a_rank_without_the_last_stage_is_ignored_with_one_warning():
    warnings = run_ranks(_step_with, 2, args=("target elsewhere",), timeout_s=60)
    assert len(warnings[0]) == 1 and "rank 0 was given target=, but the last stage runs on rank 1" in warnings[0][0]
    assert warnings[1] == []


class _FailOn(torch.autograd.Function):
    """Identity that raises in forward or backward on one microbatch (counted per pass)."""

    @staticmethod
    def forward(ctx, x, where, counter):
        ctx.where, ctx.counter = where, counter
        if where == "F":
            counter["F"] += 1
            if counter["F"] == 2:
                raise RuntimeError("boom in F")
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.counter["B"] += 1
        if ctx.counter["B"] == 2:
            raise RuntimeError(f"boom in {ctx.where}")
        return grad, None, None


class _Failing(torch.nn.Module):
    """On the input path (F, I) or on the weight's path (W): fails on microbatch 1 only."""

    def __init__(self, where):
        super().__init__()
        self.linear, self.where, self.counter = torch.nn.Linear(4, 4), where, {"F": 0, "B": 0}

    def forward(self, x):
        if self.where == "W":
            weight = _FailOn.apply(self.linear.weight, "W", self.counter)
            return torch.nn.functional.linear(x, weight, self.linear.bias)
        return self.linear(_FailOn.apply(x, self.where, self.counter))


def _stage_fails(rank, world_size, where):
    schedule = cs.build("zb-h1", ranks=world_size, microbatches=4)
    module = _Failing(where) if rank == 1 else torch.nn.Linear(4, 4)
    pipe = conveyor.Pipeline([module], schedule=schedule, loss_fn=lambda y, t: y.pow(2).mean(),
                             transfer=conveyor.TransferOptions(timeout_s=30))
    return _error(lambda: pipe.step(torch.ones(8, 4) if rank == 0 else None))


@pytest.mark.parametrize(("where", "expected"), [
    ("F", "forward failed on rank 1, stage 1, microbatch 1: RuntimeError: boom in F"),
    ("I", "backward failed on rank 1, stage 1, microbatch 1"),
    ("W", "failed on rank 1, stage 1, microbatch 1"),
])
def test_a_stage_failing_on_one_microbatch_is_named_in_f_i_and_w(where, expected):
    messages = run_ranks(_stage_fails, 2, args=(where,), timeout_s=60)
    assert expected in messages[1] and f"boom in {where}" in messages[1], messages[1]
    assert "rank 1 failed" in messages[0] and f"boom in {where}" in messages[0], messages[0]


# --- non-finite values ----------------------------------------------------------------------------
def _nonfinite(rank, world_size, mode):
    schedule = cs.build("1f1b", ranks=world_size, microbatches=4)
    pipe = _linear_pipeline(rank, schedule)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.1)
    x = torch.ones(8, 4)
    x[2] = float("inf")  # microbatch 1 (rows 2-3)
    before = [p.detach().clone() for p in pipe.parameters()]
    outcome = _error(lambda: pipe.step(x if rank == 0 else None, target=torch.zeros(8, 4) if rank == 1 else None,
                                       on_nonfinite=mode))
    if mode == "skip":
        optimizer.step()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, pipe.parameters()))
        return outcome, pipe.skipped_steps, unchanged, not optimizer.state
    # The pipeline stays usable after the error: the next, finite, step runs.
    for param in pipe.parameters():
        param.grad = None
    loss = pipe.step(torch.ones(8, 4) if rank == 0 else None, target=torch.zeros(8, 4) if rank == 1 else None,
                     on_nonfinite=mode)
    return outcome, bool(loss.isfinite())


def test_a_nonfinite_step_raises_naming_the_first_microbatch_and_the_stages():
    for outcome, next_step_ran in run_ranks(_nonfinite, 2, args=("raise",), timeout_s=60):
        assert outcome.startswith("NonFiniteError: this step's the loss of microbatch 1 (stage 1"), outcome
        assert "the gradients of stage(s) [0, 1] are not finite" in outcome
        assert next_step_ran


def test_a_nonfinite_step_is_skipped_leaving_parameters_and_optimizer_untouched():
    for outcome, skipped, unchanged, no_state in run_ranks(_nonfinite, 2, args=("skip",), timeout_s=60):
        assert (outcome, skipped, unchanged, no_state) == ("no error", 1, True, True)
