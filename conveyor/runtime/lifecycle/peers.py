"""What one rank can learn about its peers' health from the job's store, when a connection or a wait gives none.

A killed process publishes no failure of its own, and under NCCL a rank waiting for it waits
on the GPU's streams, where no wait of the host notices anything. So each rank leaves in the
store what its peers need to tell a death from a slow step, and reads what they left:

- **Its process.** Each rank says which process it is (pid and host): a peer on the same host
  whose process is gone has exited.
- **Its heartbeat.** The watcher of :mod:`conveyor.runtime.lifecycle.positions` counts it up each poll: a
  peer whose count stands still for ``silence_s`` died or froze, on any host.
- **That it left.** A rank that closed its pipeline cleanly says so: its process may then exit,
  and its heartbeat stop, without a peer taking it for dead.
- **Published failures.** The transport's failure board (the store, and for shared memory its
  rings): what a failing peer said before it closed; what stood there before this pipeline
  began is no failure of this one's.

:class:`PeerHealth` reads these for :class:`~conveyor.runtime.lifecycle.rank.RankLifecycle`, which
acts on what it finds: :meth:`PeerHealth.cause` explains a broken connection, and
:meth:`PeerHealth.verdict` is what the NCCL watcher aborts the communicators for.

Example (what :class:`~conveyor.runtime.lifecycle.rank.RankLifecycle` does)::

    peers = PeerHealth(store, rank, global_ranks, prefix=life.store_prefix)
    peers.read_failures_from(transport)
    failure = peers.verdict()       # the watcher, each poll under NCCL: None while all are well
    cause = peers.cause(exc)        # a call broke: the peer's failure that explains it, if one does
    peers.say_left()                # at a clean close
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from conveyor.errors import PeerFailure
from conveyor.runtime.lifecycle.positions import HEARTBEAT_KEY

# Where each rank says which process it is, so that a peer whose connection broke can tell
# which rank died (a killed process publishes no failure of its own).
_PROCESS_KEY = "conveyor/process/{global_rank}"
# How long a rank whose connection broke looks for the failing peer's message (the peer
# publishes before it closes, but the breakage of any pair of the group can reach this rank
# first) before it names the ranks whose processes or heartbeats are gone.
FAILURE_GRACE_S = 2.0
# How long a peer's heartbeat may stand still before the watcher (NCCL) takes the peer for dead.
# Well above the watcher's poll (0.5 s) and the longest thing a watcher does between beats
# (drawing "where is everyone", up to 3 s): a live peer's watcher never pauses that long.
SILENCE_S = 10.0
# Where a rank says that it closed this pipeline cleanly: its process may then exit, and its
# heartbeat stop, without a peer taking it for dead.
_LEFT_KEY = "conveyor/left/{prefix}/{global_rank}"


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` (on this host) still runs; an unreaped zombie has exited."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    # A process that exited but that its parent has not reaped yet (a launcher waiting on its
    # children one by one) still answers signal 0: read its state.
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


def host_identity() -> str:
    """Which processes can share rings with this one: same kernel boot, user and namespaces.

    Rings are mapped through ``/proc/<pid>/fd`` (same PID namespace, same user) and
    doorbells are abstract Unix sockets (same network namespace); the hostname is there
    for people reading it. ``CONVEYOR_HOST_ID`` replaces it (a launcher that knows
    better; tests that play several hosts on one machine).

    Example:
        >>> host_identity() == host_identity()
        True
    """
    override = os.environ.get("CONVEYOR_HOST_ID")
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
    except OSError:  # not Linux: the transport is not offered there anyway
        boot_id = "?"
    namespaces = []
    for kind in ("pid", "net"):
        try:
            namespaces.append(str(os.stat(f"/proc/self/ns/{kind}").st_ino))
        except OSError:
            namespaces.append("?")
    return f"{socket.gethostname()}/{boot_id}/uid{os.getuid()}/{'/'.join(namespaces)}"


class PeerHealth:
    """This rank's view of its peers' health in one pipeline, read from the job's store.

    ``rank``: this rank's place among ``global_ranks`` (the pipeline's ranks, by place). Made,
    it says in the store which process this rank is. ``prefix``: the pipeline's own part of a
    store key (its group's name and agreed token), asked each time, since the token is agreed
    after the groups are made. ``silence_s``: how long a heartbeat may stand still.
    """

    def __init__(self, store: Any, rank: int, global_ranks: Sequence[int], prefix: Callable[[], str]) -> None:
        self.store, self.rank, self.global_ranks, self.prefix = store, rank, list(global_ranks), prefix
        self.num_ranks = len(self.global_ranks)
        self.silence_s = SILENCE_S
        self.failure_board: Any = None  # where failures are published (the transport), once attached
        self._stale_failures = ""  # what peers had published before this pipeline began
        self._beats: dict[int, tuple[int, float]] = {}  # rank -> (heartbeat count, when it last moved)
        with contextlib.suppress(Exception):
            self.store.set(_PROCESS_KEY.format(global_rank=self.global_ranks[rank]),
                           f"{os.getpid()} {host_identity()}")

    def read_failures_from(self, board: Any) -> None:
        """Where peers' failures are published: ``board.peer_failures()`` (the transport's), asked each time."""
        self.failure_board = board
        # The store's failure board is the job's: what an earlier pipeline's ranks published is
        # no failure of this one's (the watcher acts only on news).
        self._stale_failures = board.peer_failures()

    def cause(self, exc: Exception) -> PeerFailure | None:
        """The failure of a peer that explains ``exc``, if one does."""
        import torch.distributed as dist

        if not isinstance(exc, RuntimeError) or self.failure_board is None:
            return None
        failures = self.failure_board.peer_failures()
        if failures:
            return PeerFailure(failures)
        if not (isinstance(exc, dist.DistError) or "onnection" in str(exc)):
            return None
        # A broken connection: the failing peer (or the first rank to notice a dead one) may
        # be about to say why; else name the ranks whose processes are gone (on this host) or
        # whose heartbeats stopped (on any host).
        start = time.monotonic()
        beats = self.heartbeats()
        failures, dead = "", []
        while time.monotonic() < start + FAILURE_GRACE_S:
            dead = self.exited()
            failures = self.failure_board.peer_failures()
            if failures or dead:
                break
            time.sleep(0.1)
        if not (failures or dead):
            now = self.heartbeats()
            dead = [f"rank {rank} stopped answering (no heartbeat for {FAILURE_GRACE_S:g} s: its process "
                    "died or froze)" for rank in range(self.num_ranks)
                    if rank != self.rank and now.get(rank) == beats.get(rank)]
        if failures:
            return PeerFailure(failures)
        if dead:
            return PeerFailure(f"{'; '.join(dead)} ({exc})")
        return PeerFailure(f"{exc}; a peer probably died: look at its output")

    def verdict(self) -> PeerFailure | None:
        """A peer's failure: published, or its process gone, or its heartbeat silent for ``silence_s``."""
        try:
            self.store.add(HEARTBEAT_KEY.format(global_rank=self.global_ranks[self.rank]), 0)
        except Exception as exc:  # the store's server is a process of the job (rank 0, or the launcher's)
            return PeerFailure(f"rank {self.rank} lost the job's store ({type(exc).__name__}: {exc}): the "
                               "process serving it (global rank 0, or the launcher) has died")
        failures = self.failure_board.peer_failures() if self.failure_board is not None else ""
        if failures and failures != self._stale_failures:
            return PeerFailure(failures)
        dead = self.exited() + self.silent()
        if dead:
            return PeerFailure(f"{'; '.join(dead)}; rank {self.rank} aborted the pipeline's communicators")
        return None

    def heartbeats(self) -> dict[int, int]:
        """Each peer's heartbeat count (see conveyor.runtime.lifecycle.positions), where the store has one."""
        beats = {}
        for rank, global_rank in enumerate(self.global_ranks):
            key = HEARTBEAT_KEY.format(global_rank=global_rank)
            with contextlib.suppress(Exception):
                if rank != self.rank and self.store.check([key]):
                    beats[rank] = self.store.add(key, 0)
        return beats

    def exited(self) -> list[str]:
        """'rank R (pid P) has exited' for each peer on this host whose process is gone."""
        here = host_identity()
        gone = []
        for rank, global_rank in enumerate(self.global_ranks):
            if rank == self.rank:
                continue
            try:
                pid_text, _, host = self.store.get(_PROCESS_KEY.format(global_rank=global_rank)).decode().partition(" ")
            except Exception:  # the store went with rank 0's process
                continue
            if host == here and not process_alive(int(pid_text)) and not self.left(rank):
                named = f"rank {rank}" if rank == global_rank else f"rank {rank} (global rank {global_rank})"
                gone.append(f"{named} (pid {pid_text}) has exited")
        return gone

    def silent(self) -> list[str]:
        """'rank R stopped answering ...' for each peer whose heartbeat has not moved for ``silence_s``."""
        now, silent = time.monotonic(), []
        for rank, count in self.heartbeats().items():
            seen = self._beats.get(rank)
            if seen is None or seen[0] != count:
                self._beats[rank] = (count, now)
            elif now - seen[1] > self.silence_s and not self.left(rank):
                silent.append(f"rank {rank} stopped answering (no heartbeat for {now - seen[1]:.0f} s: "
                              "its process died or froze)")
        return silent

    def left(self, rank: int) -> bool:
        """Whether ``rank`` closed this pipeline cleanly (its process may be gone: nothing failed)."""
        try:
            return bool(self.store.check([self._left_key(rank)]))
        except Exception:  # no group left to name the key by, or no store
            return False

    def say_left(self) -> None:
        """Say that this rank closed this pipeline cleanly: its exit is then no death to its peers."""
        with contextlib.suppress(Exception):
            self.store.set(self._left_key(self.rank), "closed")

    def _left_key(self, rank: int) -> str:
        return _LEFT_KEY.format(prefix=self.prefix(), global_rank=self.global_ranks[rank])
