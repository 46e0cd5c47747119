"""Choosing and building a pipeline's transport: shared memory, the process group, or both.

``"auto"`` (gloo): shared memory when the launcher says every rank is on this host
(``LOCAL_WORLD_SIZE == WORLD_SIZE``, as torchrun sets them); else the ranks tell each other
their hosts through the store and every pair of ranks that talk uses shared memory where
they share a host: shared memory, hybrid or the process group. NCCL (whose point-to-point
ignores tags): ``"ordered"`` (:mod:`conveyor.runtime.transport.ordered`), which gloo runs too, to check it.

Example (what :class:`conveyor.Pipeline` does)::

    transport = build_transport("auto", rank, schedule, life, timeout_s=300.0, fixed_shapes=False)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from conveyor.errors import PipelineConfigError
from conveyor.options import TRANSPORTS
from conveyor.runtime.lifecycle.peers import host_identity
from conveyor.runtime.lifecycle.rank import RankLifecycle
from conveyor.runtime.transport.hybrid import HostExchange, HybridTransport
from conveyor.runtime.transport.ordered import OrderedTransport
from conveyor.runtime.transport.process_group import DistTransport
from conveyor.runtime.transport.shm import SharedMemoryTransport, shared_memory_supported
from conveyor.runtime.transport.transport import Transport
from conveyor.runtime.transport.wire import BACKWARD, EVAL_FORWARD, FORWARD, Channel, flatten_payload
from conveyor.schedule.ir import Schedule


def build_transport(kind: str, rank: int, schedule: Schedule, life: RankLifecycle, *, timeout_s: float,
                    fixed_shapes: bool, in_order_channels: frozenset[Channel] = frozenset(),
                    device: torch.device | None = None, variable_shapes: bool = False) -> Transport:
    """This rank's transport of ``kind`` (one of :data:`TRANSPORTS`) over ``life``'s group and store.

    ``device``: the stage device; under NCCL the ordered transport's buffers live there.
    ``variable_shapes``: microbatches change shapes every step; the ordered transport then agrees on
    each transfer's structure every step (the others carry it with the data when it changes).

    ``in_order_channels``: see :class:`~conveyor.runtime.transport.transport.Transport` (the pass chain's,
    ``Executable.in_order_channels(rank)``).
    """
    if kind not in TRANSPORTS:
        raise PipelineConfigError(f"transport must be one of {', '.join(map(repr, TRANSPORTS))}; got {kind!r}")
    global_ranks = life.global_ranks
    why_not = shared_memory_supported()
    prefix = "-".join(map(str, global_ranks))  # names this group's keys in the store
    hosts = None
    if kind == "auto":
        kind = "process_group"
        world_size = os.environ.get("WORLD_SIZE")
        one_host = world_size is not None and os.environ.get("LOCAL_WORLD_SIZE") == world_size
        if life.backend == "gloo" and one_host:
            kind = "process_group" if why_not else "shared_memory"  # the launcher says all are here
        elif life.backend == "gloo":
            hosts = _hosts(rank, life, prefix, timeout_s, why_not)
            kind = _transport_for(schedule, hosts)
    if life.backend == "nccl" and kind in ("auto", "process_group"):
        kind = "ordered"  # the tagged protocol's CPU buffers and multi-part messages cannot run on NCCL
    if kind == "ordered":
        return ordered_transport(rank, schedule, life, timeout_s, device, variable_shapes)
    if kind == "hybrid" and life.backend != "gloo":
        raise PipelineConfigError(
            f"transport='hybrid' carries CPU tensors and needs the gloo backend; this group uses "
            f"{life.backend!r}: use transport='process_group'"
        )
    if kind != "process_group" and why_not:
        raise PipelineConfigError(f"transport={kind!r} cannot run here: {why_not}; use transport='process_group'")
    remote = DistTransport(life.group, global_ranks, rank, schedule.num_stages, schedule.num_microbatches, timeout_s,
                           fixed_shapes, in_order_channels)
    if kind == "process_group":
        return remote
    peers, local_ranks = neighbours(schedule, rank), None
    if kind == "hybrid":  # shared memory to the peers on this host only, the process group to the others
        hosts = hosts if hosts is not None else _hosts(rank, life, prefix, timeout_s, why_not)
        peers = {peer for peer in peers if hosts[peer] == hosts[rank]}
        local_ranks = hosts.count(hosts[rank])
    local = SharedMemoryTransport(rank, peers, life.store, prefix, len(global_ranks), timeout_s, fixed_shapes,
                                  local_ranks=local_ranks, rank_to_global=global_ranks)
    return local if kind == "shared_memory" else HybridTransport(local, remote, peers)


def ordered_transport(rank: int, schedule: Schedule, life: RankLifecycle, timeout_s: float,
                      device: torch.device | None = None, variable_shapes: bool = False) -> OrderedTransport:
    """The order-matched transport over a process group per channel; buffers on this rank's GPU under NCCL
    (the stage device when it is a GPU, else the current CUDA device)."""
    groups = life.groups.channel_groups(channels(schedule))
    if life.backend != "nccl":
        device = torch.device("cpu")
    elif device is None or device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return OrderedTransport(rank, life.global_ranks, groups, life.store, life.groups.store_prefix(), timeout_s,
                            device, life.backend, variable_shapes=variable_shapes)


def channels(schedule: Schedule) -> list[tuple[int, int]]:
    """Every (src, dst) pair of ranks that ``schedule`` sends something along, sorted: both ways
    across each stage boundary between ranks (forwards one way, gradients the other).

    Example:
        >>> import conveyor.schedule as cs
        >>> channels(cs.build("1f1b", ranks=3, microbatches=3))
        [(0, 1), (1, 0), (1, 2), (2, 1)]
    """
    rank_of = schedule.placement.rank_of
    pairs = {(rank_of(s), rank_of(s + 1)) for s in range(schedule.num_stages - 1)}
    return sorted({pair for a, b in pairs if a != b for pair in ((a, b), (b, a))})


def neighbours(schedule: Schedule, rank: int) -> set[int]:
    """The ranks that ``rank`` sends to or receives from: those of its stages' neighbours."""
    return {dst for src, dst in channels(schedule) if src == rank}


def _hosts(rank: int, life: RankLifecycle, prefix: str, timeout_s: float, why_not: str) -> list[int]:
    """Every rank's host, as a number; a rank that cannot share memory is a host of its own."""
    identity = f"no-shared-memory/{life.global_ranks[rank]}" if why_not else host_identity()
    return HostExchange.run(life.store, prefix, rank, len(life.global_ranks), identity, timeout_s)


def _transport_for(schedule: Schedule, hosts: list[int]) -> str:
    """Shared memory if every pair of ranks that talk shares a host, the process group if none
    does, else both. Every rank reaches the same answer (same hosts, same schedule)."""
    pairs = channels(schedule)
    local = sum(hosts[a] == hosts[b] for a, b in pairs)
    if pairs and local == len(pairs):
        return "shared_memory"
    return "hybrid" if local else "process_group"


def seed_shapes(transport: Transport, shapes: Mapping[int, Any], num_stages: int) -> None:
    """Tell both ends of each boundary what will cross it (``TransferOptions(shapes=...)``), so no step
    has to exchange it: ``shapes`` maps a stage to an example of its output for one microbatch."""
    last = num_stages - 1
    for stage, example in shapes.items():
        if not isinstance(stage, int) or not 0 <= stage < last:
            raise PipelineConfigError(
                f"shapes= names stage {stage!r}, but only the outputs of stages 0..{last - 1} cross "
                "a stage boundary; key each example by the stage that outputs it"
            )
        meta, tensors = flatten_payload(example)
        transport.seed((FORWARD, stage), meta)
        detached = pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), example)
        transport.seed((EVAL_FORWARD, stage), flatten_payload(detached)[0])
        # What comes back: one gradient per gradient-carrying output, in flatten order.
        grads = tuple(torch.empty(t.shape, dtype=t.dtype) for t in tensors if t.requires_grad)
        transport.seed((BACKWARD, stage + 1), flatten_payload(grads)[0])
