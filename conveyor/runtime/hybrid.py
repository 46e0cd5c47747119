"""Shared memory to the peers on this host, the process group to peers on other hosts.

A job on several hosts has both kinds of stage boundary: ranks of one host can hand
each other payloads through shared-memory rings (microseconds a hop), ranks of
different hosts must go through torch.distributed (gloo). :class:`HybridTransport`
routes each peer to the one that can reach it, so a multi-host pipeline pays the
network only where it crosses hosts.

The one subtlety is progress. A shared-memory send that finds its ring full waits in
the sender's outbox and moves on the sender's next call into that transport. A rank
blocked in a gloo wait makes no such call, so while it has an outbox it polls the gloo
receive instead of blocking on it, moving its shared-memory sends along in between.

Example (what :class:`conveyor.Pipeline` builds when ranks 0-1 share a host and 2-3 share another)::

    transport = HybridTransport(SharedMemoryTransport(1, {0}, ...), DistTransport(...), local_peers={0})
"""

from __future__ import annotations

import time
from typing import Any

from conveyor.errors import PeerFailure
from conveyor.runtime.shm import SharedMemoryTransport
from conveyor.runtime.transport import DistTransport, TransferKey, Transport, receive_timeout
from conveyor.runtime.wire import PayloadMeta

_HEALTH_EVERY_S = 0.5
_POLL_SLEEP_S = 20e-6


def hosts_by_rank(identities: list[str]) -> list[int]:
    """Number the distinct hosts in order of first appearance: ``["b", "a", "b"] -> [0, 1, 0]``.

    Example:
        >>> hosts_by_rank(["node7/ns1", "node7/ns1", "node9/ns1"])
        [0, 0, 1]
    """
    numbers: dict[str, int] = {}
    return [numbers.setdefault(identity, len(numbers)) for identity in identities]


class HybridTransport(Transport):
    """The executor's transport when some of this rank's peers share its host and some do not.

    ``local`` reaches ``local_peers`` (built with exactly those as its peers); ``remote``
    reaches every other rank. Both see the same seeds and FIFO channels, so a channel
    behaves alike whichever carries it.
    """

    def __init__(self, local: SharedMemoryTransport, remote: DistTransport, local_peers: set[int]) -> None:
        self.rank = local.rank
        self.local = local
        self.remote = remote
        self.local_peers = frozenset(local_peers)
        self.timeout_s = remote.timeout_s
        self.polled_waits = 0  # process-group waits that had to keep shared-memory sends moving

    # The executor and Pipeline set and read these on whatever transport they hold.
    @property
    def fifo_channels(self) -> set:
        return self.remote.fifo_channels

    @fifo_channels.setter
    def fifo_channels(self, channels: set) -> None:
        self.local.fifo_channels = channels
        self.remote.fifo_channels = channels

    @property
    def structures_sent(self) -> int:
        return self.local.structures_sent + self.remote.structures_sent

    def _side(self, peer: int) -> Transport:
        return self.local if peer in self.local_peers else self.remote

    def seed(self, channel: tuple[int, int], meta: PayloadMeta) -> None:
        self.local.seed(channel, meta)
        self.remote.seed(channel, meta)

    def send(self, dst: int, key: TransferKey, value: Any) -> None:
        self._side(dst).send(dst, key, value)

    def post_recv(self, src: int, key: TransferKey):
        side = self._side(src)
        return side, src, side.post_recv(src, key)

    def ready(self, handle) -> bool:
        side, _, inner = handle
        if side is self.remote:
            self.local.progress()
        return side.ready(inner)

    def wait(self, handle, what: str) -> Any:
        side, src, inner = handle
        if side is self.local:
            # Gloo moves our remote sends on its own threads: nothing to do for them meanwhile.
            return self.local.wait(inner, what)
        clock = time.monotonic
        deadline = clock() + self.timeout_s
        next_health = clock() + _HEALTH_EVERY_S
        polled = False
        while self.local.progress() and not self.remote.ready(inner):
            if not polled:
                polled = True
                self.polled_waits += 1
            now = clock()
            if now >= next_health:
                failures = self.peer_failures()
                if failures:
                    raise PeerFailure(failures)
                next_health = now + _HEALTH_EVERY_S
            if now >= deadline:
                raise receive_timeout(self.rank, self.timeout_s, what, src)
            time.sleep(_POLL_SLEEP_S)
        # Nothing left in our outbox (or the data is here): blocking cannot starve a local peer.
        return self.remote.wait(inner, what)

    def finish_sends(self) -> None:
        self.local.finish_sends()
        self.remote.finish_sends()

    def end_step(self) -> None:
        self.local.end_step()
        self.remote.end_step()

    def publish_failure(self, message: str) -> None:
        self.local.publish_failure(message)  # our rings and the store, which the remote side reads too

    def peer_failures(self) -> str:
        return self.local.peer_failures()
