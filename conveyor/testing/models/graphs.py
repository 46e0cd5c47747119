"""Hand-made graphs for the frontend's splitter: skips, two encoders, plain stacks.

Each exercises a shape of graph a split must handle: values that skip stages
(:class:`SkipNet`), branches that meet only in the head (:class:`TwoEncoders`),
nothing but blocks (:class:`Stack`), blocks of very different cost
(:class:`UnevenMLP`, for time-balanced splits).

Example:
    >>> import torch
    >>> Stack(num_layers=3, width=4)(torch.ones(2, 4)).shape
    torch.Size([2, 4])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch alias
from torch import nn

from conveyor.testing.models.hf import VOCAB


class TextBlock(nn.Module):
    """Pre-norm self-attention + MLP block (written out, so nothing depends on torch's fast paths)."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        scores = (q @ k.transpose(1, 2)) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        x = x + self.out(scores.softmax(-1) @ v)
        return x + self.mlp(x)


class TwoEncoders(nn.Module):
    """An image MLP and a text transformer whose outputs meet only in the head."""

    def __init__(self, width: int = 16, num_text_layers: int = 3, num_classes: int = 5):
        super().__init__()
        self.image = nn.Sequential(nn.Linear(12, width), nn.GELU(), nn.Linear(width, width))
        self.embed = nn.Embedding(VOCAB, width)
        self.text = nn.ModuleList(TextBlock(width) for _ in range(num_text_layers))
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, image, tokens, mask, labels):
        image_features = self.image(image)
        x = self.embed(tokens)
        for block in self.text:
            x = block(x, mask)
        text_features = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        logits = self.head(torch.cat([image_features, text_features], dim=-1))
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def two_encoder_batch(batch: int = 3, length: int = 7, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    image = torch.randn(batch, 12, generator=generator)
    tokens = torch.randint(0, VOCAB, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[0, -2:] = False
    labels = torch.randint(0, 5, (batch,), generator=generator)
    return image, tokens, mask, labels


class SkipNet(nn.Module):
    """U-Net-like: each down block's output is added back in the mirrored up block.

    Returns a tuple (prediction, auxiliary scalar) to exercise non-dict outputs.
    """

    def __init__(self, width: int = 8, depth: int = 3):
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.down = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.middle = nn.Sequential(nn.Linear(width, width), nn.ReLU(inplace=True))
        self.up = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norm = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        x = self.stem(x)
        skips = []
        for block in self.down:
            x = torch.relu(block(x))
            skips.append(x)
        x = self.middle(x)
        for block in self.up:
            x = block(x) + skips.pop()
        x = self.drop(self.norm(x))
        return x, (x * x).mean()


class Stack(nn.Sequential):
    """A plain stack of linear layers (a model with nothing but blocks)."""

    def __init__(self, num_layers: int = 7, width: int = 8):
        super().__init__(*(nn.Linear(width, width) for _ in range(num_layers)))


class ResidualMLP(nn.Module):
    """``x + down(gelu(up(norm(x))))``: a block whose cost grows with ``hidden``."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class UnevenMLP(nn.Module):
    """Residual MLP blocks of the given hidden widths, then a scalar loss head.

    With widths growing along the depth, equal block counts per stage put most of the
    work on the last stage: what a time-balanced split has to correct.
    """

    def __init__(self, hiddens: list[int], width: int = 128) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResidualMLP(width, hidden) for hidden in hiddens)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()
