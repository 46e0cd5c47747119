"""Ranks on one host talk through shared memory: one ring buffer per direction of each stage boundary.

Why: on CPU, a torch.distributed (gloo) message costs 0.1-0.3 ms of calls and thread
hand-offs on each side, and a pipeline pays that on every hop of its critical path.
Here a send copies the payload straight into a ring the receiver has mapped and rings
its doorbell; a waiting receiver sees the data within microseconds when it spins, or
wakes on the doorbell (an abstract Unix datagram socket) when it sleeps.

The transport is composed of parts it holds, one module each, each with a small public interface:

- :mod:`conveyor.runtime.transport.shm_ring`: the rings themselves (their memory, the layout of a
  message, how a payload's tensors lie in them);
- :class:`~conveyor.runtime.transport.shm_handshake.RingHandshake` (``rings``): who maps which
  ring, and the doorbells;
- :class:`~conveyor.runtime.transport.shm_outbox.Outbox` (``outbox``): sending (a send never
  blocks: a message that finds its ring full waits in the outbox for the next call into the
  transport), growing rings;
- :class:`~conveyor.runtime.transport.shm_inbox.Inbox` (``inbox``): receiving (the rings drained
  into the messages that arrived);
- :class:`~conveyor.runtime.transport.shm_wait.Waiter` (``waiter``): every wait (spin, then sleep
  on the doorbell; a failed peer is noticed within a second);
- this module: the transport they make (the contract of
  :class:`~conveyor.runtime.transport.transport.Transport`), failure messages and closing.

Example (what :class:`conveyor.Pipeline` does when every rank is on this host)::

    transport = SharedMemoryTransport(rank, peers={0: ..., 2: ...}, store=store, ...)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from conveyor.runtime.lifecycle.peers import process_alive
from conveyor.runtime.transport.shm_handshake import RingHandshake
from conveyor.runtime.transport.shm_inbox import Inbox
from conveyor.runtime.transport.shm_outbox import Outbox

# Re-exported: the transports' chooser imports it from here.
from conveyor.runtime.transport.shm_ring import shared_memory_supported as shared_memory_supported
from conveyor.runtime.transport.shm_wait import Waiter
from conveyor.runtime.transport.transport import FailureBoard, Transport
from conveyor.runtime.transport.wire import PayloadMeta, TransferKey


class SharedMemoryTransport(FailureBoard, Transport):
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
        self.store = store
        count = self._instances.get(store_prefix, 0)
        self._instances[store_prefix] = count + 1
        self.rank_to_global = list(range(num_ranks)) if rank_to_global is None else list(rank_to_global)
        self.timeout_s = timeout_s
        self.rings = RingHandshake(rank, sorted(peers), store, f"conveyor/shm/{store_prefix}/{count}", timeout_s,
                                   self.raise_peer_failures)
        self.outbox = Outbox(rank, self.rings, fixed_shapes)
        self.inbox = Inbox(self.rings, self.rank_to_global)
        self.waiter = Waiter(rank, self.rings, timeout_s, spin_s, local_ranks or num_ranks, self._poll,
                             self.check_health)

    @property
    def structures_sent(self) -> int:
        """How many payload structures this transport encoded (each travels once per channel)."""
        return self.outbox.structures_sent

    def seed(self, channel: tuple[int, int], meta: PayloadMeta) -> None:
        """Both ends know ``meta`` as the channel's structure 0 before the first transfer."""
        self.outbox.seed(channel, meta)
        self.inbox.seed(channel, meta)

    def end_step(self) -> None:
        self.outbox.end_step()

    def post_sends(self, dst: int, keys: Sequence[TransferKey], values: Sequence[Any]) -> None:
        for key, value in zip(keys, values):
            self.outbox.send(dst, key, value)

    def post_recvs(self, src: int, keys: Sequence[TransferKey]) -> list[tuple[int, TransferKey]]:
        return [(src, key) for key in keys]

    def _poll(self) -> None:
        self.inbox.drain()
        self.outbox.pump()

    def ready(self, handle) -> bool:
        self._poll()
        return self.inbox.has(handle)

    def progress(self) -> bool:
        """Move queued sends along and take in what arrived; True while a send still waits for room."""
        self._poll()
        return self.outbox.waiting()

    def wait(self, handle, what: str) -> Any:
        src, _ = handle
        if src not in self.rings.incoming:
            self.rings.connect(src, self.timeout_s, what)
        if not self.inbox.has(handle):
            self._poll()
        if not self.inbox.has(handle):
            self.waiter.wait_until(lambda: self.inbox.has(handle), src, what)
        else:
            # It was in the ring already: no wait, however long the copy out took (a preempted
            # copy must not make the next wait poll briefly).
            self.waiter.last_wait_s = 0.0
        return self.inbox.take(handle)

    def finish_sends(self) -> None:
        """Return once every message of this step sits in a ring its receiver has mapped.

        Then the data outlives this process: a rank whose last act is a send (an
        evaluation forward, say) may exit right after its step.
        """
        if not self.outbox.delivered():
            self.waiter.wait_until(self.outbox.delivered, self.rank, "its peers to take this step's messages "
                                   "(room in their rings, or their mapping them)", receive=False)
        self.outbox.close_retired()  # every ring before a mapped one has been mapped

    # --- failures ----------------------------------------------------------------------------
    def check_health(self, src: int, what: str) -> None:
        """Raise PeerFailure if a peer has failed (its rings, the store) or, for ``src``, exited."""
        self.inbox.check_failures()
        self.raise_peer_failures()
        pid = self.rings.pids.get(src)
        if pid is not None and not process_alive(pid):
            raise self.rings.exited(src, pid, what)

    def publish_failure(self, message: str) -> None:
        """Write ``message`` where every peer's waits look: our rings, then the store."""
        self.rings.write_failure(message)
        super().publish_failure(message)

    def _store(self):
        return self.store

    def close(self) -> None:
        """Unmap every ring and close its descriptor and the doorbell: nothing of this transport remains.

        The rings are anonymous memfds, so once the last mapping and descriptor are gone their
        pages are too (no file system entry ever existed). Data already in a ring a peer has
        mapped stays readable to that peer.
        """
        self.outbox.close()
        self.rings.close()
        self.inbox.arrived.clear()
