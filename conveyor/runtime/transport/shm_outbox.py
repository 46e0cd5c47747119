"""Sending over shared memory: each message into its peer's ring, or into the outbox until there is room.

A send never blocks. A message is written into the ring towards its receiver (its
structure only when the channel has not carried it before), published by storing the
ring's write position, and the receiver's doorbell is rung if it sleeps. When the ring is
full the message waits in the sender's outbox and goes out on its next call into the
transport; a message too large for the ring moves the channel to a larger one (a SWITCH
record names it), the old ring kept open until its receiver has followed.

Example (what the executor's posts do)::

    transport.post_sends(1, [(0, 0, 3)], [output])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy
import torch

from conveyor.runtime.transport.shm_ring import (
    _ASLEEP,
    _DATA,
    _HEADER,
    _MAPPED,
    _SWITCH,
    _WRAP,
    _WRITE,
    _copy_into,
    _full_fence,
    _layout,
    _Outgoing,
    _padded,
    _Ring,
)
from conveyor.runtime.transport.wire import (
    PayloadMeta,
    TransferKey,
    check_frozen,
    flatten_payload,
    in_layouts,
    matches,
    quick_flatten,
)

_MAX_STRUCTURES = 64  # per channel; beyond, structures travel with every message


class Outbox:
    """The sending side of a shared-memory transport.

    Owns, per channel (direction, sending stage), the structures sent (``sent_structures``,
    the index of the last in ``last_structure``, ``frozen`` under fixed shapes) and the rings
    moved away from (``retired``); per peer, the outgoing ring's outbox.
    """

    rank: int
    fixed_shapes: bool
    structures_sent: int
    outgoing: dict[int, _Outgoing]
    sent_structures: dict[tuple[int, int], list[PayloadMeta]]
    last_structure: dict[tuple[int, int], int]
    frozen: dict[tuple[int, int], PayloadMeta]
    retired: list[_Ring]

    def post_sends(self, dst: int, keys: Sequence[TransferKey], values: Sequence[Any]) -> None:
        for key, value in zip(keys, values):
            self._send(dst, key, value)

    def _send(self, dst: int, key: TransferKey, value: Any) -> None:
        channel = key[:2]
        structures = self.sent_structures.setdefault(channel, [])
        leaves, spec = quick_flatten(value)
        index = self.last_structure.get(channel)
        expected = self.frozen.get(channel) if self.fixed_shapes else None
        if expected is None and index is not None and index >= 0:
            expected = structures[index]
        if expected is not None and matches(expected, leaves, spec):
            meta, encoded = expected, b""
            tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        else:
            meta, tensors = flatten_payload(value)
            if self.fixed_shapes and channel in self.frozen:
                check_frozen(self.frozen[channel], meta, self.rank, key, dst)
                # Only a layout differs: keep the frozen one, as the process-group transport must.
                meta, tensors = self.frozen[channel], in_layouts(tensors, self.frozen[channel])
            index, encoded = self._structure_index(channel, structures, meta)
            self.last_structure[channel] = index
            if index >= 0:
                meta = structures[index]  # the remembered object: its layout is cached
        outgoing = self.outgoing[dst]
        outgoing.outbox.append((key, index, encoded, meta, tensors))
        self._pump(dst, outgoing)

    def _structure_index(self, channel, structures: list[PayloadMeta], meta: PayloadMeta) -> tuple[int, bytes]:
        for index in range(len(structures) - 1, -1, -1):
            if structures[index] == meta:
                return index, b""
        self.structures_sent += 1
        if len(structures) >= _MAX_STRUCTURES:
            return -1, meta.encode()  # travels with the message, not remembered
        structures.append(meta)
        return len(structures) - 1, meta.encode()

    def _pump(self, dst: int, outgoing: _Outgoing) -> None:
        sent = False
        while outgoing.outbox:
            key, index, encoded, meta, tensors = outgoing.outbox[0]
            data_bytes = _layout(meta).data_bytes
            total = _HEADER + _padded(len(encoded)) + _padded(data_bytes)
            if total + _HEADER > outgoing.ring.capacity // 2:
                if not self._grow(dst, outgoing, total):
                    break
                sent = True
                continue
            at = outgoing.write % outgoing.ring.capacity
            skip = outgoing.ring.capacity - at if at + total > outgoing.ring.capacity else 0
            if outgoing.free() < skip + total:
                break
            ring = outgoing.ring
            if skip:
                ring.write_header(outgoing.write, _WRAP, skip)
                outgoing.write += skip
                at = 0
            body = at + _HEADER
            if encoded:
                ring.bytes[body : body + len(encoded)] = numpy.frombuffer(encoded, numpy.uint8)
                body += _padded(len(encoded))
            if tensors:
                _copy_into(ring, body, tensors, meta)
            ring.write_header(outgoing.write, _DATA, total, key[0], key[1], key[2], index, len(encoded), data_bytes)
            outgoing.write += total
            ring.words[_WRITE] = outgoing.write  # publishes the message: stores land in order on x86-64
            outgoing.used = True
            outgoing.outbox.popleft()
            sent = True
        if sent:
            _full_fence()
            if outgoing.ring.words[_ASLEEP]:
                self._ring_doorbell(dst)

    def _grow(self, dst: int, outgoing: _Outgoing, message_bytes: int) -> bool:
        """Move the channel to a ring that holds ``message_bytes`` comfortably; False while the old one is full."""
        at = outgoing.write % outgoing.ring.capacity
        skip = outgoing.ring.capacity - at if at + _HEADER > outgoing.ring.capacity else 0
        if outgoing.free() < skip + _HEADER:
            return False
        capacity = max(2 * outgoing.ring.capacity, 1 << (4 * message_bytes - 1).bit_length())
        outgoing.generation += 1
        ring = _Ring.create(f"conveyor-{self.rank}-to-{dst}-{outgoing.generation}", capacity)
        old = outgoing.ring
        if skip:
            old.write_header(outgoing.write, _WRAP, skip)
            outgoing.write += skip
        old.write_header(outgoing.write, _SWITCH, _HEADER, ring.fd, capacity)
        outgoing.write += _HEADER
        old.words[_WRITE] = outgoing.write
        # The receiver finds the new ring through the old one, which it may not have mapped
        # yet (it opens a ring when it reads the SWITCH that names it, or on its first
        # receive): the old ring's descriptor must outlive that, or the receiver's open of
        # /proc/<pid>/fd/<n> finds nothing. Two growths before the receiver looked did that.
        self.retired.append(old)
        self._close_retired()
        self._ring_doorbell(dst)  # it may be asleep, flagged on the old ring only
        outgoing.ring, outgoing.write, outgoing.used = ring, 0, True
        return True

    def _close_retired(self) -> None:
        """Close the rings we moved away from once their receiver has mapped them."""
        if self.retired:
            mapped = [ring for ring in self.retired if ring.words[_MAPPED]]
            if mapped:
                self.retired = [ring for ring in self.retired if not ring.words[_MAPPED]]
                for ring in mapped:
                    ring.close()

    def _pump_all(self) -> None:
        self._close_retired()
        for dst, outgoing in self.outgoing.items():
            if outgoing.outbox:
                self._pump(dst, outgoing)

    def finish_sends(self) -> None:
        """Return once every message of this step sits in a ring its receiver has mapped.

        Then the data outlives this process: a rank whose last act is a send (an
        evaluation forward, say) may exit right after its step.
        """
        if not self._sends_delivered():
            self._wait_until(self._sends_delivered, self.rank,
                             "its peers to take this step's messages (room in their rings, or their mapping them)",
                             receive=False)
        self._close_retired()  # every ring before a mapped one has been mapped

    def _sends_delivered(self) -> bool:
        return all(not o.outbox and (not o.used or o.ring.words[_MAPPED]) for o in self.outgoing.values())
