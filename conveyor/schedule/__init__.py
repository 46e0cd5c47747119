"""Schedules as data: build, verify, simulate and draw pipeline schedules.

A :class:`Schedule` is made by :func:`build` (a registered schedule), :func:`load_csv` (a file), or by
hand with :meth:`Schedule.from_programs`. Pure Python: importing this package never imports torch.

Example:
    >>> import conveyor.schedule as cs
    >>> sched = cs.build("1f1b", ranks=4, microbatches=8)
    >>> sched.stages_of(2)
    [2]
    >>> round(cs.simulate(sched).bubble_ratio, 3)
    0.273
"""

from conveyor.schedule.cost import CostModel, StageCosts
from conveyor.schedule.csv_io import (
    dumps_csv,
    infer_placement,
    load_csv,
    loads_csv,
    parse_schedule,
    save_csv,
)
from conveyor.schedule.grid import render_grid
from conveyor.schedule.ir import Action, ActionKind, Placement, Schedule
from conveyor.schedule.lower import lower
from conveyor.schedule.passes import Executable, executable
from conveyor.schedule.registry import available, build, register, unregister
from conveyor.schedule.simulate import simulate
from conveyor.schedule.timeline import Span, Timeline
from conveyor.schedule.verify import verify

__all__ = [
    "Action",
    "ActionKind",
    "CostModel",
    "Executable",
    "Placement",
    "Schedule",
    "Span",
    "StageCosts",
    "Timeline",
    "available",
    "build",
    "dumps_csv",
    "executable",
    "infer_placement",
    "load_csv",
    "loads_csv",
    "lower",
    "parse_schedule",
    "register",
    "render_grid",
    "save_csv",
    "simulate",
    "unregister",
    "verify",
]
