"""A tensor crosses a stage boundary with its memory layout, so results stay bitwise one device's.

A stage whose output is a transpose or a permutation (or ``channels_last``) hands the
next stage a tensor with those strides on one device; reductions over it then add in
memory order. Arriving row-major, the same sum rounds differently.
"""

from __future__ import annotations

import pytest
import torch

import conveyor
import conveyor.schedule as cs
from conveyor.runtime.transport.wire import (
    dense_strides,
    flat_in_layout,
    flatten_payload,
    matches,
    pack,
    quick_flatten,
    unpack,
)
from conveyor.testing import run_ranks

NUM_MICROBATCHES = 2


def _layout(tensor):
    """Strides of the dimensions longer than 1 (a size-1 dimension's stride is never used)."""
    return tuple(stride for size, stride in zip(tensor.shape, tensor.stride()) if size != 1)


def test_dense_layouts_keep_their_strides_and_views_with_gaps_become_row_major():
    base = torch.arange(24.0).reshape(2, 3, 4)
    cases = {
        "row-major": (base, None),
        "transpose": (base.transpose(0, 2), base.transpose(0, 2).stride()),
        "permute": (base.permute(1, 2, 0), base.permute(1, 2, 0).stride()),
        "channels_last": (torch.ones(2, 3, 4, 5).to(memory_format=torch.channels_last), (60, 1, 15, 3)),
        "slice with gaps": (base[:, :, :2], None),
        "expanded": (torch.ones(3, 1).expand(3, 4), None),
        "size-1 dims anywhere": (torch.ones(1, 4, 1).transpose(0, 2), None),
    }
    for name, (tensor, strides) in cases.items():
        assert dense_strides(tensor) == strides, name
        meta, tensors = flatten_payload((tensor, tensor + 0))
        received, copy = unpack(pack(tensors, meta), meta)
        assert torch.equal(received, tensor), name
        row_major = torch.empty(tensor.shape)
        assert _layout(received) == _layout(tensor if strides is not None else row_major), name
        assert _layout(copy) == _layout(tensor + 0), name
        assert torch.equal(flat_in_layout(tensor), received.as_strided((tensor.numel(),), (1,))), name


def test_lazy_conjugate_and_negative_views_travel_as_their_values():
    """A conjugate view's memory holds the unconjugated numbers: the wire sends its values."""
    z = torch.complex(torch.arange(4.0), torch.arange(4.0) + 10)
    wide = torch.complex(torch.arange(12.0), -torch.arange(12.0)).reshape(3, 4)
    gapped = (wide.conj().imag.t(), wide.conj().t()[::2], wide.conj()[:, 1:3])  # resolving copies them
    for tensor in (z.conj(), torch._neg_view(torch.arange(3.0)), z.conj().reshape(2, 2).t(), *gapped):
        meta, tensors = flatten_payload((tensor, tensor))
        received, again = unpack(pack(tensors, meta), meta)
        assert torch.equal(received, tensor.resolve_conj().resolve_neg())
        assert torch.equal(again, received)
        assert not received.is_conj() and not received.is_neg()


def test_a_zero_tensor_gradient_travels_as_zeros():
    """Autograd's all-zeros gradient (``sgn``'s, say) has no memory behind it (data_ptr() is 0)."""
    for payload in ((torch._efficientzerotensor(4, 4),), (torch._efficientzerotensor(2, 3), torch.ones(2))):
        meta, tensors = flatten_payload(payload)
        buffer = pack(tensors, meta)
        assert not buffer._is_zerotensor()  # gloo sends real memory only
        received = unpack(buffer, meta)
        for got, sent in zip(received, payload):
            assert torch.equal(got, sent) and not got._is_zerotensor()


class _SignOnly(torch.nn.Module):
    """Uses its input only through sgn(), whose gradient autograd gives as a zero tensor."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return x.sgn() * self.weight


def _sign_pipeline(rank, world_size, transport):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = [torch.nn.Linear(8, 8), _SignOnly()][rank]
    pipe = conveyor.Pipeline([module], schedule=cs.build("1f1b", ranks=2, microbatches=2), loss_fn=_loss,
                             transfer=conveyor.TransferOptions(timeout_s=60, transport=transport))
    x, target = torch.randn(4, 8), torch.randn(4, 8)
    loss = pipe.step(x if rank == 0 else None, target=target if rank == 1 else None)
    return loss, [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("transport", ["process_group", "shared_memory"])
def test_a_stage_whose_input_gradient_is_a_zero_tensor_trains(transport):
    """Used to kill the rank (a memmove from address 0) or fail in gloo ("has to be contiguous")."""
    (_, first_grads), (loss, _) = run_ranks(_sign_pipeline, 2, args=(transport,), timeout_s=60)
    assert torch.isfinite(loss)
    assert all(torch.equal(grad, torch.zeros_like(grad)) for grad in first_grads)


def test_a_changed_layout_is_a_changed_structure():
    """The send path that reuses last message's structure must notice a new layout."""
    tensor = torch.randn(3, 4)
    meta, _ = flatten_payload((tensor,))
    assert matches(meta, *quick_flatten((torch.randn(3, 4),)))
    assert not matches(meta, *quick_flatten((torch.randn(4, 3).t(),)))
    transposed, _ = flatten_payload((torch.randn(4, 3).t(),))
    assert matches(transposed, *quick_flatten((torch.randn(4, 3).t(),)))
    assert not matches(transposed, *quick_flatten((tensor,)))


class _Producer(torch.nn.Module):
    """Hands on a transpose and a permutation of its activation (both dense, neither row-major)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 300)

    def forward(self, x):
        h = torch.tanh(self.linear(x))
        return h.t(), h.reshape(-1, 30, 10).permute(2, 0, 1)


class _Consumer(torch.nn.Module):
    """Sums over its inputs in their memory order, and records the strides they came with."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 300))
        self.seen_strides = []

    def forward(self, transposed, permuted):
        self.seen_strides.append((transposed.stride(), permuted.stride()))
        by_column = (transposed * self.scale[:, None]).sum(0)
        return by_column + permuted.sum(dim=(0, 2))


def _loss(output, target):
    return (output - target).pow(2).mean()


def _modules():
    torch.manual_seed(0)
    return _Producer(), _Consumer()


def _batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=generator), torch.randn(8, generator=generator)


def _one_device():
    producer, consumer = _modules()
    x, target = _batch()
    losses = []
    for part, part_target in zip(x.chunk(NUM_MICROBATCHES), target.chunk(NUM_MICROBATCHES)):
        loss = _loss(consumer(*producer(part)), part_target) / NUM_MICROBATCHES
        loss.backward()
        losses.append(loss.detach())
    grads = {**{f"0.{n}": p.grad for n, p in producer.named_parameters()},
             **{f"1.{n}": p.grad for n, p in consumer.named_parameters()}}
    return sum(losses[1:], losses[0]), grads, consumer.seen_strides


def _across_ranks(rank, world_size, transport, fixed_shapes):
    torch.set_num_threads(1)
    module = _modules()[rank]
    pipe = conveyor.Pipeline([module], schedule=cs.build("1f1b", ranks=2, microbatches=NUM_MICROBATCHES),
                             loss_fn=_loss,
                             transfer=conveyor.TransferOptions(timeout_s=60, transport=transport,
                                                               fixed_shapes=fixed_shapes))
    x, target = _batch()
    results = []
    for _ in range(2):  # the second step takes the send paths that reuse the first step's structure
        module.zero_grad()
        loss = pipe.step(x if rank == 0 else None, target=target if rank == 1 else None)
        grads = {f"{rank}.{n}": p.grad.clone() for n, p in module.named_parameters()}
        results.append((loss, grads))
    return results, getattr(module, "seen_strides", None)


@pytest.mark.parametrize("fixed_shapes", [False, True])
@pytest.mark.parametrize("transport", ["process_group", "shared_memory"])
def test_non_row_major_activations_stay_bitwise_across_processes(transport, fixed_shapes):
    torch.set_num_threads(1)
    want_loss, want_grads, want_strides = _one_device()
    results = run_ranks(_across_ranks, 2, args=(transport, fixed_shapes), timeout_s=60)
    (steps0, _), (steps1, seen_strides) = results
    assert seen_strides == want_strides * 2  # the consumer saw one device's layouts, on both steps
    for step in range(2):
        assert torch.equal(steps1[step][0], want_loss), f"step {step} loss {steps1[step][0]} vs {want_loss}"
        for name, grad in {**steps0[step][1], **steps1[step][1]}.items():
            assert torch.equal(grad, want_grads[name]), f"step {step}: gradient of {name} differs"


class _LayoutChanger(torch.nn.Module):
    """The same values each call; transposed on odd calls, row-major on even ones."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 6)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.linear(x)
        return h.t() if self.calls % 2 else h.t().contiguous()


class _LayoutRecorder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(6))
        self.seen_strides = []

    def forward(self, transposed):
        self.seen_strides.append(transposed.stride())
        return (transposed * self.weight[:, None]).sum(0)


def _changing_layout(rank, world_size, transport):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = [_LayoutChanger(), _LayoutRecorder()][rank]
    pipe = conveyor.Pipeline([module], schedule=cs.build("1f1b", ranks=2, microbatches=2), loss_fn=_loss,
                             transfer=conveyor.TransferOptions(timeout_s=60, transport=transport, fixed_shapes=True))
    x, target = torch.randn(4, 16), torch.randn(4)
    losses = [pipe.step(x if rank == 0 else None, target=target if rank == 1 else None) for _ in range(2)]
    return losses, getattr(module, "seen_strides", None)


@pytest.mark.parametrize("transport", ["process_group", "shared_memory"])
def test_fixed_shapes_keep_the_first_layout_and_the_values(transport):
    (_, _), (losses, seen_strides) = run_ranks(_changing_layout, 2, args=(transport,), timeout_s=60)
    # Step 1 carries each layout as it comes; step 2's first microbatch is copied into the layout
    # the channel froze with at the end of step 1.
    assert seen_strides == [(1, 6), (2, 1), (2, 1), (2, 1)]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)  # same values every step
