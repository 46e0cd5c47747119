"""A pipeline's life on one rank: its own process groups, what happens when a rank fails, and close.

Everything a distributed pipeline opens is held here, so that "what happens when a rank dies"
and "what does close() release" are answered in one place; the groups are made by
:class:`~conveyor.runtime.lifecycle.groups.OwnGroups`, the watch under NCCL is
:class:`~conveyor.runtime.lifecycle.watch.FailureWatch`:

- **Its own process groups** (:mod:`~conveyor.runtime.lifecycle.groups`): on a failure it can
  close *its* connections at once, which unblocks peers waiting in gloo, while the user's groups
  stay usable: after a caught conveyor error, ``dist.barrier()`` and
  ``dist.destroy_process_group()`` work as before.
- **Failure.** A rank that fails publishes its message (the transport's failure board: the
  store, and for shared memory its rings), drops every handle on its groups, destroys them,
  and raises; peers raise :class:`~conveyor.errors.PeerFailure` with that message. The
  pipeline then refuses calls with :class:`~conveyor.errors.PipelineStopped`. Under NCCL the
  watcher also aborts on a killed peer or a call past ``timeout_s``
  (:mod:`~conveyor.runtime.lifecycle.watch`), and the waiting call raises what it saw. What the
  store says of the peers' health is read by :mod:`~conveyor.runtime.lifecycle.peers`; this
  module decides what to do with it.
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
    life.groups.agree({"schedule": ...})      # the ranks built the same pipeline
    transport = DistTransport(life.group, life.global_ranks, life.rank, ...)
    life.attach(transport, on_release=[executor.forget_receives])
    loss = life.guarded(run_step, batch)      # a failure tells the peers and closes the groups
    life.close()
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.distributed_c10d import _get_default_store

import conveyor
from conveyor.errors import CommTimeout, ConveyorError, PipelineClosed, PipelineStopped
from conveyor.runtime.lifecycle.groups import OwnGroups
from conveyor.runtime.lifecycle.peers import PeerHealth
from conveyor.runtime.lifecycle.positions import PositionBoard
from conveyor.runtime.lifecycle.watch import FailureWatch

log = logging.getLogger(__name__)

OPEN, STOPPED, CLOSED = "open", "stopped", "closed"


class RankLifecycle:
    """This rank's life in one pipeline: its own groups, its failure protocol and its close.

    ``user_group``, ``timeout_s``, ``pipelines`` and ``device``: how its groups are made (see
    :class:`~conveyor.runtime.lifecycle.groups.OwnGroups`, ``groups``); ``timeout_s`` also bounds
    a call under NCCL (see :class:`~conveyor.runtime.lifecycle.watch.FailureWatch`, ``watch``).
    ``rank``, ``global_ranks`` and ``backend`` are the groups'; ``state`` is open, stopped (by a
    failure) or closed.
    """

    def __init__(self, user_group, timeout_s: float, pipelines: Sequence[Sequence[int]] | None = None,
                 device: torch.device | None = None) -> None:
        self.groups = OwnGroups(user_group, timeout_s, pipelines, device)
        self.rank, self.global_ranks, self.backend = self.groups.rank, self.groups.global_ranks, self.groups.backend
        # Failure messages travel through the store, which outlives every group (rank 0's
        # process serves it); held here so that peers can still read them after the user
        # destroyed the default group.
        self.store = _get_default_store()
        self.peers = PeerHealth(self.store, self.rank, self.global_ranks, prefix=self.groups.store_prefix)
        self.watch = FailureWatch(self.rank, self.backend, timeout_s, self.peers)
        self.transport = None
        self.board: PositionBoard | None = None
        self._on_release: list[Callable[[], None]] = []
        self.state = OPEN
        self.stopped_because: str | None = None

    @property
    def group(self):
        """The pipeline's main group (None once closed)."""
        return self.groups.group

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
            self.board = PositionBoard(self.store, f"conveyor/where/{self.groups.store_prefix()}", self.rank,
                                       self.groups.num_ranks,
                                       position, render=render, global_rank=self.global_ranks[self.rank],
                                       on_poll=self._abort_on_peer_failure)
            self.board.start()

    def _abort_on_peer_failure(self) -> None:
        """Run by the watcher thread each poll: under NCCL, abort on a peer's failure or a call past timeout_s."""
        if self.state == OPEN and self.transport is not None:
            self.watch.poll(self.groups.made)

    # --- calls ---------------------------------------------------------------------------
    def check_usable(self) -> None:
        """Raise if the pipeline was closed or stopped by a failure."""
        if self.state == CLOSED:
            raise PipelineClosed(
                f"rank {self.rank}: this pipeline was closed (pipe.close() or the end of its `with` block); "
                "build a new Pipeline to go on"
            )
        if self.state == OPEN:
            self._stop_if_aborted()  # aborted between calls
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
        watch = self.watch
        outer = watch.call_started  # a call inside a call: the outer one's clock runs on
        started = watch.call_started = outer if outer is not None else time.monotonic()
        try:
            result = fn(*args)
        except Exception as exc:
            error = self._explain(exc)
            self.fail(error, exc)
            if error is exc:
                raise
            raise error from exc
        finally:
            watch.call_started = outer
        self._stop_if_aborted()
        if watch.abort_on_failure and outer is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            done = torch.cuda.Event()  # the watcher asks it (no wait) whether the call's kernels ended
            done.record()
            watch.in_flight.append((started, done))
        return result

    def _stop_if_aborted(self) -> None:
        """Under NCCL the watcher aborted the communicators: fail with what it saw."""
        if self.watch.abort_error is not None:
            error = self._with_picture(self.watch.abort_error)
            self.fail(error, error)
            raise error

    def _explain(self, exc: Exception) -> Exception:
        """What to raise for ``exc``: the watcher's finding, a peer's failure, or ``exc`` itself."""
        if self.watch.abort_error is not None:
            return self._with_picture(self.watch.abort_error)
        if isinstance(exc, ConveyorError):
            return self._with_picture(exc)
        return self.peers.cause(exc) or exc

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
            if self.state == CLOSED and self.watch.abort_error is None:  # our exit is then no death to peers
                self.peers.say_left()
        for release in self._on_release:
            release()
        if self.transport is not None:
            self.transport.close()
        self._destroy_groups()

    def _destroy_groups(self) -> None:
        failed = self.backend == "nccl" and (self.state == STOPPED or self.watch.abort_error is not None)
        self.groups.destroy(self.watch.aborter if failed else None)


# Frames that may hold the process group or its pending work: conveyor's, and those of
# torch.distributed's calls that raised (isend's frame holds the group).
_RUNTIME_DIRS = (
    os.path.dirname(os.path.abspath(conveyor.__file__)) + os.sep,
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
