"""Receiving over shared memory: the rings drained into the messages that arrived, by transfer.

A receive is posted by name only; whenever the transport is called, the :class:`Inbox` reads
every ring towards this rank up to its sender's write position: it follows a WRAP record to the
area's start and a SWITCH record to the larger ring that replaces it, decodes a structure the
channel has not carried before, and copies each message's data out of the ring, so that the
sender may reuse the room at once. A sender that sleeps until there is room is woken.

Example (what the transport's ``wait`` does once the message is there)::

    if inbox.has((0, (0, 1, 5))):
        value = inbox.take((0, (0, 1, 5)))
"""

from __future__ import annotations

from collections import deque
from typing import Any

from conveyor.errors import PeerFailure
from conveyor.runtime.transport.shm_handshake import RingHandshake
from conveyor.runtime.transport.shm_ring import (
    HEADER_BYTES,
    SWITCH,
    WRAP,
    Incoming,
    Ring,
    full_fence,
    padded,
    tensors_of,
)
from conveyor.runtime.transport.wire import PayloadMeta, TransferKey, unflatten_payload


class Inbox:
    """The receiving side of a shared-memory transport, over the incoming rings of ``rings``
    (``rank_to_global`` names a peer whose failure it relays).

    Keeps ``arrived`` (per (source rank, transfer): the messages drained, in order) and
    ``received_structures`` (per channel, in the order the sender numbered them).
    """

    def __init__(self, rings: RingHandshake, rank_to_global: list[int]) -> None:
        self.rings, self.rank_to_global = rings, rank_to_global
        self.arrived: dict[tuple[int, TransferKey], deque] = {}
        self.received_structures: dict[tuple[int, int], list[PayloadMeta]] = {}

    def seed(self, channel: tuple[int, int], meta: PayloadMeta) -> None:
        """``meta`` is the channel's structure 0, known to the sender before the first transfer."""
        if not self.received_structures.get(channel):
            self.received_structures[channel] = [meta]

    def drain(self) -> None:
        """Take in every message the rings hold; wake a sender that waits for the room this makes."""
        for src, incoming in self.rings.incoming.items():
            if incoming.ring.write_position != incoming.read:
                self._drain(src, incoming)
                full_fence()
                if incoming.ring.sender_blocked:
                    self.rings.ring_doorbell(src)

    def has(self, handle: tuple[int, TransferKey]) -> bool:
        return bool(self.arrived.get(handle))

    def take(self, handle: tuple[int, TransferKey]) -> Any:
        """The first message that arrived for ``handle`` (which :meth:`has`), as the payload sent."""
        meta, buffer = self.arrived[handle].popleft()
        return unflatten_payload(meta, tensors_of(buffer, meta) if meta.tensors else [])

    def check_failures(self) -> None:
        """Raise PeerFailure if a peer wrote its failure into its ring towards us."""
        for peer, incoming in self.rings.incoming.items():
            message = incoming.ring.failure()
            if message:
                raise PeerFailure(_relayed(peer, message, self.rank_to_global[peer]))

    def _drain(self, src: int, incoming: Incoming) -> None:
        ring = incoming.ring
        while incoming.read != ring.write_position:
            kind, total, direction, stage, microbatch, index, meta_bytes, data_bytes = ring.read_header(incoming.read)
            if kind == SWITCH:
                fd, capacity = direction, stage  # a SWITCH header's fields 2 and 3
                ring.read_position = incoming.read + total
                incoming.ring = ring = Ring.open(incoming.pid, fd, capacity)
                self.rings.mapped(src, ring)
                incoming.read = 0
                continue
            if kind != WRAP:  # a message (a WRAP record is only skipped)
                at = incoming.read % ring.capacity + HEADER_BYTES
                channel = (direction, stage)
                if meta_bytes:
                    meta = PayloadMeta.decode(ring.copy_out(at, meta_bytes).tobytes())
                    at += padded(meta_bytes)
                    if index >= 0:
                        self.received_structures.setdefault(channel, []).append(meta)
                else:
                    meta = self.received_structures[channel][index]
                buffer = ring.copy_out(at, data_bytes)
                self.arrived.setdefault((src, (direction, stage, microbatch)), deque()).append((meta, buffer))
            incoming.read += total
            ring.read_position = incoming.read


def _relayed(peer: int, message: str, global_rank: int) -> str:
    # A peer that failed because its own peer did passes the original message on.
    prefix = f"{PeerFailure.__name__}: "
    if message.startswith(prefix):
        return message[len(prefix):]
    named = f"rank {peer}" if peer == global_rank else f"rank {peer} (global rank {global_rank})"
    return f"{named} failed: {message}"
