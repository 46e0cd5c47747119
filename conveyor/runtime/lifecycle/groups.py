"""A pipeline's own process groups on one rank: how they are made, and the agreement of its ranks.

A pipeline never communicates on the group it is given (the user's: the default group when
none). It builds a group of its own over the same ranks, plus one per set of ranks that share a
tied parameter, one per replica position with data parallelism, and one per channel for an
order-matched transport, and uses only those: on a failure it can close *its* connections at
once, which unblocks peers waiting in gloo, while the user's groups stay usable. Under NCCL each
group is connected as it is made (see :func:`group_creation`). Before its first step, the ranks
check that they built the same pipeline (:meth:`OwnGroups.agree`).

Example (what :class:`~conveyor.runtime.lifecycle.rank.RankLifecycle` does)::

    groups = OwnGroups(user_group=None, timeout_s=300.0)
    groups.agree({"schedule": "1f1b P=2 M=4"})
    tied = groups.subgroup([0, 1])
    groups.destroy()
"""

from __future__ import annotations

import datetime
import gc
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from conveyor.errors import PipelineConfigError
from conveyor.runtime.lifecycle.aborts import GroupAborter

# Under NCCL the watcher ends a wait past timeout_s and says where everyone is; NCCL's own
# watchdog (which ends the process) is given this much longer, so that it comes second.
NCCL_WATCHDOG_SLACK_S = 60.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupCreation:
    """How a pipeline makes its process groups (see :func:`group_creation`).

    ``split``: groups over ranks of the user's group are split from it, every rank of that
    group taking part in each split (torch binds NCCL communicators to a device and splits
    them eagerly); else only their members create them. ``eager_device``: the device each new
    group's communicator is created on at once (``new_group(device_id=...)``), None where
    torch does so itself (a split) or the backend connects in its constructor (gloo).
    """

    split: bool
    eager_device: torch.device | None


def group_creation(backend: str, bound_device: torch.device | None, device: torch.device | None) -> GroupCreation:
    """How to make a pipeline's groups on ``backend`` so that no communicator is made inside a step.

    NCCL creates a group's communicator lazily, at its first operation, and creating it blocks
    the host until every member is there: a rank could then block in a step, waiting for a
    peer that itself waits (for a structure, :func:`conveyor.runtime.lifecycle.host_blocking.check_first_step`)
    on this rank. So under NCCL every group is connected when it is made, on ``device`` (the
    one its operations use), in the order the pipeline makes them, the same on every rank.
    When the default group was bound to a device (``init_process_group(device_id=...)``),
    torch already does that, by splitting the default communicator, which every rank of the
    parent group must join: groups over part of the job are then split from the user's group.

    Example:
        >>> group_creation("nccl", None, torch.device("cuda", 1))
        GroupCreation(split=False, eager_device=device(type='cuda', index=1))
        >>> group_creation("nccl", torch.device("cuda", 1), torch.device("cuda", 1))
        GroupCreation(split=True, eager_device=None)
        >>> group_creation("gloo", None, torch.device("cpu"))
        GroupCreation(split=False, eager_device=None)
    """
    nccl = "nccl" in backend
    if nccl and bound_device is not None:
        return GroupCreation(split=True, eager_device=None)
    eager = device if nccl and device is not None and device.type != "cpu" else None
    return GroupCreation(split=False, eager_device=eager)


class OwnGroups:
    """This rank's own process groups of one pipeline, the main one (``group``) first in ``made``.

    ``user_group``: the group the pipeline was given (None: the default group); the main group
    has the same ranks, ``rank`` and ``global_ranks`` are this rank's place in it and the global
    ranks by place. ``timeout_s`` bounds the groups' collectives as the pipeline's receives are
    bounded. ``pipelines``: with data parallelism, every replica's global ranks. ``device``: where
    the pipeline's collectives and transfers run (under NCCL its GPU: each group's communicator
    is made there at once, see :func:`group_creation`; None: the current CUDA device).
    """

    def __init__(self, user_group, timeout_s: float, pipelines: Sequence[Sequence[int]] | None = None,
                 device: torch.device | None = None) -> None:
        self.user_group = user_group
        self.rank = dist.get_rank(user_group)
        self.num_ranks = dist.get_world_size(user_group)
        self.global_ranks = (list(range(self.num_ranks)) if user_group is None
                             else [dist.get_global_rank(user_group, r) for r in range(self.num_ranks)])
        self.backend = str(dist.get_backend(user_group))
        slack = NCCL_WATCHDOG_SLACK_S if self.backend == "nccl" else 0.0
        self.timeout = datetime.timedelta(seconds=timeout_s + slack)
        self.made: list[Any] = []  # every group this pipeline made, the main one first
        if device is None and "nccl" in self.backend and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        self.creation = group_creation(self.backend, dist.distributed_c10d._get_default_group().bound_device_id,
                                       device)
        # With data parallelism (``pipelines``: every replica's global ranks), every rank of
        # the job builds every replica's groups, in one order: torch then names groups by a
        # job-wide count. Groups built by their members only are named by their ranks and the
        # number of groups alive, which comes back to an earlier value once a closed pipeline's
        # groups are gone: a later group would reuse a dead one's name, and its rendezvous
        # could read the dead group's addresses left in the store.
        self.pipelines = [list(p) for p in pipelines] if pipelines is not None else None
        if self.pipelines is not None:
            self.group = self._each_of(self.pipelines)
        else:
            self.group = self._new_group(self.global_ranks, whole_job=user_group is None)
        # Rank 0's token, agreed at construction: this pipeline's store keys carry it, because a
        # group's name comes back once a closed pipeline's groups are gone, and a later pipeline on
        # the same ranks must not read the keys the dead one left in the store.
        self.token: str | None = None

    def _new_group(self, global_ranks: Sequence[int], whole_job: bool):
        """A process group of this pipeline's own over ``global_ranks`` (None on a rank outside it).

        ``whole_job``: every rank of the job calls this, in the same order, as torch's naming of
        groups requires. Else only the ranks of the user's group do: then the group is split
        from the user's group (every rank of it taking part) when torch splits communicators
        eagerly, else made by its members alone, with torch's local synchronisation. Either way
        its communicator is made now, not at its first operation (see :func:`group_creation`).
        """
        how, me = self.creation, self.global_ranks[self.rank]
        if whole_job:
            group = dist.new_group(list(global_ranks), timeout=self.timeout, device_id=how.eager_device)
        elif how.split:
            # split_group names the ranks by their place in the parent group; non-members get None.
            parent = [dist.get_group_rank(self.user_group, r) for r in global_ranks]
            group = dist.split_group(parent_pg=self.user_group, split_ranks=[parent], timeout=self.timeout)
        elif me in global_ranks:
            group = dist.new_group(list(global_ranks), timeout=self.timeout, use_local_synchronization=True,
                                   device_id=how.eager_device)
        else:
            group = None
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            return None
        self.made.append(group)
        return group

    def subgroup(self, ranks: Sequence[int], replicas: Sequence[Sequence[int]] | None = None):
        """A group over some of the pipeline's ranks (those holding one tied parameter).

        Collective over the whole job, as the pipelines' main groups are when no group was
        given: every rank must call it with the same ranks, in the same order. With data
        parallelism, ``replicas`` lists those positions' global ranks in every replica's
        pipeline: every rank builds each replica's group (torch names groups by the order the
        job builds them) and gets back its own replica's. Split from the user's group when
        torch splits communicators eagerly (then the ranks of other pipelines, which never
        call this, need not take part).
        """
        members = [self.global_ranks[r] for r in ranks]
        if replicas is None and self.creation.split and self.user_group is not None:
            return self._new_group(members, whole_job=False)
        return self._each_of(replicas or [members])

    def job_group(self):
        """A group of the pipeline's own over every rank of every replica (checkpoints span them all)."""
        assert self.pipelines is not None, "only a pipeline with replicas has a job group"
        return self._new_group(sorted(r for p in self.pipelines for r in p), whole_job=True)

    def replica_group(self, memberships: Sequence[Sequence[int]] | None = None):
        """A group of the pipeline's own over the ranks that hold this rank's stages in every
        replica (data parallelism); every rank of the job builds every position's.
        ``memberships``: every such group's global ranks (with tensor parallelism, one per
        pipeline position and TP position); default: each pipeline position across the pipelines."""
        assert self.pipelines is not None, "only a pipeline with replicas has replica groups"
        return self._each_of(memberships or [list(position) for position in zip(*self.pipelines)])

    def _each_of(self, memberships: Sequence[Sequence[int]]):
        """Build a group over each of ``memberships`` (collective over the whole job); keep and
        return the one this rank belongs to."""
        groups = [self._new_group(members, whole_job=True) for members in memberships]
        return next((group for members, group in zip(memberships, groups) if dist.get_rank() in members), None)

    def agree(self, fields: Mapping[str, str], group=None, who: str = "ranks") -> None:
        """Check that every rank built the same pipeline; raise PipelineConfigError on each if not.

        ``fields`` (what was built: schedule, model, options, as short strings) are gathered
        from every rank once, at construction, so that ranks given different schedules,
        microbatch counts, split points or models fail at once with what differs, instead of
        hanging in their first step. Every rank reaches the same verdict, so none waits.
        ``group`` (default: the pipeline's) and ``who`` (``"replicas"`` over the ranks holding
        this rank's stages in every replica) say among whom.
        """
        group = self.group if group is None else group
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, {**fields, "_token": uuid.uuid4().hex}, group=group)
        if self.token is None and group is self.group:
            self.token = everyone[0]["_token"]
        for name in fields:
            values = [theirs.get(name) for theirs in everyone]
            by_value = {value: [rank for rank, v in enumerate(values) if v == value] for value in dict.fromkeys(values)}
            if len(by_value) > 1:
                label = "replica(s)" if who == "replicas" else "rank(s)"
                told = "; ".join(f"{label} {ranks}: {value}" for value, ranks in by_value.items())
                raise PipelineConfigError(
                    f"the {who} of this pipeline were not built alike: their {name} differs ({told}). "
                    "Build the pipeline with the same arguments on every rank (the same script, "
                    "the same model and schedule)"
                )

    def store_prefix(self) -> str:
        """This pipeline's own part of a store key: its group's name and the token its ranks agreed on."""
        name = dist.distributed_c10d._get_process_group_name(self.group)
        return f"{name}/{self.token}" if self.token is not None else name

    def channel_groups(self, channels: Sequence[tuple[int, int]]) -> dict[tuple[int, int], Any]:
        """A group of the pipeline's own per channel (src, dst), both group ranks: {channel: group}
        for the channels this rank is on (an order-matched transport's; see conveyor.schedule.posts).

        Built as the main group was: by every rank of the job, in one order (with data
        parallelism every replica's), or by the ranks of a group of the user's. Each is
        connected as it is made, in sorted channel order on every rank: a communicator made at
        a channel's first transfer would block its rank inside a step (see
        :func:`conveyor.runtime.lifecycle.host_blocking.check_first_step`).
        """
        mine = {}
        for src, dst in sorted(set(channels)):
            pair = [self.global_ranks[src], self.global_ranks[dst]]
            if self.pipelines is not None:
                group = self._each_of([[replica[src], replica[dst]] for replica in self.pipelines])
            else:
                group = self._new_group(pair, whole_job=self.user_group is None)
            if group is not None:
                mine[(src, dst)] = group
        return mine

    def destroy(self, aborter: GroupAborter | None = None) -> None:
        """Destroy every group this pipeline made; with ``aborter`` (a failure under NCCL) abort them instead.

        Destroying waits for pending work, which a failed peer never completes: those the watcher
        has not aborted yet are aborted together, then torch forgets them.
        """
        groups, self.made, self.group = self.made, [], None
        # Gone from torch's tables when the user destroyed every group first (then dropping our
        # reference is what ends it).
        live = [group for group in groups if dist.is_initialized() and group in dist.distributed_c10d._world.pg_map]
        if aborter is not None:
            aborter.abort(live)
            for group in live:
                dist.distributed_c10d._cleanup_process_group_global_state(group)
        else:
            for group in live:
                try:
                    dist.destroy_process_group(group)
                except Exception as exc:  # a peer's failure may have broken it already
                    log.debug("destroying a pipeline process group: %s", exc)
        del groups, live
        # The last references may sit in reference cycles (an exception's frames); the
        # destructor joins gloo's threads, which must happen while the interpreter is whole.
        gc.collect()
