"""Receiving over shared memory: draining the rings, and waiting for a message without burning a core.

A receive is posted by name only; the rings are drained into ``arrived`` whenever the
transport is called. A wait polls (spins) for a short while, then says it sleeps (a flag
in each ring it reads) and sleeps on its doorbell until a sender rings it. Every wait has
the pipeline's timeout and notices a failed peer within :data:`HEALTH_EVERY_S`: through
the failure message the peer writes into its rings, through the store, or because its
process is gone.

Example (what the executor's RECV does)::

    value = transport.wait(handle, "stage 2's input, microbatch 5")
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from conveyor.errors import PeerFailure
from conveyor.runtime.lifecycle.peers import process_alive
from conveyor.runtime.transport.shm_ring import (
    _ASLEEP,
    _BLOCKED,
    _HEADER,
    _READ,
    _SWITCH,
    _WRAP,
    _WRITE,
    _full_fence,
    _Incoming,
    _Outgoing,
    _padded,
    _Ring,
    _tensors_of,
)
from conveyor.runtime.transport.transport import receive_timeout
from conveyor.runtime.transport.wire import PayloadMeta, TransferKey, unflatten_payload

HEALTH_EVERY_S = 0.5  # how often a waiting rank looks whether its peers failed


class Waiting:
    """The receiving side of a shared-memory transport, and every wait it makes.

    Owns ``arrived`` (per (source rank, transfer): the messages drained, in order),
    ``received_structures`` (per channel) and ``last_wait_s`` (how long the last receive
    that had to wait waited; the spin policy reads it).
    """

    rank: int
    timeout_s: float
    rank_to_global: list[int]
    socket: socket.socket | None
    incoming: dict[int, _Incoming]
    outgoing: dict[int, _Outgoing]
    pids: dict[int, int]
    arrived: dict[tuple[int, TransferKey], deque]
    received_structures: dict[tuple[int, int], list[PayloadMeta]]
    last_wait_s: float

    def post_recvs(self, src: int, keys: Sequence[TransferKey]) -> list[tuple[int, TransferKey]]:
        return [(src, key) for key in keys]

    def _drain(self, src: int, incoming: _Incoming) -> None:
        ring = incoming.ring
        while True:
            if incoming.read == ring.words[_WRITE]:
                return
            kind, total, direction, stage, microbatch, index, meta_bytes, data_bytes = ring.read_header(incoming.read)
            if kind == _WRAP:
                incoming.read += total
                ring.words[_READ] = incoming.read
                continue
            if kind == _SWITCH:
                fd, capacity = direction, stage  # a SWITCH header's fields 2 and 3
                ring.words[_READ] = incoming.read + total
                incoming.ring = ring = _Ring.open(incoming.pid, fd, capacity)
                self._mapped(src, ring)
                incoming.read = 0
                continue
            at = incoming.read % ring.capacity + _HEADER
            channel = (direction, stage)
            if meta_bytes:
                meta = PayloadMeta.decode(ring.bytes[at : at + meta_bytes].tobytes())
                at += _padded(meta_bytes)
                if index >= 0:
                    self.received_structures.setdefault(channel, []).append(meta)
            else:
                meta = self.received_structures[channel][index]
            buffer = ring.bytes[at : at + data_bytes].copy()
            incoming.read += total
            ring.words[_READ] = incoming.read
            self.arrived.setdefault((src, (direction, stage, microbatch)), deque()).append((meta, buffer))

    def _poll(self) -> None:
        for src, incoming in self.incoming.items():
            if incoming.ring.words[_WRITE] != incoming.read:
                self._drain(src, incoming)
                _full_fence()
                if incoming.ring.words[_BLOCKED]:
                    self._ring_doorbell(src)  # we made room for a sender that sleeps until there is
        self._pump_all()

    def _flag_sleep(self, value: int) -> None:
        """Tell senders whether we sleep on our doorbell (for data, and for room if we have an outbox)."""
        for incoming in self.incoming.values():
            incoming.ring.words[_ASLEEP] = value
        for outgoing in self.outgoing.values():
            outgoing.ring.words[_BLOCKED] = value if outgoing.outbox else 0

    def ready(self, handle) -> bool:
        self._poll()
        return bool(self.arrived.get(handle))

    def progress(self) -> bool:
        """Move queued sends along and take in what arrived; True while a send still waits for room."""
        self._poll()
        return any(outgoing.outbox for outgoing in self.outgoing.values())

    def wait(self, handle, what: str) -> Any:
        src, key = handle
        if src not in self.incoming:
            self._connect(src, self.timeout_s, what)
        queue = self.arrived.get(handle)
        if not queue:
            self._poll()
            queue = self.arrived.get(handle)
        if not queue:
            self._wait_until(lambda: bool(self.arrived.get(handle)), src, what)
            queue = self.arrived[handle]
        else:
            # It was in the ring already: no wait, however long the copy out took (a preempted
            # copy must not make the next wait poll briefly).
            self.last_wait_s = 0.0
        meta, buffer = queue.popleft()
        return unflatten_payload(meta, _tensors_of(buffer, meta) if meta.tensors else [])

    def _wait_until(self, done, src: int, what: str, *, receive: bool = True) -> None:
        clock = time.perf_counter
        start = clock()
        try:
            self._wait_loop(done, src, what, clock, start, start + self.next_spin_s())
        finally:
            if receive:
                self.last_wait_s = clock() - start

    def _wait_loop(self, done, src: int, what: str, clock, start: float, spin_until: float) -> None:
        deadline = start + self.timeout_s
        next_health = start + HEALTH_EVERY_S
        while True:
            self._poll()
            if done():
                return
            now = clock()
            if now < spin_until:
                continue
            if now >= next_health:
                self.check_health(src, what)
                next_health = now + HEALTH_EVERY_S
            if now >= deadline:
                raise receive_timeout(self.rank, self.timeout_s, what, src)
            # Say we sleep, then look once more: a sender that published before seeing the
            # flag is found by this look, one that publishes after sees the flag and rings.
            self._flag_sleep(1)
            _full_fence()
            self._poll()
            if done():
                self._flag_sleep(0)
                return
            readable, _, _ = select.select([self.socket], [], [], min(next_health, deadline) - now)
            self._flag_sleep(0)
            if readable:
                with contextlib.suppress(BlockingIOError):
                    while self.socket.recv(4096):
                        pass

    def check_health(self, src: int, what: str) -> None:
        """Raise PeerFailure if a peer has failed (its rings, the store) or, for ``src``, exited."""
        for peer, incoming in self.incoming.items():
            message = incoming.ring.failure()
            if message:
                raise PeerFailure(_relayed(peer, message, self.rank_to_global[peer]))
        failures = self.peer_failures()
        if failures:
            raise PeerFailure(failures)
        pid = self.pids.get(src)
        if pid is not None and not process_alive(pid):
            raise PeerFailure(
                f"rank {self.rank} waited for {what} from rank {src}, but rank {src} (pid {pid}) has "
                "exited; look at its output"
            )


def _relayed(peer: int, message: str, global_rank: int) -> str:
    # A peer that failed because its own peer did passes the original message on.
    prefix = f"{PeerFailure.__name__}: "
    if message.startswith(prefix):
        return message[len(prefix):]
    named = f"rank {peer}" if peer == global_rank else f"rank {peer} (global rank {global_rank})"
    return f"{named} failed: {message}"
