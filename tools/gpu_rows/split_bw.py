"""The split backward (I then W) against the fused one (B) per stage of a GPT, timed on the device
(CUDA events on a GPU): what zero bubble gains in the bubble it may lose in I + W > B.

Example::

    ok, detail = split_backward_row(Context(torch.device("cpu"), quick=True))
"""

from __future__ import annotations

import statistics

import torch

import conveyor.schedule as cs
from conveyor.runtime.stage.backward import GraphAnalysisCache, backward_full, backward_input
from conveyor.testing.models import TinyGPT

from .common import Context, Timer, deterministic

STAGES, MICROBATCHES, REPEATS = 4, 8, 5


def _workload(ctx: Context) -> TinyGPT:
    if ctx.cuda:  # big enough that kernels, not launches, fill the time
        return TinyGPT(num_ranks=STAGES, num_layers=8, width=1024, num_heads=16, vocab_size=8192, seq_len=512,
                       rows_per_microbatch=4)
    return TinyGPT(num_ranks=STAGES, num_layers=4, width=64, num_heads=4, vocab_size=256, seq_len=32)


def _once(stage, x, target, workload, last: bool, split: bool, timers: dict, analyses) -> dict:
    """Forward, then B (or I then W), timed; the parameters' and the input's gradients."""
    params = [p for p in stage.parameters() if p.requires_grad]
    inputs = [x] if x.requires_grad else []
    with timers["F"]:
        out = stage(x)
        root = workload.loss_fn(out, target) if last else out
    grad = None if last else torch.ones_like(out) / out.numel()
    if split:
        with timers["I"]:
            pending = backward_input([root], [grad], inputs, params, analyses)
        with timers["W"]:
            pending.backward_weight()
        input_grads = pending.input_grads
    else:
        with timers["B"]:
            input_grads = backward_full([root], [grad], inputs)
    got = {n: p.grad.clone() for n, p in stage.named_parameters()}
    got.update({f"<input {i}>": g for i, g in enumerate(input_grads) if g is not None})
    stage.zero_grad(set_to_none=True)
    return got


def _stage_costs(ctx: Context, workload: TinyGPT, s: int) -> tuple[dict[str, float], str]:
    """Median ms of F, B, I, W for stage ``s``, and a mismatch (or "") between B's and I + W's grads."""
    stage = workload.build_stage(s, STAGES).to(ctx.device)
    ids, targets = (t.to(ctx.device) for t in workload.batch(1))
    x = ids if s == 0 else torch.randn(*ids.shape, workload.width, device=ctx.device, requires_grad=True,
                                       generator=torch.Generator(ctx.device).manual_seed(s))
    samples: dict[str, list[float]] = {k: [] for k in "FBIW"}
    mismatch, analyses = "", GraphAnalysisCache()  # one per stage, as the runtime keeps it
    for repeat in range(REPEATS + 1):  # the first is warm-up
        timers = {k: Timer(ctx.device) for k in "FBIW"}
        fused = _once(stage, x, targets, workload, s == STAGES - 1, False, timers, analyses)
        split = _once(stage, x, targets, workload, s == STAGES - 1, True, timers, analyses)
        for name, value in fused.items():
            if not torch.equal(value, split[name]):
                mismatch = mismatch or f"stage {s} {name}: I + W's gradient differs from B's"
        if repeat:
            for k in "BIW":
                samples[k].append(timers[k].ms())
            samples["F"].append(timers["F"].ms())
    return {k: statistics.median(v) for k, v in samples.items()}, mismatch


def split_backward_row(ctx: Context) -> tuple[bool, str]:
    """Per stage: B against I + W (bitwise the same gradients), and the simulated step of 1f1b (F, B)
    against zb-h1 (F, I, W) at P=4, M=8 on those costs: whether zero bubble pays here."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    deterministic(ctx.device)
    workload = _workload(ctx)
    costs = []
    # The math kernel: the efficient one's backward adds with atomics, so B and I + W would differ by rounding.
    with sdpa_kernel(SDPBackend.MATH):
        for s in range(STAGES):
            ms, mismatch = _stage_costs(ctx, workload, s)
            if mismatch:
                return False, mismatch
            costs.append(ms)
    fused = cs.CostModel.per_stage([(c["F"], c["B"], 0.0) for c in costs])
    split = cs.CostModel.per_stage([(c["F"], c["I"], c["W"]) for c in costs])
    one_f = cs.simulate(cs.build("1f1b", ranks=STAGES, microbatches=MICROBATCHES), fused).makespan
    zero = cs.simulate(cs.build("zb-h1", ranks=STAGES, microbatches=MICROBATCHES), split).makespan
    ratios = "/".join(f"{(c['I'] + c['W']) / c['B']:.2f}" for c in costs)
    verdict = "pays" if zero < one_f else "does not pay"
    return True, (f"(I+W)/B per stage {ratios}; B {statistics.mean(c['B'] for c in costs):.2f} ms; simulated "
                  f"P={STAGES} M={MICROBATCHES}: 1f1b {one_f:.1f} ms, zb-h1 {zero:.1f} ms: zero bubble {verdict}")
