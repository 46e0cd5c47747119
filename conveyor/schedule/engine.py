"""Step per-rank programs in order, each action starting once what it needs is done.

One stepping loop serves the verifier (does every rank reach the end? if not,
who waits for what: :func:`runs_clean`, :func:`stuck_ranks`) and the simulator
(when does each action start and end: :mod:`conveyor.schedule.simulate`).
Semantics are those of the runtime: a send never blocks; a receive blocks until
the matching send was executed; an action that needs another stage's output
waits until that output was produced (plus the message latency when it
crosses ranks).

What each action waits for (stage ``s``, microbatch ``m``; one need per action,
the others follow from it, e.g. ``B(s, m)`` waits for ``B/I(s+1, m)``, which
could only run after ``F(s+1, m)`` and hence after ``F(s, m)``):

  compute-only programs          lowered programs (with SEND/RECV)
  F(s, m)    F(s-1, m)           RECV_F(s, m) if stage s-1 is on another rank, else F(s-1, m)
  B/I(s, m)  B/I(s+1, m)         RECV_B(s, m) if stage s+1 is on another rank, else B/I(s+1, m)
             (F(s, m) on the last stage)
  W(s, m)    I(s, m)             I(s, m)
  SEND_F(s, m)                   F(s, m)       SEND_B(s, m)  B/I(s, m)
  RECV_F(s, m)                   SEND_F(s-1, m)  RECV_B(s, m)  SEND_B(s+1, m)

The parts, in the order a pass uses them:

- :class:`CodeSpace`: every action of a valid schedule is one integer *code*
  ``region * S * M + stage * M + microbatch`` (B and I share the "input
  gradient" region: a (stage, microbatch) has one or the other), and what it
  needs is its code plus a delta that depends only on (region, stage).
- :func:`rank_tables`: per rank, ``{id(kind): {stage: Row}}`` for the
  (kind, stage) pairs that may appear there; the caller decides what a
  :class:`Row` carries besides its code and need (a duration, a second slot).
- :func:`step_ranks`: the loop. It looks each action up once, then touches
  plain ints and one list, the *finish table*: per code, when it is done
  (None while it is not). A waiting rank is parked on the code it needs and
  woken when that code is done, so each action is looked at once or twice and
  the loop cannot hang: a schedule with 262,144 actions steps in about a tenth
  of a second.
- :func:`step_schedule`: picks the tables of compute-only or lowered programs
  and runs the loop; :func:`blocked_ranks` words where ranks stopped.

The same loop on packed compute-only programs, with integers and float arrays in place of
actions, is :mod:`conveyor.schedule.fast` (its verdicts and times are this loop's, bit for
bit). Two steppers keep a loop of their own, each saying why where it lives: ranks sharing
CPU cores (:func:`conveyor.schedule.simulate.simulate_shared_cores`: an action's end depends
on every rank at once), zb-auto's list scheduler (:mod:`conveyor.schedule.builtin.zb_auto`:
it writes the programs as it steps). The posts a rank makes (:mod:`conveyor.schedule.posts`)
are checked by this loop too: they are written as actions it steps.

Example:
    >>> import conveyor.schedule as cs
    >>> runs_clean(cs.build("1f1b", ranks=2, microbatches=2))
    True
    >>> from conveyor.schedule.ir import Placement, Schedule
    >>> swap = Schedule.from_programs("swap", Placement.looped(2), 2,
    ...     [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]])
    >>> [(b.rank, b.position, str(b.action)) for b in stuck_ranks(swap)]
    [(0, 1, '0B0'), (1, 0, '1F1')]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import add, floordiv, is_, length_hint, mul
from typing import NamedTuple

from conveyor.errors import UnknownAction
from conveyor.schedule.fast import fast_eligible, step_packed
from conveyor.schedule.ir import NUM_COMPUTE_KINDS, Action, ActionKind, Schedule

# Regions of the code space. B and I share one: each (stage, microbatch) has one of them.
REGION_F, REGION_G, REGION_W = 0, 1, 2
REGION_SEND_F, REGION_RECV_F, REGION_SEND_B, REGION_RECV_B = 3, 4, 5, 6
REGION_NONE = 7  # always "done": the need of an action that waits for nothing
NUM_REGIONS = 8
# Past the code space, verification marks the (stage, microbatch) whose backward was split.
REGION_SPLIT_MARK = 8

KIND_REGION: dict[ActionKind, int] = {
    ActionKind.F: REGION_F,
    ActionKind.B: REGION_G,
    ActionKind.I: REGION_G,
    ActionKind.W: REGION_W,
    ActionKind.SEND_F: REGION_SEND_F,
    ActionKind.RECV_F: REGION_RECV_F,
    ActionKind.SEND_B: REGION_SEND_B,
    ActionKind.RECV_B: REGION_RECV_B,
}
# Keyed by id(): ActionKind members are singletons, and only they match (a plain "F" string
# hashes and compares equal to ActionKind.F, but is not an ActionKind).
REGION_BY_KIND_ID: dict[int, int] = {id(kind): region for kind, region in KIND_REGION.items()}
COMM_KIND_IDS = frozenset(id(k) for k in ActionKind if k.is_comm)

ASK_DURATION = object()
"""A :class:`Row` duration meaning "call ``duration(action)``": the time depends on more than (kind, stage)."""


@dataclass(frozen=True, slots=True)
class Blocked:
    """A rank that cannot go on: its action at ``position`` waits for ``waits_for``.

    ``producer_rank`` runs ``producer`` (the action that would unblock it, if the
    schedule has one), at ``producer_position`` of its program.
    """

    rank: int
    position: int
    action: Action
    waits_for: str
    producer_rank: int
    producer: Action | None = None
    producer_position: int | None = None


@dataclass(frozen=True, slots=True)
class CodeSpace:
    """The integer codes of one schedule's actions: ``region * S * M + stage * M + microbatch``.

    Example:
        >>> space = CodeSpace(num_stages=2, num_microbatches=4, stage_to_rank=(0, 1))
        >>> space.code(ActionKind.I, 1, 3), space.code(ActionKind.B, 1, 3)
        (15, 15)
        >>> space.describe(15)
        'the input gradient of stage 1, microbatch 3'
    """

    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]

    @classmethod
    def of(cls, schedule: Schedule) -> CodeSpace:
        return cls(schedule.num_stages, schedule.num_microbatches, schedule.placement.stage_to_rank)

    @property
    def region_size(self) -> int:
        return self.num_stages * self.num_microbatches

    @property
    def size(self) -> int:
        return NUM_REGIONS * self.region_size

    def code(self, kind: ActionKind, stage: int, microbatch: int) -> int:
        return (KIND_REGION[kind] * self.num_stages + stage) * self.num_microbatches + microbatch

    def split(self, code: int) -> tuple[int, int, int]:
        """``(region, stage, microbatch)`` of a code."""
        region_stage, microbatch = divmod(code, self.num_microbatches)
        region, stage = divmod(region_stage, self.num_stages)
        return region, stage, microbatch

    def encode(self, program: Sequence[Action]) -> list[int]:
        """Codes of one rank's actions (the actions must be valid: see ``verify``)."""
        return self.encode_fields(
            list(map(id, [a.kind for a in program])), [a.stage for a in program], [a.microbatch for a in program]
        )

    def encode_fields(self, kind_ids: list[int], stages: list[int], microbatches: list[int]) -> list[int]:
        """Codes from the fields of a rank's actions (``id(kind)``, stage, microbatch), with C loops only."""
        region_size, num_microbatches = self.region_size, self.num_microbatches
        region_offset = {kind_id: region * region_size for kind_id, region in REGION_BY_KIND_ID.items()}
        return list(
            map(
                add,
                map(region_offset.__getitem__, kind_ids),
                map(add, map(mul, stages, repeat(num_microbatches)), microbatches),
            )
        )

    def region_stages(self, codes: list[int]) -> list[int]:
        """``region * S + stage`` of each code: the index into :meth:`need_deltas`."""
        return list(map(floordiv, codes, repeat(self.num_microbatches)))

    def allowed_region_stages(self) -> list[set[int]]:
        """Per rank, the ``region * S + stage`` that may appear there, SEND/RECV included."""
        allowed: list[set[int]] = [set() for _ in range(max(self.stage_to_rank) + 1)]
        for kind, stage in self._kind_stages(lowered=True):
            allowed[self.stage_to_rank[stage]].add(KIND_REGION[kind] * self.num_stages + stage)
        return allowed

    def _kind_stages(self, lowered: bool) -> list[tuple[ActionKind, int]]:
        """(kind, stage) of every action the programs may hold: each stage's passes, and (lowered)
        a SEND/RECV only towards a neighbour stage on another rank."""
        last, to_rank = self.num_stages - 1, self.stage_to_rank
        pairs = []
        for kind in ActionKind:
            for stage in range(self.num_stages):
                if kind.is_comm:
                    peer = stage + 1 if kind in (ActionKind.SEND_F, ActionKind.RECV_B) else stage - 1
                    if not lowered or not 0 <= peer <= last or to_rank[peer] == to_rank[stage]:
                        continue
                pairs.append((kind, stage))
        return pairs

    def need_deltas(self, lowered: bool) -> list[int]:
        """For each ``region * S + stage``: what to add to a code to get the code it needs.

        See the table in the module docstring. Regions without actions in the
        given mode keep the delta to REGION_NONE (never read for valid schedules).
        """
        deltas = []
        for region in range(NUM_REGIONS):
            deltas.extend(self._need_delta(region, stage, lowered) for stage in range(self.num_stages))
        return deltas

    def _need_delta(self, region: int, stage: int, lowered: bool) -> int:
        last, to_rank = self.num_stages - 1, self.stage_to_rank
        num_microbatches, region_size = self.num_microbatches, self.region_size
        previous_remote = stage > 0 and to_rank[stage - 1] != to_rank[stage]
        next_remote = stage < last and to_rank[stage + 1] != to_rank[stage]
        if region == REGION_F and stage > 0:
            return (REGION_RECV_F - REGION_F) * region_size if lowered and previous_remote else -num_microbatches
        if region == REGION_G:
            if stage == last:
                return (REGION_F - REGION_G) * region_size
            return (REGION_RECV_B - REGION_G) * region_size if lowered and next_remote else num_microbatches
        if region == REGION_W:
            return (REGION_G - REGION_W) * region_size
        if region == REGION_SEND_F:
            return (REGION_F - REGION_SEND_F) * region_size
        if region == REGION_SEND_B:
            return (REGION_G - REGION_SEND_B) * region_size
        if region == REGION_RECV_F and stage > 0:
            return (REGION_SEND_F - REGION_RECV_F) * region_size - num_microbatches
        if region == REGION_RECV_B and stage < last:
            return (REGION_SEND_B - REGION_RECV_B) * region_size + num_microbatches
        return (REGION_NONE - region) * region_size

    def remote_needs(self, lowered: bool) -> list[bool]:
        """For each ``region * S + stage``: whether its need is produced on another rank."""
        num_stages, to_rank = self.num_stages, self.stage_to_rank
        remote = [False] * (NUM_REGIONS * num_stages)
        for stage in range(num_stages):
            previous_remote = stage > 0 and (lowered or to_rank[stage - 1] != to_rank[stage])
            next_remote = stage < num_stages - 1 and (lowered or to_rank[stage + 1] != to_rank[stage])
            remote[(REGION_RECV_F if lowered else REGION_F) * num_stages + stage] = previous_remote
            remote[(REGION_RECV_B if lowered else REGION_G) * num_stages + stage] = next_remote
        return remote

    def needs(self, codes: list[int], deltas: list[int], region_stages: list[int] | None = None) -> list[int]:
        """The code each action needs (``deltas`` from :meth:`need_deltas`)."""
        if region_stages is None:
            region_stages = self.region_stages(codes)
        return list(map(add, codes, map(deltas.__getitem__, region_stages)))

    def describe(self, code: int) -> str:
        """What a code stands for, in words."""
        region, stage, microbatch = self.split(code)
        return {
            REGION_F: f"the forward output of stage {stage}, microbatch {microbatch}",
            REGION_G: f"the input gradient of stage {stage}, microbatch {microbatch}",
            REGION_W: f"the weight gradient of stage {stage}, microbatch {microbatch}",
            REGION_SEND_F: f"the send {stage}SEND_F{microbatch}",
            REGION_RECV_F: f"the receive {stage}RECV_F{microbatch}",
            REGION_SEND_B: f"the send {stage}SEND_B{microbatch}",
            REGION_RECV_B: f"the receive {stage}RECV_B{microbatch}",
        }.get(region, "nothing")

    def finish_table(self, copies: int = 1, extra_regions: int = 0) -> list[float | None]:
        """``copies`` of the code space (then ``extra_regions``), nothing finished but REGION_NONE."""
        finish: list[float | None] = [None] * (copies * self.size + extra_regions * self.region_size)
        always = [float("-inf")] * self.region_size
        for copy in range(copies):
            start = copy * self.size + REGION_NONE * self.region_size
            finish[start : start + self.region_size] = always
        return finish


class Row(NamedTuple):
    """What the loop needs of one (kind, stage) on a rank; an action adds its microbatch to ``base``.

    ``took``: its duration, None for none (communication, or a pass that keeps no time),
    or :data:`ASK_DURATION`. ``echo``: 0, or the offset of a second slot the action also
    finishes, ``latency`` later (what another rank sees, or a mark the verifier reads).
    """

    base: int
    need_delta: int
    took: object
    echo: int


RowMaker = Callable[[ActionKind, int, int, int, bool], Row]
"""``(kind, stage, base, need_delta, need_is_remote) -> Row``."""


def rank_tables(space: CodeSpace, lowered: bool, make_row: RowMaker) -> list[dict[int, dict[int, Row]]]:
    """Per rank, ``{id(kind): {stage: Row}}`` of what may appear there.

    An action whose (kind, stage) may not appear on its rank misses the table,
    so the lookup doubles as a check. Tables of compute-only programs hold no
    SEND/RECV.
    """
    num_stages, region_size = space.num_stages, space.region_size
    deltas, remote = space.need_deltas(lowered), space.remote_needs(lowered)
    tables: list[dict[int, dict[int, Row]]] = [{} for _ in range(max(space.stage_to_rank) + 1)]
    for kind, stage in space._kind_stages(lowered):
        region_stage = KIND_REGION[kind] * num_stages + stage
        base = KIND_REGION[kind] * region_size + stage * space.num_microbatches
        row = make_row(kind, stage, base, deltas[region_stage], remote[region_stage])
        tables[space.stage_to_rank[stage]].setdefault(id(kind), {})[stage] = row
    return tables


@dataclass(slots=True)
class Progress:
    """Where a pass of :func:`step_ranks` left things.

    ``stopped_at[rank]``: the index of the action the rank waits at, None if it
    ran to its end. ``starts``/``ends``: per rank, the times of its actions that
    have a duration, in program order.
    """

    finish: list[float | None]
    stopped_at: list[int | None]
    starts: list[list[float]]
    ends: list[list[float]]
    lowered: bool

    @property
    def completed(self) -> bool:
        return all(position is None for position in self.stopped_at)


def step_ranks(
    programs: Sequence[Sequence[Action]],
    tables: list[dict[int, dict[int, Row]]],
    finish: list[float | None],
    space: CodeSpace,
    latency: float = 0.0,
    duration: Callable[[Action], float] | None = None,
) -> tuple[list[int | None], list[list[float]], list[list[float]]]:
    """Run every rank as far as it can; return ``(stopped_at, starts, ends)`` (see :class:`Progress`).

    A rank runs its next action once the code it needs is finished, else it is parked
    on that code and another rank runs; finishing a code wakes the rank parked on it.
    Raises :class:`UnknownAction` for an action not in the tables, IndexError for a
    microbatch out of range.
    """
    num_ranks, num_microbatches, size = len(programs), space.num_microbatches, space.size
    # Per code, the rank parked on it (a dict: a list indexed by code steps no faster within noise
    # and holds 8 bytes per code). A valid schedule has at most one waiter per code (its one consumer
    # on another rank); an invalid one that overwrites the slot stops where it would have anyway.
    waiting: dict[int, int] = {}
    # An echo without latency (the verifier's mark of an I) keeps `now` itself: no new float per mark.
    clock = [0.0] * num_ranks
    starts, ends = [[] for _ in range(num_ranks)], [[] for _ in range(num_ranks)]
    start_appenders, end_appenders = [times.append for times in starts], [times.append for times in ends]
    # One iterator per rank, resumed where it stopped (re-slicing is quadratic). A parked rank keeps
    # (action, code, need, took, echo); it is woken once that need is finished, and runs it at once.
    remaining = [iter(program) for program in programs]
    parked: list[tuple | None] = [None] * num_ranks
    work = list(range(num_ranks - 1, -1, -1))
    action = None
    try:
        while work:
            rank = work.pop()
            now, table = clock[rank], tables[rank]
            add_start, add_end = start_appenders[rank], end_appenders[rank]
            if parked[rank] is not None:  # -- resume: the parked action runs, as at the end of the loop below
                (action, code, need, took, echo), parked[rank] = parked[rank], None
                ready = finish[need]
                if ready > now:
                    now = ready
                if took is not None:
                    if took is ASK_DURATION:
                        took = duration(action)
                    add_start(now)
                    now += took
                    add_end(now)
                finish[code] = now
                if echo:
                    finish[code + echo] = now + latency if latency else now
                if code in waiting:
                    work.append(waiting.pop(code))
            for action in remaining[rank]:
                # -- look up: the action's code and need (and, for the caller, duration and echo)
                base, need_delta, took, echo = table[id(action.kind)][action.stage]
                microbatch = action.microbatch
                if not 0 <= microbatch < num_microbatches:
                    raise IndexError(f"microbatch {microbatch!r} out of range in {action}")
                code = base + microbatch
                ready = finish[code + need_delta]
                if ready is None:  # -- park on the code itself (its producer announces that, not an echo)
                    waiting[(code + need_delta) % size] = rank
                    parked[rank] = (action, code, code + need_delta, took, echo)
                    break
                if ready > now:  # -- run: once both the rank and what it needs are ready
                    now = ready
                if took is not None:
                    if took is ASK_DURATION:
                        took = duration(action)
                    add_start(now)
                    now += took
                    add_end(now)
                finish[code] = now  # -- finish the code (and its echo), wake whoever waits for it
                if echo:
                    finish[code + echo] = now + latency if latency else now
                if code in waiting:
                    work.append(waiting.pop(code))
            clock[rank] = now
    except KeyError:
        raise UnknownAction(action) from None
    return _stopped_at(programs, remaining, parked), starts, ends


def _stopped_at(programs: Sequence[Sequence[Action]], remaining: list, parked: list) -> list[int | None]:
    """Per rank, the index of its parked action (its iterator stands just past it), or None."""
    return [
        None if parked[rank] is None else len(programs[rank]) - length_hint(remaining[rank]) - 1
        for rank in range(len(programs))
    ]


def looks_lowered(schedule: Schedule) -> bool:
    """Whether a SEND/RECV shows within the first few actions of a rank (where lowering puts them)."""
    return any(id(a.kind) in COMM_KIND_IDS for program in schedule.programs for a in program[:4])


def step_schedule(
    schedule: Schedule,
    space: CodeSpace,
    make_row: RowMaker,
    copies: int = 1,
    extra_regions: int = 0,
    latency: float = 0.0,
    duration: Callable[[Action], float] | None = None,
) -> Progress:
    """One pass over ``schedule``, with the tables of compute-only or lowered programs as it needs.

    A compute-only pass that meets a SEND/RECV starts again as a lowered one
    (guessing up front from :func:`looks_lowered` makes that rare).
    """
    lowered = looks_lowered(schedule)
    while True:
        finish = space.finish_table(copies, extra_regions)
        tables = rank_tables(space, lowered, make_row)
        try:
            stopped_at, starts, ends = step_ranks(schedule.programs, tables, finish, space, latency, duration)
        except UnknownAction as error:
            if lowered or id(getattr(error.action, "kind", None)) not in COMM_KIND_IDS:
                raise
            lowered = True
            continue
        return Progress(finish, stopped_at, starts, ends, lowered)


# -- verification ----------------------------------------------------------------------------------


def runs_clean(schedule: Schedule) -> bool:
    """Whether every rank runs to its end, each action once, every pass there (the verifier's fast path).

    False means *something* is wrong (including a malformed action); the
    verifier then finds and words the first violation.

    Example:
        >>> import conveyor.schedule as cs
        >>> runs_clean(cs.lower(cs.build("zbv", ranks=2, microbatches=4)))
        True
    """
    if fast_eligible(schedule):
        return step_packed(schedule, [0.0] * (NUM_COMPUTE_KINDS * schedule.num_stages), record=False) is not None
    return checked_pass(schedule) is not None


def checked_pass(
    schedule: Schedule, make_row: RowMaker | None = None, duration: Callable[[Action], float] | None = None
) -> Progress | None:
    """One pass of :func:`runs_clean`, on rows from ``make_row`` (no echo: no latency), or None if not clean.

    A simulation without latency steps its rows through this pass, so that one
    pass both verifies the schedule and times it.

    Example:
        >>> import conveyor.schedule as cs
        >>> progress = checked_pass(cs.build("1f1b", ranks=2, microbatches=2))
        >>> progress.completed, progress.starts
        (True, [[], []])
    """
    space = CodeSpace.of(schedule)
    region_size = space.region_size
    num_actions = sum(map(len, schedule.programs))
    if num_actions < 2 * region_size:
        return None  # fewer actions than forwards + backwards: incomplete (and no tables sized S x M)
    split_mark = (REGION_SPLIT_MARK - REGION_G) * region_size

    def marked_row(kind: ActionKind, stage: int, base: int, need_delta: int, need_is_remote: bool) -> Row:
        took = None if make_row is None else make_row(kind, stage, base, need_delta, need_is_remote).took
        # An I also marks its (stage, microbatch), so that W can be matched with I, not with B.
        return Row(base, need_delta, took, split_mark if kind is ActionKind.I else 0)

    try:
        progress = step_schedule(schedule, space, marked_row, extra_regions=1, duration=duration)
    except (UnknownAction, AttributeError, TypeError, IndexError):
        return None
    if not progress.completed or not _each_action_once(progress.finish, region_size, num_actions):
        return None
    return progress


def _each_action_once(finish: list[float | None], region_size: int, num_actions: int) -> bool:
    """After a completed checked pass: every F and B/I finished, no action twice, a W exactly where
    the backward was an I (B-then-W and I-without-W both fail)."""
    if _count_unfinished(finish, 0, 2 * region_size):
        return False
    # Every action ran; each finished its own code once unless duplicated.
    unfinished = _count_unfinished(finish, 2 * region_size, REGION_NONE * region_size)
    if REGION_NONE * region_size - unfinished != num_actions:
        return False
    weights, marks = REGION_W * region_size, REGION_SPLIT_MARK * region_size
    for offset in range(0, region_size, _CHUNK):
        size = min(_CHUNK, region_size - offset)
        weight_chunk = finish[weights + offset : weights + offset + size]
        mark_chunk = finish[marks + offset : marks + offset + size]
        if list(map(is_, weight_chunk, repeat(None))) != list(map(is_, mark_chunk, repeat(None))):
            return False
    return True


# Slices of the finish table are counted a chunk at a time: whole regions would copy up to
# 7 x 8 bytes per (stage, microbatch) at once (tens of MB at P=256), and islice counts 2x slower.
_CHUNK = 1 << 16


def _count_unfinished(finish: list[float | None], start: int, stop: int) -> int:
    return sum(finish[at : min(at + _CHUNK, stop)].count(None) for at in range(start, stop, _CHUNK))


def stuck_ranks(schedule: Schedule) -> tuple[Blocked, ...]:
    """Every rank that stops before its end, with what it waits for (the actions must be valid).

    Example:
        >>> import conveyor.schedule as cs
        >>> stuck_ranks(cs.build("1f1b", ranks=2, microbatches=2))
        ()
    """
    space = CodeSpace.of(schedule)

    def make_row(kind: ActionKind, stage: int, base: int, need_delta: int, need_is_remote: bool) -> Row:
        return Row(base, need_delta, None, 0)

    progress = step_schedule(schedule, space, make_row)
    return blocked_ranks(schedule, space, progress)


def blocked_ranks(schedule: Schedule, space: CodeSpace, progress: Progress) -> tuple[Blocked, ...]:
    """Describe every rank that stopped before the end of its program."""
    stuck = [rank for rank, position in enumerate(progress.stopped_at) if position is not None]
    if not stuck:
        return ()
    programs = schedule.programs
    codes = [space.encode(program) for program in programs]
    deltas = space.need_deltas(progress.lowered)
    where = {code: (rank, i) for rank in range(len(codes)) for i, code in enumerate(codes[rank])}
    blocked = []
    for rank in stuck:
        position = progress.stopped_at[rank]
        code = codes[rank][position]
        need = code + deltas[code // space.num_microbatches]
        _, stage, _ = space.split(need)
        producer_rank, producer_position = where.get(need, (space.stage_to_rank[stage], None))
        producer = None if producer_position is None else programs[producer_rank][producer_position]
        blocked.append(
            Blocked(
                rank,
                position,
                programs[rank][position],
                space.describe(need),
                producer_rank,
                producer,
                producer_position,
            )
        )
    return tuple(blocked)
