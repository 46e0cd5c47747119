"""The rigs of ``tools/rigs/`` for the tests, imported as the commands in ``tools/`` import them.

The rigs are no part of the library: they live beside their commands, importable as ``rigs`` with
``tools/`` on ``sys.path`` (``tools/gpu_check.py`` and its ``gpu_rows`` work the same way).

Example:
    >>> from tests.rigs import launches
    >>> len(launches.launch_cases(9))
    9
"""

from __future__ import annotations

import sys
from pathlib import Path

_TOOLS = str(Path(__file__).resolve().parents[1] / "tools")
if _TOOLS not in sys.path:
    sys.path.append(_TOOLS)

from rigs import host_syncs, kill_trials, launches  # noqa: E402 - once tools/ is on the path

__all__ = ["host_syncs", "kill_trials", "launches"]
