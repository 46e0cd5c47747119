"""What crosses a stage boundary: any pytree of tensors and plain values.

A payload is flattened into its tensor leaves plus a :class:`PayloadMeta`
(tree structure, non-tensor leaves, and each tensor's shape, dtype, layout and
whether it carries a gradient). Tensors travel as one flat byte buffer, so one
message carries a whole payload whatever its dtypes; the receiver rebuilds
tensors as views of that buffer (no copy).

A tensor laid out densely in another order than row-major (a transpose, a
``channels_last`` image) keeps its strides across the boundary: the next stage's
kernels then see what they would on one device, which is what keeps a pipeline's
results bitwise one device's. A view with gaps (a slice) arrives row-major, as
``clone()`` would give it.

Example:
    >>> import torch
    >>> meta, tensors = flatten_payload((torch.ones(2, 3), {"n": 4}))
    >>> [t.shape for t in meta.tensors], meta.plain_leaves
    ([torch.Size([2, 3])], (4,))
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from conveyor.errors import SpecMismatchError

# A transfer's one address, (direction, sending stage, microbatch), is the schedule layer's
# (conveyor.schedule.posts.transfer_of): it is written into the lowered program's posts. A
# channel, (direction, sending stage), is the stream of one boundary's transfers.
from conveyor.schedule.posts import BACKWARD as BACKWARD
from conveyor.schedule.posts import EVAL_FORWARD as EVAL_FORWARD
from conveyor.schedule.posts import FORWARD as FORWARD
from conveyor.schedule.posts import Channel as Channel
from conveyor.schedule.posts import TransferKey as TransferKey

_ALIGN = 16


@dataclass(frozen=True, slots=True)
class TensorMeta:
    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool
    path: str
    strides: tuple[int, ...] | None = None  # None: row-major; else the dense layout to rebuild


    @property
    def num_bytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    def describe(self) -> str:
        layout = "" if self.strides is None else f" with strides {self.strides}"
        return f"{tuple(self.shape)} {str(self.dtype).removeprefix('torch.')}{layout}"


def dense_strides(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The strides a receiver rebuilds ``tensor`` with: None for row-major.

    A non-contiguous tensor whose elements fill a block of memory without gaps or
    overlaps keeps its strides (its bytes travel in memory order); any other
    becomes row-major, like ``clone()`` of it.

    Example:
        >>> import torch
        >>> dense_strides(torch.ones(2, 3).t()), dense_strides(torch.ones(4, 4)[:, :2])
        ((1, 3), None)
    """
    if tensor.is_contiguous():
        return None
    strides = tensor.stride()
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(tensor.shape, strides) if s != 1), key=lambda d: d[1]):
        if stride != expected:
            return None
        expected *= size
    return tuple(strides)



@dataclass(frozen=True, slots=True)
class PayloadMeta:
    """Everything about a payload except the tensors' data."""

    spec: pytree.TreeSpec
    is_tensor: tuple[bool, ...]  # per leaf, in flatten order
    plain_leaves: tuple[Any, ...]  # the non-tensor leaves, in order
    tensors: tuple[TensorMeta, ...]

    @property
    def data_bytes(self) -> int:
        return sum(aligned(t.num_bytes) for t in self.tensors)

    def encode(self) -> bytes:
        return pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def decode(data: bytes) -> PayloadMeta:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's pickled LeafSpec
            meta = pickle.loads(data)
        # The shared spec objects, so that unflatten_payload recognises the usual shapes by identity.
        for shared in (_LEAF_SPEC, _tuple_spec(len(meta.is_tensor))):
            if meta.spec == shared:
                return dataclasses.replace(meta, spec=shared)
        return meta


def aligned(n: int) -> int:
    """``n`` rounded up to where the next tensor of a packed payload starts."""
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def flatten_payload(value: Any) -> tuple[PayloadMeta, list[torch.Tensor]]:
    spec = _tensor_tuple_spec(value)
    if spec is not None:  # the usual gradient payload: no pytree walk
        tensors = list(value)
        metas = tuple(
            TensorMeta(t.shape, t.dtype, t.requires_grad, f"[{i}]", dense_strides(t)) for i, t in enumerate(tensors)
        )
        return PayloadMeta(spec, (True,) * len(tensors), (), metas), tensors
    leaves_with_path, spec = pytree.tree_flatten_with_path(value)
    is_tensor, plain, metas, tensors = [], [], [], []
    for path, leaf in leaves_with_path:
        if isinstance(leaf, torch.Tensor):
            is_tensor.append(True)
            metas.append(
                TensorMeta(leaf.shape, leaf.dtype, leaf.requires_grad, pytree.keystr(path), dense_strides(leaf))
            )
            tensors.append(leaf)
        else:
            is_tensor.append(False)
            plain.append(leaf)
    return PayloadMeta(spec, tuple(is_tensor), tuple(plain), tuple(metas)), tensors


_LEAF_SPEC = pytree.tree_flatten(0)[1]


def _tensor_tuple_spec(value: Any) -> pytree.TreeSpec | None:
    if type(value) is not tuple:
        return None
    for item in value:
        if not isinstance(item, torch.Tensor):
            return None
    return _tuple_spec(len(value))


@functools.cache
def _tuple_spec(length: int) -> pytree.TreeSpec:
    """One spec object per tuple length, shared by flatten_payload and quick_flatten, so that
    matching a tuple of tensors against a channel's structure is an identity check."""
    return pytree.tree_flatten(tuple(range(length)))[1]


def quick_flatten(value: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """Leaves and structure, with no paths: the cheap first look of every send."""
    if isinstance(value, torch.Tensor):
        return [value], _LEAF_SPEC
    spec = _tensor_tuple_spec(value)
    if spec is not None:
        return list(value), spec
    return pytree.tree_flatten(value)


def matches(meta: PayloadMeta, leaves: list[Any], spec: pytree.TreeSpec) -> bool:
    """Whether ``leaves``/``spec`` have exactly the structure ``meta`` describes (no allocation)."""
    if len(leaves) != len(meta.is_tensor) or (spec is not meta.spec and spec != meta.spec):
        return False
    tensor_metas, plain = iter(meta.tensors), iter(meta.plain_leaves)
    for leaf, is_tensor in zip(leaves, meta.is_tensor):
        if is_tensor:
            if not isinstance(leaf, torch.Tensor):
                return False
            want = next(tensor_metas)
            if leaf.shape != want.shape or leaf.dtype != want.dtype or leaf.requires_grad != want.requires_grad:
                return False
            if (want.strides is not None or not leaf.is_contiguous()) and dense_strides(leaf) != want.strides:
                return False
        elif isinstance(leaf, torch.Tensor) or _differs(leaf, next(plain)):
            return False
    return True


def _differs(value: Any, known: Any) -> bool:
    """Plain values compared as ``!=`` would, also for values whose ``!=`` is elementwise (numpy)."""
    if value is known:
        return False
    if type(value) is not type(known):
        return True
    try:
        result = value != known
        if isinstance(result, bool):
            return result
        shape = getattr(value, "shape", None)
        return shape != getattr(known, "shape", None) or bool(result.any())
    except Exception:  # incomparable values: send the structure again
        return True


def unflatten_payload(meta: PayloadMeta, tensors: list[torch.Tensor]) -> Any:
    # The usual payloads (one tensor, a tuple of tensors) by identity: pytree's general
    # rebuild costs 10 µs a message.
    if meta.spec is _LEAF_SPEC or meta.spec == _LEAF_SPEC:
        if len(tensors) == 1 and meta.is_tensor == (True,):
            return tensors[0]
    elif meta.spec is _tuple_spec(len(meta.is_tensor)) and not meta.plain_leaves:
        return tuple(tensors)
    tensor_iter, plain_iter = iter(tensors), iter(meta.plain_leaves)
    leaves = [next(tensor_iter) if flag else next(plain_iter) for flag in meta.is_tensor]
    return pytree.tree_unflatten(leaves, meta.spec)


def pack(tensors: list[torch.Tensor], meta: PayloadMeta, device: torch.device | None = None) -> torch.Tensor:
    """All tensors' bytes in one uint8 buffer (each part aligned), ready to send, on the tensors' device
    (a buffer made here is made on ``device`` when given, and the tensors are packed there).

    Example:
        >>> x = torch.ones(3, device="meta")  # another device than the CPU: no copy through the host
        >>> pack([x, x], flatten_payload((x, x))[0]).device
        device(type='meta')
    """
    if len(tensors) == 1 and tensors[0].numel() * tensors[0].element_size() % _ALIGN == 0:
        return as_bytes(tensors[0])
    buffer = torch.empty(meta.data_bytes, dtype=torch.uint8, device=device or tensors[0].device)
    pack_into(buffer, tensors, meta)
    return buffer


def pack_into(buffer: torch.Tensor, tensors: list[torch.Tensor], meta: PayloadMeta) -> None:
    """Copy the tensors' bytes into the start of ``buffer`` at the offsets :func:`unpack` reads."""
    offset = 0
    for tensor, tmeta in zip(tensors, meta.tensors):
        n = tmeta.num_bytes
        buffer[offset : offset + n].copy_(as_bytes(tensor))
        offset += aligned(n)


def unpack(buffer: torch.Tensor, meta: PayloadMeta) -> list[torch.Tensor]:
    """Tensors as views of ``buffer``; gradient-carrying ones become fresh leaves."""
    tensors, offset = [], 0
    for tmeta in meta.tensors:
        n = tmeta.num_bytes
        view = buffer[offset : offset + n].view(tmeta.dtype)
        view = view.view(tmeta.shape) if tmeta.strides is None else view.as_strided(tmeta.shape, tmeta.strides)
        if tmeta.requires_grad:
            view.requires_grad_(True)
        tensors.append(view)
        offset += aligned(n)
    return tensors


def data_and_trailer(tensors: list[torch.Tensor], meta: PayloadMeta, trailer: torch.Tensor) -> torch.Tensor:
    """The tensors' bytes as :func:`unpack` reads them, followed by ``trailer``: one new buffer."""
    if len(tensors) == 1 and meta.tensors[0].num_bytes == meta.data_bytes:
        return torch.cat((as_bytes(tensors[0]), trailer.to(tensors[0].device)))
    buffer = torch.empty(meta.data_bytes + trailer.numel(), dtype=torch.uint8, device=tensors[0].device)
    pack_into(buffer, tensors, meta)
    buffer[meta.data_bytes:].copy_(trailer)
    return buffer


def in_layouts(tensors: list[torch.Tensor], meta: PayloadMeta) -> list[torch.Tensor]:
    """``tensors`` laid out as ``meta`` says (a copy of each whose layout differs).

    A frozen channel (``fixed_shapes=True``) carries data only, so the receiver rebuilds
    the layout it was told first; values are the same, only their order in memory moves.
    Each copy stays on its tensor's device.
    """
    conformed = []
    for tensor, tmeta in zip(tensors, meta.tensors):
        if dense_strides(tensor) != tmeta.strides:
            tensor = tensor.detach()
            if tmeta.strides is None:
                tensor = tensor.contiguous()
            else:
                tensor = torch.empty_strided(tmeta.shape, tmeta.strides, dtype=tmeta.dtype,
                                             device=tensor.device).copy_(tensor)
        conformed.append(tensor)
    return conformed


def flat_in_layout(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements, 1-D, in the order :func:`unpack` lays them out (see :func:`dense_strides`)."""
    tensor = tensor.detach()
    # The layout is the one the tensor was described with, decided before any copy below.
    strides = dense_strides(tensor)
    if tensor._is_zerotensor():  # autograd's "all zeros" gradient: no memory behind it
        tensor = torch.zeros(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    elif tensor.is_conj() or tensor.is_neg():  # lazy views: their memory holds other values
        tensor = tensor.resolve_conj().resolve_neg()
    if strides is None:
        return tensor.contiguous().reshape(-1)  # row-major (a view with gaps included)
    if tensor.stride() != strides:  # a copy that did not keep them
        tensor = torch.empty_strided(tensor.shape, strides, dtype=tensor.dtype, device=tensor.device).copy_(tensor)
    return tensor.as_strided((tensor.numel(),), (1,))  # memory order: no copy


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes, 1-D uint8, in the order :func:`unpack` reads them."""
    flat = flat_in_layout(tensor)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def frozen_tensors(expected: PayloadMeta, value: Any, rank: int, key: TransferKey, dst: int,
                   fix: str | None = None) -> list[torch.Tensor]:
    """The tensors of ``value``, sent on a channel frozen to ``expected`` (data only), in its layouts.

    Raises SpecMismatchError naming the first tensor whose shape, dtype or place differs
    (``fix``: how to avoid it, said at the end; by default, about ``fixed_shapes``); a tensor
    laid out otherwise is copied into the frozen layout (see :func:`in_layouts`).

    Example (a transpose sent where a row-major tensor was frozen):
        >>> meta, _ = flatten_payload(torch.ones(2, 3))
        >>> [t.stride() for t in frozen_tensors(meta, torch.ones(3, 2).t(), 0, (0, 0, 0), 1)]
        [(3, 1)]
    """
    leaves, spec = quick_flatten(value)
    if matches(expected, leaves, spec):
        return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    actual, tensors = flatten_payload(value)
    direction, stage, microbatch = key
    what = "input gradient" if direction == BACKWARD else "output"
    where = f"rank {rank}, stage {stage}, microbatch {microbatch}: the {what} sent to rank {dst}"
    fix = fix or ("(fixed_shapes=True froze the structure seen in the first step; pass fixed_shapes=False "
           "to let shapes vary between microbatches and steps)")
    if expected.spec != actual.spec or expected.is_tensor != actual.is_tensor:
        raise SpecMismatchError(f"{where} has structure {actual.spec}, but the receiver was told {expected.spec} {fix}")
    for want, got in zip(expected.tensors, actual.tensors):
        if want.shape != got.shape or want.dtype != got.dtype or want.requires_grad != got.requires_grad:
            raise SpecMismatchError(
                f"{where}: tensor {got.path or '<value>'} is {got.describe()}"
                f"{' (requires grad)' if got.requires_grad else ''}, but the receiver was told "
                f"{want.describe()}{' (requires grad)' if want.requires_grad else ''} {fix}"
            )
    if expected.plain_leaves != actual.plain_leaves:
        raise SpecMismatchError(
            f"{where} carries the values {actual.plain_leaves}, but the receiver was told {expected.plain_leaves} {fix}"
        )
    return in_layouts(tensors, expected)  # only a layout differs
