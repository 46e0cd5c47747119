"""The shared-memory rings under :class:`conveyor.runtime.transport.shm.SharedMemoryTransport`: their memory,
their layout, and who may map them.

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
ring is created, mapped, written and read, and how a payload's tensors lie in it.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import socket
import struct
import sys
import threading
from collections import deque
from dataclasses import dataclass
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
_HEADER = 64
_HEADER_FORMAT = "<8q"  # kind, total, direction, stage, microbatch, structure id, structure bytes, data bytes
_DATA, _WRAP, _SWITCH = 1, 2, 3


def _padded(n: int) -> int:
    return (n + _HEADER - 1) // _HEADER * _HEADER


def shared_memory_supported() -> str:
    """Empty when this machine can run the transport, else why not."""
    if sys.platform != "linux" or not hasattr(os, "memfd_create"):
        return "it needs Linux (memfd_create)"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"its lock-free rings rely on x86-64's store order; this machine is {platform.machine()}"
    return ""


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` (on this host) still runs; an unreaped zombie has exited."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    # A process that exited but that its parent has not reaped yet (a launcher waiting on its
    # children one by one) still answers signal 0: read its state.
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


def host_identity() -> str:
    """Which processes can share rings with this one: same kernel boot, user and namespaces.

    Rings are mapped through ``/proc/<pid>/fd`` (same PID namespace, same user) and
    doorbells are abstract Unix sockets (same network namespace); the hostname is there
    for people reading it. ``CONVEYOR_HOST_ID`` replaces it (a launcher that knows
    better; tests that play several hosts on one machine).

    Example:
        >>> host_identity() == host_identity()
        True
    """
    override = os.environ.get("CONVEYOR_HOST_ID")
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
    except OSError:  # not Linux: the transport is not offered there anyway
        boot_id = "?"
    namespaces = []
    for kind in ("pid", "net"):
        try:
            namespaces.append(str(os.stat(f"/proc/self/ns/{kind}").st_ino))
        except OSError:
            namespaces.append("?")
    return f"{socket.gethostname()}/{boot_id}/uid{os.getuid()}/{'/'.join(namespaces)}"


class _Ring:
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
    def create(cls, name: str, capacity: int) -> _Ring:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(fd, _CONTROL_BYTES + capacity)
        return cls(fd, capacity)

    @classmethod
    def open(cls, pid: int, fd: int, capacity: int) -> _Ring:
        own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        ring = cls(own, capacity)
        # The mapping keeps a descriptor of its own; only a ring's creator needs its number.
        ring._close_fd()
        return ring

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
class _Outgoing:
    """Sender side of one ring: where the next message goes, and what waits for room."""

    ring: _Ring
    write: int = 0
    generation: int = 0
    used: bool = False  # carries (or announced) something its receiver must map to read

    def __post_init__(self) -> None:
        self.outbox: deque = deque()

    def free(self) -> int:
        return self.ring.capacity - (self.write - self.ring.words[_READ])


@dataclass
class _Incoming:
    ring: _Ring
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
    # dtypes, whose conjugate views keep their data unconjugated; _copy_into checks the
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


def _copy_into(ring: _Ring, at: int, tensors: list[torch.Tensor], meta: PayloadMeta) -> None:
    """The tensors' bytes into the ring at ``at``, where :func:`_tensors_of` finds them.

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


def _tensors_of(buffer: numpy.ndarray, meta: PayloadMeta) -> list[torch.Tensor]:
    """The payload's tensors as views of ``buffer`` (a copy out of the ring, owned by them)."""
    layout = _layout(meta)
    if not layout.numpy_ok:
        return unpack(torch.from_numpy(buffer), meta)
    tensors = []
    for offset, n, dtype, shape, strides, requires_grad, _ in layout.tensors:
        array = buffer[offset : offset + n].view(dtype)
        # Shaped by numpy, not torch: one call into torch fewer (see _copy_into).
        tensor = torch.from_numpy(array.reshape(shape)) if strides is None else (
            torch.from_numpy(array).as_strided(shape, strides))
        if requires_grad:
            tensor.requires_grad_(True)
        tensors.append(tensor)
    return tensors


_FENCE = threading.Lock()


def _full_fence() -> None:
    """Order this thread's earlier stores before its later loads.

    x86-64 keeps stores in order and loads in order, but lets a load pass an earlier
    store; a lock's atomic read-modify-write forbids that. Both sides of a sleep/ring
    handshake store their flag or position, fence, then load the other's.
    """
    _FENCE.acquire()
    _FENCE.release()
