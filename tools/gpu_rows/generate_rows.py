"""Generation at world size 1 on the device: ``pipe.generate`` against the unsplit model's ``generate()``.

A tiny GPT-2 (eager attention) cut into 2 stages in this process, on the check's device. Greedy
tokens must equal the unsplit model's own ``generate()`` (which decodes with its key/value cache:
other kernels than the pipeline's full-window forwards, whose logits differ by rounding; the argmax
agrees wherever no two logits are that close, as for this model and these prompts); the generated
tokens' log-probs must equal ``pipe.logprobs`` of the finished sequences bit for bit (the same
forward). That traced pipeline recomputes the window at each step; the second leg runs the same
model's decode stages (:func:`conveyor.frontend.decode.decode_stages`: each layer's key/value cache
the input and output of its stage) on the device, whose greedy tokens must equal ``generate()``'s too;
the third runs hand-built stages that keep one per lane (:mod:`conveyor.testing.models.cached_lm`):
prefill, then one token per step, on the device; its greedy tokens must equal the full forward's
greedy loop.

Example::

    ok, detail = generate_row(Context(torch.device("cpu")))
"""

from __future__ import annotations

import torch

import conveyor
from conveyor.pipe.generation import Sampling
from conveyor.testing.models.cached_lm import VOCAB, CachedReference, build_cached_stage
from conveyor.testing.references.generation import reference_generate

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
                             microbatches=2, layout=conveyor.InProcessLayout(ranks=2, device=device))
    out = pipe.generate(prompts, NEW, return_logprobs=True)
    with torch.no_grad():
        cached = model.generate(prompts, max_new_tokens=NEW, do_sample=False, use_cache=True,
                                attention_mask=torch.ones_like(prompts), pad_token_id=0)[:, PROMPT:]
    if not torch.equal(out.tokens.cpu(), cached.cpu()):
        return False, f"tokens {out.tokens.tolist()} != model.generate() {cached.tolist()}"
    every = pipe.logprobs(input_ids=out.sequences.to(device)).cpu()[:, PROMPT - 1:]
    if not (torch.equal(out.logprobs.cpu(), every) and torch.isfinite(every).all()):
        return False, f"generated log-probs differ from pipe.logprobs by {(out.logprobs.cpu() - every).abs().max():.3g}"
    details = []
    for leg in (_traced_cache_leg, _cached_leg):
        ok, detail = leg(device)
        if not ok:
            return False, detail
        details.append(detail)
    return True, f"{BATCH}x{NEW} greedy tokens = model.generate() (cached); log-probs = pipe.logprobs bitwise; " \
                 f"{'; '.join(details)}"


def _traced_cache_leg(device: torch.device) -> tuple[bool, str]:
    """The traced GPT-2's decode stages, each with its layers' cache, on the device: tokens = model.generate()."""
    from conveyor.frontend import split_model
    from conveyor.frontend.decode import decode_stages

    model = hf_model("gpt2").eval().to(device)
    split = split_model(model, 2, example_args=(torch.zeros(BATCH // 2, PROMPT, dtype=torch.long, device=device),))
    stages = decode_stages(split, rows=BATCH // 2, length=PROMPT + NEW, device=device,
                           stages=[split.stage_module(s, device) for s in range(2)])
    pipe = conveyor.Pipeline(stages, "1f1b", microbatches=2, layout=conveyor.InProcessLayout(device=device))
    prompts = torch.randint(1, 96, (BATCH, PROMPT), generator=torch.Generator().manual_seed(7)).to(device)
    out = pipe.generate(prompts, NEW)
    model.generation_config.eos_token_id = None  # its config's eos (0) would stop rows early
    with torch.no_grad():
        cached = model.generate(prompts, max_new_tokens=NEW, do_sample=False, use_cache=True,
                                attention_mask=torch.ones_like(prompts), pad_token_id=0)[:, PROMPT:]
    if not torch.equal(out.tokens.cpu(), cached.cpu()):
        return False, f"traced decode stages' tokens {out.tokens.tolist()} != model.generate() {cached.tolist()}"
    return True, "traced decode stages (cache per stage): tokens = model.generate()"


def _cached_leg(device: torch.device) -> tuple[bool, str]:
    """Stages with a key/value cache per lane, on the device: greedy tokens = the full forward's loop."""
    pipe = conveyor.Pipeline([build_cached_stage(s, 2).to(device) for s in range(2)], "1f1b", microbatches=2,
                             layout=conveyor.InProcessLayout(device=device))
    prompts = torch.randint(0, VOCAB, (BATCH, PROMPT), generator=torch.Generator().manual_seed(6)).to(device)
    out = pipe.generate(prompts, NEW)
    if not all(module.kv_cache for module in pipe.modules):
        return False, "the cached stages' caches stayed empty: the cached decode did not run"
    want = reference_generate(CachedReference(2).to(device), prompts.cpu(), NEW, Sampling(), lanes=2,
                              device=device)
    if not torch.equal(out.tokens.cpu(), want.cpu()):
        return False, f"cached decode tokens {out.tokens.tolist()} != the full forward's {want.tolist()}"
    return True, "cached stages: tokens = full forward"
