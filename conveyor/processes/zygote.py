"""A process that imported little, forking ranks for :class:`~conveyor.processes.RankGroup` on request.

Forked from the benchmark's parent, every rank would also carry what the parent imported for
the other side (``torch.distributed.pipelining`` alone is about 70 MiB); forked from a zygote
that imported a chosen list of modules and nothing else, a rank holds what a user's rank of
that library would. The ranks it forks run :func:`conveyor.processes.rank.rank_main`, as every
other rank of a group does.

Example:
    >>> with Zygote(["json"]) as zygote:
    ...     zygote.pid is not None
    True
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait
from typing import Any

from conveyor.errors import ZygoteFailure
from conveyor.processes.rank import RankSpec, rank_main
from conveyor.processes.support import die_with_parent


class Zygote(contextlib.AbstractContextManager):
    """A process that imports ``modules`` once, then forks rank processes on request.

    Forking is cheap and starts a rank with the imports done; forking from here rather
    than from the caller keeps the caller's other imports out of the rank.

    Example:
        >>> from conveyor.processes import RankGroup, place
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
            raise self._gone(what) from None

    def _gone(self, what: str) -> ZygoteFailure:
        return ZygoteFailure(f"zygote {what}: it is gone (exit code {self._proc.exitcode})")

    def fork(self, spec: RankSpec) -> tuple[list[Connection], list[_ForkedRank]]:
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
                raise self._gone(f"forking {spec.world_size} ranks") from None
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
    assert parent is not None, "the zygote is a multiprocessing child of its Zygote's process"
    # The parent may die without a word (killed): its sentinel says so, and we go
    # (our ranks die with us: see die_with_parent).
    while parent.sentinel not in wait([conn, parent.sentinel]):
        try:
            spec = conn.recv()
        except EOFError:
            return
        if spec is None or not _fork_ranks(spec, conn):
            return


def _fork_ranks(spec: RankSpec, conn: Connection) -> bool:
    """Fork ``spec.world_size`` ranks, sending each one's pid and pipe; False after a failure."""
    forked: list[int] = []
    try:
        for rank in range(spec.world_size):
            parent_end, child_end = mp.Pipe()
            pid = os.fork()
            if pid == 0:  # the rank: it never returns
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                rank_main(rank, spec, child_end, (conn, parent_end))
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
