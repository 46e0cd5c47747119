"""Moving payloads between ranks: torch.distributed point-to-point, or in-process.

A transfer is addressed by ``(direction, stage, microbatch)``: direction 0
carries the forward output of ``stage`` to ``stage + 1``, direction 1 the input
gradient of ``stage`` to ``stage - 1``. Each transfer is one small header
(sizes) and one flat byte buffer; the payload's structure (shapes, dtypes,
tree) is sent only when it differs from the last one on that channel, so
shapes may change between microbatches and steps at the cost of a few bytes.

Receives are posted ahead (the executor posts every receive of a step before
its first action); sends are asynchronous. Every blocking wait has a timeout
and names what it waited for. A rank that fails publishes its message in the
process group's store, so its peers raise :class:`PeerFailure` with it instead
of a bare "connection closed".

Example (in-process):
    >>> import torch
    >>> box = LocalMailbox()
    >>> LocalTransport(box, rank=0).send(1, (0, 0, 0), torch.ones(2))
    >>> handle = LocalTransport(box, rank=1).post_recv(0, (0, 0, 0))
    >>> LocalTransport(box, rank=1).wait(handle, "F input")
    tensor([1., 1.])
"""

from __future__ import annotations

import contextlib
import datetime
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from conveyor.errors import CommTimeout, PeerFailure, SpecMismatchError
from conveyor.runtime.wire import PayloadMeta, flatten_payload, pack, unflatten_payload, unpack

TransferKey = tuple[int, int, int]  # (direction, stage, microbatch)
# Evaluation forwards travel apart: their outputs carry no gradient, so their structure differs.
FORWARD, BACKWARD, EVAL_FORWARD = 0, 1, 2
_FAILURE_KEY = "conveyor/failure/{rank}"


def detach_for_next_stage(value: Any) -> Any:
    """What a stage on the same rank receives: the same data as fresh leaves (no copy)."""
    meta, tensors = flatten_payload(value)
    leaves = []
    for t, tm in zip(tensors, meta.tensors):
        leaf = t.detach()
        if tm.requires_grad:
            leaf.requires_grad_(True)
        leaves.append(leaf)
    return unflatten_payload(meta, leaves)


def check_frozen(expected: PayloadMeta, actual: PayloadMeta, rank: int, key: TransferKey, dst: int) -> None:
    """Raise SpecMismatchError naming the first tensor whose shape, dtype or place differs."""
    direction, stage, microbatch = key
    what = "output" if direction == FORWARD else "input gradient"
    where = (f"rank {rank}, stage {stage}, microbatch {microbatch}: the {what} sent to rank {dst}")
    fix = ("(fixed_shapes=True froze the structure seen in the first step; pass fixed_shapes=False "
           "to let shapes vary between microbatches and steps)")
    if expected.spec != actual.spec or expected.is_tensor != actual.is_tensor:
        raise SpecMismatchError(f"{where} has structure {actual.spec}, but the receiver was told {expected.spec} {fix}")
    for want, got in zip(expected.tensors, actual.tensors):
        if want.shape != got.shape or want.dtype != got.dtype or want.requires_grad != got.requires_grad:
            raise SpecMismatchError(
                f"{where}: tensor {got.path or '<value>'} is {got.describe()}"
                f"{' (requires grad)' if got.requires_grad else ''}, but the receiver was told "
                f"{want.describe()}{' (requires grad)' if want.requires_grad else ''} {fix}"
            )
    if expected.plain_leaves != actual.plain_leaves:
        raise SpecMismatchError(
            f"{where} carries the values {actual.plain_leaves}, but the receiver was told {expected.plain_leaves} {fix}"
        )


class Transport:
    """Interface of the executor's communication. ``post_recv`` never blocks; ``wait`` may."""

    rank: int

    def send(self, dst: int, key: TransferKey, value: Any) -> None:
        raise NotImplementedError

    def post_recv(self, src: int, key: TransferKey):
        raise NotImplementedError

    def ready(self, handle) -> bool:
        """Whether ``wait(handle)`` would return without blocking (also makes progress)."""
        raise NotImplementedError

    def wait(self, handle, what: str) -> Any:
        raise NotImplementedError

    def finish_sends(self) -> None:
        """Block until every send of this step has left (their buffers may then be freed)."""

    def can_block(self) -> bool:
        return True

    def end_step(self) -> None:
        """Called once every rank's step has finished."""


@dataclass
class LocalMailbox:
    """Shared by the ranks of one in-process run."""

    messages: dict[tuple[int, int, TransferKey], Any] = field(default_factory=dict)


class LocalTransport(Transport):
    """All ranks in one process: a send drops the payload in a shared mailbox."""

    def __init__(self, mailbox: LocalMailbox, rank: int) -> None:
        self.mailbox = mailbox
        self.rank = rank

    def send(self, dst: int, key: TransferKey, value: Any) -> None:
        self.mailbox.messages[(self.rank, dst, key)] = value

    def post_recv(self, src: int, key: TransferKey):
        return (src, self.rank, key)

    def ready(self, handle) -> bool:
        return handle in self.mailbox.messages

    def wait(self, handle, what: str) -> Any:
        return detach_for_next_stage(self.mailbox.messages.pop(handle))

    def can_block(self) -> bool:
        return False


@dataclass
class _Recv:
    src: int
    key: TransferKey
    header: torch.Tensor | None
    header_work: Any
    meta_buf: torch.Tensor | None = None
    meta_work: Any = None
    data_buf: torch.Tensor | None = None
    data_work: Any = None
    posted_body: bool = False


class DistTransport(Transport):
    """torch.distributed isend/irecv with tags (gloo on CPU; NCCL keeps the same order per peer)."""

    def __init__(
        self,
        group,
        rank_to_global: list[int],
        rank: int,
        num_stages: int,
        num_microbatches: int,
        timeout_s: float,
        fixed_shapes: bool = False,
    ) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        self.rank = rank
        self.rank_to_global = rank_to_global
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self.timeout_s = timeout_s
        self.pending_sends: list[tuple[Any, list[torch.Tensor]]] = []
        self.sent_meta: dict[tuple[int, int], bytes] = {}  # channel -> last structure sent
        self.received_meta: dict[tuple[int, int], PayloadMeta] = {}
        self.fifo_channels: set[tuple[int, int]] = set()
        # fixed_shapes: after the first step, a channel whose structure never changed during it
        # sends data only (no header); both sides freeze the same channels independently.
        self.fixed_shapes = fixed_shapes
        self.frozen: dict[tuple[int, int], PayloadMeta] = {}
        self._step_meta: dict[tuple[int, int], bytes | None] = {}
        self._steps_done = 0

    def _tag(self, key: TransferKey, part: int) -> int:
        direction, stage, microbatch = key
        return ((direction * self.num_stages + stage) * self.num_microbatches + microbatch) * 3 + part

    def send(self, dst: int, key: TransferKey, value: Any) -> None:
        meta, tensors = flatten_payload(value)
        channel = key[:2]
        frozen = self.frozen.get(channel)
        if frozen is not None:
            check_frozen(frozen, meta, self.rank, key, dst)
            if tensors:
                data = pack(tensors, meta)
                work = self.dist.isend(data, self.rank_to_global[dst], group=self.group, tag=self._tag(key, 2))
                self.pending_sends.append(([work], [data]))
            return
        encoded = meta.encode()
        self._note_meta(channel, encoded)
        new_structure = not (channel in self.fifo_channels and self.sent_meta.get(channel) == encoded)
        self.sent_meta[channel] = encoded
        data = pack(tensors, meta) if tensors else None
        header = torch.tensor(
            [len(encoded) if new_structure else 0, 0 if data is None else data.numel()], dtype=torch.int64
        )
        peer = self.rank_to_global[dst]
        keep = [header]
        works = [self.dist.isend(header, peer, group=self.group, tag=self._tag(key, 0))]
        if new_structure:
            meta_buf = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
            keep.append(meta_buf)
            works.append(self.dist.isend(meta_buf, peer, group=self.group, tag=self._tag(key, 1)))
        if data is not None:
            keep.append(data)
            works.append(self.dist.isend(data, peer, group=self.group, tag=self._tag(key, 2)))
        self.pending_sends.append((works, keep))
        if len(self.pending_sends) > 64:
            self._reap_sends()

    def _reap_sends(self) -> None:
        self.pending_sends = [(w, k) for w, k in self.pending_sends if not all(x.is_completed() for x in w)]

    def post_recv(self, src: int, key: TransferKey) -> _Recv:
        frozen = self.frozen.get(key[:2])
        if frozen is not None:
            handle = _Recv(src, key, None, None, posted_body=True)
            if frozen.tensors:
                handle.data_buf = torch.empty(frozen.data_bytes, dtype=torch.uint8)
                handle.data_work = self.dist.irecv(
                    handle.data_buf, self.rank_to_global[src], group=self.group, tag=self._tag(key, 2)
                )
            return handle
        header = torch.empty(2, dtype=torch.int64)
        work = self.dist.irecv(header, self.rank_to_global[src], group=self.group, tag=self._tag(key, 0))
        return _Recv(src, key, header, work)

    def _post_body(self, handle: _Recv) -> None:
        meta_len, data_len = (int(v) for v in handle.header.tolist())
        peer = self.rank_to_global[handle.src]
        if meta_len:
            handle.meta_buf = torch.empty(meta_len, dtype=torch.uint8)
            handle.meta_work = self.dist.irecv(handle.meta_buf, peer, group=self.group, tag=self._tag(handle.key, 1))
        if data_len:
            handle.data_buf = torch.empty(data_len, dtype=torch.uint8)
            handle.data_work = self.dist.irecv(handle.data_buf, peer, group=self.group, tag=self._tag(handle.key, 2))
        handle.posted_body = True

    def ready(self, handle: _Recv) -> bool:
        if not handle.posted_body:
            if not handle.header_work.is_completed():
                return False
            self._post_body(handle)
        return all(w is None or w.is_completed() for w in (handle.meta_work, handle.data_work))

    def wait(self, handle: _Recv, what: str) -> Any:
        deadline = time.monotonic() + self.timeout_s
        if not handle.posted_body:
            self._wait_work(handle.header_work, deadline, handle, what)
            self._post_body(handle)
        for work in (handle.meta_work, handle.data_work):
            if work is not None:
                self._wait_work(work, deadline, handle, what)
        channel = handle.key[:2]
        if channel in self.frozen:
            meta = self.frozen[channel]
        elif handle.meta_buf is not None:
            encoded = handle.meta_buf.numpy().tobytes()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch's pickled LeafSpec
                meta = PayloadMeta.decode(encoded)
            self.received_meta[channel] = meta
            self._note_meta(channel, encoded)
        else:
            meta = self.received_meta[channel]
            self._note_meta(channel, self._step_meta.get(channel) or b"")
        tensors = unpack(handle.data_buf, meta) if handle.data_buf is not None else []
        return unflatten_payload(meta, tensors)

    def _wait_work(self, work, deadline: float, handle: _Recv, what: str) -> None:
        remaining = max(deadline - time.monotonic(), 0.001)
        try:
            work.wait(datetime.timedelta(seconds=remaining))
        except Exception as exc:  # gloo reports both timeouts and dead peers as RuntimeError
            failure = self.peer_failures()
            if failure:
                raise PeerFailure(failure) from exc
            if time.monotonic() >= deadline - 0.01:
                raise CommTimeout(
                    f"rank {self.rank} waited {self.timeout_s:g} s for {what} from rank {handle.src} "
                    f"and it never came; rank {handle.src} is slow, stuck or running another schedule "
                    "(raise timeout_s= if the step is legitimately that slow)"
                ) from exc
            raise PeerFailure(
                f"rank {self.rank} lost its connection to rank {handle.src} while waiting for {what}: "
                f"{exc}. Rank {handle.src} probably died; look at its output."
            ) from exc

    def finish_sends(self) -> None:
        for works, _ in self.pending_sends:
            for work in works:
                work.wait(datetime.timedelta(seconds=self.timeout_s))
        self.pending_sends.clear()

    def _note_meta(self, channel: tuple[int, int], encoded: bytes) -> None:
        if self.fixed_shapes and self._steps_done == 0:
            seen = self._step_meta.get(channel, encoded)
            self._step_meta[channel] = encoded if seen == encoded else None

    def end_step(self) -> None:
        """With fixed_shapes, freeze the channels whose structure stayed the same through step 1."""
        if self.fixed_shapes and self._steps_done == 0:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                for channel, encoded in self._step_meta.items():
                    if encoded:
                        self.frozen[channel] = PayloadMeta.decode(encoded)
        self._steps_done += 1

    # --- failure propagation through the store ---------------------------------
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
                store.set(_FAILURE_KEY.format(rank=self.rank), message)

    def peer_failures(self) -> str:
        store = self._store()
        if store is None:
            return ""
        messages = []
        for rank in range(len(self.rank_to_global)):
            key = _FAILURE_KEY.format(rank=rank)
            try:
                if rank != self.rank and store.check([key]):
                    messages.append(f"rank {rank} failed: {store.get(key).decode()}")
            except Exception:
                continue
        return "\n".join(messages)
