"""Ranks that stay alive between calls, optionally forked from a process that imported little.

:func:`conveyor.testing.run_ranks` returns only when its ranks finish, so two
groups cannot take turns step by step. A :class:`RankGroup` keeps its ranks: each
:meth:`RankGroup.call` sends one function to every rank, which runs ``fn(worker, *args)``
and answers; the next call finds the rank as the last one left it (``worker.state``). The
benchmark keeps one group per library and steps them in turn (A B A B), so drifting load
hits both alike; the calibration steps a pipeline on one.

A group's ranks are forked from this process, or from a :class:`Zygote`: a process that
imported a chosen list of modules and nothing else, so a rank holds what a user's rank of
that library would (forked from the benchmark's parent, every rank would also carry what
the parent imported for the other side: ``torch.distributed.pipelining`` alone is about
70 MiB).

Failures read as in ``run_ranks``: a rank that raises or dies fails the call with
:class:`~conveyor.errors.RankFailure` (its traceback, or how it died) and the whole group
is killed, since its peers may be blocked in a receive from it; a call that outlives its
timeout has every unfinished rank dump its Python stack, then raises
:class:`~conveyor.errors.RankTimeout`. Every rank runs one torch thread, has the
environment torchrun gives ranks on one machine and, unless ``distributed=False``, joins
a gloo process group of its own group's ranks; it dies with the process that made it.

Example:
    >>> with RankGroup(2, distributed=False) as group:
    ...     group.call(place)
    [(0, 2), (1, 2)]
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, NoReturn

from conveyor.errors import GroupClosed, RankError, RankFailure, RankTimeout, ZygoteFailure
from conveyor.ranks.support import (
    die_with_parent,
    free_port,
    install_stack_dump,
    rank_environment,
    read_stack,
    wait_for_stacks,
)


@dataclass
class Worker:
    """What a call sees inside a rank: its place in the group and a per-process state dict."""

    rank: int
    world_size: int
    distributed: bool
    state: dict[str, Any] = field(default_factory=dict)


def place(worker: Worker) -> tuple[int, int]:
    """``(rank, world_size)`` of the calling rank: the smallest useful call.

    Example:
        >>> place(Worker(1, 2, distributed=False))
        (1, 2)
    """
    return worker.rank, worker.world_size


@dataclass(frozen=True, slots=True)
class _RankSpec:
    """What a rank needs to start serving (sent to a zygote, or given to a forked process)."""

    world_size: int
    port: int | None
    timeout_s: float
    stack_dir: str


def _serve(rank: int, spec: _RankSpec, conn: Connection) -> None:
    """Set up this rank, then run calls from ``conn`` until told to stop (or the pipe closes)."""
    stack_file = install_stack_dump(str(Path(spec.stack_dir) / f"rank{rank}.stack.txt"))  # noqa: F841
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(rank_environment(rank, spec.world_size, spec.port))
    worker = Worker(rank, spec.world_size, distributed=spec.port is not None)
    try:
        if spec.port is not None:
            dist.init_process_group(
                "gloo", rank=rank, world_size=spec.world_size,
                timeout=timedelta(seconds=spec.timeout_s),
            )
        conn.send((True, None))
    except BaseException:
        conn.send((False, ("init_process_group", traceback.format_exc())))
        return
    try:
        _serve_calls(worker, conn)
    finally:
        if spec.port is not None and dist.is_initialized():
            dist.destroy_process_group()


def _serve_calls(worker: Worker, conn: Connection) -> None:
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        fn, args = message
        try:
            conn.send((True, fn(worker, *args)))
        except BaseException:
            conn.send((False, ("fn", traceback.format_exc())))


class Zygote:
    """A process that imports ``modules`` once, then forks rank processes on request.

    Forking is cheap and starts a rank with the imports done; forking from here rather
    than from the caller keeps the caller's other imports out of the rank.

    Example:
        >>> with Zygote(["json"]) as zygote, RankGroup(2, zygote=zygote, distributed=False) as group:
        ...     group.call(place)
        [(0, 2), (1, 2)]
    """

    def __init__(self, modules: list[str], timeout_s: float = 120.0) -> None:
        self.modules = list(modules)
        self.timeout_s = timeout_s
        context = mp.get_context("fork")
        self._conn, child_end = context.Pipe()
        self._proc = context.Process(
            target=_zygote_main, args=(self.modules, child_end, self._conn),
            daemon=True, name="conveyor-zygote",
        )
        self._proc.start()
        child_end.close()
        ok, detail = self._receive(f"importing {self.modules}")
        if not ok:
            self.close()
            raise ZygoteFailure(f"zygote importing {self.modules} failed:\n{detail}")

    @property
    def pid(self) -> int | None:
        """The zygote's process id (its ranks are its children)."""
        return self._proc.pid

    def _receive(self, what: str) -> Any:
        try:
            if not self._conn.poll(self.timeout_s):
                self.close()
                raise ZygoteFailure(f"zygote {what}: no answer within {self.timeout_s:.0f} s")
            return self._conn.recv()
        except (EOFError, OSError):
            self.close()
            raise ZygoteFailure(
                f"zygote {what}: it is gone (exit code {self._proc.exitcode})"
            ) from None

    def fork(self, spec: _RankSpec) -> tuple[list[Connection], list[_ForkedRank]]:
        """``spec.world_size`` ranks serving calls; their pipes and pids.

        Any trouble (the zygote died, could not fork, or stopped answering) raises
        :class:`ZygoteFailure`, kills the ranks already made and closes the zygote: its
        stream may be half read.
        """
        conns: list[Connection] = []
        ranks: list[_ForkedRank] = []
        try:
            try:
                self._conn.send(spec)
            except OSError:
                raise ZygoteFailure(
                    f"zygote forking {spec.world_size} ranks: it is gone (exit code {self._proc.exitcode})"
                ) from None
            for _ in range(spec.world_size):
                kind, value = self._receive("forking ranks")
                if kind != "rank":
                    raise ZygoteFailure(f"zygote failed to fork ranks:\n{value}")
                ranks.append(_ForkedRank(value))
                if not self._conn.poll(self.timeout_s):
                    raise ZygoteFailure(f"zygote sent no pipe for rank {len(conns)}")
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
    exits (and its exit code with it); a signal to a gone pid is not an error.
    """

    pid: int
    exitcode: int | None = None

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
    die_with_parent()
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
        # (our ranks die with us, see _run_forked_rank).
        watched = [conn] + ([parent.sentinel] if parent is not None else [])
        if parent is not None and parent.sentinel in wait(watched):
            return
        try:
            spec = conn.recv()
        except EOFError:
            return
        if spec is None or not _fork_ranks(spec, conn):
            return


def _fork_ranks(spec: _RankSpec, conn: Connection) -> bool:
    """Fork ``spec.world_size`` ranks, sending each one's pid and pipe; False after a failure."""
    forked: list[int] = []
    try:
        for rank in range(spec.world_size):
            parent_end, child_end = mp.Pipe()
            pid = os.fork()
            if pid == 0:
                _run_forked_rank(rank, spec, child_end, [conn, parent_end])
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
        return False  # the parent's read of our stream may be cut anywhere: start no more
    return True


def _run_forked_rank(
    rank: int, spec: _RankSpec, conn: Connection, inherited: list[Connection]
) -> None:
    """A zygote-forked rank's whole life; never returns (``os._exit``: no zygote code runs on)."""
    code = 1
    try:
        die_with_parent()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for other in inherited:
            other.close()
        _serve(rank, spec, conn)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _run_process_rank(rank: int, spec: _RankSpec, conn: Connection) -> None:
    die_with_parent()
    _serve(rank, spec, conn)


# The harness frame that calls the user's function: it and its callers leave the stacks.
_ENTRY = (Path(__file__).name, "_serve_calls")


class RankGroup:
    """``world_size`` live ranks, each in a gloo group (or none with ``distributed=False``).

    Use as a context manager; :meth:`call` runs one function on every rank. The ranks
    are forked from ``zygote`` when given, else from this process. ``timeout_s`` bounds
    the set-up and, unless a call says otherwise, each call.

    Example:
        >>> with RankGroup(2, distributed=False) as group:
        ...     group.call(place)
        [(0, 2), (1, 2)]
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
        self._stack_dir = tempfile.mkdtemp(prefix="conveyor-group-")
        spec = _RankSpec(world_size, free_port() if distributed else None, timeout_s, self._stack_dir)
        self._conns: list[Connection] = []
        self._procs: list[Any] = []  # multiprocessing.Process or _ForkedRank
        try:
            if zygote is not None:
                self._conns, self._procs = zygote.fork(spec)
            else:
                self._start_here(spec)
            self._collect("init_process_group", timeout_s)
        except BaseException:
            self.kill()
            raise

    def _start_here(self, spec: _RankSpec) -> None:
        context = mp.get_context("fork")
        for rank in range(spec.world_size):
            parent_end, child_end = context.Pipe()
            proc = context.Process(
                target=_run_process_rank, args=(rank, spec, child_end),
                daemon=True, name=f"conveyor-rank{rank}",
            )
            proc.start()
            child_end.close()  # only the rank holds it now: its death reads as end-of-file
            self._conns.append(parent_end)
            self._procs.append(proc)

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, by rank."""
        return [p.pid for p in self._procs]

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Run ``fn(worker, *args)`` on every rank; their return values, by rank.

        ``fn`` and ``args`` travel pickled (a function defined at module level), and so
        do the results.
        """
        if not self._conns:
            raise GroupClosed(f"{getattr(fn, '__name__', repr(fn))}: this rank group is closed")
        for conn in self._conns:
            conn.send((fn, args))
        return self._collect(getattr(fn, "__name__", repr(fn)), timeout_s or self.timeout_s)

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        pending = dict(zip(self._conns, range(self.world_size)))
        finished: list[int] = []
        deadline = time.monotonic() + timeout_s
        while pending:
            ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._raise_timeout(what, timeout_s, sorted(pending.values()), finished)
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    ok, value = conn.recv()
                except (EOFError, OSError):
                    self._raise_failure(self._death(rank), pending.values(), finished)
                if not ok:
                    phase, details = value
                    lines = [line for line in details.strip().splitlines() if line.strip()]
                    summary = lines[-1] if lines else "raised"
                    if phase != "fn":
                        summary = f"{phase} failed: {summary}"
                    error = RankError(rank, "exception", summary, details, phase=phase)
                    self._raise_failure(error, pending.values(), finished)
                results[rank] = value
                finished.append(rank)
        return results

    def _death(self, rank: int) -> RankError:
        proc = self._procs[rank]
        proc.join(1.0)
        code = proc.exitcode
        return RankError(
            rank, "exit",
            f"died without answering (exit code {'unknown' if code is None else code})",
            read_stack(Path(self._stack_dir) / f"rank{rank}.stack.txt", _ENTRY),
            exit_code=code,
        )

    def _raise_failure(self, error: RankError, running: Any, finished: list[int]) -> NoReturn:
        killed = sorted(running)
        self.kill()  # its peers may be blocked in a receive from the failed rank
        raise RankFailure([error], killed, sorted(finished), self.world_size)

    def _raise_timeout(
        self, what: str, timeout_s: float, stuck: list[int], finished: list[int]
    ) -> NoReturn:
        paths = [Path(self._stack_dir) / f"rank{rank}.stack.txt" for rank in stuck]
        for rank in stuck:
            if self._procs[rank].is_alive():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(self._procs[rank].pid, signal.SIGUSR1)
        stacks = wait_for_stacks(paths, _ENTRY)
        self.kill()
        raise RankTimeout(
            timeout_s, stuck, dict(zip(stuck, stacks)), sorted(finished), self.world_size,
            what=f"{what} on a rank group",
        )

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
        """Kill this group's ranks (only the processes this group started); again is a no-op."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join(1.0)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        shutil.rmtree(self._stack_dir, ignore_errors=True)

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
