"""The traced rows: a tiny Hugging Face GPT-2 (tied embeddings) or Llama, traced and cut for P=2,
every schedule through an in-process ``Pipeline`` on the device, in three legs.

- **unsplit** (activation recomputation + bf16 autocast, eager stages, no dropout): against the
  unsplit model on one device, gradient accumulation over the same microbatches under the autocast
  a one-device loop puts around ``model(x, labels=x).loss``: the loss of every step, the step-1
  gradients and the parameters after 2 AdamW steps, ``torch.equal``. The same computation in
  another order of calls: conveyor promises bitwise here (README, "Bitwise parity", "Mixed
  precision"; recomputation is bitwise too).
  GPT-2's tied ``wte`` / ``lm_head``: in one process the stages' copies are one Parameter (as on any
  rank that holds both), so its two uses add into one gradient in the order the schedule runs the
  backwards, where the unsplit model adds them in autograd's order: that gradient is within
  ``hf_rows.TIED_BOUND`` (derived there) of the unsplit model's and its value after AdamW's first
  step within :data:`TIED_PARAM_BOUND`; the loss, every other gradient and parameter bitwise. GPT-2
  is compared over one step only: after it the tied weight differs by rounding, and the next
  steps' losses and gradients by what AdamW's ``m / sqrt(v)`` makes of it (up to ``lr`` an element),
  which no useful bound covers. Llama has no tied weight: 2 steps, bitwise.
- **compiled** (with ``ctx.compile``; fp32, recomputation, inductor-compiled stages): against the
  unsplit eager model in fp32, the step-1 loss and gradients within :data:`COMPILED_BOUND`.
  Inductor fuses and reassociates; the comparison is of two computations.
- **dropout** (dropout 0.1, recomputation, bf16, compile when asked): every schedule bitwise gpipe
  over the same stages, and two seeds give two losses. No one-device loop draws the masks a pipeline
  draws (one random stream per stage and microbatch, README "Random ops"), so this leg's reference
  is the pipeline's own schedule-independence.

Example::

    ok, detail = traced_row(Context(torch.device("cpu"), quick=True, compile=False), "llama")
"""

from __future__ import annotations

import math

import torch

import conveyor
import conveyor.schedule as cs
from conveyor.frontend import split_model

from .common import LR, Context, compare, cpu, deterministic, worst_relative
from .hf_rows import TIED_BOUND, _hf_loss, _train, hf_model, token_ids
from .ranks import schedule_names

MICROBATCHES, STEPS = 4, 2
# Inductor against eager, fp32: every reduction (at most 128 terms here: the vocabulary, the MLP's
# width, 2 x 16 rows in a weight's gradient) may be summed in another order, each off by at most
# (n - 1) u sum|terms| either way: 2 x 127 x 2^-24 = 1.5e-5 relative per operation; about 40
# operations lie between the input and the loss of these 4-layer models (and as many back), so
# first-order 40 x 1.5e-5 = 6e-4 of the largest element; 1e-3 above it. A microbatch dropped or
# counted twice moves the loss and gradients by about 25%; a NaN anywhere is infinitely far.
COMPILED_BOUND = 1e-3
# AdamW's first step moves each element by lr x g / (|g| + eps) (m and v hold g and g^2 alone, bias
# corrected) plus the same weight decay on both sides: less than lr either way, so two first steps
# from the same value differ by less than 2 x lr, whatever rounding did to g. Weak, but derived:
# it fails a NaN, an update of the wrong size or a weight nobody updated.
TIED_PARAM_BOUND = 2 * LR


def traced_row(ctx: Context, name: str) -> tuple[bool, str]:
    """Every schedule (P=2) on the traced ``name`` ("gpt2" or "llama"): the three legs above."""
    deterministic(ctx.device)
    legs = [_unsplit_leg(ctx, name)]
    if ctx.compile:
        legs.append(_compiled_leg(ctx, name))
    legs.append(_dropout_leg(ctx, name))
    failed = [detail for ok, detail in legs if not ok]
    if failed:
        return False, "; ".join(failed)
    return True, "; ".join(detail for _, detail in legs)


class _Cut:
    """One traced model and its cuts by stage count; each run starts from the model's first values.

    Stage modules share the model's untied tensors (tied ones are copied when a stage is built),
    so a run that trains them trains the model: it is put back before every run.
    """

    def __init__(self, name: str, ctx: Context, dropout: float = 0.0) -> None:
        self.model = hf_model(name, dropout=dropout).to(ctx.device)
        self.initial = {key: value.detach().clone() for key, value in self.model.state_dict().items()}
        self.example = token_ids(0)[:2].to(ctx.device)
        self.ctx = ctx
        self.splits: dict[int, object] = {}

    def split(self, num_stages: int):
        if num_stages not in self.splits:
            self.splits[num_stages] = split_model(self.model, num_stages, example_args=(self.example,),
                                                  example_kwargs={"labels": self.example}, split_method="uniform",
                                                  device=self.ctx.device)
        return self.splits[num_stages]

    def train(self, schedule, options: conveyor.StageOptions, steps: int = STEPS, seed: int = 7) -> dict:
        """``steps`` AdamW steps of ``schedule``: each step's loss, step-1 grads, params after, by name."""
        self.model.load_state_dict(self.initial)  # in place: the tensors the stages share
        self.model.zero_grad(set_to_none=True)
        split = self.split(schedule.num_stages)
        stages = [split.stage_module(s, self.ctx.device) for s in range(schedule.num_stages)]
        pipe = conveyor.Pipeline(stages, schedule, _hf_loss, stage=options,
                                 model=conveyor.WholeModel(tied_parameters=split.tied_groups),
                                 layout=conveyor.InProcessLayout(device=self.ctx.device))
        torch.manual_seed(seed)  # the step's random streams (dropout) come from the CPU generator
        try:
            return _train(pipe, stages, self.ctx.device, steps)
        finally:
            pipe.close()

    def tied_names(self, num_stages: int) -> set[str]:
        return {name for group in self.split(num_stages).tied_groups for name in group.names}


def unsplit_reference(name: str, ctx: Context, autocast: bool, steps: int = STEPS) -> dict:
    """The unsplit model on ``ctx.device``: gradient accumulation over :data:`MICROBATCHES`, AdamW.

    Names as ``named_parameters(remove_duplicate=False)`` gives them: a tied weight under each of its
    names, as the stages hold it.
    """
    model = hf_model(name).to(ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(steps):
        ids = token_ids(step).to(ctx.device)
        total = None
        for x in torch.tensor_split(ids, MICROBATCHES):
            with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(x, labels=x).loss / MICROBATCHES
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        losses.append(total)
        if step == 0:
            grads = cpu({n: p.grad for n, p in model.named_parameters(remove_duplicate=False)})
        optimizer.step()
        optimizer.zero_grad()
    params = cpu({n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)})
    return {"losses": cpu(losses), "grads": grads, "params": params}


def _unsplit_leg(ctx: Context, name: str) -> tuple[bool, str]:
    cut = _Cut(name, ctx)
    tied_model = bool(cut.tied_names(2))
    steps = 1 if tied_model else STEPS  # after a tied weight's first AdamW step the runs part by rounding
    want = unsplit_reference(name, ctx, autocast=True, steps=steps)
    if not all(torch.isfinite(loss) for loss in want["losses"]):
        return False, f"unsplit: the one-device losses are not finite: {[loss.item() for loss in want['losses']]}"
    options = conveyor.StageOptions(recompute=True, autocast="bf16")
    done, worst_grad, worst_param = 0, 0.0, 0.0
    for schedule_name in schedule_names(ctx.quick):
        schedule = _schedule(schedule_name)
        tied = cut.tied_names(schedule.num_stages)
        got = cut.train(schedule, options, steps=steps)
        # Everything but a tied weight bitwise; that one's gradient (its uses added in the schedule's
        # order) within TIED_BOUND, and its value after AdamW's first step within TIED_PARAM_BOUND.
        tied_keys = {f"grad {n}" for n in tied} | {f"param {n}" for n in tied}
        ok, detail = compare(_without(_flat(got), tied_keys), _without(_flat(want), tied_keys))
        if ok and tied:
            grad, where = worst_relative(got["grads"], want["grads"], tied)
            # One tensor of every difference: torch's max propagates a NaN, Python's max() over floats would not.
            param = torch.cat([(got["params"][n].double() - want["params"][n].double()).abs().flatten()
                               for n in sorted(tied)]).max().item()
            param = param if math.isfinite(param) else math.inf
            worst_grad, worst_param = max(worst_grad, grad), max(worst_param, param)
            if not grad <= TIED_BOUND:
                ok, detail = False, f"tied gradient {where} off by {grad:.3g} of its largest (bound {TIED_BOUND:g})"
            elif not param <= TIED_PARAM_BOUND:  # NaN fails here too
                ok, detail = False, f"tied weight after AdamW off by {param:.3g} (bound {TIED_PARAM_BOUND:g})"
        if not ok:
            return False, f"unsplit: {schedule_name}: {detail} (against the unsplit model, ckpt+bf16)"
        done += 1
    if tied_model:
        return True, (f"unsplit: {done}/{done} schedules bitwise the unsplit model at step 1 (loss, grads, params "
                      f"after AdamW; ckpt+bf16) but the tied weight: grad within {worst_grad:.1g}, "
                      f"after AdamW within {worst_param:.1g}")
    return True, (f"unsplit: {done}/{done} schedules bitwise the unsplit model (losses of {STEPS} steps, step-1 "
                  f"grads, params after AdamW; ckpt+bf16)")


def _compiled_leg(ctx: Context, name: str) -> tuple[bool, str]:
    want = unsplit_reference(name, ctx, autocast=False, steps=1)
    cut = _Cut(name, ctx)
    options = conveyor.StageOptions(recompute=True, compile=True)
    worst_all, where_all, done = 0.0, "", 0
    for schedule_name in schedule_names(ctx.quick):
        got = cut.train(_schedule(schedule_name), options, steps=1)
        got_step = {"loss": got["losses"][0], **got["grads"]}
        want_step = {"loss": want["losses"][0], **want["grads"]}
        if set(got_step) != set(want_step):
            return False, f"compiled: {schedule_name}: names differ from the unsplit model's (only in the " \
                          f"pipeline: {sorted(set(got_step) - set(want_step))[:3]}, only in the model: " \
                          f"{sorted(set(want_step) - set(got_step))[:3]})"
        worst, where = worst_relative(got_step, want_step, want_step)
        if worst > worst_all:
            worst_all, where_all = worst, f"{schedule_name} {where}"
        if not worst <= COMPILED_BOUND:
            return False, f"compiled: {schedule_name}: {where} off by {worst:.3g} of its largest " \
                          f"(bound {COMPILED_BOUND:g}: inductor against eager, fp32)"
        done += 1
    return True, (f"compiled: {done}/{done} within {COMPILED_BOUND:g} of the unsplit eager model (step-1 loss, "
                  f"grads; fp32, ckpt; worst {worst_all:.2g}{f' at {where_all}' if where_all else ''})")


def _dropout_leg(ctx: Context, name: str) -> tuple[bool, str]:
    cut = _Cut(name, ctx, dropout=0.1)
    options = conveyor.StageOptions(recompute=True, autocast="bf16", compile=ctx.compile)
    references: dict[int, dict] = {}
    failures, done, worst_tied = [], 0, 0.0
    for schedule_name in schedule_names(ctx.quick):
        schedule = _schedule(schedule_name)
        n = schedule.num_stages
        if n not in references:
            gpipe = cs.build("gpipe", ranks=n, microbatches=MICROBATCHES)
            references[n] = cut.train(gpipe, options, steps=1)
            if not torch.isfinite(references[n]["losses"][0]):
                return False, f"dropout: the gpipe loss over {n} stages is {references[n]['losses'][0].item()}"
            if len(references) == 1:  # another seed, another loss: else the leg tests no dropout
                other = cut.train(gpipe, options, steps=1, seed=8)
                if torch.equal(other["losses"][0], references[n]["losses"][0]):
                    return False, "dropout: two seeds gave the same loss: dropout drew nothing"
        got, want = cut.train(schedule, options, steps=1), references[n]
        # A tied weight's uses add into one gradient in the schedule's order: equal to rounding only.
        tied = cut.tied_names(n)
        ok, detail = compare({"loss": got["losses"][0], **_without(got["grads"], tied)},
                             {"loss": want["losses"][0], **_without(want["grads"], tied)})
        worst, where = worst_relative(got["grads"], want["grads"], tied)
        worst_tied = max(worst_tied, worst)
        if ok and not worst <= TIED_BOUND:
            ok, detail = False, f"tied gradient {where} off by {worst:.3g} of its largest (bound {TIED_BOUND:g})"
        done += 1
        if not ok:
            failures.append(f"{schedule_name}: {detail}")
    options_text = "ckpt+dropout+bf16" + ("+compile" if ctx.compile else ", no compile")
    if failures:
        return False, f"dropout: {len(failures)}/{done} differ from gpipe; {failures[0]}"
    tied_note = f"; tied within {worst_tied:.1g}" if worst_tied else ""
    return True, f"dropout: {done}/{done} schedules' step-1 grads bitwise gpipe's ({options_text}){tied_note}"


def _schedule(schedule_name: str):
    virtual = cs.available()[schedule_name].default_virtual
    return cs.build(schedule_name, ranks=2, microbatches=MICROBATCHES, virtual=virtual)


def _without(tensors: dict, names: set[str]) -> dict:
    return {key: value for key, value in tensors.items() if key not in names}


def _flat(run: dict) -> dict:
    """One name -> tensor map of a run: each step's loss, step-1 grads, final params."""
    return {**{f"loss {step + 1}": loss for step, loss in enumerate(run["losses"])},
            **{f"grad {n}": g for n, g in run["grads"].items()}, **{f"param {n}": p for n, p in run["params"].items()}}
