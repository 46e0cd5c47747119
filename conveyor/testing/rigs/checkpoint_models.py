"""Small models for the checkpoint tests: a tied language model to split by name, hand-built dropout stages."""

from __future__ import annotations

import random
from types import MappingProxyType

import torch
from torch import nn

VOCAB, DIM, LAYERS, SEQ = 32, 16, 4, 8
MICROBATCHES = 4

# Cuts of TiedLM for 1, 2 and 4 stages (stage count = ranks x V).
SPLITS = MappingProxyType({1: [], 2: ["blocks.2"], 4: ["blocks.1", "blocks.2", "blocks.3"]})


class TiedLM(nn.Module):
    """Embedding, residual blocks, a norm and a head tied to the embedding; one persistent buffer."""

    def __init__(self, dim: int = DIM, layers: int = LAYERS, tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.Tanh()) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h) * self.scale)


def tied_lm(seed: int, **kwargs) -> TiedLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TiedLM(**kwargs)


def ce_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def lm_batch(step: int, batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class DropStage(nn.Module):
    """A hand-built stage whose output depends on the random generators (dropout)."""

    def __init__(self, last: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(8, 1) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.drop(self.proj(x)))
        return self.out(y).squeeze(-1) if self.out is not None else y


def drop_stage(stage: int, num_stages: int, seed: int) -> DropStage:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 100 + stage)
        return DropStage(stage == num_stages - 1)


def random_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A batch drawn from the global generators (torch's and Python's): resuming must restore both."""
    x = torch.randn(8, 8)
    return x, torch.full((8,), random.random())


def mse(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (y - t).pow(2).mean()


def named_optimizer_state(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, dict]:
    """The optimizer's state keyed by parameter name (values cloned)."""
    return {names[id(p)]: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for p, s in optimizer.state.items()}


def assert_same_tensors(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), f"{what}: names differ: {sorted(set(got) ^ set(want))}"
    for name in want:
        if isinstance(want[name], dict):
            assert_same_tensors(got[name], want[name], f"{what}[{name}]")
        else:
            assert torch.equal(got[name], want[name]), f"{what}: {name} differs"
