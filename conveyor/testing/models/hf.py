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


def llama(num_layers: int = 4, num_key_value_heads: int = 2):
    """A tiny Llama with 4 query heads over ``num_key_value_heads`` key/value heads (grouped, as Llama 3's).

    Traced without ``attention_mask``, its stages run eager's attention (grouped heads inside
    ``scaled_dot_product_attention``): bitwise equal. Given a mask, the graph repeats the
    heads and is bitwise equal on padded batches only (``conveyor.frontend.attention``).
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


GROUPED_FAMILIES = ("llama", "qwen2", "mistral", "mixtral")


def grouped_heads_lm(family: str, num_layers: int = 4, **config: object) -> tuple[type, object]:
    """A tiny ``family`` causal LM (llama, qwen2, mistral, mixtral) with 4 query heads over 2 key/value heads.

    Mixtral gets 4 experts, 2 per token; ``config`` goes over any field (``output_router_logits``).

    Example:
        >>> model_class, config = grouped_heads_lm("qwen2")  # doctest: +SKIP
        >>> config.num_attention_heads // config.num_key_value_heads  # doctest: +SKIP
        2
    """
    import transformers

    prefix = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral", "mixtral": "Mixtral"}[family]
    sizes = dict(
        num_hidden_layers=num_layers, hidden_size=32, intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False,
    )
    if family == "mixtral":
        sizes.update(num_local_experts=4, num_experts_per_tok=2)
    model_class = getattr(transformers, f"{prefix}ForCausalLM")
    return model_class, getattr(transformers, f"{prefix}Config")(**{**sizes, **config})


def default_causal_lm(name: str) -> tuple[type, object]:
    """A Hugging Face causal LM's class and DEFAULT config, only made small.

    Nothing else is set: ``use_cache`` keeps its default (on), GPT-2 its dropout, tied
    embeddings and 50256 token ids, as a user building the model from the config gets them.
    Key/value heads are not grouped, as in both defaults (Llama's follows the attention
    heads, Qwen2's 32 equals its 32).
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


def token_batch(
    batch: int = 2, length: int = 12, seed: int = 0, attention_mask: bool = False
) -> dict[str, torch.Tensor]:
    """Token ids and labels, and an all-ones ``attention_mask`` (no padding) if asked for.

    Example:
        >>> sorted(token_batch(attention_mask=True))
        ['attention_mask', 'input_ids', 'labels']
    """
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, length), generator=generator)
    if attention_mask:
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    return {"input_ids": ids, "labels": ids}
