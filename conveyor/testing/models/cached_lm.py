"""A small causal LM cut into stages by hand, each stage with a key/value cache per lane: what generation's
cached decode is tested on.

A stage takes ``(ids or hidden, lane, start)`` and returns ``(hidden, lane, start)`` (the last
stage: logits). ``lane`` None runs the plain causal forward over every position (training, the
reference); a lane index runs positions ``start ..`` of that lane, attending to the keys and
values the lane's earlier calls left in the stage's cache, and appends its own
(:meth:`CachedStage.reset_kv_cache` empties every lane). The ints travel between stages as
boundary values, so each stage knows which lane's cache a microbatch reads.

Example:
    >>> import torch
    >>> stages = [build_cached_stage(s, 2) for s in range(2)]
    >>> ids = torch.randint(0, VOCAB, (2, 6))
    >>> full = stages[1](*stages[0](ids, None, 0))
    >>> for stage in stages:
    ...     stage.reset_kv_cache()
    >>> head = stages[1](*stages[0](ids[:, :5], 0, 0))
    >>> step = stages[1](*stages[0](ids[:, 5:], 0, 5))
    >>> step.shape, bool((step[:, 0] - full[:, 5]).abs().max() < 1e-5)
    (torch.Size([2, 1, 64]), True)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class CachedSizes:
    """The model's sizes: the tests' small ones by default (the benchmark passes larger)."""

    dim: int = 16
    vocab: int = 64
    heads: int = 2
    positions: int = 32


VOCAB, DIM = CachedSizes().vocab, CachedSizes().dim


class CachedAttention(nn.Module):
    """Causal self-attention whose keys and values a lane keeps between calls."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.dim, self.heads = dim, heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cache: dict | None, key: tuple) -> torch.Tensor:
        rows, length, dim = x.shape
        q, k, v = (t.view(rows, length, self.heads, dim // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(dim, -1))
        if cache is None:
            attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            if key in cache:  # this lane's earlier positions
                past_k, past_v = cache[key]
                k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
            cache[key] = (k, v)
            # Query i (position past + i) sees every key up to its own position.
            past = k.shape[2] - length
            allowed = torch.ones(length, k.shape[2], dtype=torch.bool, device=x.device).tril(past)
            attended = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.out(attended.transpose(1, 2).reshape(rows, length, dim))


class CachedStage(nn.Module):
    """Stage ``stage`` of ``num_stages``: embedding first, one block, head last; a cache per lane."""

    def __init__(self, stage: int, num_stages: int, sizes: CachedSizes = CachedSizes()) -> None:
        super().__init__()
        self.stage, self.first, self.last = stage, stage == 0, stage == num_stages - 1
        dim = sizes.dim
        if self.first:
            self.embed = nn.Embedding(sizes.vocab, dim)
            self.pos = nn.Embedding(sizes.positions, dim)
        self.norm = nn.LayerNorm(dim)
        self.attn = CachedAttention(dim, sizes.heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        if self.last:
            self.head = nn.Linear(dim, sizes.vocab)
        self.kv_cache: dict = {}

    def reset_kv_cache(self) -> None:
        """Forget every lane's keys and values (before a new generation)."""
        self.kv_cache = {}

    def forward(self, x: torch.Tensor, lane: int | None, start: int):
        if self.first:
            x = self.embed(x) + self.pos(torch.arange(start, start + x.shape[1], device=x.device))
        h = self.norm(x)
        x = x + self.attn(h, None if lane is None else self.kv_cache, ("attn", lane))
        x = x + self.mlp(x)
        return self.head(x) if self.last else (x, lane, start)


def build_cached_stage(stage: int, num_stages: int, sizes: CachedSizes = CachedSizes(), seed: int = 7) -> CachedStage:
    """Stage ``stage`` with parameters from its own seed (identical on every rank)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + stage)
        return CachedStage(stage, num_stages, sizes)


class CachedReference(nn.Module):
    """Every stage in one module, without a cache: ``model(ids)`` is the plain forward's logits."""

    def __init__(self, num_stages: int, sizes: CachedSizes = CachedSizes()) -> None:
        super().__init__()
        self.stages = nn.ModuleList(build_cached_stage(s, num_stages, sizes) for s in range(num_stages))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        value = (ids, None, 0)
        for stage in self.stages:
            value = stage(*value)
        return value
