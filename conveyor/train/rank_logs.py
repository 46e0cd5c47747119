"""Where each launched rank's stderr goes, and the last Python frames a failure report quotes from it.

A rank that dies of a signal (SIGABRT from a C++ ``abort``, SIGSEGV) leaves no Python exception
for the launcher's error file: the only trace of where it was is the dump Python's ``faulthandler``
writes to the rank's stderr as it dies, together with whatever native code printed just before
(``terminate called after throwing ...``). :class:`RankLogs` sends every rank's stderr to its own
file, ``<run.dir>/logs/rank<R>.stderr`` (``rank<R>.restart<K>.stderr`` in the K-th restarted
round), at the file-descriptor level, so native writes and the dump land there too, and torch's
launcher copies each line to the terminal as it comes (prefixed ``[rank R]``): the terminal shows
what it showed before, and the file keeps it after the terminal's scrollback is gone.
:func:`last_frames` reads a dump back for the failure report (:mod:`conveyor.train.failures`).

Example:
    >>> import tempfile
    >>> log = Path(tempfile.mkdtemp()) / "rank0.stderr"
    >>> _ = log.write_text('Fatal Python error: Aborted\\n\\nCurrent thread 0x7f (most recent call first):\\n'
    ...                    '  File "/c/loop.py", line 470 in evaluate\\n  File "/c/loop.py", line 9 in f\\n')
    >>> last_frames(log)
    ['Fatal Python error: Aborted', 'File "/c/loop.py", line 470 in evaluate', 'File "/c/loop.py", line 9 in f']
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

from conveyor.train.restarts import restart_round

# faulthandler's heading of one thread's frames, and one frame.
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ .*\(most recent call first\):$")
_FRAME = re.compile(r'^\s+File ".*", line \d+ in .*$')
# What native code and Python print as a process goes down, before the frames.
_DYING_WORDS = ("Fatal Python error", "terminate called", "what():", "Segmentation fault", "Aborted")
_QUOTED_FRAMES = 6  # the innermost frames say where the rank was; the outer ones are the same start-up


def stderr_path(run_dir: str | os.PathLike, rank: int, restart: int = 0) -> Path:
    """The file that holds ``rank``'s stderr in round ``restart`` of a launch into ``run_dir``.

    Example:
        >>> str(stderr_path("runs/x", 1)), str(stderr_path("runs/x", 1, restart=2))
        ('runs/x/logs/rank1.stderr', 'runs/x/logs/rank1.restart2.stderr')
    """
    name = f"rank{rank}.stderr" if restart == 0 else f"rank{rank}.restart{restart}.stderr"
    return Path(run_dir) / "logs" / name


class RankLogs(LogsSpecs):
    """torch elastic's ``LogsSpecs`` for a launch into ``run_dir``: each rank's stderr in
    :func:`stderr_path`'s file, copied line by line to the terminal (``tee``), its error file beside it.
    ``starting`` is called as each round's ranks are about to start (the launcher's rendezvous is over).

    Example:
        >>> specs = RankLogs("runs/x")
        >>> specs.root_log_dir
        'runs/x/logs'
    """

    def __init__(self, run_dir: str | os.PathLike, starting: Callable[[], None] | None = None) -> None:
        super().__init__(log_dir=str(Path(run_dir) / "logs"))
        self.run_dir, self.starting = Path(run_dir), starting

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """The files of one round's ranks (``envs``: each local rank's environment, which gets its error file)."""
        if self.starting is not None:
            self.starting()
        restart = restart_round(next(iter(envs.values()), {}))
        folder = Path(self.root_log_dir)
        folder.mkdir(parents=True, exist_ok=True)
        stdouts, stderrs, errors = {}, {}, {}
        for local_rank, environ in envs.items():
            rank = int(environ.get("RANK", local_rank))
            path = stderr_path(self.run_dir, rank, restart)
            path.unlink(missing_ok=True)  # a run before this one in the same directory
            error = path.with_suffix(".error.json")
            error.unlink(missing_ok=True)
            stdouts[local_rank], stderrs[local_rank], errors[local_rank] = "", str(path), str(error)
            environ["TORCHELASTIC_ERROR_FILE"] = str(error)  # where torch writes a raised exception
        return LogsDest(stdouts=stdouts, stderrs=stderrs, tee_stderrs=dict(stderrs), error_files=errors)


def last_frames(path: str | os.PathLike, limit: int = _QUOTED_FRAMES) -> list[str]:
    """What a dying rank last said in its stderr file ``path``: the native and fatal-error lines of its
    last faulthandler dump, then the innermost ``limit`` Python frames of the thread that was running
    Python (the current thread's, else the first thread with frames: a C++ thread that aborts has none)
    and, further out, the innermost frame of the training loop (``conveyor/train/``), after "...".

    [] when the file is missing or holds no dump.

    Example:
        >>> last_frames("no/such/file")
        []
    """
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return []
    start = max((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")), default=None)
    if start is None:
        return []
    before = [line.strip() for line in lines[max(0, start - 4): start]
              if line.strip().startswith(_DYING_WORDS)]
    threads: list[list[str]] = []
    current: list[str] | None = None
    for line in lines[start + 1:]:
        if _THREAD.match(line.strip()):
            current = []
            threads.append(current)
            if line.startswith("Current thread"):
                threads.insert(0, threads.pop())  # the thread that received the signal goes first
        elif current is not None and _FRAME.match(line):
            current.append(line.strip())
        elif not line.strip():
            current = None
    frames = next((thread for thread in threads if thread), [])
    quoted = frames[:limit]
    # Where in the training loop it was (validate_now, train_step), when that is further out than the quote.
    loop = next((frame for frame in frames[limit:] if "/conveyor/train/" in frame), None)
    if loop is not None:
        quoted += ["...", loop]
    return [*before, lines[start].strip(), *quoted]
