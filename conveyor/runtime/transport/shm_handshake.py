"""Who maps which shared-memory ring: the handshake of :class:`conveyor.runtime.transport.shm.SharedMemoryTransport`.

Building the transport creates this rank's doorbell (an abstract Unix datagram socket) and
one outgoing ring per peer, and publishes where they are in the process group's store; it
waits for nobody. A peer's ring towards this rank is mapped when first needed (its first
receive, or ringing its doorbell), waiting at most the pipeline's timeout for the peer to
have published it. A peer whose process is gone, or that runs in another PID namespace,
is named as such.

Example (what the transport does when it first waits for rank 0)::

    transport._connect(0, transport.timeout_s, "stage 1's input")
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
from typing import Any

from conveyor.errors import CommTimeout, PeerFailure
from conveyor.runtime.lifecycle.peers import process_alive
from conveyor.runtime.transport.shm_ring import _MAPPED, _Incoming, _Outgoing, _Ring

INITIAL_CAPACITY = 64 * 1024  # of a new ring; grows with the payloads; every touched page counts in RSS


class RingHandshake:
    """The rings and doorbells of one transport: its own, published; its peers', mapped when needed.

    Owns ``outgoing`` / ``incoming`` (per peer: the ring this rank writes / reads),
    ``doorbells`` and ``pids`` (per mapped peer) and ``socket`` (this rank's doorbell).
    """

    rank: int
    peers: list[int]
    store: Any
    prefix: str
    timeout_s: float
    outgoing: dict[int, _Outgoing]
    incoming: dict[int, _Incoming]
    doorbells: dict[int, str]
    pids: dict[int, int]
    socket: socket.socket | None

    def _publish(self) -> None:
        """Create our doorbell and outgoing rings and say where they are; waits for nobody."""
        me = os.getpid()
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        name = f"\0conveyor-{me}-{self.prefix}-{self.rank}"
        self.socket.bind(name)
        self.socket.setblocking(False)
        rings = {}
        for peer in self.peers:
            ring = _Ring.create(f"conveyor-{self.rank}-to-{peer}", INITIAL_CAPACITY)
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

    def _ring_doorbell(self, dst: int) -> None:
        doorbell = self.doorbells.get(dst)
        if doorbell is None:
            if not self._connect(dst, 0, "its doorbell"):
                return  # it has not mapped our ring yet either: it drains it when it does
            doorbell = self.doorbells[dst]
        # A full doorbell already has wake-ups pending; a gone peer is noticed by its waiters.
        with contextlib.suppress(BlockingIOError, ConnectionRefusedError, FileNotFoundError):
            self.socket.sendto(b"\1", doorbell)

