"""The I/W split against a full backward, bit for bit, and its per-shape analysis cache."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conveyor.runtime.stage.backward import GraphAnalysisCache, backward_input


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


class Swapped(nn.Module):
    """Two layers of one shape applied in either order: equal graphs but for which weight is where."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.open_ = True  # True: first then second

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = (self.first, self.second) if self.open_ else (self.second, self.first)
        return b(torch.tanh(a(x)))


class _TwoOutputs(torch.autograd.Function):
    """One node with two outputs and a weight among its inputs: both outputs become roots."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor):
        ctx.save_for_backward(x, weight)
        return x @ weight, (x @ weight) * 2.0

    @staticmethod
    def backward(ctx, grad_a: torch.Tensor, grad_b: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad = grad_a + grad_b * 2.0
        return grad @ weight.T, x.T @ grad


class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1.0, 1.0, 16).reshape(4, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _TwoOutputs.apply(torch.tanh(x), self.weight)


class NonLeafInput(nn.Module):
    """A stage input that is itself computed (the split must find it by its grad_fn)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


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
    if isinstance(module, NonLeafInput):
        return [x * 1.5]
    return [x]


def _run(module: nn.Module, step: int, split: bool, analyses: GraphAnalysisCache | None):
    inputs = _inputs(module, step)
    outputs = module(*inputs)
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    generator = torch.Generator().manual_seed(1000 + step)
    grads = [torch.randn(o.shape, generator=generator) for o in outputs]
    if isinstance(module, TwoInputs):
        grads[1] = None  # the side branch receives no gradient
    live = [x for x in inputs if x.requires_grad]
    if not split:
        # The reference is plain autograd, into .grad of the inputs (leaves or not) and parameters.
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None]
        params = [p for p in module.parameters() if p.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], inputs=live + params)
        return [x.grad for x in live]
    params = [p for p in module.parameters() if p.requires_grad]
    before = [None if p.grad is None else p.grad.clone() for p in params]
    pending = backward_input(outputs, grads, live, params, analyses)
    for p, old in zip(params, before):  # I leaves every parameter's gradient as it was
        assert (p.grad is None and old is None) or torch.equal(p.grad, old)
    pending.backward_weight()
    return pending.input_grads


@pytest.mark.parametrize("make", [Chain, Tied, TwoInputs, Gated, Swapped, TwoOutputs, NonLeafInput])
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "fresh"])
def test_split_gives_a_full_backwards_gradients_bit_for_bit(make, cached):
    torch.manual_seed(0)
    reference = make()
    split = copy.deepcopy(reference)
    analyses = GraphAnalysisCache() if cached else None
    for step in range(4):
        if isinstance(reference, Gated | Swapped):
            reference.open_ = split.open_ = step % 2 == 0
        expected = _run(reference, step, split=False, analyses=None)
        got = _run(split, step, split=True, analyses=analyses)
        for want, have in zip(expected, got):
            assert (want is None) == (have is None)
            if want is not None:
                assert torch.equal(want, have)
        for (name, want), have in zip(reference.named_parameters(), split.parameters()):
            assert (want.grad is None) == (have.grad is None), name
            if want.grad is not None:
                assert torch.equal(want.grad, have.grad), f"{name} differs after microbatch {step}"
    if cached:
        # The swapped layers are two shapes (which weight sits where); every other graph is one.
        shapes = 2 if isinstance(reference, Swapped) else 1
        assert (analyses.misses, analyses.hits) == (shapes, 4 - shapes)


def test_each_graph_shape_gets_its_own_plan_and_the_oldest_is_forgotten():
    analyses = GraphAnalysisCache(max_entries=2)
    linear = nn.Linear(4, 4)

    def shape(depth: int) -> None:
        x = torch.randn(2, 4, requires_grad=True)
        y = x
        for _ in range(depth):
            y = linear(y)
        backward_input([y], [torch.ones(2, 4)], [x], list(linear.parameters()), analyses).backward_weight()

    for depth in (1, 2, 1, 3, 1):
        shape(depth)
    # 1 and 2 are planned once each; 1 is found again, so 3 pushes out 2 (the least recently
    # used), not 1, and the last 1 is found too.
    assert (analyses.misses, analyses.hits) == (3, 2)
    assert len(analyses.analyses) == 2
    with pytest.raises(ValueError, match="at least one analysis"):
        GraphAnalysisCache(max_entries=0)
