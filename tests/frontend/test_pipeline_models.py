"""conveyor.pipeline() on unchanged Hugging Face models across gloo processes, against one device.

Untied parameters: losses, gradients and parameters after 3 AdamW steps are bitwise equal.
Tied parameters (GPT-2's wte = lm_head): each stage holding a copy contributes its part of the
gradient and the parts are summed across ranks (or accumulate into one shared Parameter where
one rank holds both stages), in another order than one device sums them. So the tied gradient is
equal up to float rounding (allclose), and parameters that depend on it drift by rounding too.

Cases that need the same model on the same number of ranks run one after the other inside one
rank group (three groups for six cases, not six); every assertion names its case.
"""

from __future__ import annotations

import functools

import pytest
import torch

import conveyor
from conveyor.testing import run_ranks
from conveyor.testing.compare import reordered_sum_bound

NUM_MICROBATCHES = 4
NUM_STEPS = 3
TIED = {"lm_head.weight": "transformer.wte.weight"}


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=4,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped, as Llama 3's
        max_position_embeddings=16,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(cfg)


MODELS = {"gpt2": _gpt2, "llama": _llama}


def _batch():
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(1))
    return ids, ids.clone()


def _external_loss(output, labels):
    logits = output.logits[:, :-1].reshape(-1, output.logits.shape[-1])
    return torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))


def _own_loss(output, _target):
    return output.loss


def _train(rank, world_size, which, schedule, virtual, own_loss):
    model = MODELS[which]()
    ids, labels = _batch()
    example_kwargs = {"labels": labels[:2]} if own_loss else {}
    pipe = conveyor.pipeline(model, example_args=(ids[:2],), example_kwargs=example_kwargs, schedule=schedule,
                             microbatches=NUM_MICROBATCHES, loss_fn=_own_loss if own_loss else _external_loss,
                             options=conveyor.PipelineOptions(virtual=virtual))
    names = dict(pipe.named_parameters()).keys()
    assert set(names) <= set(model.state_dict()), "stage parameter names must be the model's own"
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses, grads = [], None
    for step in range(NUM_STEPS):
        if own_loss:
            losses.append(pipe.step(ids, labels=labels))
        else:
            losses.append(pipe.step(ids, target=labels))
        if step == 0:
            grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, {n: p.detach().clone() for n, p in pipe.named_parameters()}


def _train_each(rank, world_size, which, cases):
    return [_train(rank, world_size, which, schedule, virtual, own_loss) for schedule, virtual, own_loss in cases]


@functools.cache
def _reference(which, own_loss):
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' thread count: CPU reductions depend on it
    try:
        model = MODELS[which]()
        ids, labels = _batch()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, grads = [], None
        for step in range(NUM_STEPS):
            total = None
            for x, y in zip(
                torch.tensor_split(ids, NUM_MICROBATCHES),
                torch.tensor_split(labels, NUM_MICROBATCHES),
            ):
                out = model(x, labels=y) if own_loss else model(x)
                loss = (out.loss if own_loss else _external_loss(out, y)) / NUM_MICROBATCHES
                loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
            losses.append(total)
            if step == 0:
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
        return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        torch.set_num_threads(previous)


CASES = [
    # (model, schedule, virtual, ranks, own loss): 2 and 4 stages, 1f1b and zbv.
    ("llama", "1f1b", None, 2, True),
    ("llama", "zbv", 2, 2, True),
    ("llama", "1f1b", None, 2, False),
    ("gpt2", "1f1b", None, 2, True),
    ("gpt2", "zbv", 2, 2, True),
    ("gpt2", "1f1b", None, 4, False),
]
GROUPS = sorted({(which, num_ranks) for which, _, _, num_ranks, _ in CASES})


@pytest.mark.parametrize(("which", "num_ranks"), GROUPS)
def test_hugging_face_model_unchanged_matches_one_device(which, num_ranks):
    cases = [(schedule, virtual, own_loss) for model, schedule, virtual, ranks, own_loss in CASES
             if (model, ranks) == (which, num_ranks)]
    by_rank = run_ranks(_train_each, num_ranks, args=(which, cases), timeout_s=240 * len(cases))
    for index, (schedule, virtual, own_loss) in enumerate(cases):
        case = f"{which} {schedule} virtual={virtual} on {num_ranks} ranks, own_loss={own_loss}"
        _check_case(case, which, own_loss, [results[index] for results in by_rank])


def _check_case(case, which, own_loss, results):
    want_losses, want_grads, want_params = _reference(which, own_loss)
    tied = TIED if which == "gpt2" else {}
    held, moved = set(), {}
    for losses, grads, params in results:
        assert torch.equal(losses[0], want_losses[0]), f"{case}: first loss differs"
        for name, grad in grads.items():
            want = want_grads[name if name in want_grads else tied[name]]
            if name in tied or name in tied.values():
                torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{case}: {n}: {m}")
            else:
                assert torch.equal(grad, want), f"{case}: {name}: gradient differs"
        for name, value in params.items():
            want = want_params[name if name in want_params else tied[name]]
            if which == "gpt2":
                # Adam turns the tied gradient's rounding into small parameter differences.
                torch.testing.assert_close(value, want, rtol=0, atol=2e-3, msg=lambda m, n=name: f"{case}: {n}: {m}")
            else:
                assert torch.equal(value, want), f"{case}: {name}: parameter after {NUM_STEPS} steps differs"
        assert len(losses) == len(want_losses) == NUM_STEPS, f"{case}: {len(losses)} losses"
        if which != "gpt2":
            assert all(torch.equal(g, w) for g, w in zip(losses, want_losses)), f"{case}: losses differ"
        held |= set(params)
        moved.update({tied.get(n, n): (value - want_params[tied.get(n, n)]).abs() for n, value in params.items()})
    model_names = {n for n, _ in MODELS[which]().named_parameters()}
    assert {tied.get(n, n) for n in held} == model_names, f"{case}: every parameter lives on some rank"
    if which == "gpt2":
        # The later steps run on parameters that differ by rounding that AdamW magnified (above), so their
        # losses differ too: to first order by sum_i g_i dp_i, at most sum_i |g_i| |dp_i|. Bounded with the
        # first step's gradient and the last step's differences (they accumulate over the steps), twice over
        # for the later steps' own gradients and the second-order terms. Each side also rounds its own loss
        # at its own point: at most the forward's rounding, whose longest sum is the vocabulary's (64 terms).
        first_order = 2 * sum((want_grads[n].abs() * moved[n]).sum().item() for n in model_names)
        for losses, *_ in results:
            for step in range(1, NUM_STEPS):
                bound = first_order + reordered_sum_bound(64) * abs(want_losses[step].item())
                difference = abs(losses[step].item() - want_losses[step].item())
                assert difference <= bound, f"{case}: loss of step {step} differs by {difference:.3g} > {bound:.3g}"
