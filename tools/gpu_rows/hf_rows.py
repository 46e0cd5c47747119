"""Tiny Hugging Face models (built from config, eager attention) and the tied GPT-2 row on 2 gloo
ranks; the traced rows, every schedule in one process, are in ``traced_rows.py``.

Example::

    ok, detail = tied_row(Context(torch.device("cpu"), quick=True, compile=False))
"""

from __future__ import annotations

import torch

import conveyor
from conveyor.frontend import split_model
from conveyor.testing.models import gpt2, llama

from .common import LR, Context, compare, cpu, deterministic, launch, worst_relative

ROWS, SEQ = 8, 16  # the minibatch: M microbatches of ROWS / M sequences
# The unsplit model's tied gradient against two copies' gradients summed: 2 x 4 microbatch terms per
# element added in two orders, 7 fp32 additions each, so at most 2 x 7 x 2^-24 x sum|terms| = 8.3e-7 x
# sum|terms| apart; 1e-5 of the tensor's largest element leaves 12x for cancellation between the uses.
TIED_BOUND = 1e-5


def hf_model(name: str, dropout: float = 0.0) -> torch.nn.Module:
    """A tiny GPT-2 (tied embeddings) or Llama from its config, attention eager (deterministic backward)."""
    if name == "gpt2":
        model_class, config = gpt2(num_layers=4, dropout=dropout)
    else:
        model_class, config = llama(num_layers=4)
        config.attention_dropout = dropout
    config._attn_implementation = "eager"  # sdpa's efficient kernel adds its gradients with atomics
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return model_class(config).train()


def token_ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 96, (ROWS, SEQ), generator=torch.Generator().manual_seed(seed))


def _hf_loss(output, target):
    return output.loss


def _named(modules, attribute: str) -> dict:
    out = {}
    for module in modules:
        for name, p in module.named_parameters():
            out[name] = p.grad if attribute == "grad" else p.detach()
    return cpu(out)


def _train(pipe, modules, device: torch.device, steps: int = 2) -> dict:
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(steps):
        ids = token_ids(step).to(device)
        losses.append(pipe.step(ids if getattr(pipe, "needs_inputs", True) else None, labels=ids))
        if step == 0:
            grads = _named(modules, "grad")
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": cpu(losses), "grads": grads, "params": _named(modules, "data")}


def _tied_rank(rank: int, world: int, device: str) -> dict:
    device = torch.device(device)
    deterministic(device)
    model = hf_model("gpt2")
    example = token_ids(0)[:2]
    with conveyor.pipeline(model, example_args=(example,), example_kwargs={"labels": example}, schedule="1f1b",
                           microbatches=4, loss_fn=_hf_loss, layout=conveyor.DistributedLayout(device=device),
                           options=conveyor.PipelineOptions(transfer=conveyor.TransferOptions(timeout_s=120),
                                                            split=conveyor.SplitOptions(method="uniform"))) as pipe:
        got = _train(pipe, pipe.modules, device)
    if rank != 0:
        return {"got": got}
    # One process on the same device: the same cut, its stages run in turn with their own copy of the
    # tied weight each, the copies' gradients summed at the end of the step (as across ranks); and the
    # unsplit model, whose one tied weight sums its two uses in autograd's order.
    split = split_model(hf_model("gpt2"), 2, example_args=(example,), example_kwargs={"labels": example},
                        split_method="uniform", device=device)
    stages = [split.stage_module(s, device) for s in range(2)]
    want = _stages_in_turn(stages, split.tied_groups, device)
    unsplit = hf_model("gpt2").to(device)
    ids = token_ids(0).to(device)
    for x in torch.tensor_split(ids, 4):
        (unsplit(x, labels=x).loss / 4).backward()
    tied = {name for group in split.tied_groups for name in group.names}
    return {"got": got, "want": want, "tied": sorted(tied),
            "unsplit": cpu({n: p.grad for n, p in unsplit.named_parameters(remove_duplicate=False)})}


def _stages_in_turn(stages, tied_groups, device: torch.device, steps: int = 2) -> dict:
    """Gradient accumulation over the stages in one process; each tied group's copies summed, in stage order."""
    from conveyor.frontend import run_sequential

    optimizer = torch.optim.AdamW([p for st in stages for p in st.parameters()], lr=LR)
    losses, grads = [], {}
    for step in range(steps):
        ids = token_ids(step).to(device)
        total = None
        for x in torch.tensor_split(ids, 4):
            out = run_sequential(stages, (x,), {"labels": x}, loss_fn=lambda out: out.loss / 4)
            total = out.loss.detach() / 4 if total is None else total + out.loss.detach() / 4
        losses.append(total)
        for group in tied_groups:
            copies = [stages[s].get_parameter(name) for s, name in group.uses]
            summed = copies[0].grad + copies[1].grad
            for copy in copies:
                copy.grad = summed.clone()
        if step == 0:
            grads = _named(stages, "grad")
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": cpu(losses), "grads": grads, "params": _named(stages, "data")}


def tied_row(ctx: Context) -> tuple[bool, str]:
    """Tied GPT-2 through conveyor.pipeline on 2 gloo ranks: bitwise the same cut's stages run in turn in
    one process; untied step-1 grads bitwise the unsplit model, the tied one (two copies summed) within 1e-5."""
    ranks = launch(_tied_rank, 2, ctx, timeout_s=300)
    zero = ranks[0]
    want = zero["want"]
    for rank, got in enumerate(ranks):
        for part in ("grads", "params"):
            ok, detail = compare(got["got"][part], {k: want[part][k] for k in got["got"][part]},
                                 f"rank {rank} {part[:-1]} ")
            if not ok:
                return ok, detail
        ok, detail = compare(dict(enumerate(got["got"]["losses"])), dict(enumerate(want["losses"])), "loss ")
        if not ok:
            return ok, detail
    for name, grad in want["grads"].items():
        if name not in zero["tied"] and not torch.equal(grad, zero["unsplit"][name]):
            return False, f"{name}: the one-process cut's gradient differs from the unsplit model's"
    # Each copy holds the copies' sum already (what every rank's copy holds after the step); the unsplit
    # model adds the two uses in autograd's order. NaN-safe: a non-finite value counts as infinitely far.
    worst, where = worst_relative(want["grads"], zero["unsplit"], zero["tied"])
    if not worst <= TIED_BOUND:
        return False, f"tied gradient {where} differs from the unsplit model's by {worst:.3g} of its largest " \
                      f"(bound {TIED_BOUND:g})"
    return True, f"2 ranks = stages in turn in one process, bitwise; untied grads = unsplit's, bitwise; " \
                 f"tied within {worst:.1g}"
