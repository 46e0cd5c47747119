"""Ranks on one host talk through shared memory: one ring buffer per direction of each stage boundary.

Why: on CPU, a torch.distributed (gloo) message costs 0.1-0.3 ms of calls and thread
hand-offs on each side, and a pipeline pays that on every hop of its critical path.
Here a send copies the payload straight into a ring the receiver has mapped and rings
its doorbell; a waiting receiver sees the data within microseconds when it spins, or
wakes on the doorbell (an abstract Unix datagram socket) when it sleeps.

The rings themselves (their memory, the layout of a message, how a payload's tensors lie
in them) are :mod:`conveyor.runtime.shm_ring`'s; this module is the transport over them:
who maps which ring, sending, receiving, waiting and noticing failed peers.

A send never blocks: when the ring is full the message waits in the sender's outbox and
goes out on its next call into the transport. Every wait has the pipeline's timeout and
notices a failed peer within a second: through the failure message the peer writes into
its rings, through the process group's store, or because its process is gone.

Example (what :class:`conveyor.Pipeline` does when every rank is on this host)::

    transport = SharedMemoryTransport(rank, peers={0: ..., 2: ...}, store=store, ...)
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy
import torch

from conveyor.errors import CommTimeout, PeerFailure
from conveyor.runtime.shm_ring import (
    _ASLEEP,
    _BLOCKED,
    _DATA,
    _HEADER,
    _MAPPED,
    _READ,
    _SWITCH,
    _WRAP,
    _WRITE,
    _copy_into,
    _full_fence,
    _Incoming,
    _layout,
    _Outgoing,
    _padded,
    _Ring,
    _tensors_of,
    process_alive,
)

# Re-exported: the transports' chooser, the lifecycle and the tests import them from here.
from conveyor.runtime.shm_ring import host_identity as host_identity
from conveyor.runtime.shm_ring import shared_memory_supported as shared_memory_supported
from conveyor.runtime.transport import FailureBoard, Transport, receive_timeout
from conveyor.runtime.wire import (
    PayloadMeta,
    TransferKey,
    check_frozen,
    flatten_payload,
    in_layouts,
    matches,
    quick_flatten,
    unflatten_payload,
)

_INITIAL_CAPACITY = 64 * 1024  # grows with the payloads; every touched page counts in RSS
_MAX_STRUCTURES = 64  # per channel; beyond, structures travel with every message
_HEALTH_EVERY_S = 0.5


class SharedMemoryTransport(FailureBoard, Transport):
    """The executor's transport between ranks of one host (see the module docstring).

    ``peers`` are the ranks this rank exchanges anything with. Building it creates this
    rank's doorbell and outgoing rings and publishes where they are in ``store`` (the
    process group's); it waits for nobody. A peer's rings are mapped when first needed,
    waiting at most ``timeout_s`` for that peer to have published them. ``spin_s``: how
    long a receiver polls before it sleeps on its doorbell (default: 1 ms when this host has a
    core for every rank, else 50 µs). ``local_ranks``: how many of the ``num_ranks`` run on
    this host (all, unless some peers are reached another way: see :mod:`conveyor.runtime.hybrid`).
    ``rank_to_global``: this pipeline group's ranks in the default group (default: the same),
    which name failures on the store.
    """

    _instances: dict[str, int] = {}  # per process group: every rank builds its pipelines in the same order

    def __init__(
        self,
        rank: int,
        peers: set[int],
        store,
        store_prefix: str,
        num_ranks: int,
        timeout_s: float,
        fixed_shapes: bool = False,
        spin_s: float | None = None,
        local_ranks: int | None = None,
        rank_to_global: list[int] | None = None,
    ) -> None:
        self.rank = rank
        self.peers = sorted(peers)
        self.store = store
        count = self._instances.get(store_prefix, 0)
        self._instances[store_prefix] = count + 1
        self.prefix = f"conveyor/shm/{store_prefix}/{count}"
        self.num_ranks = num_ranks
        self.rank_to_global = list(range(num_ranks)) if rank_to_global is None else list(rank_to_global)
        self.timeout_s = timeout_s
        self.fixed_shapes = fixed_shapes
        # An explicit spin (argument or CONVEYOR_SHM_SPIN_US) is kept as given; the default adapts.
        self.adaptive_spin = spin_s is None and not os.environ.get("CONVEYOR_SHM_SPIN_US")
        self.spin_s = _default_spin_s(local_ranks or num_ranks) if spin_s is None else spin_s
        self.last_wait_s = 0.0  # of the last receive that had to wait
        self.outgoing: dict[int, _Outgoing] = {}
        self.incoming: dict[int, _Incoming] = {}
        self.doorbells: dict[int, str] = {}
        self.pids: dict[int, int] = {}
        self.arrived: dict[tuple[int, TransferKey], deque] = {}
        self.sent_structures: dict[tuple[int, int], list[PayloadMeta]] = {}
        self.last_structure: dict[tuple[int, int], int] = {}
        self.received_structures: dict[tuple[int, int], list[PayloadMeta]] = {}
        self.frozen: dict[tuple[int, int], PayloadMeta] = {}
        self.steps_done = 0
        self.structures_sent = 0
        self.socket: socket.socket | None = None
        self.retired: list[_Ring] = []  # outgoing rings replaced by larger ones, not yet mapped by their receiver
        self._publish()

    # --- set-up --------------------------------------------------------------------------
    def _publish(self) -> None:
        """Create our doorbell and outgoing rings and say where they are; waits for nobody."""
        me = os.getpid()
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        name = f"\0conveyor-{me}-{self.prefix}-{self.rank}"
        self.socket.bind(name)
        self.socket.setblocking(False)
        rings = {}
        for peer in self.peers:
            ring = _Ring.create(f"conveyor-{self.rank}-to-{peer}", _INITIAL_CAPACITY)
            self.outgoing[peer] = _Outgoing(ring)
            rings[str(peer)] = [ring.fd, ring.capacity]
        self.store.set(f"{self.prefix}/{self.rank}", json.dumps({"pid": me, "doorbell": name, "rings": rings}))

    def _connect(self, peer: int, wait_s: float, what: str) -> bool:
        """Map ``peer``'s ring towards us; with ``wait_s`` 0, only if it has already published it."""
        key = f"{self.prefix}/{peer}"
        if wait_s <= 0:
            if not self.store.check([key]):
                return False
        else:
            try:
                self.store.wait([key], _timedelta(wait_s))
            except Exception as exc:
                raise CommTimeout(
                    f"rank {self.rank} waited {self.timeout_s:g} s for {what} from rank {peer} and it never "
                    f"came; rank {peer} never built its end of this pipeline (it is slow, stuck or running "
                    "something else)"
                ) from exc
        theirs = json.loads(self.store.get(key))
        fd, capacity = theirs["rings"][str(self.rank)]
        try:
            ring = _Ring.open(theirs["pid"], fd, capacity)
        except OSError as exc:
            # A peer that failed and exited before we looked took its rings with it: its own
            # message is the one that explains the step.
            failures = self.peer_failures()
            if failures:
                raise PeerFailure(failures) from exc
            if not process_alive(theirs["pid"]):
                raise PeerFailure(
                    f"rank {self.rank} waited for {what} from rank {peer}, but rank {peer} (pid "
                    f"{theirs['pid']}) has exited; look at its output"
                ) from exc
            raise PeerFailure(
                f"rank {self.rank} cannot map the shared-memory ring of rank {peer} (pid {theirs['pid']}): "
                f"{exc}. Ranks in separate containers or PID namespaces cannot share memory this way; "
                "pass transfer=conveyor.TransferOptions(transport='process_group') to conveyor.Pipeline"
            ) from exc
        self.incoming[peer] = _Incoming(ring, theirs["pid"])
        self.doorbells[peer] = theirs["doorbell"]
        self.pids[peer] = theirs["pid"]
        self._mapped(peer, ring)
        return True

    def _mapped(self, peer: int, ring: _Ring) -> None:
        # Its sender may wait for this (finish_sends) before it lets its process end.
        ring.words[_MAPPED] = 1
        self._ring_doorbell(peer)

    def seed(self, channel: tuple[int, int], meta: PayloadMeta) -> None:
        """Both ends know ``meta`` as the channel's structure 0 before the first transfer."""
        for table in (self.sent_structures, self.received_structures):
            if not table.get(channel):
                table[channel] = [meta]
        self.last_structure.setdefault(channel, 0)
        if self.fixed_shapes:
            self.frozen.setdefault(channel, meta)

    # --- sending ---------------------------------------------------------------------------
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

    def _ring_doorbell(self, dst: int) -> None:
        doorbell = self.doorbells.get(dst)
        if doorbell is None:
            if not self._connect(dst, 0, "its doorbell"):
                return  # it has not mapped our ring yet either: it drains it when it does
            doorbell = self.doorbells[dst]
        # A full doorbell already has wake-ups pending; a gone peer is noticed by its waiters.
        with contextlib.suppress(BlockingIOError, ConnectionRefusedError, FileNotFoundError):
            self.socket.sendto(b"\1", doorbell)

    def _pump_all(self) -> None:
        self._close_retired()
        for dst, outgoing in self.outgoing.items():
            if outgoing.outbox:
                self._pump(dst, outgoing)

    # --- receiving -----------------------------------------------------------------------
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

    def next_spin_s(self) -> float:
        """How long the next wait polls before it sleeps."""
        if self.adaptive_spin and self.last_wait_s > self.spin_s:
            # The last receive waited longer than a spin (a peer busy for milliseconds); the
            # next likely will too: poll briefly, then leave the core to whoever computes.
            return min(self.spin_s, _SHORT_SPIN_S)
        return self.spin_s

    def _wait_loop(self, done, src: int, what: str, clock, start: float, spin_until: float) -> None:
        deadline = start + self.timeout_s
        next_health = start + _HEALTH_EVERY_S
        while True:
            self._poll()
            if done():
                return
            now = clock()
            if now < spin_until:
                continue
            if now >= next_health:
                self.check_health(src, what)
                next_health = now + _HEALTH_EVERY_S
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

    def end_step(self) -> None:
        if self.fixed_shapes:
            # Each channel is held to what it carried in the first step that used it (an
            # evaluation pass before the first training step uses other channels).
            for channel, index in self.last_structure.items():
                if index >= 0 and channel not in self.frozen:
                    self.frozen[channel] = self.sent_structures[channel][index]
        self.steps_done += 1

    # --- failures ----------------------------------------------------------------------------
    def publish_failure(self, message: str) -> None:
        """Write ``message`` where every peer's waits look: our rings, then the store."""
        for dst, outgoing in self.outgoing.items():
            with contextlib.suppress(Exception):
                outgoing.ring.write_failure(message)
                self._ring_doorbell(dst)
        super().publish_failure(message)

    def _store(self):
        return self.store

    def close(self) -> None:
        """Unmap every ring and close its descriptor and the doorbell: nothing of this transport remains.

        The rings are anonymous memfds, so once the last mapping and descriptor are gone their
        pages are too (no file system entry ever existed). Data already in a ring a peer has
        mapped stays readable to that peer.
        """
        rings = [o.ring for o in self.outgoing.values()] + [i.ring for i in self.incoming.values()]
        for ring in rings + self.retired:
            ring.close()
        self.outgoing, self.incoming, self.retired = {}, {}, []
        self.arrived.clear()
        if self.socket is not None:
            self.socket.close()
            self.socket = None


def _relayed(peer: int, message: str, global_rank: int) -> str:
    # A peer that failed because its own peer did passes the original message on.
    prefix = f"{PeerFailure.__name__}: "
    if message.startswith(prefix):
        return message[len(prefix):]
    named = f"rank {peer}" if peer == global_rank else f"rank {peer} (global rank {global_rank})"
    return f"{named} failed: {message}"


_SHORT_SPIN_S = 50e-6


def _default_spin_s(num_ranks: int) -> float:
    """How long a waiting rank polls before it sleeps on its doorbell.

    Measured on a 2-core VM, each figure an A/B in the same processes:

    - every rank has a core (P=2): polling 1 ms instead of 50 µs took tiny-stage 1F1B
      (M=64) from 58-60 to 42-46 ms a step and ZBV from 182 to 138 ms; the receiver's
      core stays awake, so a message is seen when it lands, not after a wake-up. A
      small GPT and 5 ms emulated stages did not change;
    - more ranks than cores (P=4 on 2): 1 ms was no better and slightly worse than
      50 µs, since a poller takes the core from a rank with work to do.

    After a wait longer than this, the next wait polls 50 µs only (see ``_wait_until``).

    ``CONVEYOR_SHM_SPIN_US`` overrides both.
    """
    override = os.environ.get("CONVEYOR_SHM_SPIN_US")
    if override:
        return float(override) / 1e6
    # Every process on this host counts (torchrun's LOCAL_WORLD_SIZE), not just this
    # pipeline's ranks: data-parallel replicas compete for the same cores.
    try:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE") or 0)
    except ValueError:
        local_world_size = 0
    local_processes = max(num_ranks, local_world_size)
    return 1e-3 if local_processes <= _usable_cpus() else _SHORT_SPIN_S


def _usable_cpus() -> float:
    """CPUs this process may run on: its affinity, capped by a cgroup v2 CPU quota if set."""
    try:
        cpus: float = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as limit:
            quota, period = limit.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, int(quota) / int(period))
    except (OSError, ValueError):
        pass
    return cpus


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


