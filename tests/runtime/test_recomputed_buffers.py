"""Activation checkpointing writes a stage's buffers once per forward, as a run without it does."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from conveyor.layout import InProcessLayout
from conveyor.options import StageOptions
from conveyor.pipe import Pipeline
from conveyor.runtime.stage.recomputed_buffers import RecomputedBuffers

NUM_MICROBATCHES = 4


def _normed_stage(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU())


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def _one_device(stages: list[nn.Module], x: torch.Tensor, y: torch.Tensor) -> None:
    """Gradient accumulation over the microbatches, no checkpointing: the reference."""
    for x_m, y_m in zip(x.chunk(NUM_MICROBATCHES), y.chunk(NUM_MICROBATCHES)):
        out = x_m
        for stage in stages:
            out = stage(out)
        (_mse(out, y_m) / NUM_MICROBATCHES).backward()


def _two_steps_both_ways(make_stage, schedule: str) -> tuple[list[nn.Module], list[nn.Module]]:
    """Two steps of a checkpointing pipeline, and of one device without checkpointing, on the same data."""
    stages = [make_stage(seed) for seed in range(2)]
    reference = copy.deepcopy(stages)
    pipe = Pipeline(stages, schedule, _mse, microbatches=NUM_MICROBATCHES,
                    stage=StageOptions(recompute=True), layout=InProcessLayout())
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = torch.randn(16, 6, generator=generator), torch.randn(16, 6, generator=generator)
        pipe.step(x, target=y)
        _one_device(reference, x, y)
    return stages, reference


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_batch_norm_statistics_and_gradients_match_one_device_without_checkpointing(schedule):
    stages, reference = _two_steps_both_ways(_normed_stage, schedule)
    for got, want in zip(stages, reference):
        norm, want_norm = got[1], want[1]
        assert int(norm.num_batches_tracked) == 2 * NUM_MICROBATCHES  # one count per forward, not two
        assert torch.equal(norm.running_mean, want_norm.running_mean)
        assert torch.equal(norm.running_var, want_norm.running_var)
        for (name, p), q in zip(got.named_parameters(), want.parameters()):
            assert torch.equal(p.grad, q.grad), name


class _CountsWhenArmed(nn.Module):
    """Writes its buffer only once armed: the first forwards show nothing to protect."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.calls += 1
        return self.linear(x)


def test_a_buffer_that_starts_being_written_later_is_written_once_per_forward():
    module = _CountsWhenArmed()
    pipe = Pipeline([module], "gpipe", _mse, microbatches=NUM_MICROBATCHES,
                    stage=StageOptions(recompute=True), layout=InProcessLayout())
    x, y = torch.randn(8, 3), torch.randn(8, 3)
    pipe.step(x, target=y)
    module.armed = True
    pipe.step(x, target=y)
    assert int(module.calls) == NUM_MICROBATCHES


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_batch_norm_frozen_then_unfrozen_matches_one_device(schedule):
    """The fine-tuning recipe: BatchNorm in eval mode for a while inside a training stage."""
    stages = [_normed_stage(seed) for seed in range(2)]
    reference = copy.deepcopy(stages)
    pipe = Pipeline(stages, schedule, _mse, microbatches=NUM_MICROBATCHES,
                    stage=StageOptions(recompute=True), layout=InProcessLayout())
    generator = torch.Generator().manual_seed(0)
    for frozen in (True, False, False):
        for stage, twin in zip(stages, reference):
            stage[1].train(not frozen)
            twin[1].train(not frozen)
        x, y = torch.randn(16, 6, generator=generator), torch.randn(16, 6, generator=generator)
        pipe.step(x, target=y)
        _one_device(reference, x, y)
    for got, want in zip(stages, reference):
        assert int(got[1].num_batches_tracked) == 2 * NUM_MICROBATCHES
        assert torch.equal(got[1].running_mean, want[1].running_mean)
        assert torch.equal(got[1].running_var, want[1].running_var)
        for p, q in zip(got.parameters(), want.parameters()):
            assert torch.equal(p.grad, q.grad)


class _Annealed(nn.Module):
    """Reads the counter it bumps: its output depends on how many forwards ran before."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return self.linear(x) / (1 + self.steps)


def _spectral_stage(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(6, 6)), nn.Tanh())


def _annealed_stage(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(_Annealed(), nn.Tanh())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zbv"])
@pytest.mark.parametrize("make_stage", [_spectral_stage, _annealed_stage], ids=["spectral_norm", "counter"])
def test_a_recomputation_reads_the_buffers_its_forward_read(schedule, make_stage):
    """Spectral norm divides by the norm its power-iteration vectors give, and updates them
    in every forward: recomputed from later vectors, its gradients used to differ."""
    stages, reference = _two_steps_both_ways(make_stage, schedule)
    for got, want in zip(stages, reference):
        for (name, p), q in zip(got.named_parameters(), want.parameters()):
            assert torch.equal(p.grad, q.grad), name
        for (name, b), c in zip(got.named_buffers(), want.buffers()):
            assert torch.equal(b, c), name


def test_a_buffer_no_forward_changes_is_held_once_for_all_microbatches():
    """A causal mask must not cost a copy per microbatch in flight; running statistics do."""
    module = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    module.register_buffer("mask", torch.ones(64, 64).tril())
    buffers = RecomputedBuffers(module)
    microbatches = []
    for _ in range(3):
        around_forward, _ = buffers()
        with around_forward:
            module(torch.randn(5, 4))
        microbatches.append({id(owner._buffers[attribute]): copy
                             for owner, attribute, _, copy in around_forward.found})
    mask, running_mean = id(module.mask), id(module[1].running_mean)
    assert len({m[mask].data_ptr() for m in microbatches}) == 1
    assert len({m[running_mean].data_ptr() for m in microbatches}) == 3


def test_a_buffer_deleted_after_the_forward_stays_deleted():
    module = nn.Linear(3, 3)
    module.register_buffer("scratch", torch.zeros(3))
    out = checkpoint(module, torch.randn(2, 3, requires_grad=True), use_reentrant=False,
                     context_fn=RecomputedBuffers(module))
    del module.scratch
    out.sum().backward()  # the recomputation runs with the buffer its forward saw
    assert "scratch" not in module._buffers
