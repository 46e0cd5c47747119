"""A start-up that takes more than a few seconds says what it is doing.

Starting a run goes through phases that are quick on an idle machine and can each take tens of
seconds on a busy one: importing torch and checking the config and data (the launcher), then on
each rank joining the process group (waiting for every rank), building the model, tracing and
splitting it, reading and tokenizing the corpus, resuming a checkpoint. :class:`StartupPhases`
names the phase under way; a phase still running after ``quiet_s`` seconds prints one line
(``conveyor train: building the model (5 s so far)``), and again every ``repeat_s`` seconds, or
every ``quiet_s`` seconds while its :meth:`~StartupPhases.progress` moves ("12,000 of 86,000
documents"), so a slow start is never silent and a fast one prints nothing extra. A watcher thread does the
printing: the phase itself may be stuck in C++ (an import, a rendezvous) that holds no lock the
thread needs.

Example:
    >>> import time
    >>> said = []
    >>> with StartupPhases(quiet_s=0.05, say=said.append) as phases:
    ...     phases.phase("building the model")
    ...     time.sleep(0.5)
    ...     phases.phase("tracing the model")           # over at once: nothing said
    >>> said[0].startswith("conveyor train: building the model (")
    True
    >>> any("tracing" in line for line in said)
    False
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from types import TracebackType


def _print(line: str) -> None:
    print(line, flush=True)


class StartupPhases(contextlib.AbstractContextManager):
    """The phase a start-up is in, said by a watcher thread when it lasts (see the module).

    ``enabled`` False: every call does nothing (ranks other than 0). ``say``: where the lines go
    (default: stdout, flushed). Use it as a context manager, or call :meth:`close`.
    """

    def __init__(self, enabled: bool = True, quiet_s: float = 5.0, repeat_s: float = 30.0,
                 say: Callable[[str], None] = _print) -> None:
        self.enabled, self.quiet_s, self.repeat_s, self.say = enabled, quiet_s, repeat_s, say
        self.began = time.monotonic()
        self._lock = threading.Lock()
        self._current: tuple[str, float] | None = None  # (what, when it began)
        self._progress = ""  # how far the phase under way has come, in words
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def phase(self, what: str) -> None:
        """``what`` (a phrase: "building the model") is under way from now; the previous phase is over."""
        if not self.enabled:
            return
        with self._lock:
            self._current, self._progress = (what, time.monotonic()), ""
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="conveyor-startup", daemon=True)
            self._watcher.start()

    def progress(self, words: str) -> None:
        """How far the phase under way has come ("12,000 of 86,000 documents"), said with it when it lasts."""
        if self.enabled:
            with self._lock:
                self._progress = words

    def close(self) -> None:
        """The start-up is over: nothing more is said."""
        with self._lock:
            self._current = None
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=1.0)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()

    def _watch(self) -> None:
        said: tuple[str, float, str] | None = None  # the phase last said, when, and its progress then
        while not self._stop.wait(min(0.25, self.quiet_s / 2)):
            with self._lock:
                current, progress = self._current, self._progress
            if current is None:
                continue
            what, began = current
            now = time.monotonic()
            fresh = said is None or said[0] != what or said[1] < began
            due = (now - began >= self.quiet_s if fresh
                   else now - said[1] >= (self.quiet_s if progress != said[2] else self.repeat_s))
            if due:
                still = "" if fresh else "still "
                detail = f": {progress}" if progress else ""
                self.say(f"conveyor train: {still}{what}{detail} ({now - began:.0f} s so far, "
                         f"{now - self.began:.0f} s since the start)")
                said = (what, now, progress)
