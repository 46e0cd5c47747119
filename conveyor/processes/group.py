"""Local ranks, each in a process of its own: the one way conveyor starts, watches and stops them.

A :class:`RankGroup` keeps its ranks: each :meth:`RankGroup.call` sends one function to
every rank, which runs ``fn(worker, *args)`` and answers; the next call finds the rank as
the last one left it (``worker.state``). The calibration steps a pipeline on one; the
benchmark keeps one group per library and steps them in turn (A B A B), so drifting load
hits both alike. :func:`run_once` is a group that lives for one call, made with the call
(``conveyor.testing.run_ranks`` is it): start, run ``fn(rank, world_size, ...)`` on every
rank, close.

Ranks are forked from this process (or spawned: ``start_method="spawn"``, needed for
CUDA), or forked from a :class:`~conveyor.processes.Zygote` that imported little. Either way
each runs :func:`conveyor.processes.rank.rank_main`, and the parent watches them the same way:

- a rank that raises fails the call with :class:`~conveyor.errors.RankFailure`: the parent
  keeps listening a moment for other failures and deaths (a dead rank is the likely root
  cause of its peers' "connection reset"), then kills the group, since the peers may be
  blocked in a receive from the failed rank; the failure names every failed rank (its
  traceback, or how it died), the ranks killed while running and those that had finished;
- a call that outlives its timeout has every unfinished rank dump its Python stack, then
  kills the group and raises :class:`~conveyor.errors.RankTimeout` showing where each was;
- rank 0 losing the race for its free port to another process starts the ranks over;
- every rank dies with the process that made it, and :meth:`RankGroup.close` or
  :meth:`RankGroup.kill` leaves no process behind.

Every rank runs one torch thread, has the environment torchrun gives ranks on one machine
and, unless ``distributed=False``, joins a process group (gloo by default) of its group's
ranks.

Example:
    >>> with RankGroup(2, distributed=False) as group:
    ...     group.call(place)
    [(0, 2), (1, 2)]
    >>> run_once(lambda rank, world_size, step: rank * step, 3, args=(10,), init_process_group=False)
    [0, 10, 20]
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, NoReturn

from conveyor.errors import GroupClosed, HarnessConfigError, RankError, RankFailure, RankTimeout, positive_int
from conveyor.processes.rank import (
    ENTRY,
    MAX_RESULT_BYTES,
    Call,
    RankSpec,
    place,
    rank_main,
    stack_path,
)
from conveyor.processes.support import free_port, read_stack, wait_for_stacks
from conveyor.processes.zygote import Zygote

__all__ = ["MAX_RESULT_BYTES", "START_METHODS", "RankGroup", "place", "run_once"]

logger = logging.getLogger(__name__)

START_METHODS = ("fork", "spawn")
# After the first failure, how long the parent keeps listening for other failures and deaths
# before it kills the ranks still running.
_FAILURE_SETTLE_S = 0.25
# Rank 0 may lose the race for the free port to another process: start over this often.
_PORT_ATTEMPTS = 3
# How long killed ranks may take to go, all together.
_KILL_WAIT_S = 10.0
# Grace for a one-call group's ranks to leave their process group and exit by themselves.
_EXIT_GRACE_S = 5.0


class RankGroup(contextlib.AbstractContextManager):
    """``world_size`` live ranks, each in a process group (none with ``distributed=False``).

    Use as a context manager; :meth:`call` runs one function on every rank. The ranks are
    forked from ``zygote`` when given, else started from this process by ``start_method``
    (``"fork"``, or ``"spawn"`` for ranks that use CUDA). ``timeout_s`` bounds the set-up
    and, unless a call says otherwise, each call. ``env`` adds environment variables in
    every rank (after the standard ones, so it may override them); ``max_result_bytes``
    limits one rank's pickled answer.

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
        start_method: str = "fork",
        backend: str = "gloo",
        env: Mapping[str, str] | None = None,
        max_result_bytes: int = MAX_RESULT_BYTES,
    ) -> None:
        _check_options(world_size, timeout_s, start_method, max_result_bytes)
        if zygote is not None and start_method != "fork":
            raise HarnessConfigError(f"a zygote forks its ranks; start_method={start_method!r} cannot apply")
        spec = RankSpec(world_size, None, float(timeout_s), "", backend, dict(env or {}), max_result_bytes)
        self._open(spec, distributed, zygote, start_method, "init_process_group on a rank group")

    def _open(
        self, spec: RankSpec, distributed: bool, zygote: Zygote | None, start_method: str, label: str
    ) -> list[Any]:
        """Start the ranks and return their first answers (set-up, or ``spec.first_call``)."""
        self.world_size = spec.world_size
        self.timeout_s = spec.timeout_s
        self._conns: list[Connection] = []
        self._procs: list[Any] = []  # multiprocessing.Process, or a zygote's _ForkedRank
        self._stack_dir: str | None = None
        deadline = time.monotonic() + spec.timeout_s
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            self._stack_dir = tempfile.mkdtemp(prefix="conveyor-ranks-")
            attempt_spec = replace(spec, port=free_port() if distributed else None, stack_dir=self._stack_dir)
            try:
                self._start(attempt_spec, zygote, start_method)
                return self._collect(label, deadline, spec.timeout_s)
            except RankFailure as failure:
                if attempt == _PORT_ATTEMPTS or not _lost_port_race(failure.errors):
                    raise
                logger.warning("port %d was taken before rank 0 could listen on it; retrying", attempt_spec.port)
            except BaseException:
                self.kill()
                raise
        raise AssertionError("unreachable: the last attempt re-raises instead of retrying")

    def _start(self, spec: RankSpec, zygote: Zygote | None, start_method: str) -> None:
        if zygote is not None:
            self._conns, self._procs = zygote.fork(spec)
            return
        context = mp.get_context(start_method)
        for rank in range(spec.world_size):
            parent_end, child_end = context.Pipe()
            self._conns.append(parent_end)
            try:
                proc = context.Process(
                    target=rank_main, args=(rank, spec, child_end), daemon=True, name=f"conveyor-rank{rank}"
                )
                proc.start()
                self._procs.append(proc)
            finally:
                child_end.close()  # only the rank holds it now: its death reads as end-of-file

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, by rank."""
        return [p.pid for p in self._procs]

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Run ``fn(worker, *args)`` on every rank; their return values, by rank.

        ``fn`` and ``args`` travel pickled (a function defined at module level), and so
        do the results.
        """
        call = Call(fn, args)
        if not self._conns:
            raise GroupClosed(f"{call.name}: this rank group is closed")
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                conn.send(call)  # a rank that is gone is reported by _collect
        timeout = timeout_s or self.timeout_s
        return self._collect(f"{call.name} on a rank group", time.monotonic() + timeout, timeout)

    def _collect(self, label: str, deadline: float, timeout_s: float) -> list[Any]:
        """Every rank's answer, or a failure (after a short settling time) or a timeout."""
        answers: dict[int, tuple[str, Any]] = {}
        settle_end: float | None = None
        while len(answers) < self.world_size:
            now = time.monotonic()
            until = deadline if settle_end is None else min(deadline, settle_end)
            if settle_end is not None and now >= until:
                break  # a failure seen before the deadline is the story, not the timeout
            pending = [rank for rank in range(self.world_size) if rank not in answers]
            if now >= deadline:
                self._raise_timeout(label, timeout_s, pending, sorted(answers))
            watched: dict[Any, int] = {}
            for rank in pending:
                watched[self._conns[rank]] = rank
                sentinel = getattr(self._procs[rank], "sentinel", None)
                if sentinel is not None:  # also a death while a child of the rank holds its pipe
                    watched[sentinel] = rank
            for rank in {watched[ready] for ready in wait(list(watched), timeout=until - now)}:
                self._read(rank, answers)
            if settle_end is None and any(kind != "ok" for kind, _ in answers.values()):
                settle_end = time.monotonic() + _FAILURE_SETTLE_S
        if any(kind != "ok" for kind, _ in answers.values()) or len(answers) < self.world_size:
            self._raise_failure(answers)
        payloads = [answers[rank][1] for rank in range(self.world_size)]
        return [None if payload is None else pickle.loads(payload) for payload in payloads]

    def _read(self, rank: int, answers: dict[int, tuple[str, Any]]) -> None:
        """Put in ``answers`` the rank's answer if one is there, or its death if it has ended without one."""
        conn, proc = self._conns[rank], self._procs[rank]
        try:
            if conn.poll():
                answers[rank] = conn.recv()
                return
            if proc.is_alive():
                return
        except (EOFError, OSError, pickle.UnpicklingError):
            pass  # the rank died before (or while) writing its answer
        answers[rank] = "error", self._death(rank)

    def _death(self, rank: int) -> RankError:
        proc = self._procs[rank]
        proc.join(1.0)
        code = proc.exitcode
        if code is None:
            summary = "died without answering (exit code unknown), no Python exception"
        elif code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            summary = f"killed by {name} (exit code {code}), no Python exception"
        else:
            summary = f"died with exit code {code}, no Python exception (os._exit, or a crash in native code)"
        stack = read_stack(self._stack_path(rank), ENTRY)
        return RankError(rank, "exit", summary, stack, exit_code=code, seen_at=time.monotonic())

    def _stack_path(self, rank: int) -> Path:
        return stack_path(self._stack_dir or "", rank)

    def _raise_failure(self, answers: dict[int, tuple[str, Any]]) -> NoReturn:
        for rank in range(self.world_size):
            if rank not in answers:
                self._read(rank, answers)  # a rank that has just died is a failure, not a kill
        killed = [rank for rank in range(self.world_size) if rank not in answers]
        finished = sorted(rank for rank, (kind, _) in answers.items() if kind == "ok")
        errors = [value for kind, value in answers.values() if kind != "ok"]
        # A dead process is a root cause; its peers' exceptions ("connection reset") follow from it.
        errors.sort(key=lambda error: (error.kind != "exit", error.seen_at))
        self.kill()  # its peers may be blocked in a receive from the failed rank
        raise RankFailure(errors, killed, finished, self.world_size)

    def _raise_timeout(self, label: str, timeout_s: float, stuck: list[int], finished: list[int]) -> NoReturn:
        for rank in stuck:
            if self._procs[rank].is_alive():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(self._procs[rank].pid, signal.SIGUSR1)
        stacks = wait_for_stacks([self._stack_path(rank) for rank in stuck], ENTRY)
        self.kill()
        raise RankTimeout(timeout_s, stuck, dict(zip(stuck, stacks)), finished, self.world_size, what=label)

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask every rank to leave its process group and exit; kill those that do not."""
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(None)
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                logger.warning("rank process %d did not exit when asked to; killing it", proc.pid)
        self.kill()

    def kill(self) -> None:
        """Kill this group's ranks (only the processes this group started); again is a no-op."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        # SIGKILL cannot be ignored, but a busy machine may take a while to tear a rank down:
        # waiting here reaps it, so no zombie of this group outlives the call.
        deadline = time.monotonic() + _KILL_WAIT_S
        for proc in self._procs:
            proc.join(max(0.1, deadline - time.monotonic()))
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        if self._stack_dir is not None:
            shutil.rmtree(self._stack_dir, ignore_errors=True)

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_once(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout_s: float = 120.0,
    backend: str = "gloo",
    start_method: str = "fork",
    init_process_group: bool = True,
    env: Mapping[str, str] | None = None,
    max_result_bytes: int = MAX_RESULT_BYTES,
) -> list[Any]:
    """A rank group for one call: ``fn(rank, world_size, *args, **kwargs)`` on every rank, by rank.

    This is ``conveyor.testing.run_ranks`` (see :mod:`conveyor.testing.multiprocess` for the
    full contract). The call is part of the ranks' start (under fork, ``fn`` is not pickled: a
    lambda or a closure works). Raises :class:`~conveyor.errors.RankFailure` as soon as a rank
    fails, :class:`~conveyor.errors.RankTimeout` when the whole run, set-up included, takes
    longer than ``timeout_s`` seconds (both read as a group's, ``what="run_ranks"``), and
    :class:`~conveyor.errors.HarnessConfigError` for arguments that cannot work, before any
    process starts. ``env`` adds environment variables in every rank (after the standard ones,
    so it may override them).

    Example:
        >>> run_once(lambda rank, world_size: (rank, world_size), 2, init_process_group=False)
        [(0, 2), (1, 2)]
    """
    call = Call(fn, tuple(args), dict(kwargs or {}), by_rank=True)
    if not callable(fn):
        raise HarnessConfigError(f"fn must be callable as fn(rank, world_size, ...); got {fn!r}")
    _check_options(world_size, timeout_s, start_method, max_result_bytes)
    if start_method == "spawn":
        _check_picklable(call)
    _check_parent(start_method)
    spec = RankSpec(
        world_size, None, float(timeout_s), "", backend, dict(env or {}), max_result_bytes, first_call=call
    )
    group = RankGroup.__new__(RankGroup)  # the same group, started with its one call
    results = group._open(spec, init_process_group, None, start_method, "run_ranks")
    group.close(_EXIT_GRACE_S)
    return results


def _check_options(world_size: int, timeout_s: float, start_method: str, max_result_bytes: int) -> None:
    if not positive_int(world_size):
        raise HarnessConfigError(f"world_size must be an int >= 1; got {world_size!r}")
    if not timeout_s > 0:
        raise HarnessConfigError(f"timeout_s must be > 0 seconds; got {timeout_s!r}")
    if max_result_bytes < 1:
        raise HarnessConfigError(f"max_result_bytes must be >= 1; got {max_result_bytes!r}")
    if start_method not in START_METHODS:
        raise HarnessConfigError(f"start_method must be one of {START_METHODS}; got {start_method!r}")


def _check_picklable(call: Call) -> None:
    for what, value in (("fn", call.fn), ("args", call.args), ("kwargs", call.kwargs)):
        try:
            pickle.dumps(value)
        except Exception as error:
            raise HarnessConfigError(
                f"start_method='spawn' pickles {what} to send it to the ranks, and this failed "
                f"({type(error).__name__}: {error}). Define the rank function at module level "
                "(no lambda, closure or nested function), pass picklable arguments, "
                "or use start_method='fork'."
            ) from error


def _check_parent(start_method: str) -> None:
    """Import torch here so forked ranks inherit it, and refuse a parent that would poison them."""
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise HarnessConfigError(
            "the calling process has initialised torch.distributed; ranks must own their "
            "process groups. Call torch.distributed.destroy_process_group() in the caller, "
            "or move the distributed code into the function given to run_ranks."
        )
    if start_method == "fork" and torch.cuda.is_initialized():
        raise HarnessConfigError(
            "the calling process has initialised CUDA, which forked ranks cannot use; "
            "pass start_method='spawn' or keep CUDA out of the test process."
        )


def _lost_port_race(errors: Sequence[RankError]) -> bool:
    return any(
        error.rank == 0
        and error.phase == "init_process_group"
        and ("EADDRINUSE" in error.details or "address already in use" in error.details.lower())
        for error in errors
    )
