"""A pass cut into segments where it exchanges tensors gives the gradients of one backward, bit for bit.

In one process, with an exchange that is a copy (what an all-to-all between one rank and itself moves): a
residual block whose middle is "sent" and "received", its backward run segment by segment (B), or as I with
each segment's weight gradients kept for W, against ``loss.backward()`` on the same graph uncut.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.runtime.stage.segments import (
    SegmentedPass,
    interleave,
    run_to_end,
    segmented_backward,
    timed,
    within,
)


class _Copied:
    """An exchange in flight that carries a copy of what was posted."""

    def __init__(self, tensor: torch.Tensor, posted: list[str], label: str) -> None:
        self.tensor = tensor.detach().clone()
        posted.append(label)

    def wait(self) -> torch.Tensor:
        return self.tensor


def _model() -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"a": torch.nn.Linear(8, 8), "b": torch.nn.Linear(8, 8), "c": torch.nn.Linear(8, 8)})


def _forward(model, x, passes: SegmentedPass | None, posted: list[str]):
    """Two residual blocks, each one's middle exchanged; with ``passes``, cut there."""
    h = model["a"](x).tanh()
    for layer in ("b", "c"):
        sent = model[layer](h)
        if passes is None:
            h = h + sent.relu() * 2
            continue
        cut = passes.boundary()
        kept = cut.cut(h)  # what is needed after the exchange crosses as a leaf
        received = cut.exchanged(sent, _Copied(sent, posted, f"{layer}").wait(),
                                 lambda grad, layer=layer: _Copied(grad, posted, f"{layer} grad"))
        h = kept + received.relu() * 2
    return (h * h).sum()


@pytest.mark.parametrize("split", [False, True], ids=["B", "I then W"])
def test_segmented_backward_equals_one_backward(split):
    reference, segmented = _model(), _model()
    x = torch.randn(4, 8, requires_grad=True)
    _forward(reference, x, None, []).backward()
    y = x.detach().requires_grad_()
    passes, posted = SegmentedPass(), []
    loss = _forward(segmented, y, passes, posted)
    params = list(segmented.parameters())
    weights = (params, None) if split else None
    input_grads, pending = run_to_end(segmented_backward(passes, [loss], [None], [y], weights))
    assert all(p.grad is None for p in params) == split  # I leaves the weights to W
    for kept in pending:
        kept.backward_weight()
    assert torch.equal(input_grads[0], x.grad)
    for name, param in reference.named_parameters():
        assert torch.equal(dict(segmented.named_parameters())[name].grad, param.grad), name
    assert posted == ["b", "c", "c grad", "b grad"]  # the reverse exchanges, last cut first


def test_passes_take_turns_and_each_is_timed_by_its_own_stretches():
    order: list[str] = []

    def steps(name: str, turns: int):
        for turn in range(turns):
            order.append(f"{name}{turn}")
            yield
        return name

    spent = [0.0, 0.0]
    assert interleave(timed(steps("F", 3), spent, 0), timed(steps("B", 1), spent, 1)) == ["F", "B"]
    assert order == ["F0", "B0", "F1", "F2"]
    assert spent[0] > 0 and spent[1] > 0


def test_a_context_covers_each_stretch_and_not_the_other_pass():
    entered: list[str] = []

    class Marked:
        def __enter__(self):
            entered.append("in")

        def __exit__(self, *exc):
            entered.append("out")

    def steps():
        yield
        yield
        return 7

    assert run_to_end(within(steps(), Marked)) == 7
    assert entered == ["in", "out"] * 3


def test_a_measured_cut_counts_what_it_keeps_until_its_backward_ends():
    from conveyor.runtime.stage.memory import MemoryMeter

    def held(segmented: bool) -> tuple[int, int]:
        meter = MemoryMeter(0, {})
        meter.start_step()
        x = torch.ones(4, 8, requires_grad=True)
        passes = SegmentedPass(hold=meter.count_kept)
        with meter.saving(0, 0):
            h = x * 3  # a product by a number saves nothing
            y = passes.boundary().cut(h) if segmented else h
            loss = (y + 1).sum()  # nor does a sum: unsegmented, nothing is held for the backward
        during = meter.live_bytes
        if segmented:
            grad = run_to_end(segmented_backward(passes, [loss], [None], [x]))[0][0]
        else:
            grad = torch.autograd.grad(loss, [x])[0]
        assert torch.equal(grad, torch.full((4, 8), 3.0))
        return during, meter.live_bytes

    assert held(segmented=False) == (0, 0)
    assert held(segmented=True) == (4 * 8 * 4, 0)  # the cut keeps h (its leaf shares the storage) until then


def test_a_forward_in_steps_counts_each_storage_once_over_its_steps():
    from conveyor.runtime.stage.memory import MemoryMeter

    meter = MemoryMeter(0, {})
    meter.start_step()
    x = torch.ones(4, 8, requires_grad=True)
    passes = SegmentedPass(hold=meter.count_kept)
    with meter.saving(0, 0):  # the first step: gelu saves h
        h = x * 3
        g = torch.nn.functional.gelu(h)
    with meter.saving(0, 0):  # the next one cuts h, which the first step's gelu already holds, and g
        y, z = passes.boundary().cut((h, g))
        loss = (y + z).sum()
    assert meter.live_bytes == 2 * 4 * 8 * 4  # h once, and g
    assert meter.report().stage_bytes == {0: 2 * 4 * 8 * 4}
    run_to_end(segmented_backward(passes, [loss], [None], [x]))
    assert meter.live_bytes == 0
