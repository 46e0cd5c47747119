"""The shared-memory rings under :class:`conveyor.runtime.transport.shm.SharedMemoryTransport`: their memory
and their layout.

Layout of a ring (an anonymous ``memfd`` of the sender, opened by the receiver through
``/proc/<pid>/fd``, so nothing is ever left behind in a file system): a 4 KiB control
page (write position, read position, the sender's failure message) and a data area of
``capacity`` bytes. Positions only grow; a message never straddles the end of the area
(a WRAP record skips to its start). A message is a 64-byte header ``(kind, total
bytes, direction, stage, microbatch, structure id, structure bytes, data bytes)``, then
the pickled structure when the channel has not carried it before, then the data as
:mod:`conveyor.runtime.transport.wire` packs it. A message too large for the ring moves the
channel to a larger ring (a SWITCH record names it). The sender publishes a message by
storing the write position after the bytes: on x86-64 stores become visible in order,
which is why this transport is offered on x86-64 Linux only.

This module knows nothing of peers, stores or waits (the transport's part): only how a
ring is created, mapped, written and read, and how a payload's tensors lie in it. What the other
parts use is public here: :class:`Ring` (its control words as properties), :class:`Outgoing`,
:class:`Incoming`, the record kinds, :func:`packed_bytes`, :func:`copy_into`, :func:`tensors_of` and
:func:`full_fence`.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import struct
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy
import torch

from conveyor.runtime.transport.wire import PayloadMeta, aligned, as_bytes, unpack

_CONTROL_BYTES = 4096
# int64 word indices in the control page, each on its own cache line. _ASLEEP: the receiver
# sleeps on its doorbell (ring it); _BLOCKED: the sender has messages waiting for room;
# _MAPPED: the receiver has mapped the ring, so its data outlives the sender's process.
_WRITE, _READ, _FAILED, _FAILURE_LEN, _ASLEEP, _BLOCKED, _MAPPED = 0, 8, 16, 24, 32, 40, 48
_FAILURE_AT = 512  # byte offset of the failure message in the control page
HEADER_BYTES = 64
_HEADER_FORMAT = "<8q"  # kind, total, direction, stage, microbatch, structure id, structure bytes, data bytes
DATA, WRAP, SWITCH = 1, 2, 3  # record kinds: a message, a skip to the area's start, a move to a larger ring


def padded(n: int) -> int:
    """``n`` bytes rounded up to whole headers: where the next part of a message starts."""
    return (n + HEADER_BYTES - 1) // HEADER_BYTES * HEADER_BYTES


def packed_bytes(meta: PayloadMeta) -> int:
    """The bytes of a payload's tensors as they lie in a ring (each aligned)."""
    return _layout(meta).data_bytes


def shared_memory_supported() -> str:
    """Empty when this machine can run the transport, else why not."""
    if sys.platform != "linux" or not hasattr(os, "memfd_create"):
        return "it needs Linux (memfd_create)"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"its lock-free rings rely on x86-64's store order; this machine is {platform.machine()}"
    return ""


class _ControlWord:
    """One int64 word of a ring's control page, read and written as an attribute of the ring."""

    def __init__(self, index: int, doc: str) -> None:
        self.index, self.__doc__ = index, doc

    def __get__(self, ring: Ring, owner: type | None = None) -> int:
        return ring.words[self.index]

    def __set__(self, ring: Ring, value: int) -> None:
        ring.words[self.index] = value


class Ring:
    """One mapping of a ring: the control words and the data area as numpy and torch views."""

    def __init__(self, fd: int, capacity: int) -> None:
        self.fd = fd
        self.capacity = capacity
        self.map = mmap.mmap(fd, _CONTROL_BYTES + capacity)
        # The control page's int64 words as plain ints: the hot path reads and writes them
        # several times a message, and a memoryview item is 4x cheaper than a numpy scalar.
        # Each is one aligned 8-byte load or store, as the ordering argument needs.
        self.words = memoryview(self.map).cast("q")[: _CONTROL_BYTES // 8]
        self.bytes = numpy.frombuffer(self.map, dtype=numpy.uint8, count=capacity, offset=_CONTROL_BYTES)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8, count=capacity, offset=_CONTROL_BYTES)
        self.address = self.bytes.ctypes.data  # of the data area, for copies that bypass torch

    @classmethod
    def create(cls, name: str, capacity: int) -> Ring:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(fd, _CONTROL_BYTES + capacity)
        return cls(fd, capacity)

    @classmethod
    def open(cls, pid: int, fd: int, capacity: int) -> Ring:
        own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        ring = cls(own, capacity)
        # The mapping keeps a descriptor of its own; only a ring's creator needs its number.
        ring._close_fd()
        return ring

    # The control words. Each is one aligned 8-byte load or store, as the ordering argument needs.
    write_position = _ControlWord(_WRITE, "where the sender has written up to; storing it publishes what is before")
    read_position = _ControlWord(_READ, "where the receiver has read up to: the sender may reuse the room before")
    receiver_asleep = _ControlWord(_ASLEEP, "1 while the receiver sleeps on its doorbell: a sender that publishes "
                                            "rings it")
    sender_blocked = _ControlWord(_BLOCKED, "1 while the sender sleeps with messages waiting for room: a receiver "
                                            "that drains rings it")
    mapped = _ControlWord(_MAPPED, "1 once the receiver has mapped the ring: its data outlives the sender's process")

    def write_bytes(self, at: int, data: bytes) -> None:
        """``data`` into the data area at offset ``at`` (a message's encoded structure)."""
        self.bytes[at : at + len(data)] = numpy.frombuffer(data, numpy.uint8)

    def copy_out(self, at: int, n: int) -> numpy.ndarray:
        """A copy of ``n`` bytes of the data area at offset ``at``, owned by the caller."""
        return self.bytes[at : at + n].copy()

    def write_header(self, position: int, kind: int, total: int, *fields: int) -> None:
        """A header at ``position``; fields a record kind does not use are zero."""
        fields += (0,) * (6 - len(fields))
        struct.pack_into(_HEADER_FORMAT, self.map, _CONTROL_BYTES + position % self.capacity, kind, total, *fields)

    def read_header(self, position: int) -> tuple[int, ...]:
        return struct.unpack_from(_HEADER_FORMAT, self.map, _CONTROL_BYTES + position % self.capacity)

    def write_failure(self, message: str) -> None:
        data = message.encode()[: _CONTROL_BYTES - _FAILURE_AT]
        self.map[_FAILURE_AT : _FAILURE_AT + len(data)] = data
        self.words[_FAILURE_LEN] = len(data)
        self.words[_FAILED] = 1

    def failure(self) -> str:
        if not self.words[_FAILED]:
            return ""
        n = self.words[_FAILURE_LEN]
        return self.map[_FAILURE_AT : _FAILURE_AT + n].decode(errors="replace")

    def close(self) -> None:
        # Views must go before the map can close; a received tensor never views a ring.
        try:
            with contextlib.suppress(BufferError):
                self.words.release()
            del self.bytes, self.tensor, self.words
            with contextlib.suppress(BufferError, ValueError):
                self.map.close()
        finally:
            self._close_fd()

    def _close_fd(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        # The memfd's pages live as long as a descriptor or a mapping does: a Pipeline
        # dropped by its user must give them back. The mapping goes with its last view.
        self._close_fd()


@dataclass
class Outgoing:
    """Sender side of one ring: where the next message goes, and what waits for room."""

    ring: Ring
    write: int = 0
    generation: int = 0
    used: bool = False  # carries (or announced) something its receiver must map to read
    outbox: deque = field(default_factory=deque)  # the messages waiting for room

    def free(self) -> int:
        return self.ring.capacity - (self.write - self.ring.read_position)

    def make_room(self, n: int) -> bool:
        """Whether ``n`` bytes fit at the write position now; if so, a WRAP record first skips
        to the area's start when they would straddle its end."""
        at = self.write % self.ring.capacity
        skip = self.ring.capacity - at if at + n > self.ring.capacity else 0
        if self.free() < skip + n:
            return False
        if skip:
            self.ring.write_header(self.write, WRAP, skip)
            self.write += skip
        return True


@dataclass
class Incoming:
    """Receiver side of one ring: the sender's process, and where the next message starts."""

    ring: Ring
    pid: int
    read: int = 0

# numpy copies a small CPU tensor in far fewer interpreter steps than torch's slicing and
# copy_ (and interpreter steps are what a rank pays, cold, right after its compute).
_NUMPY_DTYPES = MappingProxyType({
    torch.float32: numpy.float32, torch.float64: numpy.float64, torch.float16: numpy.float16,
    torch.int64: numpy.int64, torch.int32: numpy.int32, torch.int16: numpy.int16, torch.int8: numpy.int8,
    torch.uint8: numpy.uint8, torch.bool: numpy.bool_, torch.complex64: numpy.complex64,
})


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where each tensor of a payload lies in its packed bytes, and how to view it."""

    numpy_ok: bool  # every dtype has a numpy twin (else wire's torch packing is used)
    data_bytes: int
    # offset, bytes, numpy dtype, shape, strides (None: row-major), requires_grad, raw_ok
    # (raw_ok: the bytes may be copied straight from the tensor's memory; not for complex
    # dtypes, whose conjugate views keep their data unconjugated; copy_into checks the
    # negative bit, which real views can carry too)
    tensors: tuple[tuple[int, int, Any, torch.Size, tuple[int, ...] | None, bool, bool], ...]


_LAYOUTS: dict[int, tuple[tuple, _Layout]] = {}


def _layout(meta: PayloadMeta) -> _Layout:
    """``meta``'s layout, cached: a channel sends the same few structures every microbatch.

    Keyed by the identity of ``meta.tensors`` (a layout depends on nothing else), which
    the entry holds, so that the id cannot be reused while it is cached.
    """
    cached = _LAYOUTS.get(id(meta.tensors))
    if cached is not None:
        return cached[1]
    entries, offset = [], 0
    for t in meta.tensors:
        n = t.num_bytes
        entries.append((offset, n, _NUMPY_DTYPES.get(t.dtype), t.shape, t.strides, t.requires_grad,
                        not t.dtype.is_complex))
        offset += aligned(n)
    layout = _Layout(all(entry[2] is not None for entry in entries), offset, tuple(entries))
    if len(_LAYOUTS) >= 256:  # shapes that change every step must not grow this without bound
        _LAYOUTS.clear()
    _LAYOUTS[id(meta.tensors)] = (meta.tensors, layout)
    return layout


def copy_into(ring: Ring, at: int, tensors: list[torch.Tensor], meta: PayloadMeta) -> None:
    """The tensors' bytes into the ring at ``at``, where :func:`tensors_of` finds them.

    A CPU tensor whose bytes lie in one dense block, in the order the receiver reads
    them, is copied with one ``memmove`` from its ``data_ptr()``: after the core has
    been idle, every call into torch costs tens of microseconds (benchmarks/README.md,
    finding 17), and the general path (detach, reshape, numpy view) makes four.
    """
    layout = _layout(meta)
    for tensor, (offset, n, _, _, strides, _, raw_ok) in zip(tensors, layout.tensors):
        if not n:
            continue
        start = at + offset
        # A tensor the sender matched against ``meta`` with strides is dense in that layout;
        # one without strides is row-major only if contiguous (a view with gaps is not). A
        # view with the negative bit (``z.conj().imag``) holds the negated values in memory.
        # Autograd's all-zeros gradient (a "zero tensor") has no memory: its data_ptr() is 0.
        if (raw_ok and tensor.is_cpu and not tensor.is_neg()
                and (strides is not None or tensor.is_contiguous()) and (address := tensor.data_ptr())):
            _memmove(ring.address + start, address, n)
        else:
            ring.tensor[start : start + n].copy_(as_bytes(tensor))


_memmove = ctypes.memmove


def tensors_of(buffer: numpy.ndarray, meta: PayloadMeta) -> list[torch.Tensor]:
    """The payload's tensors as views of ``buffer`` (a copy out of the ring, owned by them)."""
    layout = _layout(meta)
    if not layout.numpy_ok:
        return unpack(torch.from_numpy(buffer), meta)
    tensors = []
    for offset, n, dtype, shape, strides, requires_grad, _ in layout.tensors:
        array = buffer[offset : offset + n].view(dtype)
        # Shaped by numpy, not torch: one call into torch fewer (see copy_into).
        tensor = torch.from_numpy(array.reshape(shape)) if strides is None else (
            torch.from_numpy(array).as_strided(shape, strides))
        if requires_grad:
            tensor.requires_grad_(True)
        tensors.append(tensor)
    return tensors


_FENCE = threading.Lock()


def full_fence() -> None:
    """Order this thread's earlier stores before its later loads.

    x86-64 keeps stores in order and loads in order, but lets a load pass an earlier
    store; a lock's atomic read-modify-write forbids that. Both sides of a sleep/ring
    handshake store their flag or position, fence, then load the other's.
    """
    _FENCE.acquire()
    _FENCE.release()
