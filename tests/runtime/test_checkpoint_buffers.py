"""Activation checkpointing writes a stage's buffers once per forward, as a run without it does."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conveyor.pipe import LocalPipeline

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


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_batch_norm_statistics_and_gradients_match_one_device_without_checkpointing(schedule):
    stages = [_normed_stage(seed) for seed in range(2)]
    reference = copy.deepcopy(stages)
    pipe = LocalPipeline(stages, schedule, _mse, microbatches=NUM_MICROBATCHES, checkpoint_activations=True)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = torch.randn(16, 6, generator=generator), torch.randn(16, 6, generator=generator)
        pipe.step(x, target=y)
        _one_device(reference, x, y)
    for got, want in zip(stages, reference):
        norm, want_norm = got[1], want[1]
        assert int(norm.num_batches_tracked) == 2 * NUM_MICROBATCHES  # one count per forward, not two
        assert torch.equal(norm.running_mean, want_norm.running_mean)
        assert torch.equal(norm.running_var, want_norm.running_var)
        for (name, p), q in zip(got.named_parameters(), want.parameters()):
            assert torch.equal(p.grad, q.grad), name


class _CountsWhenArmed(nn.Module):
    """Writes its buffer only once armed, so the first forward gives nothing to learn from."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.calls += 1
        return self.linear(x)


def test_a_buffer_first_written_by_a_recomputation_is_named_and_restored_from_then_on():
    module = _CountsWhenArmed()
    pipe = LocalPipeline([module], "gpipe", _mse, microbatches=NUM_MICROBATCHES, checkpoint_activations=True)
    x, y = torch.randn(8, 3), torch.randn(8, 3)
    pipe.step(x, target=y)  # learns that no buffer is written
    module.armed = True
    with pytest.warns(UserWarning, match=r"stage 0: the recomputed forward changed buffer\(s\) calls"):
        pipe.step(x, target=y)
    # The step that found it counted one recomputation too; the next counts each forward once.
    assert int(module.calls) == NUM_MICROBATCHES + 1
    pipe.step(x, target=y)
    assert int(module.calls) == 2 * NUM_MICROBATCHES + 1


def test_a_failed_first_forward_teaches_nothing_and_the_next_one_learns():
    stage = _normed_stage(0)
    pipe = LocalPipeline([stage], "gpipe", _mse, microbatches=NUM_MICROBATCHES, checkpoint_activations=True)
    with pytest.raises(Exception, match="mat1 and mat2"):
        pipe.step(torch.randn(8, 5), target=torch.randn(8, 6))
    pipe.step(torch.randn(8, 6), target=torch.randn(8, 6))
    assert int(stage[1].num_batches_tracked) == NUM_MICROBATCHES
