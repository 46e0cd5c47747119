"""A small transformer language model cut into stages by hand: what the runtime's parity tests,
the kill trials and the soak train.

Stages pass a tuple ``(hidden, mask, depth, summary)`` to one another on
purpose: a float tensor that carries a gradient, a bool mask that does not, a
plain int, and a tensor that carries a gradient but that the next stage does
not use (it receives no gradient). Each stage is built from its own seed, so
every rank builds identical parameters for its stages without communication,
and :func:`reference_model` builds the same parameters in one module.

Example:
    >>> import torch
    >>> cfg = TinyConfig(num_stages=2)
    >>> stages = [build_stage(s, cfg) for s in range(2)]
    >>> ids = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
    >>> stages[1](*stages[0](ids)).shape
    torch.Size([4, 8, 32])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TinyConfig:
    num_stages: int = 2
    blocks_per_stage: int = 1
    vocab_size: int = 32
    dim: int = 16
    num_heads: int = 2
    seq_len: int = 8
    seed: int = 1234


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, num_heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyStage(nn.Module):
    """Stage ``stage`` of ``cfg.num_stages``: embedding on the first, head on the last."""

    def __init__(self, stage: int, cfg: TinyConfig) -> None:
        super().__init__()
        self.stage, self.cfg = stage, cfg
        self.first = stage == 0
        self.last = stage == cfg.num_stages - 1
        if self.first:
            self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(
            Block(cfg.dim, cfg.num_heads) for _ in range(cfg.blocks_per_stage)
        )
        if self.last:
            self.norm = nn.LayerNorm(cfg.dim)
            self.head = nn.Linear(cfg.dim, cfg.vocab_size)

    def forward(self, *inputs):
        if self.first:
            (ids,) = inputs
            seq = ids.shape[1]
            hidden = self.embed(ids) + self.pos[:seq]
            mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)  # True = may not attend
            depth = 0
        else:
            hidden, mask, depth, _unused_summary = inputs
        for block in self.blocks:
            hidden = block(hidden, mask)
        depth += len(self.blocks)
        if self.last:
            return self.head(self.norm(hidden))
        return hidden, mask, depth, hidden.mean(dim=-1)


def build_stage(stage: int, cfg: TinyConfig) -> TinyStage:
    """Stage ``stage`` with parameters drawn from its own seed (identical on every rank)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed + stage)
        return TinyStage(stage, cfg)


class ReferenceModel(nn.Module):
    """All stages in one module: the single-device model the pipeline must match bit for bit."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.stages = nn.ModuleList(build_stage(s, cfg) for s in range(cfg.num_stages))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        value = self.stages[0](ids)
        for stage in self.stages[1:]:
            value = stage(*value)
        return value


def reference_model(cfg: TinyConfig) -> ReferenceModel:
    return ReferenceModel(cfg)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over every position."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_batch(
    cfg: TinyConfig, batch_size: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets drawn from a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def reference_step(
    model: nn.Module,
    ids: torch.Tensor,
    targets: torch.Tensor,
    num_microbatches: int,
    loss_fn=lm_loss,
) -> torch.Tensor:
    """Single-device gradient accumulation: ``(loss_fn(model(x_i), y_i) / M).backward()`` in order."""
    total = None
    for x, y in zip(
        torch.tensor_split(ids, num_microbatches), torch.tensor_split(targets, num_microbatches)
    ):
        loss = loss_fn(model(x), y) / num_microbatches
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total
