"""The transport contract every transport implements, the failure board they share, and the in-process one.

A transfer is addressed by ``(direction, stage, microbatch)``: direction 0
carries the forward output of ``stage`` to ``stage + 1``, direction 1 the input
gradient of ``stage`` to ``stage - 1`` (2: forwards of evaluation). The transports:
:class:`LocalTransport` (one process), :mod:`conveyor.runtime.transport.process_group` (gloo,
matched by tag), :mod:`conveyor.runtime.transport.shm` (shared memory), :mod:`conveyor.runtime.transport.hybrid`
(both), :mod:`conveyor.runtime.transport.ordered` (NCCL, matched by order); which one a pipeline gets
is :mod:`conveyor.runtime.transport.choice`'s.

Where and in which batches a rank posts its sends and receives is written in the lowered
program (:mod:`conveyor.schedule.posts`); a transport declares which discipline it needs
(matched by address, or by order as NCCL matches). Sends are asynchronous. Every blocking
wait has a timeout and names what it waited for. A rank that fails publishes its message in the
process group's store, so its peers raise :class:`PeerFailure` with it instead
of a bare "connection closed".

Example (in-process):
    >>> import torch
    >>> box = LocalMailbox()
    >>> LocalTransport(box, rank=0).post_sends(1, [(0, 0, 0)], [torch.ones(2)])
    >>> [handle] = LocalTransport(box, rank=1).post_recvs(0, [(0, 0, 0)])
    >>> LocalTransport(box, rank=1).wait(handle, "F input")
    tensor([1., 1.])
"""

from __future__ import annotations

import contextlib
import datetime
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from conveyor.errors import CommTimeout, LostConnection, PeerFailure
from conveyor.runtime.lifecycle.positions import stored
from conveyor.runtime.transport.wire import (
    Channel,
    PayloadMeta,
    TransferKey,
    flatten_payload,
    unflatten_payload,
)
from conveyor.schedule.posts import LOOKAHEAD

# Keyed by global rank: with several pipeline groups in one job (data x pipeline parallel)
# group ranks repeat, and a failure must be named by the group it happened in.
_FAILURE_KEY = "conveyor/failure/{global_rank}"
# How many ranks of the job have published a failure: one store round trip tells a
# waiting rank whether to look at all.
_FAILURE_COUNT_KEY = "conveyor/failures"


def detach_for_next_stage(value: Any) -> Any:
    """What a stage on the same rank receives: the same data as fresh leaves (no copy)."""
    meta, tensors = flatten_payload(value)
    return unflatten_payload(meta, [t.detach().requires_grad_(t.requires_grad) for t in tensors])


def receive_timeout(rank: int, timeout_s: float, what: str, src: int) -> CommTimeout:
    """The error of a receive that never came, the same whichever transport waited."""
    return CommTimeout(
        f"rank {rank} waited {timeout_s:g} s for {what} from rank {src} "
        f"and it never came; rank {src} is slow, stuck or running another schedule "
        "(raise timeout_s= if the step is legitimately that slow)"
    )


class FailureBoard:
    """Failure messages through the process group's store, so that peers can say why a rank stopped.

    Needs ``rank``, ``rank_to_global`` (this pipeline group's ranks in the default group)
    and, to wait (:meth:`wait_work`), ``timeout_s`` on the instance. A failure in this group is
    named by its group rank; one in another group of the same job (another data-parallel
    replica) is reported too, as such. Transports that look at the board while they wait (shared memory) thereby stop
    every replica; the process group's looks only when one of its own waits fails.
    """

    rank: int
    rank_to_global: list[int]
    timeout_s: float

    def _store(self):
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            return _get_default_store()
        except Exception:  # no store reachable: failures surface as lost connections
            return None

    def publish_failure(self, message: str) -> None:
        store = self._store()
        if store is not None:
            # The store itself may be gone with a failing peer; the error we raise matters more.
            with contextlib.suppress(Exception):
                store.set(_FAILURE_KEY.format(global_rank=self.rank_to_global[self.rank]), message)
                store.add(_FAILURE_COUNT_KEY, 1)

    def peer_failures(self) -> str:
        """What failed ranks published: those of this group first, else those of other groups."""
        store = self._store()
        try:
            if store is None or store.add(_FAILURE_COUNT_KEY, 0) == 0:
                return ""
        except Exception:
            return ""
        mine = self.rank_to_global[self.rank]
        messages = []
        for rank, global_rank in enumerate(self.rank_to_global):
            message = _published_failure(store, global_rank) if global_rank != mine else None
            if message is not None:
                named = f"rank {rank}" if rank == global_rank else f"rank {rank} (global rank {global_rank})"
                messages.append(f"{named} failed: {message}")
        if messages:
            return "\n".join(messages)
        ours = set(self.rank_to_global)
        for global_rank in range(_world_size(max(self.rank_to_global) + 1)):
            message = _published_failure(store, global_rank) if global_rank not in ours else None
            if message is not None:
                messages.append(f"global rank {global_rank}, in another pipeline group of this job, failed: {message}")
        return "\n".join(messages)

    def raise_peer_failures(self, cause: BaseException | None = None) -> None:
        """Raise PeerFailure with what failed peers published, if any did (``cause``: what ended a wait)."""
        failures = self.peer_failures()
        if failures:
            raise PeerFailure(failures) from cause

    def wait_work(self, work, deadline: float, src: int, what: str, *, board_on_loss: bool) -> None:
        """Wait for a gloo ``work`` (``what``, from rank ``src``) until ``deadline``, on the host.

        A wait that fails raises what failed peers published (looked at past the deadline, and
        with ``board_on_loss`` before it too), else :func:`receive_timeout` past the deadline,
        else LostConnection.
        """
        try:
            work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except Exception as exc:  # gloo reports both timeouts and dead peers as RuntimeError
            timed_out = time.monotonic() >= deadline - 0.01  # read once: both tests below see the same answer
            if board_on_loss or timed_out:
                self.raise_peer_failures(exc)
            if timed_out:
                raise receive_timeout(self.rank, self.timeout_s, what, src) from exc
            raise LostConnection(
                f"rank {self.rank} lost its connection while waiting for {what} from rank {src}: {exc}"
            ) from exc


def _published_failure(store, global_rank: int) -> str | None:
    message = stored(store, _FAILURE_KEY.format(global_rank=global_rank))
    return None if message is None else message.decode()


def _world_size(at_least: int) -> int:
    try:
        import torch.distributed as dist

        return max(dist.get_world_size(), at_least) if dist.is_initialized() else at_least
    except Exception:
        return at_least


class Transport(ABC):
    """What the executor and the pipelines need of a transport: the whole contract.

    The executor posts batches (:class:`conveyor.schedule.posts.Batch`: transfers to or from
    one peer) where the lowered program's posts say, whatever the transport: ``post_sends``
    and ``post_recvs`` never block; ``wait`` on a receive's handle may, for at most the
    transport's timeout, and names what it waited for when it gives up. ``discipline`` says
    how the transport matches transfers, hence how posts must be planned (by address:
    ``"lookahead"``; by order, as NCCL: ``"in_order"``). A transfer is addressed by its
    :data:`~conveyor.runtime.transport.wire.TransferKey`; transfers of one channel (direction, sending
    stage) are a stream. Failures: ``publish_failure`` tells the peers why this rank stops,
    ``peer_failures`` reads what they published; ``close`` releases everything.

    ``in_order_channels`` are the channels whose receiver consumes in the order the sender
    sends (the posts pass finds them: :func:`conveyor.schedule.posts.rank_channels`, given when
    the transport is built): a transport may post their receives ahead sized for the last transfer's structure.
    ``structures_sent`` counts the transfers that carried their structure (shapes, dtypes, tree)
    besides their data: after the first step it stays put unless shapes change.
    """

    rank: int
    discipline: str = LOOKAHEAD
    in_order_channels: frozenset[Channel] = frozenset()
    structures_sent: int = 0

    @abstractmethod
    def post_sends(self, dst: int, keys: Sequence[TransferKey], values: Sequence[Any]) -> None:
        """Start sending each of ``values`` (addressed by ``keys``) to rank ``dst``, in order; returns at once."""

    @abstractmethod
    def post_recvs(self, src: int, keys: Sequence[TransferKey]) -> list:
        """Post the receives of ``keys`` from rank ``src``, in order; returns a handle per key."""

    @abstractmethod
    def ready(self, handle) -> bool:
        """Whether ``wait(handle)`` would return without blocking (also makes progress)."""

    @abstractmethod
    def wait(self, handle, what: str) -> Any:
        """The received value; ``what`` names it in timeout and failure messages."""

    def finish_sends(self) -> None:  # noqa: B027 - nothing to wait for unless sends are asynchronous
        """Block until every send of this step has left (their buffers may then be freed)."""

    def can_block(self) -> bool:
        """Whether ``wait`` blocks; False means the executor must yield until ``ready``."""
        return True

    def seed(self, channel: Channel, meta: PayloadMeta) -> None:  # noqa: B027 - for structure-once transports
        """Expect ``meta`` on ``channel`` from its first transfer on (both ends seed alike).

        Transports that send a payload's structure only when it changes use it to skip even
        the first exchange (``TransferOptions(shapes=...)``); the others ignore it.
        """

    def end_step(self) -> None:  # noqa: B027 - only transports that learn per step need it
        """Called once every rank's step has finished."""

    def close(self) -> None:  # noqa: B027 - only transports holding rings, sockets or work need it
        """Release what this transport holds (rings, sockets, pending work); it is not used again.

        Called after the last step and after a failure, before the pipeline's process groups
        are destroyed: nothing may hold work on them then, or their connections stay open.
        """

    def publish_failure(self, message: str) -> None:  # noqa: B027 - in one process, nobody to tell
        """Tell the peers that this rank failed, and why."""

    def peer_failures(self) -> str:
        """What failed peers published (empty when none did)."""
        return ""

    # One transfer at a time, for tests and tools that drive a transport by hand.
    def send(self, dst: int, key: TransferKey, value: Any) -> None:
        """``post_sends`` of one transfer."""
        self.post_sends(dst, (key,), (value,))

    def post_recv(self, src: int, key: TransferKey):
        """``post_recvs`` of one transfer: its handle."""
        return self.post_recvs(src, (key,))[0]


@dataclass
class LocalMailbox:
    """Shared by the ranks of one in-process run."""

    messages: dict[tuple[int, int, TransferKey], Any] = field(default_factory=dict)


class LocalTransport(Transport):
    """All ranks in one process: a send drops the payload in a shared mailbox."""

    def __init__(self, mailbox: LocalMailbox, rank: int) -> None:
        self.mailbox = mailbox
        self.rank = rank

    def post_sends(self, dst: int, keys: Sequence[TransferKey], values: Sequence[Any]) -> None:
        for key, value in zip(keys, values):
            self.mailbox.messages[(self.rank, dst, key)] = value

    def post_recvs(self, src: int, keys: Sequence[TransferKey]) -> list:
        return [(src, self.rank, key) for key in keys]

    def ready(self, handle) -> bool:
        return handle in self.mailbox.messages

    def wait(self, handle, what: str) -> Any:
        return detach_for_next_stage(self.mailbox.messages.pop(handle))

    def can_block(self) -> bool:
        return False
