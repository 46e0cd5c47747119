"""A rank's side of a :class:`~conveyor.processes.RankGroup`: set up, answer calls, report failures.

A rank sets up once (its stack dump, the environment torchrun gives ranks on one machine, one
torch thread, its process group), then answers call after call on its pipe until told to stop.
Every answer is ``("ok", pickled result)`` or ``("error", RankError)``: the rank itself turns
an exception into its traceback, and a result that cannot travel (not picklable, or larger
than the limit) into a clear ``"result"`` error, so the parent never has to guess. A rank
that failed keeps its sockets open until the parent kills it: closing them first would have
its peers fail with "connection closed" errors that bury the root cause.

Importing this module does not import torch.

Example:
    >>> place(Worker(1, 2, distributed=False))
    (1, 2)
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from conveyor.errors import RankError
from conveyor.processes.support import die_with_parent, install_stack_dump, rank_environment

MAX_RESULT_BYTES = 256 * 2**20
"""Default limit on one rank's pickled return value (256 MiB)."""

# The process group's own timeout outlives the parent's, so a hang is always reported by the
# parent (with stacks) rather than by gloo (with a bare timeout message).
PROCESS_GROUP_EXTRA_S = 60.0
# How long a rank whose set-up failed keeps its sockets open for the parent to kill its peers.
FAILED_RANK_LINGER_S = 5.0


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
class Call:
    """One function for every rank: ``fn(worker, *args, **kwargs)``, or with ``by_rank``
    ``fn(rank, world_size, *args, **kwargs)`` (the calling convention of ``run_ranks``)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    by_rank: bool = False

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", repr(self.fn))


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What a rank needs to start serving (sent to a zygote or a spawned rank, inherited by a fork).

    ``first_call`` runs right after set-up, before the pipe is read: under fork it reaches
    the rank without being pickled, so a lambda or a closure works.
    """

    world_size: int
    port: int | None
    timeout_s: float
    stack_dir: str
    backend: str = "gloo"
    env: dict[str, str] = field(default_factory=dict)
    max_result_bytes: int = MAX_RESULT_BYTES
    first_call: Call | None = None


def stack_path(stack_dir: str, rank: int) -> Path:
    """Where rank ``rank`` of a group whose stacks go to ``stack_dir`` dumps its stack."""
    return Path(stack_dir) / f"rank{rank}.stack.txt"


def rank_main(rank: int, spec: RankSpec, conn: Connection, inherited: tuple[Connection, ...] = ()) -> None:
    """A rank process's whole life; never returns.

    It ends with ``os._exit``: no interpreter teardown, so a thread the user's code left
    behind cannot keep the rank alive, and no code of a zygote runs on in its fork.
    """
    code = 1
    try:
        die_with_parent()
        for other in inherited:  # a zygote's pipes, inherited by the fork
            other.close()
        code = 0 if serve(rank, spec, conn) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        _flush_output()
        os._exit(code)


def serve(rank: int, spec: RankSpec, conn: Connection) -> bool:
    """Set this rank up, then answer calls from ``conn`` until told to stop; False if set-up failed."""
    stack_file = install_stack_dump(str(stack_path(spec.stack_dir, rank)))  # noqa: F841 (open for the process's life)
    # Before torch is imported: the caller's env may steer it (CUDA_VISIBLE_DEVICES, say).
    os.environ.update(rank_environment(rank, spec.world_size, spec.port))
    os.environ.update(spec.env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    worker = Worker(rank, spec.world_size, distributed=spec.port is not None)
    try:
        if spec.port is not None:
            dist.init_process_group(
                spec.backend, rank=rank, world_size=spec.world_size,
                timeout=timedelta(seconds=spec.timeout_s + PROCESS_GROUP_EXTRA_S),
            )
    except BaseException as error:  # noqa: BLE001 (reported, never swallowed)
        _send(conn, ("error", exception_error(rank, error, "init_process_group")))
        conn.poll(FAILED_RANK_LINGER_S)  # see the module docstring: the parent kills the peers first
        return False
    try:
        # Set up: the group may call (a one-call group's call answers for the set-up).
        first = ("ok", None) if spec.first_call is None else _answer(worker, spec.first_call, spec.max_result_bytes)
        _send(conn, first)
        with contextlib.suppress(EOFError):  # end of file: the parent is gone
            for call in iter(conn.recv, None):  # None: told to stop
                _send(conn, _answer(worker, call, spec.max_result_bytes))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return True


def _send(conn: Connection, answer: tuple[str, Any]) -> None:
    # What the call printed goes out first: a rank that failed is killed, not flushed at exit.
    _flush_output()
    conn.send(answer)


def _flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _answer(worker: Worker, call: Call, max_result_bytes: int) -> tuple[str, Any]:
    try:
        result = _call_user_function(worker, call)
    except BaseException as error:  # noqa: BLE001 (SystemExit and KeyboardInterrupt are reported too)
        return "error", exception_error(worker.rank, error, "fn")
    # The result pickled, or why it cannot travel back to the caller.
    try:
        payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:
        problem = (
            f"returned a {type(result).__name__} that cannot be pickled "
            f"({type(error).__name__}: {error}); return plain data (numbers, lists, dicts, tensors)"
        )
    else:
        if len(payload) <= max_result_bytes:
            return "ok", payload
        problem = (
            f"returned {len(payload):,} bytes once pickled, more than "
            f"max_result_bytes={max_result_bytes:,}; return a summary (a checksum, a few "
            "values) or write large data to a file and return its path"
        )
    return "error", RankError(worker.rank, "result", problem, "", phase="result", seen_at=time.monotonic())


def _call_user_function(worker: Worker, call: Call) -> Any:
    # This frame and its callers are the harness's: stacks and tracebacks start below it.
    if call.by_rank:
        return call.fn(worker.rank, worker.world_size, *call.args, **call.kwargs)
    return call.fn(worker, *call.args, **call.kwargs)


ENTRY = (Path(__file__).name, _call_user_function.__name__)
"""``(file, function)`` of the frame that calls user code: dumped stacks are trimmed there."""


def exception_error(rank: int, error: BaseException, phase: str) -> RankError:
    """``error`` as a :class:`RankError`, its traceback starting in the user's code."""
    tb = error.__traceback__
    if phase == "fn":
        user_tb = tb
        while user_tb is not None and user_tb.tb_frame.f_code.co_filename == __file__:
            user_tb = user_tb.tb_next
        tb = user_tb or tb  # raised by the call itself (a wrong signature): keep the harness's frame
    details = "".join(traceback.format_exception(type(error), error, tb))
    summary = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    if phase != "fn":
        summary = f"{phase} failed: {summary}"
    return RankError(rank, "exception", summary, details, phase=phase, seen_at=time.monotonic())
