"""Generation against one device: the unsplit model's greedy or sampled loop, microbatch by microbatch.

:func:`reference_generate` is what :meth:`conveyor.Pipeline.generate` must equal bit for bit: at
each step the same right-padded window, the unsplit model's logits of each microbatch (lane) in
order, and the library's own :func:`~conveyor.pipe.generation.pick_tokens` on each row's last
position (the same formula, the same generator draws). The loop itself is written plainly here.

Example:
    >>> import torch
    >>> from conveyor.pipe.generation import Sampling
    >>> from conveyor.testing.models import TinyConfig, reference_model
    >>> model = reference_model(TinyConfig(num_stages=2, seq_len=12))
    >>> reference_generate(model, torch.ones(2, 4, dtype=torch.long), 5, Sampling(), lanes=2).shape
    torch.Size([2, 5])
"""

from __future__ import annotations

import torch

from conveyor.pipe.generation import Sampling, pick_tokens, prompt_lengths
from conveyor.pipe.logprobs import logits_of


@torch.no_grad()
def reference_generate(model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int, sampling: Sampling,
                       generator: torch.Generator | None = None, attention_mask: torch.Tensor | None = None,
                       lanes: int = 1, length: int | None = None, keyword: bool = False,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """The generated tokens [batch, max_new_tokens] (``pad_token_id`` after a row's eos); the model runs on
    ``device`` (where its parameters are)."""
    lengths = prompt_lengths(input_ids, attention_mask)
    width = length or input_ids.shape[1] + max_new_tokens
    batch = input_ids.shape[0]
    window = torch.full((batch, width), sampling.pad_token_id, dtype=torch.long)
    for row in range(batch):
        window[row, :lengths[row]] = input_ids[row, :lengths[row]]
    tokens = torch.full((batch, max_new_tokens), sampling.pad_token_id, dtype=torch.long)
    finished = [False] * batch
    for step in range(max_new_tokens):
        parts = window.to(device).tensor_split(lanes)
        logits = torch.cat([logits_of(model(input_ids=part) if keyword else model(part)) for part in parts])
        picked = pick_tokens(logits[torch.arange(batch), lengths + step - 1].cpu(), sampling, generator)
        for row in range(batch):
            if not finished[row]:
                tokens[row, step] = window[row, lengths[row] + step] = picked[row]
                finished[row] = sampling.eos_token_id is not None and int(picked[row]) == sampling.eos_token_id
            else:
                window[row, lengths[row] + step] = sampling.pad_token_id
        if all(finished):
            break
    return tokens
