"""Ranks on one host talk through shared memory: one ring buffer per direction of each stage boundary.

Why: on CPU, a torch.distributed (gloo) message costs 0.1-0.3 ms of calls and thread
hand-offs on each side, and a pipeline pays that on every hop of its critical path.
Here a send copies the payload straight into a ring the receiver has mapped and rings
its doorbell; a waiting receiver sees the data within microseconds when it spins, or
wakes on the doorbell (an abstract Unix datagram socket) when it sleeps.

The transport is cut by concern, a module each:

- :mod:`conveyor.runtime.transport.shm_ring`: the rings themselves (their memory, the layout of a
  message, how a payload's tensors lie in them);
- :mod:`conveyor.runtime.transport.shm_handshake`: who maps which ring, and the doorbells;
- :mod:`conveyor.runtime.transport.shm_outbox`: sending (a send never blocks: a message that finds
  its ring full waits in the outbox for the next call into the transport), growing rings;
- :mod:`conveyor.runtime.transport.shm_wait`: receiving and waiting (spin, then sleep on the
  doorbell; a failed peer is noticed within a second);
- this module: the transport they make, what it remembers per channel, its spin policy,
  failure messages and closing.

Example (what :class:`conveyor.Pipeline` does when every rank is on this host)::

    transport = SharedMemoryTransport(rank, peers={0: ..., 2: ...}, store=store, ...)
"""

from __future__ import annotations

import contextlib
import os
from collections import deque

from conveyor.runtime.transport.shm_handshake import RingHandshake
from conveyor.runtime.transport.shm_outbox import Outbox
from conveyor.runtime.transport.shm_ring import _Incoming, _Outgoing, _Ring

# Re-exported: the transports' chooser imports it from here.
from conveyor.runtime.transport.shm_ring import shared_memory_supported as shared_memory_supported
from conveyor.runtime.transport.shm_wait import Waiting
from conveyor.runtime.transport.transport import FailureBoard, Transport
from conveyor.runtime.transport.wire import PayloadMeta, TransferKey


class SharedMemoryTransport(RingHandshake, Outbox, Waiting, FailureBoard, Transport):
    """The executor's transport between ranks of one host (see the module docstring).

    ``peers`` are the ranks this rank exchanges anything with. Building it creates this
    rank's doorbell and outgoing rings and publishes where they are in ``store`` (the
    process group's); it waits for nobody. A peer's rings are mapped when first needed,
    waiting at most ``timeout_s`` for that peer to have published them. ``spin_s``: how
    long a receiver polls before it sleeps on its doorbell (default: 1 ms when this host has a
    core for every rank, else 50 µs). ``local_ranks``: how many of the ``num_ranks`` run on
    this host (all, unless some peers are reached another way: see :mod:`conveyor.runtime.transport.hybrid`).
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
        self.socket = None  # the doorbell, made by _publish
        self.retired: list[_Ring] = []  # outgoing rings replaced by larger ones, not yet mapped by their receiver
        self._publish()

    def seed(self, channel: tuple[int, int], meta: PayloadMeta) -> None:
        """Both ends know ``meta`` as the channel's structure 0 before the first transfer."""
        for table in (self.sent_structures, self.received_structures):
            if not table.get(channel):
                table[channel] = [meta]
        self.last_structure.setdefault(channel, 0)
        if self.fixed_shapes:
            self.frozen.setdefault(channel, meta)

    def next_spin_s(self) -> float:
        """How long the next wait polls before it sleeps."""
        if self.adaptive_spin and self.last_wait_s > self.spin_s:
            # The last receive waited longer than a spin (a peer busy for milliseconds); the
            # next likely will too: poll briefly, then leave the core to whoever computes.
            return min(self.spin_s, _SHORT_SPIN_S)
        return self.spin_s

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

