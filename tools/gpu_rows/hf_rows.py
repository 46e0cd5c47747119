"""Rows on traced Hugging Face models (tiny, built from config, eager attention): tied GPT-2 on 2
gloo ranks, and every schedule of GPT-2 and Llama in one process with activation checkpointing,
dropout, compile and bf16, gradients compared bitwise.

Example::

    ok, detail = traced_row(Context(torch.device("cpu"), quick=True, compile=False), "gpt2")
"""

from __future__ import annotations

import torch

import conveyor
import conveyor.schedule as cs
from conveyor.frontend import split_model
from conveyor.testing.models import gpt2, llama

from .common import LR, Context, compare, cpu, deterministic, launch
from .ranks import schedule_names

ROWS, SEQ = 8, 16  # the minibatch: M microbatches of ROWS / M sequences


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
                           microbatches=4, loss_fn=_hf_loss,
                           options=conveyor.PipelineOptions(transfer=conveyor.TransferOptions(timeout_s=120), layout=conveyor.Layout(device=device), split=conveyor.SplitOptions(method="uniform"))) as pipe:
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
    worst = 0.0
    for name, grad in want["grads"].items():
        reference = zero["unsplit"][name]
        if name in zero["tied"]:
            # Each copy holds the copies' sum already (what every rank's copy holds after the step).
            worst = max(worst, ((grad - reference).abs().max() / reference.abs().max()).item())
        elif not torch.equal(grad, reference):
            return False, f"{name}: the one-process cut's gradient differs from the unsplit model's"
    if worst > 1e-5:
        return False, f"tied gradient differs from the unsplit model's by {worst:.3g} (relative)"
    return True, f"2 ranks = stages in turn in one process, bitwise; untied grads = unsplit's, bitwise; " \
                 f"tied within {worst:.1g}"


def _traced_run(model, split, schedule, ctx: Context, seed: int = 7) -> dict:
    """One step of ``schedule`` over the cut, every option on; step-1 losses and grads by name."""
    model.zero_grad(set_to_none=True)  # stage modules share the model's untied parameters
    stages = [split.stage_module(s, ctx.device) for s in range(schedule.num_stages)]
    pipe = conveyor.LocalPipeline(stages, schedule, _hf_loss, device=ctx.device,
                                  stage=conveyor.StageOptions(checkpoint_activations=True, autocast="bf16",
                                                              compile=ctx.compile),
                                  model=conveyor.WholeModel(tied_parameters=split.tied_groups))
    torch.manual_seed(seed)  # the step's random streams (dropout) come from the CPU generator
    ids = token_ids(1).to(ctx.device)
    loss = pipe.step(ids, labels=ids)
    out = {"loss": cpu(loss), "grads": _named(stages, "grad")}
    pipe.close()
    return out


def traced_row(ctx: Context, name: str) -> tuple[bool, str]:
    """Every schedule (P=2) on the traced model, checkpointing + dropout + compile + bf16 autocast:
    gradients bitwise those of gpipe over the same stages (the stages run in turn)."""
    deterministic(ctx.device)
    model = hf_model(name, dropout=0.1).to(ctx.device)
    example = token_ids(0)[:2].to(ctx.device)
    splits, references, failures, done, worst_tied = {}, {}, [], 0, 0.0
    for schedule_name in schedule_names(ctx.quick):
        schedule = cs.build(schedule_name, ranks=2, microbatches=4, virtual=cs.available()[schedule_name].default_virtual)
        n = schedule.num_stages
        if n not in splits:
            splits[n] = split_model(model, n, example_args=(example,), example_kwargs={"labels": example},
                                    split_method="uniform", device=ctx.device)
            references[n] = _traced_run(model, splits[n], cs.build("gpipe", ranks=n, microbatches=4), ctx)
            if not torch.isfinite(references[n]["loss"]):
                return False, f"the reference loss over {n} stages is {references[n]['loss'].item()}"
            if len(references) == 1:  # dropout draws: another seed, another loss (else the row tests no dropout)
                other = _traced_run(model, splits[n], cs.build("gpipe", ranks=n, microbatches=4), ctx, seed=8)
                if torch.equal(other["loss"], references[n]["loss"]):
                    return False, "two seeds gave the same loss: dropout drew nothing"
        got = _traced_run(model, splits[n], schedule, ctx)
        # A tied weight's uses add into one gradient in the schedule's order: equal to rounding only.
        tied = {name for group in splits[n].tied_groups for name in group.names}
        want = references[n]
        ok, detail = compare({"loss": got["loss"], **{k: v for k, v in got["grads"].items() if k not in tied}},
                             {"loss": want["loss"], **{k: v for k, v in want["grads"].items() if k not in tied}})
        for tied_name in tied & set(want["grads"]):
            got_grad, want_grad = got["grads"][tied_name], want["grads"][tied_name]
            worst_tied = max(worst_tied, ((got_grad - want_grad).abs().max() / want_grad.abs().max()).item())
        done += 1
        if not ok or worst_tied > 1e-5:
            failures.append(f"{schedule_name}: {detail if not ok else f'tied grads differ by {worst_tied:.2g}'}")
    options = "ckpt+dropout+bf16" + ("+compile" if ctx.compile else ", no compile")
    if failures:
        return False, f"{len(failures)}/{done} differ from gpipe; {failures[0]}"
    tied_note = f"; tied within {worst_tied:.1g}" if worst_tied else ""
    return True, f"{done}/{done} schedules' grads bitwise gpipe's over the same stages ({options}){tied_note}"
