"""What a rank group's two sides share: a free port, a rank's environment, its stack dumps.

The parent (:mod:`conveyor.processes.group`) picks the port and reads the stacks a hung or
crashed rank dumped; the rank (:mod:`conveyor.processes.rank`) sets its environment to what
torchrun gives ranks on one machine, installs its stack dump and ties its life to its
parent's.

Importing this module does not import torch.

Example:
    >>> rank_environment(1, 4, 29500)["LOCAL_WORLD_SIZE"]
    '4'
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TextIO

logger = logging.getLogger(__name__)

# How long the harness waits for stuck ranks to write their stacks after SIGUSR1.
STACK_DUMP_WAIT_S = 2.0
_PR_SET_PDEATHSIG = 1



def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (rank 0 may still lose it to a race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_environment(rank: int, world_size: int, port: int | None) -> dict[str, str]:
    """What torchrun sets for a rank on one machine (conveyor picks its transport by it)."""
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
    }
    if port is not None:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


def install_stack_dump(stack_path: str) -> TextIO:
    """Let this rank write every thread's stack to ``stack_path`` on a crash or on SIGUSR1.

    Returns the open file, which must stay open for the process's life.
    """
    stack_file = open(stack_path, "w")  # noqa: SIM115 (open for the process's life)
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)
    return stack_file


def wait_for_stacks(paths: list[Path], entry: tuple[str, str]) -> list[str]:
    """Read the dumped stacks once every file has stopped growing (or the wait is over).

    ``entry`` is ``(file name, function)`` of the harness frame that called the user's
    code: it and its callers are dropped from each stack.
    """
    end = time.monotonic() + STACK_DUMP_WAIT_S
    previous: list[int] = []
    while True:
        sizes = [path.stat().st_size if path.exists() else 0 for path in paths]
        if (all(sizes) and sizes == previous) or time.monotonic() > end:
            return [read_stack(path, entry) for path in paths]
        previous = sizes
        time.sleep(0.05)


def read_stack(path: Path, entry: tuple[str, str]) -> str:
    """The stack dumped at ``path`` without the harness's frames (see :func:`wait_for_stacks`)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    file_name, function = entry
    kept: list[str] = []
    skipping = False
    for line in text.splitlines():
        is_frame = line.startswith("  File ")
        if is_frame and line.endswith(f" in {function}") and file_name in line:
            skipping = True
        elif not is_frame:
            skipping = False
        if not skipping:
            kept.append(line)
    return "\n".join(kept)


def die_with_parent() -> None:
    """Ask Linux to kill this process if its parent dies (no orphaned ranks in CI)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        logger.debug("prctl(PR_SET_PDEATHSIG) unavailable; ranks may outlive a killed parent")
