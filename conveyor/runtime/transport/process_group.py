"""torch.distributed point-to-point matched by tag (gloo on CPU): the process-group transport.

Tensors travel as one flat byte buffer; the payload's structure (shapes, dtypes, tree)
travels only when it differs from what the channel carried before, so shapes may change
between microbatches and steps (see :class:`DistTransport`).

Example (what :func:`conveyor.runtime.transport.choice.build_transport` builds for ``"process_group"``)::

    transport = DistTransport(group, global_ranks, rank, num_stages, num_microbatches, timeout_s=300.0)
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy
import torch
import torch.distributed as dist

from conveyor.runtime.transport.transport import FailureBoard, Transport
from conveyor.runtime.transport.wire import (
    Channel,
    PayloadMeta,
    TransferKey,
    data_and_trailer,
    flatten_payload,
    frozen_tensors,
    matches,
    pack,
    quick_flatten,
    unflatten_payload,
    unpack,
)


@dataclass
class _Recv:
    src: int
    key: TransferKey
    expected: PayloadMeta | None  # the structure assumed when this receive was posted
    first: torch.Tensor | None  # expected data bytes followed by the trailer (none when frozen)
    first_work: Any
    meta_buf: torch.Tensor | None = None  # only when the structure changed
    meta_work: Any = None
    body_buf: torch.Tensor | None = None
    body_work: Any = None
    changed: bool | None = None


# Message parts of one transfer (the tag's last digit).
_FIRST, _META, _BODY = 0, 1, 2
_TRAILER_BYTES = 24  # three int64: changed flag, structure bytes, body bytes
_SAME = torch.zeros(_TRAILER_BYTES, dtype=torch.uint8)  # trailer of a transfer as expected


class DistTransport(FailureBoard, Transport):
    """torch.distributed isend/irecv with tags (gloo on CPU).

    Protocol per channel (direction, sending stage), both sides keeping the
    structure of the channel's last transfer as of the end of the previous step
    (the *expected* structure; channels whose receiver consumes in the sender's
    order only). The first message of a transfer is sized for the expected
    structure, so its receive is posted ahead, and ends with a 24-byte trailer:

    - as expected: the data, trailer ``[0, 0, 0]``: one message, no handshake;
    - changed, or nothing expected yet: unused bytes, trailer
      ``[1, structure_bytes, body_bytes]``, then the structure and the data.

    Every message costs a fixed ~0.1-0.3 ms in gloo, far more than copying a
    small activation, so data and trailer travel together.
    Receives are posted a few ahead (:data:`conveyor.schedule.posts.RECEIVES_AHEAD`) so that
    receive buffers do not hold more activations than the schedule keeps alive.
    """

    def __init__(
        self,
        group,
        rank_to_global: list[int],
        rank: int,
        num_stages: int,
        num_microbatches: int,
        timeout_s: float,
        fixed_shapes: bool = False,
        in_order_channels: frozenset[Channel] = frozenset(),
    ) -> None:
        self.dist = dist
        self.group = group
        self.rank = rank
        self.rank_to_global = rank_to_global
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self.timeout_s = timeout_s
        self.fixed_shapes = fixed_shapes
        self.pending_sends: list[tuple[list, list[torch.Tensor]]] = []
        self.prune_at = 64
        self.in_order_channels = frozenset(in_order_channels)
        self.expected: dict[tuple[int, int], PayloadMeta] = {}
        self.last_meta: dict[tuple[int, int], PayloadMeta] = {}
        self.structures_sent = 0

    def seed(self, channel: tuple[int, int], meta: PayloadMeta) -> None:
        """Expect ``meta`` on ``channel`` from the first transfer on (both ends must seed alike)."""
        if channel in self.in_order_channels:
            self.expected[channel] = meta

    def _tag(self, key: TransferKey, part: int) -> int:
        direction, stage, microbatch = key
        return ((direction * self.num_stages + stage) * self.num_microbatches + microbatch) * 3 + part

    def _isend(self, tensor: torch.Tensor, dst: int, key: TransferKey, part: int):
        return self.dist.isend(tensor, self.rank_to_global[dst], group=self.group, tag=self._tag(key, part))

    def _irecv(self, tensor: torch.Tensor, src: int, key: TransferKey, part: int):
        return self.dist.irecv(tensor, self.rank_to_global[src], group=self.group, tag=self._tag(key, part))

    # --- sending -------------------------------------------------------------------------
    def post_sends(self, dst: int, keys: Sequence[TransferKey], values: Sequence[Any]) -> None:
        for key, value in zip(keys, values):
            self._send(dst, key, value)

    def _send(self, dst: int, key: TransferKey, value: Any) -> None:
        channel = key[:2]
        expected = self.expected.get(channel)
        if self.fixed_shapes and expected is not None:  # a frozen channel carries data only
            self._send_as_expected(frozen_tensors(expected, value, self.rank, key, dst), expected, dst, key)
            return
        leaves, spec = quick_flatten(value)
        if expected is not None and matches(expected, leaves, spec):
            # The common case, on every transfer's critical path: as little as possible.
            self._send_as_expected([leaf for leaf in leaves if isinstance(leaf, torch.Tensor)], expected, dst, key)
            return
        meta, tensors = flatten_payload(value)
        self.structures_sent += 1
        expected_bytes = expected.data_bytes if expected is not None else 0
        first = torch.empty(expected_bytes + _TRAILER_BYTES, dtype=torch.uint8)
        encoded = torch.frombuffer(bytearray(meta.encode()), dtype=torch.uint8)
        body = pack(tensors, meta) if tensors else None
        first[expected_bytes:].view(torch.int64).copy_(
            torch.tensor([1, encoded.numel(), 0 if body is None else body.numel()])
        )
        works = [self._isend(first, dst, key, _FIRST), self._isend(encoded, dst, key, _META)]
        keep = [first, encoded]
        if body is not None:
            keep.append(body)
            works.append(self._isend(body, dst, key, _BODY))
        self.last_meta[channel] = meta
        self._remember_send(works, keep)

    def _send_as_expected(self, tensors: list[torch.Tensor], expected: PayloadMeta, dst: int,
                          key: TransferKey) -> None:
        if self.fixed_shapes:
            first = pack(tensors, expected) if tensors else None  # no trailer: nothing can change
        else:
            first = data_and_trailer(tensors, expected, _SAME)
        if first is not None:
            self._remember_send([self._isend(first, dst, key, _FIRST)], [first])
        self.last_meta[key[:2]] = expected  # both sides must agree on what came last

    def _remember_send(self, works: list, keep: list[torch.Tensor]) -> None:
        # Buffers stay referenced until their sends complete. Gloo reports a send complete
        # only once it has been waited for, so most stay until finish_sends; the list is
        # pruned at doubling sizes, never rescanned on every send.
        self.pending_sends.append((works, keep))
        if len(self.pending_sends) >= self.prune_at:
            self.pending_sends = [
                (w, k) for w, k in self.pending_sends if not all(x.is_completed() for x in w)
            ]
            self.prune_at = max(64, 2 * len(self.pending_sends))

    # --- receiving -----------------------------------------------------------------------
    def post_recvs(self, src: int, keys: Sequence[TransferKey]) -> list[_Recv]:
        return [self._post_recv(src, key) for key in keys]

    def _post_recv(self, src: int, key: TransferKey) -> _Recv:
        expected = self.expected.get(key[:2])
        if self.fixed_shapes and expected is not None:
            if not expected.tensors:
                return _Recv(src, key, expected, None, None, changed=False)
            first = torch.empty(expected.data_bytes, dtype=torch.uint8)  # a frozen channel carries data only
            return _Recv(src, key, expected, first, self._irecv(first, src, key, _FIRST), changed=False)
        size = (expected.data_bytes if expected is not None else 0) + _TRAILER_BYTES
        first = torch.empty(size, dtype=torch.uint8)
        return _Recv(src, key, expected, first, self._irecv(first, src, key, _FIRST))

    def _read_trailer(self, handle: _Recv) -> None:
        trailer = handle.first.numpy()[handle.first.numel() - _TRAILER_BYTES:].view(numpy.int64)
        changed, meta_len, body_len = int(trailer[0]), int(trailer[1]), int(trailer[2])
        handle.changed = bool(changed)
        if handle.changed:
            handle.meta_buf = torch.empty(meta_len, dtype=torch.uint8)
            handle.meta_work = self._irecv(handle.meta_buf, handle.src, handle.key, _META)
            if body_len:
                handle.body_buf = torch.empty(body_len, dtype=torch.uint8)
                handle.body_work = self._irecv(handle.body_buf, handle.src, handle.key, _BODY)

    def ready(self, handle: _Recv) -> bool:
        if handle.changed is False and handle.first_work is not None:
            return handle.first_work.is_completed()
        if handle.changed is None:
            if not handle.first_work.is_completed():
                return False
            self._read_trailer(handle)
        return all(w is None or w.is_completed() for w in (handle.meta_work, handle.body_work))

    def wait(self, handle: _Recv, what: str) -> Any:
        deadline = time.monotonic() + self.timeout_s
        # Which rank failed first, when a connection broke, is for the pipeline's failure protocol to
        # find out (conveyor.runtime.lifecycle.rank): the breakage of any pair of the group reaches here.
        if handle.changed is None:
            self.wait_work(handle.first_work, deadline, handle.src, what, board_on_loss=False)
            self._read_trailer(handle)
        elif handle.first_work is not None and handle.meta_work is None and not handle.first_work.is_completed():
            self.wait_work(handle.first_work, deadline, handle.src, what, board_on_loss=False)
        for work in (handle.meta_work, handle.body_work):
            if work is not None:
                self.wait_work(work, deadline, handle.src, what, board_on_loss=False)
        if handle.changed:
            meta = PayloadMeta.decode(handle.meta_buf.numpy().tobytes())
            buffer = handle.body_buf
        else:
            meta, buffer = handle.expected, handle.first
        self.last_meta[handle.key[:2]] = meta
        tensors = unpack(buffer, meta) if meta.tensors else []
        return unflatten_payload(meta, tensors)

    def finish_sends(self) -> None:
        for works, _ in self.pending_sends:
            for work in works:
                work.wait(datetime.timedelta(seconds=self.timeout_s))
        self.pending_sends.clear()

    def close(self) -> None:
        # A gloo pair closes only when nothing refers to its context any more; an outstanding
        # send or receive does, and would leave peers waiting for this rank their full timeout.
        self.pending_sends.clear()
        self.group = None

    def end_step(self) -> None:
        """Both sides now expect, per channel, the structure of its last transfer.

        With fixed_shapes each channel's expectation is set once, after the first step that
        used it (an evaluation pass before the first training step uses other channels), and
        never moves.
        """
        for channel, meta in self.last_meta.items():
            if channel in self.in_order_channels and not (self.fixed_shapes and channel in self.expected):
                self.expected[channel] = meta
