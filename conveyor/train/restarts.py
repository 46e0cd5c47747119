"""What a restarted round of an elastic launch needs to start clean and carry on where the failed one was.

With ``run.max_restarts`` (or ``torchrun --max-restarts``), the launcher ends every rank of
a round in which one failed and starts them all again, with ``TORCHELASTIC_RESTART_COUNT``
one higher. Such a round must not trip over what the failed one left:

- the launcher's store keeps the failed round's keys (gloo's addresses, the pipelines'
  shared-memory rings): :func:`round_prefix` gives each round keys of its own;
- the run resumes from the newest complete checkpoint *this job* wrote
  (:func:`restart_checkpoint`): one from an older run in the same directory, written
  before this job's launcher started (:func:`job_started`), is not this job's progress;
- ``metrics.jsonl`` has records of steps after that checkpoint (and maybe a line cut
  short): :func:`continue_log` drops them, so every step is logged once.

The rest needs nothing: the shared-memory rings are anonymous memfds and the doorbells
abstract sockets, gone with their processes; a checkpoint cut short is a hidden
``.partial`` directory that no load counts and the next save removes.

Example:
    >>> restart_round({"TORCHELASTIC_RESTART_COUNT": "1"}), round_prefix({})
    (1, 'conveyor/round0')
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO

# /proc/stat's boot time has whole seconds, and it wobbles by one between reads.
_START_SLACK_S = 2.0


def restart_round(environ: Mapping[str, str] | None = None) -> int:
    """How many times the launcher has restarted the ranks before this round (0: the first round).

    Example:
        >>> restart_round({}), restart_round({"TORCHELASTIC_RESTART_COUNT": "2"})
        (0, 2)
    """
    environ = os.environ if environ is None else environ
    return int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def round_prefix(environ: Mapping[str, str] | None = None) -> str:
    """The prefix of this round's keys in the launcher's store (which keeps every round's keys).

    Example:
        >>> round_prefix({"TORCHELASTIC_RESTART_COUNT": "3"})
        'conveyor/round3'
    """
    return f"conveyor/round{restart_round(environ)}"


def launcher_pid() -> int:
    """The process id of the launcher above this rank: the nearest ancestor that is not a rank itself.

    A rank's environment holds ``TORCHELASTIC_RUN_ID`` from its start (torchrun's) or from
    the launcher's setting it (a function launched by ``elastic_launch``); the launcher's own
    does not. Usually the parent; a wrapper between launcher and rank (``torchrun --no-python
    run.sh``) is a rank by this test and is passed over.

    Example:
        >>> launcher_pid() > 0
        True
    """
    parent = pid = os.getppid()
    for _ in range(32):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return parent
        if not any(entry.startswith(b"TORCHELASTIC_RUN_ID=") for entry in environ):
            return pid
        try:
            above = int(_stat_fields(pid)[1])  # field 4: the parent
        except (OSError, IndexError, ValueError):
            return parent
        if above <= 1:
            return parent
        pid = above
    return parent


def _stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` from its third on: the name (field 2) may hold spaces and parentheses,
    the fields after it are plain."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def job_started(pid: int | None = None) -> float | None:
    """When the job began: the start (seconds since the epoch) of its launcher, which outlives every round.

    ``pid``: the process whose start to read (default: :func:`launcher_pid`). None when
    ``/proc`` cannot tell (not Linux).

    Example:
        >>> import time
        >>> job_started(os.getpid()) <= time.time()
        True
    """
    pid = launcher_pid() if pid is None else pid
    try:
        ticks = int(_stat_fields(pid)[19])  # field 22: the start, in clock ticks after boot
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def restart_checkpoint(checkpoint_dir: str | os.PathLike, started: float | None) -> Path | None:
    """The newest complete checkpoint in ``checkpoint_dir`` saved after ``started``, or None.

    ``started`` None: any (the newest there is).

    Example:
        >>> restart_checkpoint("no/such/dir", None) is None
        True
    """
    from conveyor.checkpoint import checkpoints
    from conveyor.checkpoint.files import read_meta

    found = checkpoints(checkpoint_dir)  # oldest first
    if started is not None:
        found = [path for path in found if read_meta(path).get("saved_at", 0.0) >= started - _START_SLACK_S]
    return found[-1] if found else None


def continue_log(path: str | os.PathLike, step: int) -> IO[str]:
    """``path`` (a JSON-lines log of records with a ``step``) open for appending after ``step``.

    Step 0 starts the log over. Otherwise records of later steps are dropped, and so is a
    line that is not whole JSON (a writer killed mid-line), so a resumed run logs each step once.

    Example:
        >>> import tempfile
        >>> log = Path(tempfile.mkdtemp()) / "metrics.jsonl"
        >>> _ = log.write_text('{"step": 1}\\n{"step": 2}\\n{"step": 3}\\n{"st')
        >>> continue_log(log, 2).close()
        >>> log.read_text()
        '{"step": 1}\\n{"step": 2}\\n'
    """
    path = Path(path)
    if step == 0 or not path.is_file():
        return open(path, "w" if step == 0 else "a")  # noqa: SIM115 - the caller closes it
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line + "\n")
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("".join(kept))
    os.replace(temporary, path)
    return open(path, "a")  # noqa: SIM115 - the caller closes it
