"""Small models for the frontend tests: tiny Hugging Face configs (no downloads) and hand-made graphs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 96


def gpt2(num_layers: int = 4, dropout: float = 0.0):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=num_layers,
        n_embd=32,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel, config


def llama(num_layers: int = 4, num_key_value_heads: int = 4):
    """A tiny Llama; key/value heads not grouped unless ``num_key_value_heads`` < 4.

    With grouped heads and no padding, eager sdpa attention runs the groups inside
    ``scaled_dot_product_attention(enable_gqa=True)`` while the traced graph repeats the
    key/value heads, so gradients differ in rounding (see test_hf's grouped-heads test).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=num_layers,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=num_key_value_heads,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM, config


def default_causal_lm(name: str) -> tuple[type, object]:
    """A Hugging Face causal LM's class and DEFAULT config, only made small.

    Nothing else is set: ``use_cache`` keeps its default (on), GPT-2 its dropout, tied
    embeddings and 50256 token ids, as a user building the model from the config gets them.
    Key/value heads are not grouped, as in both defaults (Llama's follows the attention
    heads, Qwen2's 32 equals its 32): with groups, eager sdpa attention runs them grouped
    while the traced graph repeats them, so gradients differ in rounding (see ``llama``).
    """
    import transformers

    small = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, vocab_size=128)
    builders = {
        "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(n_layer=2, n_embd=32, n_head=4, vocab_size=128)),
        "llama": ("LlamaForCausalLM", "LlamaConfig", dict(small, num_attention_heads=4)),
        "qwen2": (
            "Qwen2ForCausalLM", "Qwen2Config", dict(small, num_attention_heads=4, num_key_value_heads=4)
        ),
    }
    model_name, config_name, sizes = builders[name]
    return getattr(transformers, model_name), getattr(transformers, config_name)(**sizes)


def token_batch(batch: int = 2, length: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, length), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


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
