"""A pipeline's life on one rank: its own process groups, what happens when a rank fails, and close.

Everything a distributed pipeline opens lives here, so that "what happens when a rank dies"
and "what does close() release" are answered in one file:

- **Its own process groups.** A pipeline never communicates on the group it is given (the
  user's: the default group when none). It builds a group of its own over the same ranks,
  plus one per set of ranks that share a tied parameter, and uses only those. On a failure
  it can then close *its* connections at once, which is what unblocks peers waiting in gloo,
  while the user's groups stay usable: after a caught conveyor error, ``dist.barrier()``
  and ``dist.destroy_process_group()`` work as before.
- **Failure.** A rank that fails publishes its message (the transport's failure board: the
  store, and for shared memory its rings), drops every handle on its groups, destroys them,
  and raises; peers raise :class:`~conveyor.errors.PeerFailure` with that message. The
  pipeline then refuses calls with :class:`~conveyor.errors.PipelineStopped`. Under NCCL,
  whose waits are the GPU's streams, the watcher thread also looks for a killed peer (its
  process gone, its heartbeat stopped) and for a call past ``timeout_s``, aborts every
  communicator of the pipeline together (:mod:`conveyor.runtime.lifecycle.aborts`), and the waiting
  call raises what it saw. What the store says of the peers' health (their processes,
  heartbeats, clean exits and published failures) is read by :mod:`conveyor.runtime.lifecycle.peers`;
  this module decides what to do with it.
- **Close.** ``close()`` (also on ``with``, when the pipeline is garbage collected, and at
  interpreter exit) releases the transport's rings, sockets and pending work and destroys
  the pipeline's groups, so that gloo's threads are joined while the interpreter is
  still whole.

Why close at exit matters: gloo runs collectives on worker threads, and a worker drops its
reference to a finished collective's tensors only after the caller has returned from
``wait()``. When that last reference goes during interpreter finalization, the worker
must take the GIL to free the tensor's Python object, Python ends the thread instead, and
the C++ runtime calls ``std::terminate`` ("terminate called without an active exception",
SIGABRT): a run that did all its work fails. Destroying a group joins its workers, so a
group destroyed before finalization cannot do that. The user's default group is no help
here: importing ``torch._dynamo`` (an optimizer's constructor does) takes references to it
that ``destroy_process_group()`` does not release, so its workers outlive the script.

Example (what :class:`conveyor.Pipeline` does)::

    life = RankLifecycle(user_group=None, timeout_s=300.0)
    transport = DistTransport(life.group, life.global_ranks, life.rank, ...)
    life.attach(transport, on_release=[executor.forget_receives])
    loss = life.guarded(run_step, batch)      # a failure tells the peers and closes the groups
    life.close()
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import gc
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.errors import (
    CommTimeout,
    ConveyorError,
    PipelineClosed,
    PipelineConfigError,
    PipelineStopped,
)
from conveyor.runtime.lifecycle.aborts import GroupAborter
from conveyor.runtime.lifecycle.peers import PeerHealth
from conveyor.runtime.lifecycle.positions import PositionBoard

# Under NCCL the watcher ends a wait past timeout_s and says where everyone is; NCCL's own
# watchdog (which ends the process) is given this much longer, so that it comes second.
NCCL_WATCHDOG_SLACK_S = 60.0

log = logging.getLogger(__name__)

OPEN, STOPPED, CLOSED = "open", "stopped", "closed"


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


class RankLifecycle:
    """This rank's process groups of one pipeline, its failure protocol and its close.

    ``user_group``: the group the pipeline was given (None: the default group); the
    pipeline's own group has the same ranks. ``timeout_s`` bounds the own groups'
    collectives as the pipeline's receives are bounded. ``device``: where the pipeline's
    collectives and transfers run (under NCCL its GPU: each group's communicator is made
    there at once, see :func:`group_creation`; None: the current CUDA device).
    """

    def __init__(self, user_group, timeout_s: float, pipelines: Sequence[Sequence[int]] | None = None,
                 device: torch.device | None = None) -> None:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        self.user_group = user_group
        self.rank = dist.get_rank(user_group)
        self.num_ranks = dist.get_world_size(user_group)
        self.global_ranks = (list(range(self.num_ranks)) if user_group is None
                             else [dist.get_global_rank(user_group, r) for r in range(self.num_ranks)])
        self.backend = str(dist.get_backend(user_group))
        # Failure messages travel through the store, which outlives every group (rank 0's
        # process serves it); held here so that peers can still read them after the user
        # destroyed the default group.
        self.store = _get_default_store()
        self.peers = PeerHealth(self.store, self.rank, self.global_ranks, prefix=self.store_prefix)
        slack = NCCL_WATCHDOG_SLACK_S if self.backend == "nccl" else 0.0
        self.timeout = datetime.timedelta(seconds=timeout_s + slack)
        self.groups: list[Any] = []  # every group this pipeline made, the main one first
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
        self.transport = None
        self.board: PositionBoard | None = None
        self._on_release: list[Callable[[], None]] = []
        self.state = OPEN
        self.stopped_because: str | None = None
        # NCCL waits are the streams': a rank waiting for a peer that failed blocks in a kernel
        # until the communicator is aborted, so the watcher aborts once the store names a failure,
        # a peer's process is gone or its heartbeat stopped, or a call waited past timeout_s.
        self.abort_on_failure = self.backend == "nccl"
        self.aborted_because: str | None = None
        self.abort_error: ConveyorError | None = None  # what the watcher aborted for, raised by the call
        self.timeout_s = timeout_s
        self._aborter = GroupAborter(self.rank)  # the watcher's and a failing call's aborts, each group once
        self._call_started: float | None = None  # monotonic time the running pipeline call began
        # (began, its end's CUDA event) of each call whose GPU work may still run, oldest first
        self._in_flight: collections.deque[tuple[float, Any]] = collections.deque()
        # Rank 0's token, agreed at construction: this pipeline's store keys carry it, because a
        # group's name comes back once a closed pipeline's groups are gone, and a later pipeline on
        # the same ranks must not read the keys the dead one left in the store.
        self.token: str | None = None

    # --- set-up --------------------------------------------------------------------------
    def _new_group(self, global_ranks: Sequence[int], whole_job: bool):
        """A process group of this pipeline's own over ``global_ranks`` (None on a rank outside it).

        ``whole_job``: every rank of the job calls this, in the same order, as torch's naming of
        groups requires. Else only the ranks of the user's group do: then the group is split
        from the user's group (every rank of it taking part) when torch splits communicators
        eagerly, else made by its members alone, with torch's local synchronisation. Either way
        its communicator is made now, not at its first operation (see :func:`group_creation`).
        """
        import torch.distributed as dist

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
        self.groups.append(group)
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
        import torch.distributed as dist

        me = dist.get_rank()
        mine = None
        for members in memberships:
            group = self._new_group(members, whole_job=True)
            if me in members:
                mine = group
        return mine

    def agree(self, fields: Mapping[str, str], group=None, who: str = "ranks") -> None:
        """Check that every rank built the same pipeline; raise PipelineConfigError on each if not.

        ``fields`` (what was built: schedule, model, options, as short strings) are gathered
        from every rank once, at construction, so that ranks given different schedules,
        microbatch counts, split points or models fail at once with what differs, instead of
        hanging in their first step. Every rank reaches the same verdict, so none waits.
        ``group`` (default: the pipeline's) and ``who`` (``"replicas"`` over the ranks holding
        this rank's stages in every replica) say among whom.
        """
        import torch.distributed as dist

        group = self.group if group is None else group
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, {**fields, "_token": uuid.uuid4().hex}, group=group)
        if self.token is None and group is self.group:
            self.token = everyone[0]["_token"]
        for name in fields:
            values = [theirs.get(name) for theirs in everyone]
            if len(set(values)) > 1:
                by_value: dict[Any, list[int]] = {}
                for rank, value in enumerate(values):
                    by_value.setdefault(value, []).append(rank)
                label = "replica(s)" if who == "replicas" else "rank(s)"
                told = "; ".join(f"{label} {ranks}: {value}" for value, ranks in by_value.items())
                raise PipelineConfigError(
                    f"the {who} of this pipeline were not built alike: their {name} differs ({told}). "
                    "Build the pipeline with the same arguments on every rank (the same script, "
                    "the same model and schedule)"
                )

    def attach(self, transport, on_release: Sequence[Callable[[], None]] = (),
               position: Callable[[], dict[str, Any]] | None = None,
               render: Callable[[list], str] | None = None) -> None:
        """The transport this pipeline moves payloads with, and what else holds work on its groups.

        ``position`` (the executor's) and ``render`` (positions -> picture) make this rank answer
        "where is everyone" (:mod:`conveyor.runtime.lifecycle.positions`) until the pipeline closes.
        """
        self.transport = transport
        self._on_release = list(on_release)
        self.peers.read_failures_from(transport)
        if position is not None:
            self.board = PositionBoard(self.store, f"conveyor/where/{self.store_prefix()}", self.rank, self.num_ranks,
                                       position, render=render, global_rank=self.global_ranks[self.rank],
                                       on_poll=self._abort_on_peer_failure)
            self.board.start()

    def store_prefix(self) -> str:
        """This pipeline's own part of a store key: its group's name and the token its ranks agreed on."""
        import torch.distributed as dist

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

    def _abort_on_peer_failure(self) -> None:
        """Run by the watcher thread each poll under NCCL: abort this pipeline's communicators once
        a peer published a failure, a peer's process is gone or its heartbeat stopped, or a call
        has waited longer than timeout_s.

        A killed peer publishes nothing, and a rank waiting for it waits in a kernel that only
        an abort ends (else NCCL's watchdog ends the process). What the watcher saw becomes
        :attr:`abort_error`, which the waiting call raises.
        """
        if not self.abort_on_failure or self.state != OPEN or self.abort_error is not None or self.transport is None:
            return
        error = self.peers.verdict() or self._timeout_verdict()
        if error is None:
            return
        self.abort_error, self.aborted_because = error, str(error)
        log.warning("conveyor: rank %d aborts its communicators: %s", self.rank, error)
        self._aborter.abort(list(self.groups))

    def _timeout_verdict(self) -> CommTimeout | None:
        """A pipeline call, or the GPU work it queued, running longer than timeout_s."""
        while self._in_flight and self._in_flight[0][1].query():  # the host returned, the kernels too
            self._in_flight.popleft()
        began = [self._call_started, *(call[0] for call in list(self._in_flight)[:1])]
        started = min((b for b in began if b is not None), default=None)
        if started is None or time.monotonic() - started <= self.timeout_s:
            return None
        return CommTimeout(
            f"rank {self.rank}: a pipeline call has waited more than timeout_s={self.timeout_s:g} s for its "
            "peers (NCCL waits on the GPU's streams, so this rank's watcher aborted the pipeline's "
            "communicators); a peer is slow, stuck or running another schedule (raise timeout_s= if the "
            "step is legitimately that slow)"
        )

    # --- calls ---------------------------------------------------------------------------
    def check_usable(self) -> None:
        """Raise if the pipeline was closed or stopped by a failure."""
        if self.state == CLOSED:
            raise PipelineClosed(
                f"rank {self.rank}: this pipeline was closed (pipe.close() or the end of its `with` block); "
                "build a new Pipeline to go on"
            )
        if self.state == OPEN and self.abort_error is not None:  # aborted between calls
            error = self._with_picture(self.abort_error)
            self.fail(error, error)
            raise error
        if self.state == STOPPED:
            raise PipelineStopped(
                f"rank {self.rank}: this pipeline stopped after a failure ({self.stopped_because}) and closed "
                "its own process groups (yours are untouched); build a new Pipeline to go on"
            )

    def guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``; if it raises, every rank of the pipeline stops with the reason.

        A peer that failed closes its connections after publishing why; whichever
        communication call notices first (send, post, wait, collective) reports that. Under
        NCCL the watcher may abort the communicators while ``fn`` runs (a dead or silent peer,
        a wait past timeout_s): then what it saw is raised, whether ``fn`` broke or returned
        results that the abort made worthless.
        """
        self.check_usable()
        outer = self._call_started  # a call inside a call: the outer one's clock runs on
        started = self._call_started = outer if outer is not None else time.monotonic()
        try:
            result = fn(*args)
        except Exception as exc:
            error = self._explain(exc)
            self.fail(error, exc)
            if error is exc:
                raise
            raise error from exc
        finally:
            self._call_started = outer
        if self.abort_error is not None:
            error = self._with_picture(self.abort_error)
            self.fail(error, error)
            raise error
        if self.abort_on_failure and outer is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            done = torch.cuda.Event()  # the watcher asks it (no wait) whether the call's kernels ended
            done.record()
            self._in_flight.append((started, done))
        return result

    def _explain(self, exc: Exception) -> Exception:
        """What to raise for ``exc``: the watcher's finding, a peer's failure, or ``exc`` itself."""
        if self.abort_error is not None:
            return self._with_picture(self.abort_error)
        if isinstance(exc, ConveyorError):
            return self._with_picture(exc)
        cause = self.peers.cause(exc)
        return exc if cause is None else cause

    def _with_picture(self, error: Exception) -> Exception:
        """A timeout says where every rank stands (asked through the store; the data plane is stuck)."""
        if isinstance(error, CommTimeout) and self.board is not None and "where every rank" not in str(error):
            picture = self.board.picture()
            if picture:
                error.args = (f"{error}\n\nwhere every rank of the pipeline stands (>action<: where it is):"
                              f"\n{picture}",)
        return error

    # --- failure and close -----------------------------------------------------------------
    def fail(self, exc: BaseException, raised: BaseException) -> None:
        """Tell the peers why, then close this pipeline's connections so that none of them waits for us.

        Peers blocked in a gloo receive from this rank only notice once its sockets close,
        and those close only when nothing holds the group: not the transport, not a pending
        send or receive, not the frames of ``raised``'s traceback (which the caller keeps, in
        its ``except`` block, for as long as it likes). So the runtime's frames in that
        traceback (and torch.distributed's) lose their local variables; the user's own
        frames keep theirs.
        """
        if self.state != OPEN:
            return
        message = f"{type(exc).__name__}: {exc}"
        if self.transport is not None:
            self.transport.publish_failure(message)
        self.state = STOPPED
        self.stopped_because = message
        _clear_runtime_frames(raised.__traceback__)
        self._release()

    def close(self) -> None:
        """Release everything this pipeline holds on this rank; idempotent, never communicates.

        Call it at the same point on every rank (after the last step): a peer still
        waiting for this rank would see its connections close.
        """
        if self.state == CLOSED:
            return
        if self.state == OPEN and self.transport is not None:
            # What this rank sent must have left before its connections go.
            with contextlib.suppress(Exception):
                self.transport.finish_sends()
        self.state = CLOSED
        self._release()

    def _release(self) -> None:
        if self.board is not None:
            self.board.stop()
            if self.state == CLOSED and self.abort_error is None:  # our exit is then no death to peers
                self.peers.say_left()
        for release in self._on_release:
            release()
        if self.transport is not None:
            self.transport.close()
        self._destroy_groups()

    def _destroy_groups(self) -> None:
        import torch.distributed as dist

        groups, self.groups, self.group = self.groups, [], None
        # Gone from torch's tables when the user destroyed every group first (then dropping our
        # reference is what ends it).
        live = [group for group in groups if dist.is_initialized() and group in dist.distributed_c10d._world.pg_map]
        if self.backend == "nccl" and (self.state == STOPPED or self.abort_error is not None):
            # Destroying waits for pending work, which a failed peer never completes: abort
            # instead, those the watcher has not aborted yet, together; then torch forgets them.
            self._aborter.abort(live)
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


# Frames that may hold the process group or its pending work: conveyor's, and those of
# torch.distributed's calls that raised (isend's frame holds the group).
_RUNTIME_DIRS = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    os.path.dirname(os.path.abspath(torch.distributed.__file__)) + os.sep,
)


def _clear_runtime_frames(traceback) -> None:
    """Drop the local variables of conveyor's and torch.distributed's finished frames in ``traceback``."""
    while traceback is not None:
        frame = traceback.tb_frame
        if frame.f_code.co_filename.startswith(_RUNTIME_DIRS):
            with contextlib.suppress(RuntimeError):  # a frame still running keeps its locals
                frame.clear()
        traceback = traceback.tb_next
