"""Persistent groups of forked gloo ranks that run benchmark calls on command.

The comparison keeps two groups alive at once, one per library, and steps them
in turn (A B A B): each library runs in its own processes, so peak RSS per rank
is its own, and neither library's steps overlap the other's. A group's ranks are
forked from a :class:`Zygote`: a process that imported torch and one library, so that
a rank carries the memory of its own library only (forked straight from the parent,
every rank would also carry whatever the parent imported for the other side). (A one-shot helper
such as ``conveyor.testing.run_ranks`` returns only when its ranks finish, so it
cannot interleave two live groups.)

Every rank sets ``torch.set_num_threads(1)`` and joins its own gloo process group
(one TCP store per group). A call sends the same function to every rank, which
runs ``fn(worker, *args)``; the parent waits for all answers with a timeout. A
rank that raises or dies fails the call with its traceback, and the whole group
is killed (its peers may be blocked in a receive from it).

Example:
    >>> with RankGroup(2) as group:
    ...     group.call(place)
    [(0, 2), (1, 2)]
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait
from typing import Any


class RankFailure(RuntimeError):
    """A rank raised or died during a call; the message carries its traceback."""


class RankTimeout(TimeoutError):
    """Some ranks did not answer a call in time (often: a peer is blocked in a receive)."""


@dataclass
class Worker:
    """What a call sees inside a rank: its place in the group and a per-process state dict."""

    rank: int
    world_size: int
    distributed: bool
    state: dict[str, Any] = field(default_factory=dict)


def place(worker: Worker) -> tuple[int, int]:
    """``(rank, world_size)`` of the calling rank: the smallest useful call."""
    return worker.rank, worker.world_size


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(
    rank: int, world_size: int, port: int | None, conn: Connection, timeout_s: float
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # What torchrun tells every rank it starts on one machine (conveyor picks its transport by it).
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    worker = Worker(rank, world_size, distributed=port is not None)
    try:
        if port is not None:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )
        conn.send((True, None))
    except BaseException:
        conn.send((False, traceback.format_exc()))
        return
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:
                break
            if message is None:
                break
            fn, args = message
            try:
                conn.send((True, fn(worker, *args)))
            except BaseException:
                conn.send((False, traceback.format_exc()))
    finally:
        if port is not None and dist.is_initialized():
            dist.destroy_process_group()


class Zygote:
    """A process that imports ``modules`` once, then forks rank processes on request.

    Forking is cheap and starts a rank with the imports done; forking from here rather
    than from the benchmark's parent keeps the other library's modules out of the rank
    (``torch.distributed.pipelining`` alone adds about 70 MiB to a process).

    Example:
        >>> with Zygote(["json"]) as zygote, RankGroup(2, zygote=zygote) as group:
        ...     group.call(place)
        [(0, 2), (1, 2)]
    """

    def __init__(self, modules: list[str], timeout_s: float = 120.0) -> None:
        self.modules = list(modules)
        self.timeout_s = timeout_s
        context = mp.get_context("fork")
        self._conn, child_end = context.Pipe()
        self._proc = context.Process(
            target=_zygote_main,
            args=(self.modules, child_end, self._conn),
            daemon=True,
            name="bench-zygote",
        )
        self._proc.start()
        child_end.close()
        ok, detail = self._receive(f"importing {self.modules}")
        if not ok:
            self.close()
            raise RankFailure(f"zygote importing {self.modules} failed:\n{detail}")

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def _receive(self, what: str) -> Any:
        try:
            if not self._conn.poll(self.timeout_s):
                self.close()
                raise RankTimeout(f"zygote {what}: no answer within {self.timeout_s:.0f} s")
            return self._conn.recv()
        except (EOFError, OSError):
            self.close()
            raise RankFailure(
                f"zygote {what}: it is gone (exit code {self._proc.exitcode})"
            ) from None

    def fork(
        self, world_size: int, port: int | None, timeout_s: float
    ) -> tuple[list[Connection], list[_ForkedRank]]:
        """``world_size`` ranks serving as :func:`_serve` does; their pipes and pids.

        Any trouble (the zygote died, could not fork, or stopped answering) raises
        :class:`RankFailure` or :class:`RankTimeout`, kills the ranks already made and
        closes the zygote: its stream may be half read.
        """
        conns: list[Connection] = []
        ranks: list[_ForkedRank] = []
        try:
            try:
                self._conn.send((world_size, port, timeout_s))
            except OSError:
                raise RankFailure(
                    f"zygote forking {world_size} ranks: it is gone (exit code {self._proc.exitcode})"
                ) from None
            for _ in range(world_size):
                kind, value = self._receive("forking ranks")
                if kind != "rank":
                    raise RankFailure(f"zygote failed to fork ranks:\n{value}")
                ranks.append(_ForkedRank(value))
                if not self._conn.poll(self.timeout_s):
                    raise RankTimeout(f"zygote sent no pipe for rank {len(conns)}")
                conns.append(Connection(reduction.recv_handle(self._conn)))
        except BaseException:
            for conn in conns:
                conn.close()
            for rank in ranks:
                rank.kill()
            self.close()
            raise
        return conns, ranks

    def close(self) -> None:
        """Stop the zygote (ranks it forked live on; their groups close them)."""
        if self._conn.closed:
            return
        with contextlib.suppress(BrokenPipeError, OSError):
            self._conn.send(None)
        self._proc.join(5.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(1.0)
        self._conn.close()

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _ForkedRank:
    """What :class:`RankGroup` needs of a rank the zygote forked (it is the zygote's child).

    The zygote lets the kernel reap its children, so a pid is gone as soon as its rank
    exits; a signal to a gone pid is not an error.
    """

    pid: int

    def is_alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except (ProcessLookupError, PermissionError):  # gone (PermissionError: reused by another user)
            return False
        return True

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, signal.SIGKILL)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)


def _zygote_main(modules: list[str], conn: Connection, parents_end: Connection) -> None:
    parents_end.close()  # the parent's end of our pipe, inherited by the fork
    _die_with_parent()
    try:
        for name in modules:
            importlib.import_module(name)
    except BaseException:
        conn.send((False, traceback.format_exc()))
        return
    # Ranks are reaped by the kernel as they exit: nobody here waits for them.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    conn.send((True, None))
    parent = mp.parent_process()
    while True:
        # The parent may die without a word (killed): its sentinel says so, and we go
        # (our ranks die with us, see _run_rank).
        watched = [conn] + ([parent.sentinel] if parent is not None else [])
        if parent is not None and parent.sentinel in wait(watched):
            return
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        world_size, port, timeout_s = request
        forked: list[int] = []
        try:
            for rank in range(world_size):
                parent_end, child_end = mp.Pipe()
                pid = os.fork()
                if pid == 0:
                    _run_rank(rank, world_size, port, child_end, timeout_s, [conn, parent_end])
                child_end.close()
                forked.append(pid)
                conn.send(("rank", pid))
                reduction.send_handle(conn, parent_end.fileno(), os.getppid())
                parent_end.close()
        except BaseException:
            for pid in forked:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                conn.send(("error", traceback.format_exc()))
            return  # the parent's read of our stream may be cut anywhere: start no more


def _run_rank(
    rank: int,
    world_size: int,
    port: int | None,
    conn: Connection,
    timeout_s: float,
    inherited: list[Connection],
) -> None:
    """A forked rank's whole life; never returns (``os._exit``, so no zygote code runs on)."""
    code = 1
    try:
        _die_with_parent()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for other in inherited:
            other.close()
        _serve(rank, world_size, port, conn, timeout_s)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _die_with_parent() -> None:
    """SIGKILL this process when its parent exits (Linux; elsewhere a no-op).

    A zygote dies with the benchmark, a rank with its zygote: a killed benchmark leaves
    no process behind, even one blocked in a collective.
    """
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class RankGroup:
    """``world_size`` forked ranks, each in a gloo group (or none with ``distributed=False``).

    Use as a context manager; :meth:`call` runs one function on every rank. The ranks
    are forked from ``zygote`` when given, else from this process.
    """

    def __init__(
        self,
        world_size: int,
        *,
        distributed: bool = True,
        timeout_s: float = 120.0,
        zygote: Zygote | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        port = _free_port() if distributed else None
        self._conns: list[Connection] = []
        self._procs: list[mp.Process | _ForkedRank] = []
        if zygote is not None:
            self._conns, self._procs = zygote.fork(world_size, port, timeout_s)
        else:
            context = mp.get_context("fork")
            for rank in range(world_size):
                parent_end, child_end = context.Pipe()
                proc = context.Process(
                    target=_serve,
                    args=(rank, world_size, port, child_end, timeout_s),
                    daemon=True,
                    name=f"bench-rank{rank}",
                )
                proc.start()
                child_end.close()
                self._conns.append(parent_end)
                self._procs.append(proc)
        self._collect("init_process_group", timeout_s)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Run ``fn(worker, *args)`` on every rank; their return values, by rank."""
        if not self._conns:
            raise RankFailure("this rank group is closed")
        for conn in self._conns:
            conn.send((fn, args))
        return self._collect(getattr(fn, "__name__", repr(fn)), timeout_s or self.timeout_s)

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        pending = dict(zip(self._conns, range(self.world_size)))
        deadline = time.monotonic() + timeout_s
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                missing = sorted(pending.values())
                self.kill()
                raise RankTimeout(
                    f"{what}: ranks {missing} did not answer within {timeout_s:.0f} s"
                )
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    ok, value = conn.recv()
                except (EOFError, OSError):
                    self.kill()
                    raise RankFailure(f"{what}: rank {rank} died (no answer on its pipe)") from None
                if not ok:
                    self.kill()
                    raise RankFailure(f"{what}: rank {rank} raised:\n{value}")
                results[rank] = value
        return results

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask every rank to leave its process group and exit; kill those that do not."""
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(None)
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill this group's ranks (only the processes this group started)."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join(1.0)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
