"""Schedules as text and as torch-compatible CSV files.

Text: ``str(schedule)`` prints one line per rank in the compact action form of
``torch.distributed.pipelining`` (``2F0``, ``1SEND_B3``); :func:`parse_schedule`
reads it back (the header line is optional, so a hand-written block of
``rank 0: 0F0 0B0`` lines works too).

The text form lists each rank's pairs on a line of its own, ``rank 0 overlaps: 0F1+0B0``.

CSV: torch's layout (``_dump_csv`` / ``_load_csv``): one row per rank, one
action string per cell, empty cells allowed (torch writes idle steps as empty
cells). ``format="compute_only"`` holds F/B/I/W only, ``"compute_comms"`` also
SEND/RECV. Schedules written for torchtitan load unchanged:

- the placement is inferred from where each stage's actions appear (a stage
  on two ranks is an error), the microbatch count from the largest id;
- torch's ``(0F7;7B3)OVERLAP_F_B`` is an overlapped pair (``Schedule.overlapped``:
  :mod:`conveyor.schedule.overlap`) when it is one: a forward, then a B or I of another
  microbatch, which does not stop the schedule once lowered with both receives before it;
  any other overlap's sub-actions run one after the other (as torch's runtime runs them
  all), so ``(0F7;0B7)OVERLAP_F_B`` loads as ``0F7 0B7``. A schedule's pairs are written
  back the same way;
- FSDP/DDP actions (UNSHARD, RESHARD, REDUCE_GRAD) are not run by conveyor:
  they are rejected with a message, or skipped with ``drop=``.

Example:
    >>> import conveyor.schedule as cs
    >>> sched = cs.build("1f1b", ranks=2, microbatches=2)
    >>> print(dumps_csv(sched), end="")
    0F0,0F1,0B0,0B1
    1F0,1B0,1F1,1B1
    >>> loads_csv(dumps_csv(sched), name="1f1b") == sched
    True
    >>> parse_schedule(str(sched)) == sched
    True
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

from conveyor.errors import ScheduleError
from conveyor.schedule.ir import Action, ActionKind, Placement, Schedule

CsvFormat = Literal["compute_only", "compute_comms"]

#: Actions of torch's schedules that conveyor does not run (FSDP / DDP hooks).
UNSUPPORTED_KINDS = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
_FORMATS = ("compute_only", "compute_comms")
_OTHER_KIND_RE = re.compile(r"^(\d+)(" + "|".join(UNSUPPORTED_KINDS) + r")(\d*)$")
_OVERLAP_RE = re.compile(r"^\((.*)\)OVERLAP_F_B$")
_HEADER_RE = re.compile(r"^schedule (.*): (\d+) ranks?, (\d+) stages?, (\d+) microbatch(?:es)?$")
_RANK_LINE_RE = re.compile(r"^rank (\d+):(.*)$")
_PAIRS_LINE_RE = re.compile(r"^rank (\d+) overlaps:(.*)$")


# -- building a schedule from rows of actions ---------------------------------------------------


def schedule_from_rows(
    rows: Iterable[Iterable[Action | str | None]],
    *,
    name: str = "custom",
    placement: Placement | None = None,
    num_microbatches: int | None = None,
    drop: Iterable[str] = (),
    source: str = "",
) -> Schedule:
    """A :class:`Schedule` from one row of actions per rank (``Action`` objects or strings).

    Empty strings and ``None`` are skipped (idle steps). Without ``placement``,
    each stage goes to the rank whose row holds its actions; without
    ``num_microbatches``, the largest microbatch id + 1. ``drop`` names kinds
    to skip, e.g. ``UNSUPPORTED_KINDS``. ``source`` prefixes messages (a path).
    The result is not verified: call :func:`conveyor.schedule.verify`.

    Example:
        >>> sched = schedule_from_rows([["0F0", "", "0B0"], ["1F0", "1B0"]])
        >>> sched.placement.stage_to_rank, sched.num_microbatches
        ((0, 1), 1)
    """
    drop_set = _check_drop(drop)
    if isinstance(rows, str | bytes) or not isinstance(rows, Iterable):
        raise ScheduleError(
            f"{source}expected one sequence of actions per rank (e.g. [['0F0', '0B0'], ['1F0', '1B0']]), "
            f"got {type(rows).__name__}"
        )
    programs: list[tuple[Action, ...]] = []
    pairs: list[list[tuple[Action, Action]]] = []
    for rank, row in enumerate(rows):
        pairs.append([])
        programs.append(_read_row(row, rank, drop_set, source, pairs[-1]))
    if not programs:
        raise ScheduleError(f"{source}no programs: expected one row of actions per rank")
    if placement is None:
        placement = infer_placement(programs, source=source)
    elif not isinstance(placement, Placement):
        raise ScheduleError(
            f"{source}placement must be a Placement (e.g. Placement.looped(num_ranks, virtual)) or None "
            f"to infer it, got {type(placement).__name__}"
        )
    elif placement.num_ranks != len(programs):
        raise ScheduleError(
            f"{source}the placement has {placement.num_ranks} ranks but there are {len(programs)} rows of actions"
        )
    if num_microbatches is None:
        num_microbatches = 1 + max((a.microbatch for p in programs for a in p), default=-1)
        if num_microbatches < 1:
            raise ScheduleError(f"{source}no actions at all: cannot infer the number of microbatches")
    overlapped = tuple(map(tuple, pairs)) if any(pairs) else ()
    return Schedule(name, placement, num_microbatches, tuple(programs), overlapped=overlapped)


def _check_drop(drop: Iterable[str]) -> frozenset[str]:
    if isinstance(drop, str):
        drop = (drop,)
    drop_set = frozenset(drop)
    unknown = sorted(drop_set - set(UNSUPPORTED_KINDS) - {k.value for k in ActionKind})
    if unknown:
        raise ScheduleError(
            f"drop= names unknown action kinds {unknown}; expected some of "
            f"{', '.join(UNSUPPORTED_KINDS + tuple(k.value for k in ActionKind))}"
        )
    return drop_set


def _read_row(row: object, rank: int, drop: frozenset[str], source: str,
              pairs: list[tuple[Action, Action]]) -> tuple[Action, ...]:
    """The row's actions; the overlapped pairs among its cells appended to ``pairs``."""
    if isinstance(row, str | bytes) or not isinstance(row, Iterable):
        raise ScheduleError(
            f"{source}the row of rank {rank} must be a sequence of actions or action strings, "
            f"got {type(row).__name__}"
            + (f" {row!r}: split it into one string per action" if isinstance(row, str) else "")
        )
    items = list(row)
    if set(map(type, items)) <= {Action}:
        return tuple(a for a in items if a.kind.value not in drop) if drop else tuple(items)
    actions: list[Action] = []
    for column, item in enumerate(items):
        if item is None or type(item) is Action:
            if item is not None and item.kind.value not in drop:
                actions.append(item)
            continue
        if not isinstance(item, str):
            raise ScheduleError(
                f"{source}rank {rank}, column {column}: expected an Action or a string such as '2F0', "
                f"got {item!r} ({type(item).__name__})"
            )
        cell = _parse_cell(item, rank, column, drop, source)
        if _OVERLAP_RE.match(item.strip()) and _is_pair(cell):
            pairs.append((cell[0], cell[1]))
        actions.extend(cell)
    return tuple(actions)


def _is_pair(actions: Sequence[Action]) -> bool:
    """Whether an overlap cell's actions are a pair conveyor runs overlapped: a forward, then a backward (B or I) of
    another microbatch (:func:`~conveyor.schedule.overlap.check_pairs` says the rest: same rank, stages)."""
    return (len(actions) == 2 and actions[0].kind is ActionKind.F and actions[1].kind in (ActionKind.B, ActionKind.I)
            and actions[0].microbatch != actions[1].microbatch)


def _parse_cell(text: str, rank: int, column: int, drop: frozenset[str], source: str) -> list[Action]:
    """The actions of one cell: none (empty), one, or the sub-actions of an OVERLAP_F_B."""
    text = text.strip()
    if not text:
        return []
    where = f"{source}rank {rank}, column {column}"
    overlap = _OVERLAP_RE.match(text)
    if overlap:
        parts = [p for p in overlap.group(1).split(";") if p.strip()]
        return [a for part in parts for a in _parse_cell(part, rank, column, drop, source)]
    other = _OTHER_KIND_RE.match(text)
    if other:
        kind = other.group(2)
        if kind in drop:
            return []
        raise ScheduleError(
            f"{where}: {text!r} is a {kind} action, which conveyor does not run (it belongs to torch's "
            "FSDP/DDP integration; conveyor.parallel handles sharding and gradient reduction itself). "
            f"Remove it, or load with drop={UNSUPPORTED_KINDS!r} to skip such actions"
        )
    try:
        action = Action.parse(text)
    except ScheduleError as error:
        raise ScheduleError(f"{where}: {error}") from None
    return [] if action.kind.value in drop else [action]


def infer_placement(programs: Sequence[Sequence[Action]], *, source: str = "") -> Placement:
    """Each stage on the rank whose program holds its actions.

    Example:
        >>> infer_placement([[Action.parse("0F0"), Action.parse("3F0")], [Action.parse("1F0")],
        ...                  [Action.parse("2F0")]]).stage_to_rank
        (0, 1, 2, 0)
    """
    owner: dict[int, tuple[int, Action]] = {}
    for rank, program in enumerate(programs):
        for action in program:
            first = owner.setdefault(action.stage, (rank, action))
            if first[0] != rank:
                raise ScheduleError(
                    f"{source}stage {action.stage} appears on rank {first[0]} ({first[1]}) and on rank {rank} "
                    f"({action}); a stage runs on one rank: move one of them, or pass placement= explicitly"
                )
    if not owner:
        raise ScheduleError(f"{source}no actions at all: cannot infer a placement")
    num_stages = max(owner) + 1
    missing = [s for s in range(num_stages) if s not in owner]
    if missing:
        raise ScheduleError(
            f"{source}stages {missing} have no actions, but stage {num_stages - 1} does: stages are numbered "
            "0..S-1 without gaps, each with its forward and backward"
        )
    idle = [rank for rank, program in enumerate(programs) if not program]
    if idle:
        raise ScheduleError(
            f"{source}ranks {idle} have no actions: every rank runs at least one stage (remove the empty rows, "
            "or give them their stages' actions)"
        )
    return Placement(len(programs), tuple(owner[s][0] for s in range(num_stages)))


# -- CSV --------------------------------------------------------------------------------------


def loads_csv(
    text: str,
    *,
    name: str = "custom",
    placement: Placement | None = None,
    num_microbatches: int | None = None,
    format: CsvFormat | None = None,  # noqa: A002 - torch's name
    drop: Iterable[str] = (),
    source: str = "",
) -> Schedule:
    """A schedule from CSV text in torch's layout (see the module docstring).

    ``format="compute_only"`` rejects SEND/RECV cells, ``"compute_comms"``
    keeps them, ``None`` accepts either.
    """
    if format is not None and format not in _FORMATS:
        raise ScheduleError(f"{source}format must be one of {_FORMATS} or None, got {format!r}")
    rows = list(csv.reader(io.StringIO(text)))
    while rows and not rows[-1]:
        rows.pop()  # trailing blank lines are no ranks (a row of empty cells is: an idle rank)
    schedule = schedule_from_rows(
        rows, name=name, placement=placement, num_microbatches=num_microbatches, drop=drop, source=source
    )
    if any(schedule.overlapped) and not schedule.is_lowered:  # torch runs every overlap in turn: none may stop it
        from conveyor.schedule.overlap import without_stopping_pairs  # (it lowers: lower imports this module)

        schedule = without_stopping_pairs(schedule)
    if format == "compute_only" and schedule.is_lowered:
        rank, step, action = next(
            (r, i, a) for r, p in enumerate(schedule.programs) for i, a in enumerate(p) if a.kind.is_comm
        )
        raise ScheduleError(
            f"{source}format='compute_only' but rank {rank} has the communication action {action} "
            f"(its step {step}); load with format='compute_comms', or remove the SEND/RECV cells"
        )
    return schedule


def load_csv(
    path: str | os.PathLike,
    *,
    name: str | None = None,
    placement: Placement | None = None,
    num_microbatches: int | None = None,
    format: CsvFormat | None = None,  # noqa: A002 - torch's name
    drop: Iterable[str] = (),
) -> Schedule:
    """Load a schedule from a CSV file in torch's layout; ``name`` defaults to the file's stem.

    Example:
        >>> import conveyor.schedule as cs, tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "mine.csv"
        >>> _ = path.write_text("0F0,0B0\\n1F0,1B0\\n")
        >>> sched = load_csv(path)
        >>> sched.name, sched.num_ranks
        ('mine', 2)
    """
    path = os.fspath(path)
    try:
        with open(path, newline="", encoding="utf-8") as file:
            text = file.read()
    except OSError as error:
        raise ScheduleError(f"cannot read schedule CSV {path!r}: {error.strerror or error}") from error
    if name is None:
        name = os.path.splitext(os.path.basename(path))[0]
    return loads_csv(
        text,
        name=name,
        placement=placement,
        num_microbatches=num_microbatches,
        format=format,
        drop=drop,
        source=f"{path}: ",
    )


def dumps_csv(schedule: Schedule, format: CsvFormat = "compute_only") -> str:  # noqa: A002
    """CSV text in torch's layout: ``compute_only`` drops SEND/RECV, ``compute_comms`` lowers first."""
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"expected a Schedule, got {type(schedule).__name__}")
    if format == "compute_only":
        programs = schedule.compute_only().programs
    elif format == "compute_comms":
        from conveyor.schedule.lower import lower

        programs = lower(schedule).programs
    else:
        raise ScheduleError(f"format must be one of {_FORMATS}, got {format!r}")
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(
        _cells(program, dict(schedule.overlapped[rank]) if schedule.overlapped else {})
        for rank, program in enumerate(programs))
    return out.getvalue()


def _cells(program: Sequence[Action], partner: dict[Action, Action]) -> list[str]:
    """A row of CSV cells: each action's string, a pair's two in one cell as torch writes them,
    ``(0F1;0B0)OVERLAP_F_B``."""
    cells, at = [], 0
    while at < len(program):
        action = program[at]
        if action in partner and at + 1 < len(program) and program[at + 1] == partner[action]:
            cells.append(f"({action};{program[at + 1]})OVERLAP_F_B")
            at += 2
        else:
            cells.append(str(action))
            at += 1
    return cells


def save_csv(schedule: Schedule, path: str | os.PathLike, format: CsvFormat = "compute_only") -> None:  # noqa: A002
    """Write :func:`dumps_csv` to ``path``."""
    Path(path).write_text(dumps_csv(schedule, format), encoding="utf-8", newline="")


# -- text ---------------------------------------------------------------------------------------


def parse_schedule(
    text: str,
    *,
    name: str | None = None,
    placement: Placement | None = None,
    num_microbatches: int | None = None,
) -> Schedule:
    """Read the text form back: ``parse_schedule(str(s)) == s`` for a valid schedule.

    Lines are ``rank N: 0F0 0B0 ...`` (or just the actions, one line per rank
    in order); blank lines and ``#`` comments are skipped; the header line
    ``schedule NAME: P ranks, S stages, M microbatches`` is optional.

    Example:
        >>> parse_schedule("rank 0: 0F0 0B0\\nrank 1: 1F0 1B0").placement.stage_to_rank
        (0, 1)
    """
    if not isinstance(text, str):
        raise ScheduleError(f"parse_schedule expects a string, got {type(text).__name__}")
    header: tuple[str, int, int, int] | None = None
    rows: dict[int, list[str]] = {}
    pairs: dict[int, list[str]] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        # The header whole first: a schedule's name may hold a '#'.
        match = _HEADER_RE.match(raw.strip()) or _HEADER_RE.match(line)
        if not line and not match:
            continue
        if match:
            header = (match.group(1), int(match.group(2)), int(match.group(3)), int(match.group(4)))
            continue
        listed = _PAIRS_LINE_RE.match(line)
        if listed:
            if int(listed.group(1)) in pairs:
                raise ScheduleError(f"line {number}: rank {listed.group(1)} has a second overlaps line; list each "
                                    "rank's pairs on one")
            pairs[int(listed.group(1))] = listed.group(2).split()
            continue
        match = _RANK_LINE_RE.match(line)
        rank = int(match.group(1)) if match else len(rows)
        if rank in rows:
            raise ScheduleError(f"line {number}: rank {rank} has a second line; give each rank one line")
        rows[rank] = (match.group(2) if match else line).split()
    if not rows:
        raise ScheduleError("no ranks in the text: expected lines such as 'rank 0: 0F0 0B0'")
    if sorted(rows) != list(range(len(rows))):
        raise ScheduleError(f"ranks {sorted(rows)} in the text; expected lines for ranks 0..{len(rows) - 1}")
    if header is not None:
        name = header[0] if name is None else name
        num_microbatches = header[3] if num_microbatches is None else num_microbatches
        if header[1] != len(rows):
            raise ScheduleError(f"the header says {header[1]} ranks but the text has lines for {len(rows)}")
    schedule = schedule_from_rows(
        [rows[r] for r in range(len(rows))],
        name="custom" if name is None else name,
        placement=placement,
        num_microbatches=num_microbatches,
    )
    if header is not None and header[2] != schedule.num_stages:
        raise ScheduleError(f"the header says {header[2]} stages but the actions use {schedule.num_stages}")
    listed = _parsed_pairs(pairs, schedule.num_ranks)
    return schedule.with_programs(schedule.programs, listed) if any(listed) else schedule


def _parsed_pairs(listed: dict[int, list[str]], num_ranks: int) -> tuple:
    """Per rank, its pairs from the ``rank N overlaps: 0F1+0B0 ...`` lines (``check_pairs`` checks them)."""
    if any(rank >= num_ranks for rank in listed):
        raise ScheduleError(f"overlaps listed for rank {max(listed)}, but the schedule has ranks 0..{num_ranks - 1}")
    out = []
    for rank in range(num_ranks):
        pairs = []
        for item in listed.get(rank, ()):
            parts = item.split("+")
            if len(parts) != 2:
                raise ScheduleError(f"rank {rank} overlaps {item!r}: expected FORWARD+BACKWARD, e.g. 0F1+0B0")
            pairs.append((Action.parse(parts[0]), Action.parse(parts[1])))
        out.append(tuple(pairs))
    return tuple(out)
