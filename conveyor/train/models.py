"""The models ``conveyor train`` builds from ``cfg.model``: transformers models made from a config, no download.

Example:
    >>> from conveyor.train.config import load_config
    >>> model = build_model(load_config(None, ["model.layers=2", "model.width=32"]), 256)
    >>> type(model).__name__
    'GPT2LMHeadModel'
"""

from __future__ import annotations

import torch

from conveyor.errors import ConfigError
from conveyor.train.config import TrainConfig


def build_model(cfg: TrainConfig, vocab_size: int) -> torch.nn.Module:
    """The model ``cfg.model`` names, freshly initialised from the current torch seed (no download).

    Dropout is off: the runs are short, and without it a resumed run repeats the
    uninterrupted one bit for bit.

    Example:
        >>> from conveyor.train.config import load_config
        >>> model = build_model(load_config(None, ["model.layers=2", "model.width=32"]), 256)
        >>> model.config.n_layer, model.config.vocab_size
        (2, 256)
    """
    m = cfg.model
    if m.name == "gpt":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=m.layers, n_embd=m.width, n_head=m.heads, n_positions=m.seq_len,
                            vocab_size=vocab_size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            use_cache=False, bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(config)
    if m.name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(num_hidden_layers=m.layers, hidden_size=m.width, num_attention_heads=m.heads,
                             intermediate_size=4 * m.width, max_position_embeddings=m.seq_len,
                             vocab_size=vocab_size, use_cache=False, bos_token_id=0, eos_token_id=0)
        return LlamaForCausalLM(config)
    raise ConfigError(f"model.name={m.name!r}: the training loop builds 'gpt' and 'llama' so far")
