"""How much of this VM's CPU time the host gave to other guests while a benchmark ran.

On a shared host the figure swings from 1% to over 50% within seconds and moves step
times as much as any change to the code; every figure the benchmarks print comes with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class StealMeter:
    """CPU time the hypervisor gave to someone else while this VM's CPUs wanted it.

    Summed over chosen windows from ``/proc/stat`` (all CPUs, in clock ticks):
    ``steal / (steal + busy)`` is the share of the CPU time this VM's CPUs wanted (to run
    something, not idle) that the host spent elsewhere. On a shared host it swings from 1%
    to over 50% within seconds, and a step whose ranks keep both CPUs busy loses more than
    one process that keeps one busy; so every record says how much each side lost. None
    where ``/proc/stat`` has no steal.

    Example:
        >>> meter = StealMeter()
        >>> with meter.window("conveyor"):
        ...     pass
        >>> set(meter.percent()) <= {"conveyor"}
        True
    """

    def __init__(self) -> None:
        self.ticks: dict[str, list[int]] = {}

    @staticmethod
    def read() -> tuple[int, int] | None:
        """``(steal, wanted)`` clock ticks of all CPUs since boot (wanted: not idle), or None."""
        try:
            with open("/proc/stat") as stat:
                fields = stat.readline().split()
        except OSError:
            return None
        if len(fields) < 9 or fields[0] != "cpu":
            return None
        # user nice system idle iowait irq softirq steal (guest time is inside user)
        ticks = [int(f) for f in fields[1:9]]
        return ticks[7], sum(ticks) - ticks[3] - ticks[4]

    @contextlib.contextmanager
    def window(self, side: str) -> Iterator[None]:
        """Count the ticks of the ``with`` body towards ``side``."""
        start = self.read()
        try:
            yield
        finally:
            end = self.read()
            if start is not None and end is not None:
                totals = self.ticks.setdefault(side, [0, 0])
                totals[0] += end[0] - start[0]
                totals[1] += end[1] - start[1]

    def percent(self) -> dict[str, float]:
        """Per side: steal as a percentage of the CPU time wanted in its windows."""
        return {side: 100.0 * steal / wanted for side, (steal, wanted) in self.ticks.items() if wanted > 0}
