"""Tiny Hugging Face causal language models (configs only, no downloads) and their batches.

``transformers`` is imported when a builder is called, not with this module.

Example:
    >>> model_class, config = gpt2(num_layers=2)  # doctest: +SKIP
    >>> model_class(config)(**token_batch()).loss.shape  # doctest: +SKIP
    torch.Size([])
"""

from __future__ import annotations

import torch

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
