"""Emulated device time: a model whose passes sleep, so many ranks run honestly on few cores.

:class:`Emulated` builds stage ``stage`` of ``num_stages`` of a model of sleeping blocks: each
block's forward, input-gradient and weight-gradient parts each *sleep* a set time, so P=4 or
P=8 ranks run on two cores as they would on P devices (a sleeping rank frees its core, like a
rank waiting on its GPU). An I pass (``autograd.grad`` w.r.t. the stage input only) runs only
the input-gradient sleeps, a W pass only the weight-gradient sleeps. The calibration
(:mod:`conveyor.plan.calibration`) times the runtime on it; the benchmarks build it too.

Weights are seeded by the global block index, so any cut of the model holds the same weights.

Example:
    >>> wl = Emulated(num_ranks=2, forward_ms=1.0, input_grad_ms=1.0, weight_grad_ms=1.0)
    >>> x, y = wl.batch(num_microbatches=2)
    >>> tuple(x.shape), len(wl.build_stage(0, 2).blocks)
    ((8, 16), 2)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch alias
from torch import nn


@runtime_checkable
class Workload(Protocol):
    """A model any cut of which can be built, with its batches and loss: what calibration times.

    Example:
        >>> isinstance(Emulated(2), Workload)
        True
    """

    def build_stage(self, stage: int, num_stages: int) -> nn.Module: ...

    def batch(self, num_microbatches: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor: ...


class _ActivationPathSleep(torch.autograd.Function):
    """Identity on the activation path: forward sleeps T_F, backward sleeps T_I.

    Placed before the block's matmul, so its backward runs when (and only when)
    the gradient of the block's input is asked for.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, input_grad_s: float) -> torch.Tensor:
        ctx.input_grad_s = input_grad_s
        time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.input_grad_s)
        return grad, None, None


class _WeightPathSleep(torch.autograd.Function):
    """Identity on the weight path: backward sleeps T_W, run only when weight gradients are asked for."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, weight_grad_s: float) -> torch.Tensor:
        ctx.weight_grad_s = weight_grad_s
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.weight_grad_s)
        return grad, None


class SleepBlock(nn.Module):
    """A tiny linear map whose three passes each sleep a set time.

    ``y = sleep_activation(x) @ sleep_weight(W).T``: the matmul's input-gradient
    edge leads to the activation sleep, its weight-gradient edge to the weight
    sleep, so I and W passes never run each other's sleeps.
    """

    def __init__(
        self, width: int, forward_s: float, input_grad_s: float, weight_grad_s: float
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / math.sqrt(width))
        self.forward_s = forward_s
        self.input_grad_s = input_grad_s
        self.weight_grad_s = weight_grad_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _ActivationPathSleep.apply(x, self.forward_s, self.input_grad_s)
        weight = _WeightPathSleep.apply(self.weight, self.weight_grad_s)
        return F.linear(x, weight)


class BlockStack(nn.Module):
    """Blocks run one after the other; one stage of the emulated or overhead model."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _blocks_of(stage: int, num_stages: int, num_blocks: int) -> range:
    """Global indices of the blocks stage ``stage`` holds; the remainder goes to the middle stages."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in 0..{num_stages - 1}, got {stage}")
    if num_blocks < num_stages:
        raise ValueError(
            f"a model of {num_blocks} blocks cannot be cut into {num_stages} stages; "
            "give more blocks per rank or fewer stages"
        )
    base, extra = divmod(num_blocks, num_stages)
    # Middle stages take the extra blocks: the first and last stages already carry
    # the embeddings / head (GPT) or the loss.
    order = sorted(range(num_stages), key=lambda s: (s in (0, num_stages - 1), s))
    sizes = [base + (1 if s in order[:extra] else 0) for s in range(num_stages)]
    start = sum(sizes[:stage])
    return range(start, start + sizes[stage])


@dataclass(frozen=True, slots=True)
class Emulated:
    """A model of ``num_ranks * blocks_per_rank`` sleeping blocks (the same model for every V).

    With ``blocks_per_rank=2``, a V=1 stage holds 2 blocks and a V=2 stage 1, so
    every schedule of a given P trains the same model and their step times compare.
    """

    num_ranks: int
    forward_ms: float = 5.0
    input_grad_ms: float = 5.0
    weight_grad_ms: float = 5.0
    blocks_per_rank: int = 2
    width: int = 16
    rows_per_microbatch: int = 4
    seed: int = 0
    name: str = "emulated"

    @property
    def num_blocks(self) -> int:
        return self.num_ranks * self.blocks_per_rank

    def build_stage(self, stage: int, num_stages: int) -> BlockStack:
        blocks = []
        for index in _blocks_of(stage, num_stages, self.num_blocks):
            torch.manual_seed(self.seed * 100_003 + index)
            blocks.append(
                SleepBlock(
                    self.width,
                    self.forward_ms / 1e3,
                    self.input_grad_ms / 1e3,
                    self.weight_grad_ms / 1e3,
                )
            )
        return BlockStack(blocks)

    def batch(self, num_microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.rows_per_microbatch * num_microbatches
        generator = torch.Generator().manual_seed(self.seed + 7)
        x = torch.randn(rows, self.width, generator=generator)
        y = torch.randn(rows, self.width, generator=generator)
        return x, y

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)
