"""Who maps which shared-memory ring, and the doorbells: the :class:`RingHandshake` a transport holds.

Building the handshake creates this rank's doorbell (an abstract Unix datagram socket) and
one outgoing ring per peer, and publishes where they are in the process group's store; it
waits for nobody. A peer's ring towards this rank is mapped when first needed (its first
receive, or ringing its doorbell), waiting at most the pipeline's timeout for the peer to
have published it. A peer whose process is gone, or that runs in another PID namespace,
is named as such.

Example (what the transport does when it first waits for rank 0)::

    rings.connect(0, timeout_s, "stage 1's input")
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import select
import socket
from collections.abc import Callable
from typing import Any

from conveyor.errors import CommTimeout, PeerFailure
from conveyor.runtime.lifecycle.peers import process_alive
from conveyor.runtime.transport.shm_ring import Incoming, Outgoing, Ring

INITIAL_CAPACITY = 64 * 1024  # of a new ring; grows with the payloads; every touched page counts in RSS


class RingHandshake:
    """The rings and doorbells of one transport: its own, published when made; its peers', mapped when needed.

    ``outgoing`` / ``incoming``: per peer, the ring this rank writes / reads; ``pids``: per mapped
    peer, its process. ``prefix``: this transport's part of a store key. ``raise_peer_failures``: raises
    what failed peers published (the transport's failure board), which explains a ring that is gone.
    """

    def __init__(self, rank: int, peers: list[int], store: Any, prefix: str, timeout_s: float,
                 raise_peer_failures: Callable[[BaseException], None]) -> None:
        self.rank, self.peers, self.store, self.prefix = rank, peers, store, prefix
        self.timeout_s = timeout_s
        self.raise_peer_failures = raise_peer_failures
        self.outgoing: dict[int, Outgoing] = {}
        self.incoming: dict[int, Incoming] = {}
        self.doorbells: dict[int, str] = {}
        self.pids: dict[int, int] = {}
        # Ours, published at once; nobody is waited for.
        me = os.getpid()
        self.socket: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        name = f"\0conveyor-{me}-{self.prefix}-{self.rank}"
        self.socket.bind(name)
        self.socket.setblocking(False)
        rings = {}
        for peer in self.peers:
            ring = Ring.create(f"conveyor-{self.rank}-to-{peer}", INITIAL_CAPACITY)
            self.outgoing[peer] = Outgoing(ring)
            rings[str(peer)] = [ring.fd, ring.capacity]
        self.store.set(f"{self.prefix}/{self.rank}", json.dumps({"pid": me, "doorbell": name, "rings": rings}))

    def connect(self, peer: int, wait_s: float, what: str) -> bool:
        """Map ``peer``'s ring towards us; with ``wait_s`` 0, only if it has already published it."""
        key = f"{self.prefix}/{peer}"
        if wait_s <= 0:
            if not self.store.check([key]):
                return False
        else:
            try:
                self.store.wait([key], datetime.timedelta(seconds=wait_s))
            except Exception as exc:
                raise CommTimeout(
                    f"rank {self.rank} waited {self.timeout_s:g} s for {what} from rank {peer} and it never "
                    f"came; rank {peer} never built its end of this pipeline (it is slow, stuck or running "
                    "something else)"
                ) from exc
        theirs = json.loads(self.store.get(key))
        fd, capacity = theirs["rings"][str(self.rank)]
        try:
            ring = Ring.open(theirs["pid"], fd, capacity)
        except OSError as exc:
            # A peer that failed and exited before we looked took its rings with it: its own
            # message is the one that explains the step.
            self.raise_peer_failures(exc)
            if not process_alive(theirs["pid"]):
                raise self.exited(peer, theirs["pid"], what) from exc
            raise PeerFailure(
                f"rank {self.rank} cannot map the shared-memory ring of rank {peer} (pid {theirs['pid']}): "
                f"{exc}. Ranks in separate containers or PID namespaces cannot share memory this way; "
                "pass transfer=conveyor.TransferOptions(transport='process_group') to conveyor.Pipeline"
            ) from exc
        self.incoming[peer] = Incoming(ring, theirs["pid"])
        self.doorbells[peer] = theirs["doorbell"]
        self.pids[peer] = theirs["pid"]
        self.mapped(peer, ring)
        return True

    def exited(self, peer: int, pid: int, what: str) -> PeerFailure:
        """What a wait for ``what`` from ``peer`` raises once its process ``pid`` is gone."""
        return PeerFailure(f"rank {self.rank} waited for {what} from rank {peer}, but rank {peer} (pid {pid}) has "
                           "exited; look at its output")

    def mapped(self, peer: int, ring: Ring) -> None:
        """Tell ``peer`` that we mapped ``ring`` (its sender may wait for that before its process ends)."""
        ring.mapped = 1
        self.ring_doorbell(peer)

    def ring_doorbell(self, dst: int) -> None:
        """Wake ``dst`` if it sleeps on its doorbell (nothing if it has not published one yet)."""
        doorbell = self.doorbells.get(dst)
        if doorbell is None:
            if not self.connect(dst, 0, "its doorbell"):
                return  # it has not mapped our ring yet either: it drains it when it does
            doorbell = self.doorbells[dst]
        # A full doorbell already has wake-ups pending; a gone peer is noticed by its waiters.
        with contextlib.suppress(BlockingIOError, ConnectionRefusedError, FileNotFoundError):
            self.socket.sendto(b"\1", doorbell)

    def say_asleep(self, asleep: int) -> None:
        """Tell senders whether we sleep on our doorbell (for data, and for room where our messages wait)."""
        for incoming in self.incoming.values():
            incoming.ring.receiver_asleep = asleep
        for outgoing in self.outgoing.values():
            outgoing.ring.sender_blocked = asleep if outgoing.outbox else 0

    def sleep(self, timeout_s: float) -> None:
        """Sleep on our doorbell until a peer rings it or ``timeout_s`` passes; then empty it."""
        readable, _, _ = select.select([self.socket], [], [], timeout_s)
        if readable:
            with contextlib.suppress(BlockingIOError):
                while self.socket.recv(4096):
                    pass

    def write_failure(self, message: str) -> None:
        """``message`` into every ring we write, where each peer's waits look."""
        for dst, outgoing in self.outgoing.items():
            with contextlib.suppress(Exception):
                outgoing.ring.write_failure(message)
                self.ring_doorbell(dst)

    def close(self) -> None:
        """Unmap every ring and close its descriptor, and the doorbell."""
        for ring in [o.ring for o in self.outgoing.values()] + [i.ring for i in self.incoming.values()]:
            ring.close()
        self.outgoing, self.incoming = {}, {}
        if self.socket is not None:
            self.socket.close()
            self.socket = None
