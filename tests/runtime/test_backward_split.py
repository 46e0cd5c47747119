"""The I/W split against a full backward, bit for bit, and its per-shape plan cache."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conveyor.runtime.backward import PlanCache, backward_full, backward_input


class Chain(nn.Module):
    """Frontier nodes that feed one another through the input path."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class Tied(nn.Module):
    """One weight used twice, plus an output that depends on the parameters alone."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4, bias=False)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.shared(torch.relu(self.shared(x)) * self.scale)
        return hidden, self.scale * 2.0


class TwoInputs(nn.Module):
    """A gradient-carrying input, an input with no gradient, and a branch that gets none."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(4, 4)
        self.side = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.main(x) * mask, self.side(x)


class _Gate(torch.autograd.Function):
    """Identity whose backward lets the gradient through only when told to."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, open_: bool) -> torch.Tensor:
        ctx.open_ = open_
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad if ctx.open_ else None), None


class Gated(nn.Module):
    """The same graph shape whose first layer receives a gradient in some microbatches only."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.open_ = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(_Gate.apply(self.first(x), self.open_))


def _inputs(module: nn.Module, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(3, 4, generator=generator, requires_grad=True)
    if isinstance(module, TwoInputs):
        return [x, (torch.arange(4) % 2).float()]
    return [x]


def _run(module: nn.Module, step: int, split: bool, plans: PlanCache | None):
    inputs = _inputs(module, step)
    outputs = module(*inputs)
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    generator = torch.Generator().manual_seed(1000 + step)
    grads = [torch.randn(o.shape, generator=generator) for o in outputs]
    if isinstance(module, TwoInputs):
        grads[1] = None  # the side branch receives no gradient
    live = [x for x in inputs if x.requires_grad]
    if not split:
        return backward_full(outputs, grads, live)
    params = [p for p in module.parameters() if p.requires_grad]
    pending = backward_input(outputs, grads, live, params, plans)
    assert all(p.grad is None or step > 0 for p in params), "I must leave .grad alone"
    pending.backward_weight()
    return pending.input_grads


@pytest.mark.parametrize("make", [Chain, Tied, TwoInputs, Gated])
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "fresh"])
def test_split_gives_a_full_backwards_gradients_bit_for_bit(make, cached):
    torch.manual_seed(0)
    reference = make()
    split = copy.deepcopy(reference)
    plans = PlanCache() if cached else None
    for step in range(4):
        if isinstance(reference, Gated):
            reference.open_ = split.open_ = step % 2 == 0
        expected = _run(reference, step, split=False, plans=None)
        got = _run(split, step, split=True, plans=plans)
        for want, have in zip(expected, got):
            assert (want is None) == (have is None)
            if want is not None:
                assert torch.equal(want, have)
        for (name, want), have in zip(reference.named_parameters(), split.parameters()):
            assert (want.grad is None) == (have.grad is None), name
            if want.grad is not None:
                assert torch.equal(want.grad, have.grad), f"{name} differs after microbatch {step}"
    if cached:
        assert plans.misses == 1 and plans.hits == 3


def test_each_graph_shape_gets_its_own_plan_and_the_oldest_is_forgotten():
    plans = PlanCache(max_entries=2)
    linear = nn.Linear(4, 4)

    def shape(depth: int) -> None:
        x = torch.randn(2, 4, requires_grad=True)
        y = x
        for _ in range(depth):
            y = linear(y)
        backward_input([y], [torch.ones(2, 4)], [x], list(linear.parameters()), plans).backward_weight()

    for depth in (1, 2, 1, 2, 3, 1):
        shape(depth)
    # 1 and 2 are planned once each and found again; 3 pushes 1 out, so 1 is planned anew.
    assert (plans.misses, plans.hits) == (4, 2)
    assert len(plans.plans) == 2
