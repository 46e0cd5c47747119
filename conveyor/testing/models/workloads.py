"""The benchmark's workloads: the same stage modules for every library, cut any way.

Three kinds, each a frozen record that builds stage ``stage`` of ``num_stages``
deterministically (weights are seeded by the global layer index, so any cut of
the model holds the same weights and a one-process model equals the union of
the stages):

* :class:`Emulated` -- emulated device time (every pass of every block sleeps a set
  time, 5 ms by default); it lives in :mod:`conveyor.plan.emulated`, since the
  library's calibration times the runtime on it, and is re-exported here.
* :class:`Overhead` -- tiny stages (microseconds of compute) and many
  microbatches: what is left of the step time is the framework's own.
* :class:`TinyGPT` -- real compute: a small GPT written out here (no downloads),
  cut by hand into stages (stage 0 holds the embeddings, the last stage the final
  norm and the untied head).

The benchmarks time them (``benchmarks/costs.py`` measures each stage's passes in
one process); tests may build them like any other model here.

Example:
    >>> wl = Emulated(num_ranks=2, forward_ms=1.0, input_grad_ms=1.0, weight_grad_ms=1.0)
    >>> x, y = wl.batch(num_microbatches=2)
    >>> tuple(x.shape), len(wl.build_stage(0, 2).blocks)
    ((8, 16), 2)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch alias
from torch import nn

from conveyor.plan.emulated import BlockStack, Emulated, SleepBlock, Workload, _blocks_of

__all__ = ["WORKLOADS", "BlockStack", "Emulated", "GPTBlock", "GPTStage", "Overhead", "SleepBlock", "TinyGPT",
           "Workload"]

# ---------------------------------------------------------------------------
# (b) framework overhead
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Overhead:
    """Tiny stages: one small linear each (microseconds), so the step time is mostly framework time."""

    num_ranks: int
    width: int = 16
    rows_per_microbatch: int = 2
    blocks_per_rank: int = 2
    seed: int = 0
    name: str = "overhead"

    @property
    def num_blocks(self) -> int:
        return self.num_ranks * self.blocks_per_rank

    def build_stage(self, stage: int, num_stages: int) -> BlockStack:
        blocks: list[nn.Module] = []
        for index in _blocks_of(stage, num_stages, self.num_blocks):
            torch.manual_seed(self.seed * 100_003 + index)
            blocks.append(nn.Linear(self.width, self.width, bias=False))
        return BlockStack(blocks)

    def batch(self, num_microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.rows_per_microbatch * num_microbatches
        generator = torch.Generator().manual_seed(self.seed + 11)
        return (
            torch.randn(rows, self.width, generator=generator),
            torch.randn(rows, self.width, generator=generator),
        )

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)


# ---------------------------------------------------------------------------
# (c) real compute: a small GPT
# ---------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        # (batch, seq, 3 * width) -> three (batch, heads, seq, head_width)
        q, k, v = self.qkv(x).split(width, dim=2)
        shape = (batch, seq, self.num_heads, width // self.num_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class GPTBlock(nn.Module):
    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, num_heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPTStage(nn.Module):
    """A slice of the GPT: optional embeddings, some blocks, optional final norm and head.

    Stage 0 takes token ids ``(batch, seq)``; the others take hidden states
    ``(batch, seq, width)``; the last returns logits ``(batch, seq, vocab)``.
    """

    def __init__(self, config: TinyGPT, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        seed = config.seed * 100_003
        if first:
            torch.manual_seed(seed - 1)
            self.token_embedding = nn.Embedding(config.vocab_size, config.width)
            self.position_embedding = nn.Embedding(config.seq_len, config.width)
        self.blocks = nn.ModuleList()
        for index in blocks:
            torch.manual_seed(seed + index)
            self.blocks.append(GPTBlock(config.width, config.num_heads))
        if last:
            torch.manual_seed(seed - 2)
            self.final_norm = nn.LayerNorm(config.width)
            self.head = nn.Linear(config.width, config.vocab_size, bias=False)
        self.first, self.last = first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.token_embedding(x) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.head(self.final_norm(x))
        return x


@dataclass(frozen=True, slots=True)
class TinyGPT:
    """A GPT of ``num_layers`` blocks, cut by hand: embeddings on stage 0, head on the last.

    ``num_ranks`` is unused by the model (kept so every workload is built the same way).
    """

    num_ranks: int
    num_layers: int = 8
    width: int = 128
    num_heads: int = 4
    vocab_size: int = 512
    seq_len: int = 64
    rows_per_microbatch: int = 2
    seed: int = 0
    name: str = "gpt"

    def build_stage(self, stage: int, num_stages: int) -> GPTStage:
        blocks = _blocks_of(stage, num_stages, self.num_layers)
        return GPTStage(self, blocks, first=stage == 0, last=stage == num_stages - 1)

    def build_whole(self) -> GPTStage:
        """The whole model in one module (same weights as the union of any cut)."""
        return self.build_stage(0, 1)

    def batch(self, num_microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.rows_per_microbatch * num_microbatches
        generator = torch.Generator().manual_seed(self.seed + 13)
        tokens = torch.randint(0, self.vocab_size, (rows, self.seq_len + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


WORKLOADS: Mapping[str, Callable[..., Workload]] = MappingProxyType({
    "emulated": Emulated,
    "overhead": Overhead,
    "gpt": TinyGPT,
})
