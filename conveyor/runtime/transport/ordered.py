"""The transport for NCCL: transfers matched by order, data only, one communicator per channel.

NCCL ignores tags and matches point-to-point operations by order, so this transport never
relies on them (on gloo it sends tag 0 alike, which makes gloo match by order too: the CPU
check of the same logic). What it does differently from
:class:`~conveyor.runtime.transport.process_group.DistTransport`:

- **Order.** Each channel (src rank, dst rank) has a process group of its two ranks, so its
  transfers complete in their own order whatever the other direction does; its discipline is
  ``"in_order"``, so the lowered program's posts put a channel's receives in the order the
  sender sends (:mod:`conveyor.schedule.posts`). Each group's communicator is made
  when the pipeline is built, in one order on every rank
  (:meth:`~conveyor.runtime.lifecycle.rank.OwnGroups.channel_groups`): made at a channel's first
  transfer, it would block the host inside the first step, where a peer may wait for this
  rank's structures (:func:`conveyor.runtime.lifecycle.host_blocking.check_first_step`).
- **Data only.** The structure of each transfer (shapes, dtypes, tree) travels once, through
  the store, the first time that transfer (direction, stage, microbatch) happens; from then
  on, and from the start for stages given in ``TransferOptions(shapes=...)``, only the bytes travel,
  into a buffer the receiver sized ahead. A later transfer of another structure is an error
  (SpecMismatchError) naming rank, stage, microbatch and tensor, as with ``fixed_shapes``.
- **Variable shapes** (``TransferOptions(variable_shapes=True)``, for ``pipe.step(Microbatches(...))``
  whose microbatches differ in length): every step is a first step. Each transfer's structure
  travels through the store under that step's number, the receiver sizes its buffer from it and
  deletes the key; the data still travels alone, matched by order. The host waits for a structure
  at the posts where a first step waits for it, which the ordering proves deadlock-free.
- **Device.** Receive buffers live on ``device`` (the stage's GPU under NCCL), send buffers too,
  packed there; a send's buffer is let go once its work completed (asked as later transfers
  post and at waits), not held to the end of the step.
- **Batches.** What a rank posts over one channel at one point goes in one
  ``torch.distributed.batch_isend_irecv``; waiting for a receive waits for its batch.
- **Failure.** Under NCCL a wait is the stream's (the host goes on), so a peer's failure
  cannot surface in a wait: the pipeline's watcher thread reads the store's failure board
  every poll and aborts the communicators once a peer published one
  (:mod:`conveyor.runtime.lifecycle.rank`), which ends every kernel waiting on them. Under gloo
  a wait blocks the host until ``timeout_s``, and the failing rank's closed connections end it;
  either way the message comes from the store. The first step's wait for a structure
  looks at the board every :data:`FAILURE_POLL_S`.

Example (what :func:`conveyor.runtime.transport.choice.build_transport` does for NCCL)::

    transport = OrderedTransport(rank, life.global_ranks, channel_groups, life.store, prefix, timeout_s=300.0,
                                 device=device, backend="nccl")
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from conveyor.runtime.transport.transport import FailureBoard, Transport, receive_timeout
from conveyor.runtime.transport.wire import (
    PayloadMeta,
    TransferKey,
    flatten_payload,
    frozen_tensors,
    pack,
    unflatten_payload,
    unpack,
)
from conveyor.schedule.posts import IN_ORDER

# How often a waiting rank looks at the store's failure board (gloo; NCCL: the watcher's poll).
FAILURE_POLL_S = 0.5
_FIX = ("(transport='ordered', NCCL's, sends data only once a transfer's structure is known; keep each "
        "microbatch's shapes as in the first step (pad variable lengths), pass "
        "TransferOptions(variable_shapes=True) to agree on shapes every step, or use gloo with "
        "transport='process_group')")


@dataclass
class _Receive:
    src: int
    key: TransferKey
    meta: PayloadMeta
    buffer: torch.Tensor | None
    works: list = field(default_factory=list)  # the whole batch's: it completes together


class OrderedTransport(FailureBoard, Transport):
    """Order-matched, data-only point-to-point over one process group per channel (NCCL, or gloo to test it).

    ``channel_groups``: {(src, dst): the process group of those two ranks} for every channel
    this rank sends or receives on. ``prefix`` names this pipeline's keys in ``store``.
    """

    discipline = IN_ORDER

    def __init__(self, rank: int, rank_to_global: list[int], channel_groups: dict, store,
                 prefix: str, timeout_s: float, device: torch.device, backend: str, *,
                 variable_shapes: bool = False) -> None:
        self.dist = dist
        self.rank = rank
        self.rank_to_global = rank_to_global
        self.channel_groups = channel_groups
        self.store = store
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        self.stream_waits = backend == "nccl"  # a wait orders the stream; the host goes on
        self.known: dict[TransferKey, PayloadMeta] = {}
        self.seeded: dict[tuple[int, int], PayloadMeta] = {}
        self.pending_sends: list[tuple[list, list[torch.Tensor]]] = []
        self.structures_sent = 0
        self.variable_shapes = variable_shapes
        self.steps_done = 0  # names each step's structures under variable_shapes

    def seed(self, channel: tuple[int, int], meta: PayloadMeta) -> None:
        """Every transfer of ``channel`` has structure ``meta`` (both ends seed alike)."""
        if not self.variable_shapes:
            self.seeded[channel] = meta

    def end_step(self) -> None:
        """Under ``variable_shapes`` the next step agrees on its structures afresh."""
        self.steps_done += 1
        if self.variable_shapes:
            self.known.clear()

    # --- structures ------------------------------------------------------------------------
    def _structure(self, key: TransferKey) -> PayloadMeta | None:
        return self.known.get(key) or self.seeded.get(key[:2])

    def _store_key(self, key: TransferKey) -> str:
        """Where ``key``'s structure is published (under variable_shapes, afresh each step)."""
        direction, stage, microbatch = key
        step = f"step{self.steps_done}/" if self.variable_shapes else ""
        return f"conveyor/ordered/{self.prefix}/{step}{direction}/{stage}/{microbatch}"

    def _fetch_structure(self, src: int, key: TransferKey, what: str) -> PayloadMeta:
        """The structure ``src`` published for ``key`` (its first time), waited for through the store."""
        name = self._store_key(key)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                self.store.wait([name], datetime.timedelta(seconds=FAILURE_POLL_S))
                break
            except Exception as exc:  # not there yet (or the store is gone: then the deadline says so)
                self.raise_peer_failures(exc)
                if time.monotonic() >= deadline:
                    raise receive_timeout(self.rank, self.timeout_s, f"the structure of {what}", src) from exc
        meta = PayloadMeta.decode(self.store.get(name))
        self.known[key] = meta
        if self.variable_shapes:  # read by this rank only, once: the store does not grow step by step
            self.store.delete_key(name)
        return meta

    # --- sending ---------------------------------------------------------------------------
    def post_sends(self, dst: int, keys: Sequence[TransferKey], values: Sequence[Any]) -> None:
        """Send each of ``values`` (addressed by ``keys``) to ``dst``, in order, as one batch."""
        self._release_sent()
        ops, keep = [], []
        group = self.channel_groups[(self.rank, dst)]
        for key, value in zip(keys, values):
            body = self._body(dst, key, value)
            if body is not None:
                keep.append(body)
                ops.append(self.dist.P2POp(self.dist.isend, body, self.rank_to_global[dst], group=group))
        if ops:
            self.pending_sends.append((self.dist.batch_isend_irecv(ops), keep))

    def _release_sent(self) -> None:
        """Let go of the sends that completed, and of their buffers (a stage's output or
        gradient, or a packed copy): held to the end of the step, a step's sends would all stay
        alive at once. ``is_completed`` only asks (under NCCL it queries the work's CUDA event, no
        host sync); ``wait`` on a completed work returns at once, raising what it failed with."""
        done, still = [], []
        for entry in self.pending_sends:
            (done if all(work.is_completed() for work in entry[0]) else still).append(entry)
        for works, _ in done:
            for work in works:
                work.wait()
        self.pending_sends = still

    def _body(self, dst: int, key: TransferKey, value: Any) -> torch.Tensor | None:
        """The bytes of ``value`` as the receiver expects them (publishing the structure the first time)."""
        meta = self._structure(key)
        if meta is None:
            meta, tensors = flatten_payload(value)
            self.store.set(self._store_key(key), meta.encode())
            self.known[key] = meta
            self.structures_sent += 1
        else:
            tensors = frozen_tensors(meta, value, self.rank, key, dst, fix=_FIX)
        if not tensors:
            return None
        body = pack(tensors, meta, self.device)
        return body if body.device == self.device else body.to(self.device)

    # --- receiving -------------------------------------------------------------------------
    def post_recvs(self, src: int, keys: Sequence[TransferKey]) -> list[_Receive]:
        """Post the receives of ``keys`` from ``src``, in order, as one batch."""
        self._release_sent()
        handles, ops = [], []
        group = self.channel_groups[(src, self.rank)]
        for key in keys:
            meta = self._structure(key) or self._fetch_structure(src, key, f"transfer {key}")
            buffer = torch.empty(meta.data_bytes, dtype=torch.uint8, device=self.device) if meta.tensors else None
            handles.append(_Receive(src, key, meta, buffer))
            if buffer is not None:
                ops.append(self.dist.P2POp(self.dist.irecv, buffer, self.rank_to_global[src], group=group))
        works = self.dist.batch_isend_irecv(ops) if ops else []
        for handle in handles:
            handle.works = works  # the same list: waited once for all (a gloo work waits once)
        return handles

    def ready(self, handle: _Receive) -> bool:
        return all(work.is_completed() for work in handle.works)

    def wait(self, handle: _Receive, what: str) -> Any:
        deadline = time.monotonic() + self.timeout_s
        # Under NCCL the stream waits (the watcher aborts on a peer's failure); under gloo the host, at
        # most until the deadline (a gloo wait that times out closes the pair, so it cannot be cut into
        # slices that look at the store in between).
        for work in handle.works:
            if self.stream_waits:
                work.wait()
            else:
                self.wait_work(work, deadline, handle.src, what, board_on_loss=True)
        handle.works.clear()  # one list per batch: its other receives are complete too
        self._release_sent()
        tensors = unpack(handle.buffer, handle.meta) if handle.buffer is not None else []
        return unflatten_payload(handle.meta, tensors)

    def finish_sends(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        for works, _ in self.pending_sends:
            for work in works:
                if self.stream_waits:
                    work.wait()
                else:
                    work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        self.pending_sends.clear()

    def close(self) -> None:
        self.pending_sends.clear()
        self.channel_groups = {}
