"""Shared by the parity tests: which (schedule, P, V) to run, and the single-device reference."""

from __future__ import annotations

import torch

import conveyor.schedule as cs
from conveyor.runtime.stage.device import torch_threads
from conveyor.testing.models import TinyConfig, lm_loss, make_batch, reference_model, reference_step

NUM_MICROBATCHES = 4
BATCH_SIZE = 8
NUM_STEPS = 3


def schedule_grid(ranks: tuple[int, ...] = (1, 2, 4)) -> list[tuple[str, int, int]]:
    """Every built-in schedule at each P, with V in {1, 2} where the schedule takes it."""
    cases = []
    for name, info in sorted(cs.available().items()):
        choices = info.virtual_choices if info.virtual_choices is not None else (1, 2)
        for num_ranks in ranks:
            for virtual in (1, 2):
                if virtual in choices:
                    cases.append((name, num_ranks, virtual))
    return cases


def config_for(schedule: cs.Schedule) -> TinyConfig:
    return TinyConfig(num_stages=schedule.num_stages)


def reference_run(schedule: cs.Schedule, num_threads: int = 1):
    """Losses, gradients after step 1 and parameters after NUM_STEPS AdamW steps, per stage.

    Runs with the ranks' thread count: CPU kernels such as LayerNorm's backward
    reduce in an order that depends on it, so bitwise parity needs the same count.
    """
    with torch_threads(num_threads):
        return _reference_run(schedule)


def _reference_run(schedule: cs.Schedule):
    cfg = config_for(schedule)
    model = reference_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, first_grads = [], None
    for step in range(NUM_STEPS):
        ids, targets = make_batch(cfg, BATCH_SIZE, seed=step)
        losses.append(reference_step(model, ids, targets, schedule.num_microbatches, lm_loss))
        if step == 0:
            first_grads = [{n: p.grad.clone() for n, p in stage.named_parameters()} for stage in model.stages]
        optimizer.step()
        optimizer.zero_grad()
    params = [{n: p.detach().clone() for n, p in stage.named_parameters()} for stage in model.stages]
    return losses, first_grads, params


def assert_same(what: str, got: dict, want: dict) -> None:
    assert got.keys() == want.keys(), f"{what}: names differ: {sorted(got)} vs {sorted(want)}"
    for name in want:
        assert torch.equal(got[name], want[name]), (
            f"{what}: {name} differs by {(got[name] - want[name]).abs().max().item():.3g}"
        )
