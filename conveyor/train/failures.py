"""What a user reads when a launched run fails: the cause last, torch elastic's tracebacks in a log file.

torch's elastic launcher logs each failed rank's traceback (wrapped in its own
``ProcessRaisedException`` frames) and then a ``ChildFailedError`` table, some 60 lines in
which the reason sits in the middle. :func:`launcher_log` sends the launcher's log lines to
``<run.dir>/launch.log`` instead, and :func:`failure_report` ends the output with the three
things that matter: which rank failed (a rank killed by a signal first: the others' errors
are then mostly its peers noticing that it is gone), the error's type and message, and what to
do, with where the tracebacks are.

Example:
    >>> from types import SimpleNamespace as NS
    >>> raised = NS(pid=7, exitcode=1, timestamp=5, signal_name=lambda: "",
    ...             message={"message": "ValueError: bad batch", "extraInfo": {"py_callstack": "..."}})
    >>> print(failure_report(NS(failures={1: raised}), 0, "runs/x/launch.log"))
    conveyor train: rank 1 (pid 7) failed: ValueError: bad batch
    conveyor train: no restarts were allowed (run.max_restarts=0); every rank's traceback is in runs/x/launch.log
    conveyor train: what to do: fix the cause the error names, then run the same command again
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The launcher's loggers: its agent, process contexts and rendezvous, and the processes it starts and stops.
LAUNCHER_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")
# A user's mistake, whose message already says what to change: conveyor's checks of what it was given.
_USER_ERRORS = ("ConfigError", "CheckpointError", "CheckpointIncompleteError", "CheckpointMismatchError",
                "PretrainedWeightsError", "PipelineConfigError", "SplitError", "TracingError", "PlanError",
                "NonFiniteError")


@contextlib.contextmanager
def launcher_log(path: str | os.PathLike, notify: bool = True) -> Iterator[Path]:
    """Within the block, torch elastic's log lines go to ``path`` (appended), not to the terminal.

    With ``notify``, each rank failure the launcher sees still prints one line to stderr (a run
    with restarts left says so before the next round resumes).

    Example:
        >>> import tempfile
        >>> where = Path(tempfile.mkdtemp()) / "launch.log"
        >>> with launcher_log(where):
        ...     logging.getLogger("torch.distributed.elastic.agent").warning("a worker failed")
        >>> "a worker failed" in where.read_text()
        True
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(name) for name in LAUNCHER_LOGGERS]
    kept = [(logger.propagate, logger.level) for logger in loggers]
    notice = _RoundFailedNotice(path) if notify else logging.NullHandler()
    for logger in loggers:
        logger.addHandler(handler)
        logger.addHandler(notice)
        logger.propagate = False
        if logger.level == logging.NOTSET or logger.level > logging.INFO:
            logger.setLevel(logging.INFO)  # the file may say more than the terminal did: restarts, rounds
    try:
        yield path
    finally:
        for logger, (propagate, level) in zip(loggers, kept):
            logger.removeHandler(handler)
            logger.removeHandler(notice)
            logger.propagate, logger.level = propagate, level
        handler.close()


class _RoundFailedNotice(logging.Handler):
    """One line on stderr when the launcher sees a rank fail (its record, traceback and all, goes to the log):
    with restarts left, the only word the user gets that a round failed before the next one resumes."""

    def __init__(self, log_path: Path) -> None:
        super().__init__(logging.ERROR)
        self.log_path = log_path

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("failed (exitcode") or len(record.args or ()) < 3:
            return
        code, local_rank, pid = record.args[:3]
        how = f"exit code {code}" if not isinstance(code, int) or code >= 0 else _signal_name(-code)
        print(f"conveyor train: rank {local_rank} (pid {pid}) failed ({how}); the launcher stops this round's "
              f"ranks (details: {self.log_path})", file=sys.stderr, flush=True)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def root_cause(error: Any) -> tuple[int, Any]:
    """``(rank, failure)`` of a ``ChildFailedError`` whose failure ended the run.

    A rank that died of a signal comes first, then the earliest failure, then the lowest rank.
    """
    failures = error.failures
    rank = min(failures, key=lambda r: (failures[r].exitcode >= 0, failures[r].timestamp, r))
    return rank, failures[rank]


def describe_failure(error: Any, restarts: int) -> str:
    """One line naming the rank whose failure ended the run (a ``ChildFailedError``'s) and how it ended.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> dead = NS(pid=42, exitcode=-9, timestamp=5, signal_name=lambda: "SIGKILL")
        >>> print(describe_failure(NS(failures={1: dead}), 0))
        rank 1 (pid 42) died of SIGKILL; no restarts were allowed (run.max_restarts=0)
    """
    rank, failure = root_cause(error)
    how = (f"died of {failure.signal_name()}" if failure.exitcode < 0
           else f"exited with status {failure.exitcode}")
    return f"rank {rank} (pid {failure.pid}) {how}; {_restarts_spent(restarts)}"


def _restarts_spent(restarts: int) -> str:
    return (f"after {restarts} restart(s), none left (run.max_restarts={restarts})" if restarts
            else "no restarts were allowed (run.max_restarts=0)")


def raised(failure: Any) -> str | None:
    """``"Type: message"`` of the exception a failed rank raised (from its error file), or None.

    A message of many lines (one that carries other tracebacks) is cut to its first line and,
    when it differs, its last: the error and the error under it.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> message = "CheckpointError: save failed\\nTraceback ...\\n  File x\\nOSError: disk full"
        >>> raised(NS(message={"message": message}))
        'CheckpointError: save failed (under it: OSError: disk full)'
    """
    message = getattr(failure, "message", None)
    if isinstance(message, dict):
        message = message.get("message")
    if not isinstance(message, str) or not message or message.startswith(("Signal ", "To enable traceback")):
        return None
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if len(lines) > 1 and not lines[-1].startswith(("File ", "^")) and lines[-1] != lines[0]:
        return f"{lines[0]} (under it: {lines[-1]})"
    return lines[0]


def failure_report(error: Any, restarts: int, log_path: str | os.PathLike,
                   run_dir: str | os.PathLike | None = None) -> str:
    """The last lines printed when a launched run fails: the rank, its error, what to do (see the module).

    With ``run_dir`` (ranks launched with :class:`~conveyor.train.rank_logs.RankLogs`), the report names the
    failed rank's stderr file and, when the rank died without a Python exception, quotes the last Python
    frames its faulthandler dump there holds (:func:`~conveyor.train.rank_logs.last_frames`).
    """
    rank, failure = root_cause(error)
    exception = raised(failure)
    if failure.exitcode < 0:
        what = f"died of {failure.signal_name()}"
    elif exception is not None:
        what = f"failed: {exception}"
    else:
        what = f"exited with status {failure.exitcode} without a Python exception (os._exit, or a crash in native code)"
    lines = [f"rank {rank} (pid {failure.pid}) {what}"]
    if failure.exitcode < 0:
        # A rank killed by a signal comes first; but a native abort may itself follow a peer's own error (gloo
        # aborts a rank whose connection a failed peer dropped): such errors are named before it.
        lines[:0] = [f"rank {other} (pid {peer.pid}) also failed: {message}"
                     for other, peer, message in _own_errors(error, rank)]
    where = f"every rank's traceback is in {log_path}"
    if run_dir is not None:
        from conveyor.train.rank_logs import last_frames, stderr_path

        stderr = stderr_path(run_dir, rank, restarts)  # the round that failed last: restarts are spent
        frames = last_frames(stderr) if exception is None else []
        if frames:
            lines.append(f"rank {rank}'s last words (from {stderr}):")
            lines += [f"    {frame}" for frame in frames]
        where += f", its stderr (faulthandler's dump included) in {stderr}"
    lines += [f"{_restarts_spent(restarts)}; {where}", f"what to do: {_advice(failure, exception, restarts)}"]
    return "\n".join(f"conveyor train: {line}" for line in lines)


# What a rank raises when it only noticed another's failure: not a cause of its own.
_ECHOES = ("PeerFailure", "PipelineStopped", "Connection closed by peer", "Connection reset by peer")


def _own_errors(error: Any, cause: int) -> list[tuple[int, Any, str]]:
    """The other ranks' exceptions that are not echoes of a peer's failure, rank by rank."""
    messages = {rank: raised(failure) for rank, failure in sorted(error.failures.items()) if rank != cause}
    return [(rank, error.failures[rank], message) for rank, message in messages.items()
            if message is not None and not any(echo in message for echo in _ECHOES)]


def _advice(failure: Any, exception: str | None, restarts: int) -> str:
    if failure.exitcode < 0:
        why = (" (SIGKILL from outside, often the kernel's out-of-memory killer: see `dmesg`)"
               if failure.signal_name() == "SIGKILL" else "")
        again = "" if restarts else "; run.max_restarts=N with checkpoint.interval restarts a run after such a loss"
        return f"find out what stopped the rank{why}, then run the same command again{again}"
    if exception is not None and exception.split(":", 1)[0] in _USER_ERRORS:
        return "change what the error names, then run the same command again"
    if exception is not None:
        return "fix the cause the error names, then run the same command again"
    return "read the rank's own output above and the log for why it exited"
