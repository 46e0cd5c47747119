"""The step x rank text grid: one column per rank, one row per program step.

Row ``i`` shows the ``i``-th action of every rank's program (not a time: use
the simulator for times). Error messages use it with the failing cells marked,
``>0B1<`` for where a rank is stuck and ``[1B1]`` for what it waits for, and
only the rows around them.

Example:
    >>> import conveyor.schedule as cs
    >>> print(render_grid(cs.build("1f1b", ranks=2, microbatches=2).programs, {(0, 2): STUCK}))
    step  rank 0  rank 1
       0  0F0     1F0
       1  0F1     1B0
       2  >0B0<   1F1
       3  0B1     1B1
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

STUCK = ">{}<"  # the action a rank cannot get past (or the action in error)
AWAITED = "[{}]"  # the action it waits for

_GAP = "..."


def render_grid(
    programs: Sequence[Sequence[object]],
    marks: Mapping[tuple[int, int], str] | None = None,
    *,
    context: int = 2,
    max_rows: int = 40,
    max_ranks: int = 16,
) -> str:
    """Render ``programs`` (one sequence of actions per rank) as a step x rank grid.

    ``marks`` maps ``(rank, step)`` to a format such as :data:`STUCK`. With
    marks, only the rows within ``context`` steps of a mark are shown (gaps as
    ``...``) and, beyond ``max_ranks`` ranks, only the marked ranks' columns.
    Without marks, the first ``max_rows`` rows.
    """
    marks = dict(marks or {})
    num_ranks = len(programs)
    num_steps = max((len(p) for p in programs), default=0)
    ranks = list(range(num_ranks))
    if marks and num_ranks > max_ranks:
        ranks = sorted({rank for rank, _ in marks})
    rows: list[int | None] = list(_rows(num_steps, marks, context, max_rows))

    def cell(rank: int, step: int) -> str:
        program = programs[rank]
        text = _text(program[step]) if step < len(program) and program[step] is not None else ""
        mark = marks.get((rank, step))
        return mark.format(text) if mark else text

    step_width = max(len("step"), len(str(max(num_steps - 1, 0))))
    table = [["step".rjust(step_width)] + [f"rank {r}" for r in ranks]]
    for step in rows:
        if step is None:
            table.append([_GAP.rjust(step_width)] + [""] * len(ranks))
        else:
            table.append([str(step).rjust(step_width)] + [cell(r, step) for r in ranks])
    widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
    lines = ["  ".join(text.ljust(width) for text, width in zip(row, widths)).rstrip() for row in table]
    if len(ranks) < num_ranks:
        lines.insert(0, f"(showing ranks {', '.join(map(str, ranks))} of {num_ranks})")
    return "\n".join(lines)


def _rows(num_steps: int, marks: Mapping[tuple[int, int], str], context: int, max_rows: int) -> Iterable[int | None]:
    """Step numbers to show, ``None`` standing for a gap."""
    if not marks:
        yield from range(min(num_steps, max_rows))
        if num_steps > max_rows:
            yield None
        return
    wanted = sorted(
        {s for _, step in marks for s in range(step - context, step + context + 1) if 0 <= s < max(num_steps, step + 1)}
    )
    previous = -1
    for step in wanted:
        if step > previous + 1:
            yield None
        yield step
        previous = step
    if previous < num_steps - 1:
        yield None


def _text(action: object) -> str:
    # Grids also show programs that failed verification: never fail on a malformed action.
    try:
        return str(action)
    except Exception:  # noqa: BLE001
        return repr(action)


def render_positions(train: Sequence[Sequence[object]], evaluation: Sequence[Sequence[object]],
                     positions: Sequence[dict | None]) -> str:
    """Every rank's position (see :mod:`conveyor.runtime.lifecycle.positions`) on the step x rank grid.

    A line per rank says what it runs or waits for; the grid marks each rank's current action
    ``>like this<`` in the programs the ranks run (``train`` or ``evaluation``, one program per
    rank, whichever they are in).

    Example:
        >>> print(render_positions([["0F0", "0B0"]], [["0F0"]], [{"running": True, "index": 1, "length": 2,
        ...                                                        "runs": 1, "action": "0B0"}]))  # doctest: +ELLIPSIS
        rank 0: action 1 of 2 in run 1: runs 0B0
        ...
    """
    programs, marks, lines = train, {}, []
    for rank, where in enumerate(positions):
        if where is None:
            lines.append(f"rank {rank}: no answer (its process is gone, or it cannot reach the store)")
            continue
        if not where["running"]:
            lines.append(f"rank {rank}: between steps ({where['runs']} run(s) started)")
            continue
        index, action = where["index"], where["action"]
        if index < len(train[rank]) and str(train[rank][index]) != action:
            programs = evaluation  # it is evaluating
        doing = "waits for" if "RECV" in action else "runs"
        lines.append(f"rank {rank}: action {index} of {where['length']} in run {where['runs']}: {doing} {action}")
        if index < where["length"]:
            marks[(rank, index)] = STUCK
    return "\n".join(lines) + "\n" + render_grid(programs, marks)
