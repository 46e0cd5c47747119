"""Sending over shared memory: each message into its peer's ring, or into the outbox until there is room.

A send never blocks. A message is written into the ring towards its receiver (its
structure only when the channel has not carried it before), published by storing the
ring's write position, and the receiver's doorbell is rung if it sleeps. When the ring is
full the message waits in the sender's outbox and goes out on its next call into the
transport; a message too large for the ring moves the channel to a larger one (a SWITCH
record names it), the old ring kept open until its receiver has followed.

Example (what the transport's ``post_sends`` does)::

    outbox.send(1, (0, 0, 3), output)
"""

from __future__ import annotations

from typing import Any

import torch

from conveyor.runtime.transport.shm_handshake import RingHandshake
from conveyor.runtime.transport.shm_ring import (
    DATA,
    HEADER_BYTES,
    SWITCH,
    Outgoing,
    Ring,
    copy_into,
    full_fence,
    packed_bytes,
    padded,
)
from conveyor.runtime.transport.wire import (
    PayloadMeta,
    TransferKey,
    flatten_payload,
    frozen_tensors,
    matches,
    quick_flatten,
)

_MAX_STRUCTURES = 64  # per channel; beyond, structures travel with every message


class Outbox:
    """The sending side of a shared-memory transport, over the outgoing rings of ``rings``.

    Keeps, per channel (direction, sending stage), the structures sent (``sent_structures``,
    the index of the last in ``last_structure``, ``frozen`` under fixed shapes, the first step's);
    the rings moved away from (``retired``) until their receiver has followed; and how many
    structures it encoded (``structures_sent``). The messages waiting for room sit in each
    :class:`~conveyor.runtime.transport.shm_ring.Outgoing`'s ``outbox``.
    """

    def __init__(self, rank: int, rings: RingHandshake, fixed_shapes: bool) -> None:
        self.rank, self.rings, self.fixed_shapes = rank, rings, fixed_shapes
        self.sent_structures: dict[tuple[int, int], list[PayloadMeta]] = {}
        self.last_structure: dict[tuple[int, int], int] = {}
        self.frozen: dict[tuple[int, int], PayloadMeta] = {}
        self.retired: list[Ring] = []
        self.structures_sent = 0

    def seed(self, channel: tuple[int, int], meta: PayloadMeta) -> None:
        """``meta`` is the channel's structure 0, known to the receiver before the first transfer."""
        if not self.sent_structures.get(channel):
            self.sent_structures[channel] = [meta]
        self.last_structure.setdefault(channel, 0)
        if self.fixed_shapes:
            self.frozen.setdefault(channel, meta)

    def end_step(self) -> None:
        if self.fixed_shapes:
            # Each channel is held to what it carried in the first step that used it (an
            # evaluation pass before the first training step uses other channels).
            for channel, index in self.last_structure.items():
                if index >= 0 and channel not in self.frozen:
                    self.frozen[channel] = self.sent_structures[channel][index]

    def send(self, dst: int, key: TransferKey, value: Any) -> None:
        """``value`` into the ring towards ``dst``, or into its outbox until there is room; never blocks."""
        channel = key[:2]
        structures = self.sent_structures.setdefault(channel, [])
        index = self.last_structure.get(channel)  # the frozen structure's, once there is one
        frozen = self.frozen.get(channel)
        if frozen is not None:  # data only, in the frozen layout, as the process-group transport must
            meta, encoded, tensors = frozen, b"", frozen_tensors(frozen, value, self.rank, key, dst)
        else:
            leaves, spec = quick_flatten(value)
            if index is not None and index >= 0 and matches(structures[index], leaves, spec):
                meta, encoded = structures[index], b""
                tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
            else:
                meta, tensors = flatten_payload(value)
                index, encoded = self._structure_index(structures, meta)
                self.last_structure[channel] = index
                if index >= 0:
                    meta = structures[index]  # the remembered object: its layout is cached
        outgoing = self.rings.outgoing[dst]
        outgoing.outbox.append((key, index, encoded, meta, tensors))
        self._pump(dst, outgoing)

    def _structure_index(self, structures: list[PayloadMeta], meta: PayloadMeta) -> tuple[int, bytes]:
        for index in range(len(structures) - 1, -1, -1):
            if structures[index] == meta:
                return index, b""
        self.structures_sent += 1
        if len(structures) >= _MAX_STRUCTURES:
            return -1, meta.encode()  # travels with the message, not remembered
        structures.append(meta)
        return len(structures) - 1, meta.encode()

    def _pump(self, dst: int, outgoing: Outgoing) -> None:
        sent = False
        while outgoing.outbox:
            key, index, encoded, meta, tensors = outgoing.outbox[0]
            data_bytes = packed_bytes(meta)
            total = HEADER_BYTES + padded(len(encoded)) + padded(data_bytes)
            if total + HEADER_BYTES > outgoing.ring.capacity // 2:
                if not self._grow(dst, outgoing, total):
                    break
                sent = True
                continue
            if not outgoing.make_room(total):
                break
            ring = outgoing.ring
            body = outgoing.write % ring.capacity + HEADER_BYTES
            if encoded:
                ring.write_bytes(body, encoded)
                body += padded(len(encoded))
            if tensors:
                copy_into(ring, body, tensors, meta)
            ring.write_header(outgoing.write, DATA, total, key[0], key[1], key[2], index, len(encoded), data_bytes)
            outgoing.write += total
            ring.write_position = outgoing.write  # publishes the message: stores land in order on x86-64
            outgoing.used = True
            outgoing.outbox.popleft()
            sent = True
        if sent:
            full_fence()
            if outgoing.ring.receiver_asleep:
                self.rings.ring_doorbell(dst)

    def _grow(self, dst: int, outgoing: Outgoing, message_bytes: int) -> bool:
        """Move the channel to a ring that holds ``message_bytes`` comfortably; False while the old one is full."""
        if not outgoing.make_room(HEADER_BYTES):
            return False
        capacity = max(2 * outgoing.ring.capacity, 1 << (4 * message_bytes - 1).bit_length())
        outgoing.generation += 1
        ring = Ring.create(f"conveyor-{self.rank}-to-{dst}-{outgoing.generation}", capacity)
        old = outgoing.ring
        old.write_header(outgoing.write, SWITCH, HEADER_BYTES, ring.fd, capacity)
        outgoing.write += HEADER_BYTES
        old.write_position = outgoing.write
        # The receiver finds the new ring through the old one, which it may not have mapped
        # yet (it opens a ring when it reads the SWITCH that names it, or on its first
        # receive): the old ring's descriptor must outlive that, or the receiver's open of
        # /proc/<pid>/fd/<n> finds nothing. Two growths before the receiver looked did that.
        self.retired.append(old)
        self.close_retired()
        self.rings.ring_doorbell(dst)  # it may be asleep, flagged on the old ring only
        outgoing.ring, outgoing.write, outgoing.used = ring, 0, True
        return True

    def close_retired(self) -> None:
        """Close the rings we moved away from once their receiver has mapped them."""
        if self.retired:
            mapped = [ring for ring in self.retired if ring.mapped]
            if mapped:
                self.retired = [ring for ring in self.retired if not ring.mapped]
                for ring in mapped:
                    ring.close()

    def pump(self) -> None:
        """Move waiting messages into rings that have room now."""
        self.close_retired()
        for dst, outgoing in self.rings.outgoing.items():
            if outgoing.outbox:
                self._pump(dst, outgoing)

    def waiting(self) -> bool:
        """Whether a message still waits for room."""
        return any(outgoing.outbox for outgoing in self.rings.outgoing.values())

    def delivered(self) -> bool:
        """Whether every message sits in a ring its receiver has mapped: then it outlives this process."""
        return all(not o.outbox and (not o.used or o.ring.mapped) for o in self.rings.outgoing.values())

    def close(self) -> None:
        for ring in self.retired:
            ring.close()
        self.retired = []
