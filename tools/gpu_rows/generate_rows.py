"""Generation at world size 1 on the device: ``pipe.generate`` against the unsplit model's ``generate()``.

A tiny GPT-2 (eager attention) cut into 2 stages in this process, on the check's device. Greedy
tokens must equal the unsplit model's own ``generate()`` (which decodes with its key/value cache:
other kernels than the pipeline's full-window forwards, whose logits differ by rounding; the argmax
agrees wherever no two logits are that close, as for this model and these prompts); the generated
tokens' log-probs must equal ``pipe.logprobs`` of the finished sequences bit for bit (the same
forward). The pipeline has no key/value cache yet: each step recomputes the window.

Example::

    ok, detail = generate_row(Context(torch.device("cpu")))
"""

from __future__ import annotations

import torch

import conveyor

from .common import Context, deterministic
from .hf_rows import hf_model

PROMPT, NEW, BATCH = 8, 8, 4


def generate_row(ctx: Context) -> tuple[bool, str]:
    device = ctx.device
    deterministic(device)
    model = hf_model("gpt2").eval().to(device)
    prompts = torch.randint(1, 96, (BATCH, PROMPT), generator=torch.Generator().manual_seed(5)).to(device)
    example = torch.zeros(BATCH // 2, PROMPT + NEW, dtype=torch.long, device=device)
    pipe = conveyor.pipeline(hf_model("gpt2").eval(), example_kwargs={"input_ids": example}, schedule="1f1b",
                             microbatches=2, options=conveyor.PipelineOptions(
                                 layout=conveyor.Layout(in_process=True, ranks=2, device=device)))
    out = pipe.generate(prompts, NEW, return_logprobs=True)
    with torch.no_grad():
        cached = model.generate(prompts, max_new_tokens=NEW, do_sample=False, use_cache=True,
                                attention_mask=torch.ones_like(prompts), pad_token_id=0)[:, PROMPT:]
    if not torch.equal(out.tokens.cpu(), cached.cpu()):
        return False, f"tokens {out.tokens.tolist()} != model.generate() {cached.tolist()}"
    every = pipe.logprobs(input_ids=out.sequences.to(device)).cpu()[:, PROMPT - 1:]
    if not (torch.equal(out.logprobs.cpu(), every) and torch.isfinite(every).all()):
        return False, f"generated log-probs differ from pipe.logprobs by {(out.logprobs.cpu() - every).abs().max():.3g}"
    return True, f"{BATCH}x{NEW} greedy tokens = model.generate() (cached); log-probs = pipe.logprobs bitwise"
