"""Run a function on N torch.distributed CPU ranks, each in its own process, and fail loud.

``run_ranks(fn, world_size)`` starts ``world_size`` processes, joins them into one
process group (gloo by default) and returns what ``fn(rank, world_size, *args, **kwargs)``
returned on each rank, in rank order. It never hangs and never hides a failure:

- a rank that raises makes the whole run stop at once: the other ranks (perhaps blocked
  in a collective or a receive) are killed and :class:`RankFailure` carries each failed
  rank's full traceback and names the ranks that were killed while still running;
- a rank that dies without a Python exception (``os._exit``, a signal, a segfault) is
  reported with its exit code (and the crash stack, if Python printed one);
- a run that outlives ``timeout_s`` first has every unfinished rank dump its Python stack
  (``faulthandler`` on SIGUSR1), then kills them and raises :class:`RankTimeout`, whose
  message shows where each one was stuck.

The calling process (pytest) never initialises torch.distributed or CUDA. Ranks are forked
by default because a forked rank inherits the already imported torch (about 0.3 s for a
whole test file, against 6-7 s per spawned process); ``start_method="spawn"`` works too
when ``fn`` and its arguments can be pickled (a function defined at module level).

Example (a test in ``tests/runtime/``; the rank function lives at module level so the
same test also runs under ``start_method="spawn"``):

    import torch
    import torch.distributed as dist

    from conveyor.testing import run_ranks

    def _sum_of_ranks(rank: int, world_size: int) -> float:
        value = torch.tensor([float(rank)])
        dist.all_reduce(value)
        return value.item()

    def test_all_reduce_sums_ranks() -> None:
        assert run_ranks(_sum_of_ranks, 4, timeout_s=30) == [6.0] * 4

Inside a rank, RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR (127.0.0.1) and MASTER_PORT are
set, ``torch.get_num_threads()`` is 1, and the default process group is ready (unless
``init_process_group=False``). Return small, picklable values (numbers, lists, tensors,
state dicts, CPU tensors only: a CUDA tensor would initialise CUDA in the caller);
anything that cannot be pickled or weighs more than ``max_result_bytes`` fails the run
with a message saying so.

Ranks that live on between calls (the calibration stepping a pipeline, a benchmark that
steps two libraries' groups in turn) come from the library's :class:`conveyor.ranks.RankGroup`:
the same rank set-up (:mod:`conveyor.ranks.support`) and the same failure reports. The two
stay apart because they answer different needs: this one runs a function once on fresh
ranks under fork or spawn, with any backend and environment, and reports every failed
rank; a group keeps forked gloo ranks and their state between calls.

Notes for test and benchmark authors:
- mark such tests ``@pytest.mark.distributed`` (registered in ``tests/conftest.py``);
- keep ``timeout_s`` below pytest-timeout's per-test limit (300 s in pyproject.toml), or
  raise that with ``@pytest.mark.timeout(...)``, so that the harness, not pytest-timeout,
  reports a hang (with stacks);
- ranks killed after a failure run no ``finally`` blocks: keep cleanup that matters in
  the caller (pytest's ``tmp_path`` is shared by all ranks under fork and spawn alike);
- a failed rank waits (up to 5 s) for the harness to kill its peers before it closes its
  sockets, so the peers do not add "connection closed" errors that bury the root cause.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import connection as mp_connection
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from conveyor.errors import HarnessConfigError, RankError, RankFailure, RankTimeout
from conveyor.ranks.support import (
    die_with_parent,
    install_stack_dump,
    rank_environment,
    read_stack,
    wait_for_stacks,
)
from conveyor.ranks.support import free_port as _free_port

__all__ = ["MAX_RESULT_BYTES", "HarnessConfigError", "RankError", "RankFailure", "RankTimeout", "run_ranks"]

logger = logging.getLogger(__name__)

MAX_RESULT_BYTES = 256 * 2**20
"""Default limit on one rank's pickled return value (256 MiB)."""

START_METHODS = ("fork", "spawn")

# How long a rank that failed waits for the parent to kill its peers before it tears down
# its process group: closing its sockets first would make the peers fail with secondary
# "connection closed" errors that hide the root cause.
_FAILED_RANK_LINGER_S = 5.0
# After the first failure, how long the harness keeps listening for other failures and
# deaths before it kills the ranks still running.
_FAILURE_SETTLE_S = 0.25
# Grace for ranks that have reported their result to tear down and exit by themselves.
_EXIT_GRACE_S = 5.0
# The process group's own timeout outlives the harness's, so a hang is always reported
# by the harness (with stacks) rather than by gloo (with a bare timeout message).
_PROCESS_GROUP_EXTRA_S = 60.0
# Rank 0 may lose the race for the free port to another process: start over this often.
_PORT_ATTEMPTS = 3


def run_ranks(
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
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes; return each rank's result.

    Raises :class:`RankFailure` as soon as a rank fails, :class:`RankTimeout` when the whole
    run takes longer than ``timeout_s`` seconds, :class:`HarnessConfigError` for arguments
    that cannot work. ``env`` adds environment variables in every rank (after the standard
    ones, so it may override them). See the module docstring for the full contract.

    Example:
        >>> def product(rank, world_size, factor):
        ...     return rank * factor
        >>> run_ranks(product, 3, args=(10,), init_process_group=False)
        [0, 10, 20]
    """
    kwargs = dict(kwargs or {})
    _check_arguments(fn, world_size, args, kwargs, timeout_s, start_method, max_result_bytes)
    _prepare_parent(start_method)
    job = _RankJob(
        fn=fn,
        world_size=world_size,
        args=tuple(args),
        kwargs=kwargs,
        timeout_s=float(timeout_s),
        backend=backend,
        init_process_group=init_process_group,
        env=dict(env or {}),
        max_result_bytes=max_result_bytes,
    )
    deadline = time.monotonic() + job.timeout_s
    for attempt in range(1, _PORT_ATTEMPTS + 1):
        try:
            return _run_attempt(
                job, start_method, deadline, last_attempt=attempt == _PORT_ATTEMPTS
            )
        except _PortTaken as taken:
            logger.warning(
                "port %d was taken before rank 0 could listen on it; retrying", taken.port
            )
    raise AssertionError("unreachable: the last attempt re-raises instead of retrying")


@dataclass(frozen=True, slots=True)
class _RankJob:
    """Everything a rank needs to know, fixed for the whole call (pickled for spawned ranks)."""

    fn: Callable[..., Any]
    world_size: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    timeout_s: float
    backend: str
    init_process_group: bool
    env: dict[str, str]
    max_result_bytes: int


class _PortTaken(Exception):
    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.port = port


def _check_arguments(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    timeout_s: float,
    start_method: str,
    max_result_bytes: int,
) -> None:
    if not callable(fn):
        raise HarnessConfigError(f"fn must be callable as fn(rank, world_size, ...); got {fn!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise HarnessConfigError(f"world_size must be an int >= 1; got {world_size!r}")
    if not timeout_s > 0:
        raise HarnessConfigError(f"timeout_s must be > 0 seconds; got {timeout_s!r}")
    if max_result_bytes < 1:
        raise HarnessConfigError(f"max_result_bytes must be >= 1; got {max_result_bytes!r}")
    if start_method not in START_METHODS:
        raise HarnessConfigError(
            f"start_method must be one of {START_METHODS}; got {start_method!r}"
        )
    if start_method == "spawn":
        for what, value in (("fn", fn), ("args", tuple(args)), ("kwargs", dict(kwargs))):
            try:
                pickle.dumps(value)
            except Exception as error:
                raise HarnessConfigError(
                    f"start_method='spawn' pickles {what} to send it to the ranks, and this failed "
                    f"({type(error).__name__}: {error}). Define the rank function at module level "
                    "(no lambda, closure or nested function), pass picklable arguments, "
                    "or use start_method='fork'."
                ) from error


def _prepare_parent(start_method: str) -> None:
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


# ---------------------------------------------------------------------------------------
# Parent side: start the ranks, collect their reports, stop them.


@dataclass(slots=True)
class _RankHandle:
    rank: int
    process: Any  # multiprocessing.Process of the chosen context
    reader: Any  # read end of the rank's report pipe
    stack_path: Path
    report: tuple[str, Any] | None = None
    killed: bool = False


def _run_attempt(job: _RankJob, start_method: str, deadline: float, last_attempt: bool) -> list[Any]:
    context = get_context(start_method)
    port = _free_port()
    handles: list[_RankHandle] = []
    with tempfile.TemporaryDirectory(prefix="conveyor-ranks-") as stack_dir:
        released = context.Event()  # set once every rank has reported, or been killed after a failure
        try:
            for rank in range(job.world_size):
                handles.append(_start_rank(context, job, rank, port, Path(stack_dir), released))
            outcome = _collect_reports(handles, deadline)
            if outcome == "timeout":
                _raise_timeout(job, handles)
            errors = _errors_of(handles)
            if errors:
                _stop_after_failure(handles, released)
                errors = _errors_of(handles)  # ranks that failed before being killed
                if not last_attempt and _lost_port_race(errors):
                    raise _PortTaken(port)
                finished = [h.rank for h in handles if h.report and h.report[0] == "ok"]
                killed = [h.rank for h in handles if h.killed]
                raise RankFailure(errors, killed, finished, job.world_size)
            released.set()  # every rank has reported: rank 0 may close the store
            _wait_for_exit(handles)
            return [pickle.loads(handle.report[1]) for handle in handles]  # type: ignore[index]
        finally:
            _kill_all(handles)


def _start_rank(
    context: Any, job: _RankJob, rank: int, port: int, stack_dir: Path, released: Any
) -> _RankHandle:
    reader, writer = context.Pipe(duplex=False)
    stack_path = stack_dir / f"rank{rank}.stack.txt"
    process = context.Process(
        target=_rank_main,
        args=(job, rank, port, str(stack_path), writer, released),
        name=f"conveyor-rank{rank}",
        daemon=True,
    )
    process.start()
    # Only the rank holds the write end now, so its death shows as end-of-file here.
    writer.close()
    return _RankHandle(rank, process, reader, stack_path)


def _collect_reports(handles: list[_RankHandle], deadline: float) -> str:
    """Wait until every rank reported success ("done"), one failed ("failed") or time ran out.

    After the first failure, reports keep being collected for a short settling time: a rank
    that died leaves its peers failing with "connection reset" errors, and the dead rank's
    exit must be seen too for the report to show the root cause.
    """
    settle_end: float | None = None
    while True:
        waiting = [h for h in handles if h.report is None]
        if not waiting:
            return "failed" if settle_end is not None else "done"
        now = time.monotonic()
        if settle_end is not None and now >= min(settle_end, deadline):
            return "failed"  # a failure seen before the deadline is the story, not the timeout
        if now >= deadline:
            return "timeout"
        watched = {}
        for handle in waiting:
            watched[handle.reader] = handle
            watched[handle.process.sentinel] = handle
        wait_until = deadline if settle_end is None else min(deadline, settle_end)
        ready = mp_connection.wait(list(watched), timeout=wait_until - now)
        for handle in {id(watched[obj]): watched[obj] for obj in ready}.values():
            _read_report(handle)
        if settle_end is None and any(h.report and h.report[0] != "ok" for h in handles):
            settle_end = time.monotonic() + _FAILURE_SETTLE_S


def _read_report(handle: _RankHandle) -> None:
    """Take the rank's report if one is there; if its process has ended without one, record the exit."""
    try:
        if handle.reader.poll():
            handle.report = pickle.loads(handle.reader.recv_bytes())
            return
    except (EOFError, OSError):
        pass  # the rank died before (or while) writing its report
    if handle.process.is_alive():
        return
    handle.process.join(1.0)
    handle.report = ("exit", _exit_error(handle))


def _exit_error(handle: _RankHandle) -> RankError:
    code = handle.process.exitcode
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        summary = f"killed by {name} (exit code {code}), no Python exception"
    else:
        summary = (
            f"died with exit code {code}, no Python exception (os._exit, or a crash in native code)"
        )
    return RankError(
        rank=handle.rank,
        kind="exit",
        summary=summary,
        details=read_stack(handle.stack_path, _ENTRY),
        exit_code=code,
        seen_at=time.monotonic(),
    )


def _errors_of(handles: list[_RankHandle]) -> list[RankError]:
    errors = [h.report[1] for h in handles if h.report is not None and h.report[0] != "ok"]
    # A dead process is a root cause; its peers' exceptions ("connection reset") follow from it.
    return sorted(errors, key=lambda error: (error.kind != "exit", error.seen_at))


def _stop_after_failure(handles: list[_RankHandle], released: Any) -> None:
    """Kill the ranks still running, keep any report they managed to send, let failed ranks exit."""
    for handle in handles:
        if handle.report is None:
            _read_report(handle)  # a rank that has just died is a failure, not a kill
    running = [h for h in handles if h.report is None]
    for handle in running:
        handle.process.kill()
    for handle in running:
        handle.process.join(2.0)
        try:
            if handle.reader.poll():
                handle.report = pickle.loads(handle.reader.recv_bytes())
        except (EOFError, OSError, pickle.UnpicklingError):
            pass  # killed halfway through writing: nothing usable
        handle.killed = handle.report is None
    released.set()
    _wait_for_exit(handles)


def _wait_for_exit(handles: list[_RankHandle]) -> None:
    end = time.monotonic() + _EXIT_GRACE_S
    for handle in handles:
        handle.process.join(max(0.0, end - time.monotonic()))
        if handle.process.is_alive():
            logger.warning("rank %d did not exit after reporting; killing it", handle.rank)


def _kill_all(handles: list[_RankHandle]) -> None:
    for handle in handles:
        if handle.process.is_alive():
            handle.process.kill()
    for handle in handles:
        handle.process.join(2.0)
        handle.reader.close()


def _lost_port_race(errors: list[RankError]) -> bool:
    return any(
        error.rank == 0
        and error.phase == "init_process_group"
        and ("EADDRINUSE" in error.details or "address already in use" in error.details.lower())
        for error in errors
    )


def _raise_timeout(job: _RankJob, handles: list[_RankHandle]) -> None:
    stuck = [h for h in handles if h.report is None]
    for handle in stuck:
        if handle.process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(handle.process.pid, signal.SIGUSR1)
    stacks = wait_for_stacks([h.stack_path for h in stuck], _ENTRY)
    _kill_all(handles)
    finished = [h.rank for h in handles if h.report is not None]
    raise RankTimeout(
        job.timeout_s,
        [h.rank for h in stuck],
        {h.rank: stack for h, stack in zip(stuck, stacks)},
        finished,
        job.world_size,
    )


# The harness frame that calls the user's function: it and its callers leave the stacks.
_ENTRY = (Path(__file__).name, "_rank_main")


# ---------------------------------------------------------------------------------------
# Rank side: set up, run fn, report, tear down.


def _rank_main(job: _RankJob, rank: int, port: int, stack_path: str, writer: Any, released: Any) -> None:
    # First thing, so a stuck or crashing rank can always say where it is.
    stack_file = install_stack_dump(stack_path)  # noqa: F841 (open for the process's life)
    die_with_parent()
    os.environ.update(rank_environment(rank, job.world_size, port))
    os.environ.update(job.env)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    exit_code = 0
    phase = "init_process_group"
    try:
        if job.init_process_group:
            dist.init_process_group(
                job.backend,
                rank=rank,
                world_size=job.world_size,
                timeout=timedelta(seconds=job.timeout_s + _PROCESS_GROUP_EXTRA_S),
            )
        phase = "fn"
        result = job.fn(rank, job.world_size, *job.args, **job.kwargs)
        phase = "result"
        report: tuple[str, Any] = ("ok", _pickle_result(result, job.max_result_bytes))
    except BaseException as error:  # noqa: BLE001 (report everything, SystemExit included)
        report = ("error", _exception_error(rank, error, phase))
        exit_code = 1
    try:
        writer.send_bytes(pickle.dumps(report))
        writer.close()
        if exit_code:
            # Let the parent kill the peers before this rank's sockets close (see the constant).
            released.wait(_FAILED_RANK_LINGER_S)
        elif rank == 0 and job.init_process_group:
            # Rank 0 hosts the store: peers still in their function (stopping after a failure,
            # say) may need it, so it stays until every rank has reported or been killed.
            released.wait(job.timeout_s)
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter teardown: leftover non-daemon threads must not keep a rank alive.
        os._exit(exit_code)


class _ResultError(Exception):
    """The rank's return value cannot travel back to the caller."""


def _pickle_result(result: Any, max_result_bytes: int) -> bytes:
    try:
        payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:
        raise _ResultError(
            f"returned a {type(result).__name__} that cannot be pickled "
            f"({type(error).__name__}: {error}); return plain data (numbers, lists, dicts, tensors)"
        ) from None
    if len(payload) > max_result_bytes:
        raise _ResultError(
            f"returned {len(payload):,} bytes once pickled, more than "
            f"max_result_bytes={max_result_bytes:,}; return a summary (a checksum, a few "
            "values) or write large data to a file and return its path"
        )
    return payload


def _exception_error(rank: int, error: BaseException, phase: str) -> RankError:
    if isinstance(error, _ResultError):
        return RankError(rank, "result", str(error), "", phase=phase, seen_at=time.monotonic())
    # Drop this module's own frame: the traceback starts in the user's function.
    tb = error.__traceback__
    if tb is not None and tb.tb_next is not None and phase == "fn":
        tb = tb.tb_next
    details = "".join(traceback.format_exception(type(error), error, tb))
    summary = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    if phase == "init_process_group":
        summary = f"init_process_group failed: {summary}"
    return RankError(rank, "exception", summary, details, phase=phase, seen_at=time.monotonic())
