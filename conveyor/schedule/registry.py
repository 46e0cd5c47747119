"""Schedules by name: the built-ins and any the user registers.

A builder is ``fn(num_ranks, num_microbatches, virtual) -> Schedule``. It raises
:class:`ScheduleError` stating the rule when it cannot serve the sizes asked.

Example:
    >>> import conveyor.schedule as cs
    >>> sched = cs.build("gpipe", ranks=2, microbatches=3)
    >>> sched.num_stages
    2
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from conveyor.errors import ScheduleError
from conveyor.schedule.ir import Schedule

Builder = Callable[[int, int, int], Schedule]


@dataclass(frozen=True, slots=True)
class ScheduleInfo:
    name: str
    builder: Builder
    description: str
    default_virtual: int
    virtual_choices: tuple[int, ...] | None  # None: any V >= 1


_REGISTRY: dict[str, ScheduleInfo] = {}


def register(
    name: str,
    builder: Builder,
    *,
    description: str = "",
    default_virtual: int = 1,
    virtual_choices: tuple[int, ...] | None = (1,),
    replace: bool = False,
) -> None:
    """Make ``build(name, ...)`` call ``builder(num_ranks, num_microbatches, virtual)``."""
    if name in _REGISTRY and not replace:
        raise ScheduleError(f"a schedule named {name!r} is already registered; pass replace=True to override it")
    _REGISTRY[name] = ScheduleInfo(name, builder, description, default_virtual, virtual_choices)


def available() -> dict[str, ScheduleInfo]:
    """Every registered schedule by name (built-ins first)."""
    _load_builtins()
    return dict(_REGISTRY)


def build(name: str, *, ranks: int, microbatches: int, virtual: int | None = None, check: bool = True) -> Schedule:
    """The schedule ``name`` for ``ranks`` ranks and ``microbatches`` microbatches, verified.

    ``virtual`` is the number of stages per rank for the schedules that take one.
    """
    from conveyor.schedule.ir import _check_positive
    from conveyor.schedule.verify import verify

    _load_builtins()
    info = _REGISTRY.get(name)
    if info is None:
        known = ", ".join(sorted(_REGISTRY))
        raise ScheduleError(f"unknown schedule {name!r}; known schedules: {known}")
    _check_positive(ranks=ranks, microbatches=microbatches)
    if virtual is None:
        virtual = info.default_virtual
    _check_positive(virtual=virtual)
    if info.virtual_choices is not None and virtual not in info.virtual_choices:
        choices = ", ".join(map(str, info.virtual_choices))
        raise ScheduleError(f"schedule {name!r} runs {choices} stage(s) per rank, not virtual={virtual}")
    schedule = info.builder(ranks, microbatches, virtual)
    if check:
        verify(schedule)
    return schedule


def _load_builtins() -> None:
    # Imported for their register() calls; late so registry has no import cycle.
    import conveyor.schedule.builtin  # noqa: F401
