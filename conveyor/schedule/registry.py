"""Schedules by name: the built-ins and any the user registers.

A builder is ``fn(num_ranks, num_microbatches, virtual)``. It returns a
:class:`Schedule`, or the programs as plain data: one sequence of actions
(``Action`` objects or strings such as ``"2F0"``) per rank, returned as a list
or yielded one rank at a time. For plain data, ``register(placement=...)``
decides which rank runs each stage: ``"looped"`` (stage s on rank s % P, the
default), ``"vshape"`` (rank r runs stages r and 2P-1-r; V must be 2),
``"infer"`` (from where each stage's actions are), or a callable
``(num_ranks, virtual) -> Placement``. :func:`build` verifies the result and
raises the verifier's message for an invalid one. A builder registered with
``uses_costs=True`` is searched for measured costs: :func:`build` then passes it
``costs=`` (a :class:`~conveyor.schedule.cost.CostModel`, or None for its default). A builder raises
:class:`ScheduleError` stating the rule when it cannot serve the sizes asked.

Example:
    >>> import conveyor.schedule as cs
    >>> @cs.register("all-forwards-first", replace=True)
    ... def all_forwards_first(num_ranks, num_microbatches, virtual):
    ...     for rank in range(num_ranks):
    ...         yield [f"{rank}F{m}" for m in range(num_microbatches)] + [
    ...             f"{rank}B{m}" for m in range(num_microbatches)]
    >>> cs.build("all-forwards-first", ranks=2, microbatches=3).programs[1][3]
    Action(kind=<ActionKind.B: 'B'>, stage=1, microbatch=0)
    >>> cs.unregister("all-forwards-first")
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from conveyor.errors import ConveyorError, PipelineConfigError, ScheduleError, positive_int
from conveyor.schedule.cost import CostModel
from conveyor.schedule.ir import Placement, Schedule

Builder = Callable[[int, int, int], Any]  # -> Schedule, or rows of actions (returned or yielded)
PlacementSpec = str | Callable[[int, int], Placement]
_PLACEMENT_NAMES = ("looped", "vshape", "infer")


@dataclass(frozen=True, slots=True)
class ScheduleInfo:
    name: str
    builder: Builder
    description: str
    default_virtual: int
    virtual_choices: tuple[int, ...] | None  # None: any V >= 1
    placement: PlacementSpec = "looped"  # used when the builder returns plain rows
    uses_costs: bool = False  # build() passes the builder costs=CostModel | None


_REGISTRY: dict[str, ScheduleInfo] = {}


def register(
    name: str,
    builder: Builder | None = None,
    *,
    description: str = "",
    default_virtual: int = 1,
    virtual_choices: tuple[int, ...] | None = (1,),
    replace: bool = False,
    placement: PlacementSpec = "looped",
    uses_costs: bool = False,
) -> Any:
    """Make ``build(name, ...)`` call ``builder(num_ranks, num_microbatches, virtual)``.

    Without ``builder``, returns a decorator. ``placement`` applies when the
    builder returns or yields rows of actions (see the module docstring); with
    ``uses_costs``, the builder also takes ``costs=`` (see :func:`build`).

    Example:
        >>> import conveyor.schedule as cs
        >>> cs.register("two-rank-demo", lambda p, m, v: [["0F0", "0B0"], ["1F0", "1B0"]],
        ...             replace=True)
        >>> cs.build("two-rank-demo", ranks=2, microbatches=1).placement.stage_to_rank
        (0, 1)
        >>> cs.unregister("two-rank-demo")
    """
    if builder is None:

        def decorate(fn: Builder) -> Builder:
            register(
                name,
                fn,
                description=description,
                default_virtual=default_virtual,
                virtual_choices=virtual_choices,
                replace=replace,
                placement=placement,
                uses_costs=uses_costs,
            )
            return fn

        return decorate
    _check_registration(name, builder, description, default_virtual, virtual_choices, placement)
    # The built-ins first: a user's replace=True of a built-in name must outlive their loading.
    _load_builtins()
    if name in _REGISTRY and not replace:
        raise ScheduleError(f"a schedule named {name!r} is already registered; pass replace=True to override it")
    _REGISTRY[name] = ScheduleInfo(
        name, builder, description, default_virtual, virtual_choices, placement, bool(uses_costs)
    )
    return None


def unregister(name: str) -> None:
    """Forget the schedule ``name`` (a no-op if it is not registered)."""
    _load_builtins()  # else a built-in forgotten before its first use would come back
    _REGISTRY.pop(name, None)


def _check_registration(
    name: object,
    builder: object,
    description: object,
    default_virtual: object,
    virtual_choices: object,
    placement: object,
) -> None:
    if not isinstance(name, str) or not name.strip() or "\n" in name or "\r" in name:
        raise ScheduleError(f"a schedule's name must be a non-empty string on one line, got {name!r}")
    if not callable(builder):
        raise ScheduleError(
            f"schedule {name!r}: builder must be callable as builder(num_ranks, num_microbatches, virtual), "
            f"got {type(builder).__name__}"
        )
    if not isinstance(description, str):
        raise ScheduleError(f"schedule {name!r}: description must be a string, got {type(description).__name__}")
    if not positive_int(default_virtual):
        raise ScheduleError(f"schedule {name!r}: default_virtual must be a positive integer, got {default_virtual!r}")
    if virtual_choices is not None:
        if not isinstance(virtual_choices, tuple) or not all(positive_int(v) for v in virtual_choices):
            raise ScheduleError(
                f"schedule {name!r}: virtual_choices must be a tuple of positive integers, or None for any V, "
                f"got {virtual_choices!r}"
            )
        if default_virtual not in virtual_choices:
            raise ScheduleError(
                f"schedule {name!r}: default_virtual={default_virtual} is not among virtual_choices={virtual_choices}"
            )
    if not callable(placement) and placement not in _PLACEMENT_NAMES:
        raise ScheduleError(
            f"schedule {name!r}: placement must be one of {', '.join(map(repr, _PLACEMENT_NAMES))} or a callable "
            f"(num_ranks, virtual) -> Placement, got {placement!r}"
        )


def available() -> dict[str, ScheduleInfo]:
    """Every registered schedule by name (built-ins first)."""
    _load_builtins()
    return dict(_REGISTRY)


def build(
    name: str, *, ranks: int, microbatches: int, virtual: int | None = None, check: bool = True,
    costs: CostModel | None = None,
) -> Schedule:
    """The schedule ``name`` for ``ranks`` ranks and ``microbatches`` microbatches, verified.

    ``virtual`` is the number of stages per rank for the schedules that take one.
    ``costs`` (one entry per stage) reach the builders registered with ``uses_costs``
    (ZB-1p, ZB-2p search their order for them); the others ignore them.

    Example:
        >>> import conveyor.schedule as cs
        >>> costs = cs.CostModel.uniform(2, 1.0, 2.0, 0.5)
        >>> str(build("zb-1p", ranks=2, microbatches=3, costs=costs)).splitlines()[0]
        'schedule zb-1p: 2 ranks, 2 stages, 3 microbatches'
    """
    from conveyor.schedule.ir import _check_positive
    from conveyor.schedule.verify import verify

    _load_builtins()
    info = _REGISTRY.get(name) if isinstance(name, str) else None
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
    sizes = f"ranks={ranks}, microbatches={microbatches}, virtual={virtual}"
    try:
        if info.uses_costs:
            result = info.builder(ranks, microbatches, virtual, costs=costs)
        else:
            result = info.builder(ranks, microbatches, virtual)
        schedule = _as_schedule(result, info, ranks, microbatches, virtual, sizes)
    except ConveyorError:
        raise
    except Exception as error:  # noqa: BLE001 - a user's builder: say whose code failed
        raise ScheduleError(
            f"the builder of schedule {name!r} failed for {sizes}: {type(error).__name__}: {error}"
        ) from error
    if check:
        try:
            verify(schedule)
        except ScheduleError as error:
            raise ScheduleError(f"schedule {name!r} ({sizes}) is invalid: {error.message}", grid=error.grid) from None
    return schedule


def _as_schedule(
    result: object, info: ScheduleInfo, ranks: int, microbatches: int, virtual: int, sizes: str
) -> Schedule:
    """The builder's result as a Schedule of the sizes asked."""
    from conveyor.schedule.csv_io import schedule_from_rows

    name = info.name
    if isinstance(result, Schedule):
        schedule = result
    else:
        if result is None or isinstance(result, str | bytes) or not isinstance(result, Iterable):
            raise ScheduleError(
                f"the builder of schedule {name!r} returned {type(result).__name__} for {sizes}; return a Schedule, "
                "or one sequence of actions (or strings such as '2F0') per rank, or yield them rank by rank"
            )
        rows = [list(row) if isinstance(row, Iterable) and not isinstance(row, str | bytes) else row for row in result]
        if len(rows) != ranks:
            raise ScheduleError(
                f"the builder of schedule {name!r} gave programs for {len(rows)} ranks, but {sizes} asks for {ranks}"
            )
        placement = _placement(info, ranks, virtual)
        schedule = schedule_from_rows(
            rows, name=name, placement=placement, num_microbatches=microbatches, source=f"schedule {name!r}: "
        )
    if schedule.num_ranks != ranks or schedule.num_microbatches != microbatches:
        raise ScheduleError(
            f"the builder of schedule {name!r} returned a schedule for ranks={schedule.num_ranks}, "
            f"microbatches={schedule.num_microbatches}, but {sizes} was asked"
        )
    return schedule


def _placement(info: ScheduleInfo, ranks: int, virtual: int) -> Placement | None:
    spec = info.placement
    if spec == "looped":
        return Placement.looped(ranks, virtual)
    if spec == "vshape":
        if virtual != 2:
            raise ScheduleError(
                f"schedule {info.name!r} uses placement='vshape', which runs 2 stages on each rank, "
                f"but virtual={virtual}; register it with virtual_choices=(2,), default_virtual=2"
            )
        return Placement.vshape(ranks)
    if spec == "infer":
        return None
    placement = spec(ranks, virtual)
    if not isinstance(placement, Placement):
        raise ScheduleError(
            f"the placement callable of schedule {info.name!r} returned {type(placement).__name__}, not a Placement"
        )
    return placement


def _load_builtins() -> None:
    # Imported for their register() calls; late so registry has no import cycle.
    import conveyor.schedule.builtin  # noqa: F401


def resolve_schedule(schedule: Schedule | str, microbatches: int | None, virtual: int | None,
                     num_ranks: int) -> Schedule:
    """A Schedule object as given (verified), or built by name for ``num_ranks`` ranks.

    Example:
        >>> resolve_schedule("1f1b", 8, None, 4).num_microbatches
        8
    """
    if isinstance(schedule, Schedule):
        if microbatches is not None and microbatches != schedule.num_microbatches:
            raise PipelineConfigError(
                f"microbatches={microbatches} disagrees with the schedule's {schedule.num_microbatches}; "
                "leave microbatches out when passing a Schedule"
            )
        from conveyor.schedule.verify import verify  # verify imports this module's neighbours

        verify(schedule)  # a schedule of the user's own: a deadlock or a missing action fails here, not in a step
        return schedule
    if not isinstance(schedule, str):
        raise PipelineConfigError(f"schedule must be a Schedule or a schedule name, got {type(schedule).__name__}")
    if microbatches is None:
        raise PipelineConfigError(f"schedule={schedule!r} is a name: also pass microbatches=M")
    return build(schedule, ranks=num_ranks, microbatches=microbatches, virtual=virtual)
