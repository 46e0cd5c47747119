"""Clipping's layout exchanged once: mixed dtypes stay bitwise torch's, a changed layout is named."""

from __future__ import annotations

import pytest
import torch

import conveyor
from conveyor.errors import PipelineConfigError
from conveyor.parallel.clipping import NormExchange


def _stages():
    torch.manual_seed(0)
    return [torch.nn.Linear(3, 3), torch.nn.Linear(3, 3).to(torch.bfloat16), torch.nn.Linear(3, 1).double()]


def _fill(stages, scale: float = 1.0):
    for i, p in enumerate(p for m in stages for p in m.parameters()):
        p.grad = (torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * scale).to(p.dtype)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_mixed_dtypes_give_torchs_total_bit_for_bit_on_every_call(norm_type):
    stages = _stages()
    pipe = conveyor.Pipeline(stages, "gpipe", microbatches=1, layout=conveyor.InProcessLayout())
    for scale in (1.0, 3.0):
        _fill(stages, scale)
        want = torch.nn.utils.get_total_norm([p.grad for m in stages for p in m.parameters()], norm_type)
        got = pipe.clip_grad_norm_(1e30, norm_type)
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert pipe.gradient_checks.norm_exchange.exchanges == 1  # the second call sent norms only


def test_a_rank_whose_gradients_changed_says_so_until_the_layout_is_forgotten():
    stages = _stages()
    pipe = conveyor.Pipeline(stages, "gpipe", microbatches=1, layout=conveyor.InProcessLayout())
    _fill(stages)
    pipe.clip_grad_norm_(1.0)
    stages[1].bias.grad = None
    with pytest.raises(
        PipelineConfigError, match=r"changed since clip_grad_norm_ first exchanged them \(6 then, 5 now"
    ):
        pipe.clip_grad_norm_(1.0)
    pipe.forget_norm_layout()
    want = torch.nn.utils.get_total_norm([p.grad for m in stages for p in m.parameters() if p.grad is not None])
    assert torch.equal(pipe.clip_grad_norm_(1e30), want)


def test_no_gradient_anywhere_is_zero_and_not_kept():
    exchange = NormExchange(lambda mine: [mine], lambda t: t, torch.device("cpu"), torch.device("cpu"))
    assert torch.equal(exchange.total([], [], [], 2.0, None), torch.tensor(0.0))
    assert exchange.layout is None  # the next call, with gradients, exchanges again
    grad = torch.ones(4)
    assert torch.equal(exchange.total([(0,)], [grad], [grad.norm()], 2.0, None), torch.tensor(2.0))
    assert exchange.exchanges == 2


def test_a_skipped_step_lets_the_next_clip_exchange_again():
    stages = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)]
    pipe = conveyor.Pipeline(stages, "1f1b", microbatches=2, loss_fn=lambda y, t: (y - t).pow(2).mean(),
                             layout=conveyor.InProcessLayout())
    x, y = torch.ones(4, 2), torch.zeros(4, 1)
    pipe.step(x, target=y)
    pipe.clip_grad_norm_(1.0)
    pipe.step(x, target=torch.full((4, 1), float("nan")), on_nonfinite="skip")
    assert pipe.skipped_steps == 1
    assert torch.equal(pipe.clip_grad_norm_(1.0), torch.tensor(0.0))  # nothing to clip, no error
    pipe.step(x, target=y)
    pipe.clip_grad_norm_(1.0)
