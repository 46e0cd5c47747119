"""The fast paths of the payload helpers agree with pytree's general walk, whatever the structure."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch
from torch.utils import _pytree as pytree

from conveyor.runtime.stage.runner import grad_leaves
from conveyor.runtime.transport.wire import (
    PayloadMeta,
    data_and_trailer,
    flatten_payload,
    in_layouts,
    pack,
    unflatten_payload,
)

Pair = namedtuple("Pair", "first second")


def _values():
    a = torch.randn(2, requires_grad=True)
    b = torch.randn(2)  # carries no gradient
    c = torch.nn.Parameter(torch.randn(3))
    d = torch.randn(1, requires_grad=True) * 2  # not a leaf
    return a, b, c, d


def _structures():
    a, b, c, d = _values()
    return {
        "one tensor": a,
        "call of one tensor": ((a,), {}),
        "mixed call": ((a, b, 3, None), {"mask": b, "extra": [d, "s", (c, 1.5)]}),
        "dict order kept": {"z": d, "a": a},
        "namedtuple": (Pair(a, d), {}),
        "OrderedDict": OrderedDict(y=d, x=a),
        "empty": ((), {}),
        "nothing needs grad": ((b, 2), {}),
    }


@pytest.mark.parametrize("name", list(_structures()))
def test_grad_leaves_finds_what_pytree_finds_in_the_same_order(name):
    value = _structures()[name]
    want = [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.requires_grad]
    got = grad_leaves(value)
    assert len(got) == len(want) and all(g is w for g, w in zip(got, want))


def _payloads():
    a, b, _, d = _values()
    return {
        "tensor": a.detach(),
        "tuple of tensors": (a.detach(), b),
        "empty tuple": (),
        "tuple with a number": (b, 3),
        "list": [b],
        "dict": {"x": b, "n": 2},
        "nested": ((b, (d.detach(),)), {"k": [b]}),
    }


@pytest.mark.parametrize("name", list(_payloads()))
@pytest.mark.parametrize("decoded", [False, True], ids=["sender's meta", "received meta"])
def test_unflatten_payload_rebuilds_the_sent_structure(name, decoded):
    value = _payloads()[name]
    meta, tensors = flatten_payload(value)
    if decoded:
        meta = PayloadMeta.decode(meta.encode())
    rebuilt = unflatten_payload(meta, tensors)
    want_leaves, want_spec = pytree.tree_flatten(value)
    got_leaves, got_spec = pytree.tree_flatten(rebuilt)
    assert type(rebuilt) is type(value) and got_spec == want_spec
    assert all(g is w if isinstance(w, torch.Tensor) else g == w for g, w in zip(got_leaves, want_leaves, strict=True))


class _WithArray(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        import numpy

        return self.linear(x), numpy.arange(3)  # a plain value whose != is elementwise


class _TakesArray(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, array):
        return self.linear(x) * float(array.sum())


def _numpy_across(rank, world_size, transport):
    import conveyor
    import conveyor.schedule as cs

    module = _WithArray() if rank == 0 else _TakesArray()
    pipe = conveyor.Pipeline([module], schedule=cs.build("1f1b", ranks=2, microbatches=2),
                             loss_fn=lambda y, t: y.sum(),
                             transfer=conveyor.TransferOptions(timeout_s=60, transport=transport))
    return [pipe.step(torch.ones(4, 4) if rank == 0 else None).item() for _ in range(3)]


@pytest.mark.parametrize("transport", ["process_group", "shared_memory"])
def test_a_numpy_array_crosses_stages_as_a_plain_value(transport):
    from conveyor.testing import run_ranks

    losses = run_ranks(_numpy_across, 2, args=(transport,), timeout_s=60)
    assert losses[0] == losses[1] and len(set(losses[0])) == 1


def test_packing_and_layouts_stay_on_the_payloads_device():
    """A GPU payload is packed and re-laid out on its GPU, never through the host: the meta
    device stands in (a copy between it and the CPU raises)."""
    x = torch.ones(3, 5, device="meta")
    meta, tensors = flatten_payload((x, x.t()))
    assert pack(tensors, meta).device.type == "meta"
    assert data_and_trailer(tensors, meta, torch.zeros(8, dtype=torch.uint8)).device.type == "meta"
    # A frozen channel told "transposed" gets a row-major tensor: re-laid out where it is.
    told, _ = flatten_payload(x.t())
    (laid,) = in_layouts([x.t().contiguous()], told)
    assert laid.device.type == "meta" and laid.stride() == x.t().stride()
    (row_major,) = in_layouts([x.t()], flatten_payload(x.t().contiguous())[0])
    assert row_major.device.type == "meta" and row_major.is_contiguous()
