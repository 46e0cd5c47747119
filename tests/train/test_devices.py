"""The trainer's data, loss and collectives go where the stage is (issue 33): checked with meta tensors,
which are another device than the CPU, and NCCL's rule (CUDA tensors only) standing in as "meta only"."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import conveyor.runtime.device
from conveyor.train.data import ResumableLoader, TokenBlocks, resumable_loader
from conveyor.train.loop import evaluate, validation_sums

META, CPU = torch.device("meta"), torch.device("cpu")


class _Pipe:
    """A last-stage rank's pipeline stand-in: logits on its stage device, as pipe.forward gives them."""

    needs_inputs = needs_target = True
    dp_rank, dp_size = 0, 1

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def forward(self, x):
        return SimpleNamespace(logits=torch.zeros(*x.shape, 7, device=self.device))


class _CpuBatches:
    """A user's loader: (ids, targets) on the CPU, whatever the stage device."""

    def restart(self):
        pass

    def __next__(self):
        return torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long)


class _Reduced(Exception):
    pass


@pytest.fixture
def nccl_rule(monkeypatch):
    """The default group reports NCCL, which here carries meta tensors only (as NCCL carries CUDA ones);
    all_reduce records where its tensor is and stops (a meta tensor holds no number to read back)."""
    reduced = []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(conveyor.runtime.device, "collective_device", lambda backend, device: META)

    def all_reduce(tensor, *args, **kwargs):
        reduced.append((tensor.device, tensor.dtype, tuple(tensor.shape)))
        raise _Reduced

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return reduced


def _run(pipe, data=None):
    return SimpleNamespace(pipe=pipe, val_data=data or _CpuBatches(), cfg=SimpleNamespace(train=SimpleNamespace(
        eval_batches=2)))


def test_validation_scores_cpu_targets_where_the_stage_logits_are(nccl_rule):
    # Before: cross_entropy(logits on the stage device, targets from the CPU loader) raised a device
    # mismatch on any GPU, at step 0 of the default config.
    sums = validation_sums(_run(_Pipe(META)))
    assert (sums.device, sums.dtype, tuple(sums.shape)) == (META, torch.float64, (2,))
    with pytest.raises(_Reduced):
        evaluate(_run(_Pipe(META)))
    assert nccl_rule == [(META, torch.float64, (2,))]


def test_the_validation_reduce_takes_its_tensor_on_the_groups_device(nccl_rule):
    # Before: a CPU tensor was all-reduced on the default group, which NCCL refuses.
    with pytest.raises(_Reduced):
        evaluate(_run(_Pipe(CPU)))
    assert nccl_rule == [(META, torch.float64, (2,))]


def test_on_the_cpu_the_validation_loss_is_what_it_was(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *a, **k: None)  # one rank: the sum is its own
    loss = torch.nn.functional.cross_entropy(torch.zeros(8, 7), torch.ones(8, dtype=torch.long))
    assert evaluate(_run(_Pipe(CPU))) == float(torch.tensor([loss.item()], dtype=torch.float64))


def test_the_loader_hands_batches_over_on_the_stage_device():
    blocks = TokenBlocks(torch.arange(100), 4)
    x, y = next(resumable_loader(_Pipe(META), lambda: blocks, 2))
    assert x.device == y.device == META and x.shape == y.shape == (2, 4)
    x, y = next(resumable_loader(_Pipe(CPU), lambda: blocks, 2))
    want = next(ResumableLoader(blocks, 2))
    assert torch.equal(x, want[0]) and torch.equal(y, want[1]) and x.device == CPU
