"""Bitwise parity of every built-in schedule with single-device gradient accumulation, all ranks in one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import conveyor.schedule as cs
from conveyor.layout import InProcessLayout
from conveyor.options import StageOptions
from conveyor.pipe import Pipeline
from conveyor.testing.models import build_stage, lm_loss, make_batch
from conveyor.testing.references.schedule_parity import (
    BATCH_SIZE,
    NUM_MICROBATCHES,
    NUM_STEPS,
    assert_same,
    config_for,
    reference_run,
    schedule_grid,
)


def run_local(schedule, recompute=False):
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # as the reference does
    try:
        return _run_local(schedule, recompute)
    finally:
        torch.set_num_threads(previous)


def _run_local(schedule, recompute):
    cfg = config_for(schedule)
    stages = [build_stage(s, cfg) for s in range(schedule.num_stages)]
    pipe = Pipeline(stages, schedule, lm_loss, stage=StageOptions(recompute=recompute), layout=InProcessLayout())
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses, first_grads = [], None
    for step in range(NUM_STEPS):
        ids, targets = make_batch(cfg, BATCH_SIZE, seed=step)
        losses.append(pipe.step(ids, target=targets))
        if step == 0:
            first_grads = [{n: p.grad.clone() for n, p in st.named_parameters()} for st in stages]
        optimizer.step()
        optimizer.zero_grad()
    return losses, first_grads, [{n: p.detach().clone() for n, p in st.named_parameters()} for st in stages]


@pytest.mark.parametrize(("name", "num_ranks", "virtual"), schedule_grid((1, 2, 4)))
def test_local_pipeline_is_bitwise_equal_to_one_device(name, num_ranks, virtual):
    _assert_bitwise_equal_to_one_device(cs.build(name, ranks=num_ranks, microbatches=NUM_MICROBATCHES,
                                                 virtual=virtual))


def test_torchs_dualpipev_csv_runs_with_its_pairs_bitwise_equal_to_one_device():
    # torch's file, its "(0F7;7B3)OVERLAP_F_B" cells loaded as pairs: lowered with each pair's receives before it.
    schedule = cs.load_csv(Path(__file__).parents[1] / "schedule" / "data" / "torch" / "dualpipev.csv")
    assert all(schedule.overlapped) and schedule.num_ranks == 4 and schedule.num_microbatches == 8
    _assert_bitwise_equal_to_one_device(schedule)


def _assert_bitwise_equal_to_one_device(schedule):
    want_losses, want_grads, want_params = reference_run(schedule)
    got_losses, got_grads, got_params = run_local(schedule)
    for step, (got, want) in enumerate(zip(got_losses, want_losses)):
        assert torch.equal(got, want), f"loss of step {step}: {got.item()} vs {want.item()}"
    for stage in range(schedule.num_stages):
        assert_same(f"stage {stage} grads after step 1", got_grads[stage], want_grads[stage])
        assert_same(f"stage {stage} params after {NUM_STEPS} AdamW steps", got_params[stage], want_params[stage])


@pytest.mark.parametrize("name", sorted(cs.available()))
def test_activation_checkpointing_stays_bitwise_equal(name):
    info = cs.available()[name]
    virtual = info.default_virtual
    schedule = cs.build(name, ranks=2, microbatches=NUM_MICROBATCHES, virtual=virtual)
    want_losses, want_grads, want_params = reference_run(schedule)
    got_losses, got_grads, got_params = run_local(schedule, recompute=True)
    assert all(torch.equal(g, w) for g, w in zip(got_losses, want_losses))
    for stage in range(schedule.num_stages):
        assert_same(f"stage {stage} grads", got_grads[stage], want_grads[stage])
        assert_same(f"stage {stage} params", got_params[stage], want_params[stage])


def test_forward_only_matches_the_model_and_alternates_with_training():
    schedule = cs.build("1f1b", ranks=2, microbatches=NUM_MICROBATCHES)
    cfg = config_for(schedule)
    stages = [build_stage(s, cfg) for s in range(2)]
    pipe = Pipeline(stages, schedule, lm_loss, layout=InProcessLayout())
    ids, targets = make_batch(cfg, BATCH_SIZE, seed=5)  # forward only: no reduction-order concern
    with torch.no_grad():
        want = stages[1](*stages[0](ids))
    first = pipe.forward(ids)
    loss = pipe.step(ids, target=targets)
    second = pipe.forward(ids)
    assert torch.equal(first, want) and torch.equal(second, want)
    assert loss.requires_grad is False
    assert all(not runner.in_flight for runner in pipe.runners.values())
