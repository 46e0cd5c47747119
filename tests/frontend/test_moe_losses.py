"""Mixture-of-experts auxiliary losses through the pipeline under every built-in schedule, bitwise.

The three ways users write them: router logits carried to the loss (Mixtral's load-balancing
loss, traced unchanged with grouped heads); an auxiliary loss attached to a layer's output by a
custom autograd Function (DeepSeek-V3's ``AddAuxiliaryLoss``: hand-built stages keep its backward,
and a trace, which would drop it, is refused); an auxiliary loss returned beside the activations
for ``loss_fn`` to add (traced). Losses and parameters after 2 AdamW steps are ``torch.equal`` to
one device accumulating the same 4 microbatches. All ranks in one process (InProcessLayout).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import conveyor.schedule as cs
from conveyor import frontend
from conveyor.errors import TracingError
from conveyor.layout import InProcessLayout
from conveyor.pipe import Pipeline
from conveyor.testing.models import grouped_heads_lm

M = 4
SCHEDULES = sorted(cs.available())


def _schedule(name):
    return cs.build(name, ranks=2, microbatches=M)


def _train(parameters, step, batches):
    """Losses and parameters after one AdamW step per batch; ``step(batch)`` returns the batch's loss."""
    parameters = list(parameters)
    optimizer = torch.optim.AdamW([p for _, p in parameters], lr=1e-2)
    losses = []
    for batch in batches:
        losses.append(step(batch))
        optimizer.step()
        optimizer.zero_grad()
    return losses, {name: p.detach().clone() for name, p in parameters}


def _one_device(model, loss_fn, batches):
    def step(batch):
        total = None
        for part in zip(*(torch.tensor_split(t, M) for t in batch)):
            loss = loss_fn(model(part[0]), part[1]) / M
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total

    return _train(model.named_parameters(), step, batches)


def _pipelined(stages, schedule, loss_fn, batches):
    pipe = Pipeline(stages, schedule, loss_fn=loss_fn, layout=InProcessLayout())
    return _train(pipe.named_parameters(), lambda batch: pipe.step(batch[0], target=batch[1]), batches)


def _assert_bitwise(got, want):
    (losses, params), (want_losses, want_params) = got, want
    assert all(torch.equal(a, b) for a, b in zip(losses, want_losses)), (losses, want_losses)
    assert params.keys() == want_params.keys()
    for name, value in params.items():
        assert torch.equal(value, want_params[name]), f"{name} differs after {len(losses)} steps"


# -- 1. router logits carried to the loss (Mixtral) ------------------------------------------------

def _mixtral():
    model_class, config = grouped_heads_lm("mixtral", output_router_logits=True, router_aux_loss_coef=0.02)
    torch.manual_seed(0)
    return model_class(config)


def _tokens():
    return [(ids, ids) for ids in (torch.randint(0, 96, (8, 12), generator=torch.Generator().manual_seed(s))
                                   for s in range(2))]


def _mixtral_loss(output, _target):
    assert output.aux_loss is not None and output.router_logits is not None
    return output.loss  # the language-model loss + router_aux_loss_coef x the load-balancing loss


@functools.cache
def _mixtral_split(num_stages):
    example = _tokens()[0][0][: 8 // M]
    return frontend.split_model(_mixtral(), num_stages, example_args=(example,),
                                example_kwargs={"labels": example}, split_method="uniform")


@functools.cache
def _mixtral_one_device():
    model = _mixtral()

    def step(batch):
        total = None
        for ids in torch.tensor_split(batch[0], M):
            loss = _mixtral_loss(model(ids, labels=ids), None) / M
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total

    return _train(model.named_parameters(), step, _tokens())


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_mixtral_router_logits_carried_to_the_loss(schedule):
    sched = _schedule(schedule)
    stages = copy.deepcopy(_mixtral_split(sched.num_stages).stage_modules())  # fresh weights, one trace
    pipe = Pipeline(stages, sched, loss_fn=_mixtral_loss, layout=InProcessLayout())
    got = _train(pipe.named_parameters(), lambda batch: pipe.step(batch[0], labels=batch[1]), _tokens())
    _assert_bitwise(got, _mixtral_one_device())


# -- 2. an auxiliary loss attached by a custom autograd Function (DeepSeek-V3) ----------------------

class AddAuxiliaryLoss(torch.autograd.Function):
    """DeepSeek-V3's: the output is the input; backward gives the auxiliary loss a gradient of one."""

    @staticmethod
    def forward(ctx, x, loss):
        ctx.dtype = loss.dtype
        ctx.required_aux_loss = loss.requires_grad
        return x

    @staticmethod
    def backward(ctx, grad_output):
        grad_loss = torch.ones(1, dtype=ctx.dtype, device=grad_output.device) if ctx.required_aux_loss else None
        return grad_output, grad_loss


class _RoutedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.mlp = nn.Linear(8, 4), nn.Linear(8, 8)

    def balance(self, h):
        share = self.gate(h).softmax(-1).mean((0, 1))
        return 0.1 * (share * share).sum()

    def forward(self, h):
        return AddAuxiliaryLoss.apply(h + torch.tanh(self.mlp(h)), self.balance(h))


def _regression():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 3, 8, generator=generator), torch.randn(8, 3, 8, generator=generator)) for _ in range(2)]


def _mse(out, target):
    return nn.functional.mse_loss(out, target)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_auxiliary_loss_attached_by_an_autograd_function_on_hand_built_stages(schedule):
    sched = _schedule(schedule)
    torch.manual_seed(0)
    blocks = [_RoutedBlock() for _ in range(sched.num_stages)]
    want = _one_device(nn.Sequential(*copy.deepcopy(blocks)), _mse, _regression())
    assert blocks[0].gate.weight.grad is None
    stages = [nn.Sequential() for _ in blocks]
    for index, (stage, block) in enumerate(zip(stages, blocks)):
        stage.add_module(str(index), block)  # "1.gate.weight" on stage 1, as in the model
    got = _pipelined(stages, sched, _mse, _regression())
    _assert_bitwise(got, want)


def test_a_trace_through_an_autograd_function_is_refused_naming_it():
    """Before: traced, the Function's forward ran and its backward was dropped: gates got no gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_RoutedBlock() for _ in range(2)])
    with pytest.raises(TracingError, match=r"AddAuxiliaryLoss in module '0'(.|\n)*AddAuxiliaryLoss in module '1'"):
        frontend.split_model(model, 2, example_args=(_regression()[0][0][:2],))


# -- 3. an auxiliary loss returned beside the activations, for loss_fn to add -----------------------

class _ReturnsAux(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_RoutedBlock() for _ in range(4))

    def forward(self, h):
        aux = h.new_zeros(())
        for block in self.blocks:
            aux = aux + block.balance(h)
            h = h + torch.tanh(block.mlp(h))
        return {"hidden": h, "aux": aux}


def _with_aux(out, target):
    return nn.functional.mse_loss(out["hidden"], target) + out["aux"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_auxiliary_loss_returned_beside_the_activations_traced(schedule):
    sched = _schedule(schedule)
    torch.manual_seed(0)
    model = _ReturnsAux()
    want = _one_device(copy.deepcopy(model), _with_aux, _regression())
    split = frontend.split_model(model, sched.num_stages, example_args=(_regression()[0][0][:2],),
                                 split_method="uniform")
    got = _pipelined(split.stage_modules(), sched, _with_aux, _regression())
    _assert_bitwise(got, want)
