"""Shared memory to the peers on this host, the process group to peers on other hosts.

A job on several hosts has both kinds of stage boundary: ranks of one host can hand
each other payloads through shared-memory rings (microseconds a hop), ranks of
different hosts must go through torch.distributed (gloo). :class:`HybridTransport`
routes each peer to the one that can reach it, so a multi-host pipeline pays the
network only where it crosses hosts.

The one subtlety is progress. A shared-memory send that finds its ring full waits in
the sender's outbox and moves on the sender's next call into that transport. A rank
blocked in a gloo wait makes no such call, so while it has an outbox it waits for the
gloo receive on a helper thread and moves its shared-memory sends along meanwhile.

Example (what :class:`conveyor.Pipeline` builds when ranks 0-1 share a host and 2-3 share another)::

    transport = HybridTransport(SharedMemoryTransport(1, {0}, ...), DistTransport(...), local_peers={0})
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Sequence
from typing import Any

from conveyor.errors import CommTimeout
from conveyor.runtime.lifecycle.positions import stored
from conveyor.runtime.transport.process_group import DistTransport
from conveyor.runtime.transport.shm import SharedMemoryTransport
from conveyor.runtime.transport.shm_wait import HEALTH_EVERY_S
from conveyor.runtime.transport.transport import Transport
from conveyor.runtime.transport.wire import Channel, PayloadMeta, TransferKey

_POLL_SLEEP_S = 50e-6


class HostExchange:
    """Every rank of a pipeline tells the others which host it runs on, through the store.

    Not a process-group collective: a rank that never comes makes the others fail after
    ``timeout_s`` with the ranks that are missing, like every other wait of a pipeline.
    Rounds are numbered per group of ranks, in the order pipelines are built (the same on
    every rank, as for the shared-memory rings).
    """

    _rounds: dict[str, int] = {}

    @classmethod
    def run(cls, store, group_key: str, rank: int, num_ranks: int, identity: str, timeout_s: float) -> list[int]:
        """Each rank's host as a number (see :func:`hosts_by_rank`)."""
        count = cls._rounds.get(group_key, 0)
        cls._rounds[group_key] = count + 1
        prefix = f"conveyor/hosts/{group_key}/{count}"
        store.set(f"{prefix}/{rank}", identity)
        keys = [f"{prefix}/{r}" for r in range(num_ranks)]
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except Exception as exc:
            missing = [r for r, key in enumerate(keys) if stored(store, key) is None]
            raise CommTimeout(
                f"rank {rank} waited {timeout_s:g} s for rank(s) {missing} to say which host they run on "
                "while building a Pipeline; they never did (slow, stuck, or not building this pipeline)"
            ) from exc
        return hosts_by_rank([store.get(key).decode() for key in keys])


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
        self.polled_waits = 0  # process-group waits that had to keep shared-memory sends moving

    @property
    def in_order_channels(self) -> frozenset:  # type: ignore[override]  # the process group's, which uses them
        return self.remote.in_order_channels

    @property
    def structures_sent(self) -> int:
        return self.local.structures_sent + self.remote.structures_sent

    def _side(self, peer: int) -> Transport:
        return self.local if peer in self.local_peers else self.remote

    def seed(self, channel: Channel, meta: PayloadMeta) -> None:
        self.local.seed(channel, meta)
        self.remote.seed(channel, meta)

    def post_sends(self, dst: int, keys: Sequence[TransferKey], values: Sequence[Any]) -> None:
        self._side(dst).post_sends(dst, keys, values)

    def post_recvs(self, src: int, keys: Sequence[TransferKey]) -> list:
        side = self._side(src)
        return [(side, src, inner) for inner in side.post_recvs(src, keys)]

    def ready(self, handle) -> bool:
        side, _, inner = handle
        if side is self.remote:
            self.local.progress()
        return side.ready(inner)  # gloo: False until waited for (the executor blocks instead)

    def wait(self, handle, what: str) -> Any:
        side, src, inner = handle
        if side is self.local:
            # Gloo moves our remote sends on its own threads: nothing to do for them meanwhile.
            return self.local.wait(inner, what)
        if not self.local.progress():
            return self.remote.wait(inner, what)  # no send waits for room: blocking starves nobody
        # Sends to a peer on this host wait for room in its ring. Gloo cannot say whether a
        # receive has arrived without waiting for it (its is_completed stays False until
        # wait), so a helper thread waits on the receive while this one keeps those sends
        # moving; the wait keeps its own timeout and error messages.
        self.polled_waits += 1
        outcome: dict[str, Any] = {}
        arrived = threading.Event()

        def receive() -> None:
            try:
                outcome["value"] = self.remote.wait(inner, what)
            except BaseException as exc:  # handed to the waiting thread, which raises it
                outcome["error"] = exc
            finally:
                arrived.set()

        # A daemon thread: if this rank fails meanwhile, its exit must not wait for gloo's timeout.
        threading.Thread(target=receive, name=f"conveyor-recv-{src}", daemon=True).start()
        next_health = time.monotonic() + HEALTH_EVERY_S
        while not arrived.wait(_POLL_SLEEP_S):
            if not self.local.progress():
                arrived.wait()  # the last queued send went out: nothing left to move
                break
            if time.monotonic() >= next_health:
                self.local.check_health(src, what)
                next_health = time.monotonic() + HEALTH_EVERY_S
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def finish_sends(self) -> None:
        self.local.finish_sends()
        self.remote.finish_sends()

    def end_step(self) -> None:
        self.local.end_step()
        self.remote.end_step()

    def close(self) -> None:
        self.local.close()
        self.remote.close()

    def publish_failure(self, message: str) -> None:
        self.local.publish_failure(message)  # our rings and the store, which the remote side reads too

    def peer_failures(self) -> str:
        return self.local.peer_failures()
