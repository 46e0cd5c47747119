"""Step per-rank programs in order, each action starting once what it needs is done.

One engine serves the verifier (does every rank reach the end? if not, who
waits for what) and the simulator (when does each action start and end).
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

Inside, every action of a valid schedule is one integer *code*
``region * S * M + stage * M + microbatch`` (B and I share the "input gradient"
region: a (stage, microbatch) has one or the other), and what it needs is its
code plus a delta that depends only on (region, stage). The hot loops look
each action up once in a per-rank table and then touch plain ints, a bytearray
(verification) or a list of times (simulation): a schedule with 262,144
actions steps in about a tenth of a second. A waiting rank is parked on the
code it needs and woken when that code is done, so each action is looked at
once or twice and the engine cannot hang.

Example:
    >>> import conveyor.schedule as cs
    >>> result = run(cs.build("1f1b", ranks=2, microbatches=2), lambda action: 1.0)
    >>> result.completed, len(result.spans)
    (True, 8)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from operator import add, floordiv, mul

from conveyor.schedule.cost import CostModel
from conveyor.schedule.ir import Action, ActionKind, Schedule, gc_paused
from conveyor.schedule.timeline import Span

# Regions of the code space. B and I share one: each (stage, microbatch) has one of them.
REGION_F, REGION_G, REGION_W = 0, 1, 2
REGION_SEND_F, REGION_RECV_F, REGION_SEND_B, REGION_RECV_B = 3, 4, 5, 6
REGION_NONE = 7  # always "done": the need of an action that waits for nothing
NUM_REGIONS = 8

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
class EngineResult:
    spans: tuple[Span, ...]
    blocked: tuple[Blocked, ...]

    @property
    def completed(self) -> bool:
        return not self.blocked


@dataclass(frozen=True, slots=True)
class CodeSpace:
    """The integer codes of one schedule's actions: ``region * S * M + stage * M + microbatch``."""

    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]

    @property
    def region_size(self) -> int:
        return self.num_stages * self.num_microbatches

    @property
    def size(self) -> int:
        return NUM_REGIONS * self.region_size

    def code(self, region: int, stage: int, microbatch: int) -> int:
        return (region * self.num_stages + stage) * self.num_microbatches + microbatch

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
        SM, M = self.region_size, self.num_microbatches
        region_offset = {kind_id: region * SM for kind_id, region in REGION_BY_KIND_ID.items()}
        return list(
            map(add, map(region_offset.__getitem__, kind_ids), map(add, map(mul, stages, repeat(M)), microbatches))
        )

    def region_stages(self, codes: list[int]) -> list[int]:
        """``region * S + stage`` of each code: the index into :meth:`need_deltas`."""
        return list(map(floordiv, codes, repeat(self.num_microbatches)))

    def need_deltas(self, lowered: bool) -> list[int]:
        """For each ``region * S + stage``: what to add to a code to get the code it needs.

        See the table in the module docstring. Regions without actions in the
        given mode keep the delta to REGION_NONE (never read for valid schedules).
        """
        S, M, SM = self.num_stages, self.num_microbatches, self.region_size
        to_rank = self.stage_to_rank
        deltas = []
        for region in range(NUM_REGIONS):
            nothing = (REGION_NONE - region) * SM
            for s in range(S):
                delta = nothing
                prev_remote = s > 0 and to_rank[s - 1] != to_rank[s]
                next_remote = s < S - 1 and to_rank[s + 1] != to_rank[s]
                if region == REGION_F and s > 0:
                    delta = (REGION_RECV_F - REGION_F) * SM if lowered and prev_remote else -M
                elif region == REGION_G:
                    if s == S - 1:
                        delta = (REGION_F - REGION_G) * SM
                    elif lowered and next_remote:
                        delta = (REGION_RECV_B - REGION_G) * SM
                    else:
                        delta = M
                elif region == REGION_W:
                    delta = (REGION_G - REGION_W) * SM
                elif region == REGION_SEND_F:
                    delta = (REGION_F - REGION_SEND_F) * SM
                elif region == REGION_SEND_B:
                    delta = (REGION_G - REGION_SEND_B) * SM
                elif region == REGION_RECV_F and s > 0:
                    delta = (REGION_SEND_F - REGION_RECV_F) * SM - M
                elif region == REGION_RECV_B and s < S - 1:
                    delta = (REGION_SEND_B - REGION_RECV_B) * SM + M
                deltas.append(delta)
        return deltas

    def remote_needs(self, lowered: bool) -> list[bool]:
        """For each ``region * S + stage``: whether its need is produced on another rank."""
        S = self.num_stages
        to_rank = self.stage_to_rank
        remote = [False] * (NUM_REGIONS * S)
        for s in range(S):
            if lowered:
                remote[REGION_RECV_F * S + s] = s > 0
                remote[REGION_RECV_B * S + s] = s < S - 1
            else:
                remote[REGION_F * S + s] = s > 0 and to_rank[s - 1] != to_rank[s]
                remote[REGION_G * S + s] = s < S - 1 and to_rank[s + 1] != to_rank[s]
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


def step(num_ranks: int, codes: Sequence[list[int]], needs: Sequence[list[int]], space: CodeSpace) -> list[int]:
    """Run every rank as far as it can; return how many actions each rank completed.

    The plain form of the engine, over precomputed codes and needs: the
    verifier uses it to say where a failing schedule gets stuck. A rank runs
    its next action once the code it needs is done, else it waits (registered
    on that code) and another rank runs. Each action runs once, so this is
    linear in the number of actions and cannot hang.
    """
    SM = space.region_size
    done = bytearray(space.size)
    done[REGION_NONE * SM :] = b"\x01" * SM
    waiting: dict[int, list[int]] = {}
    position = [0] * num_ranks
    # One iterator per rank, resumed where it stopped (an islice from the position would
    # skip the done prefix again on every resume: quadratic).
    steps = [zip(codes[rank], needs[rank]) for rank in range(num_ranks)]
    pending: list[tuple[int, int] | None] = [None] * num_ranks
    work = list(range(num_ranks - 1, -1, -1))
    while work:
        rank = work.pop()
        i = position[rank]
        head = pending[rank]
        pending[rank] = None
        for code, need in steps[rank] if head is None else chain((head,), steps[rank]):
            if not done[need]:
                waiting.setdefault(need, []).append(rank)
                pending[rank] = (code, need)
                break
            done[code] = 1
            if code in waiting:
                work.extend(waiting.pop(code))
            i += 1
        position[rank] = i
    return position


# The fused engine below looks each action up in a per-rank table
# {id(kind): {stage: row}}: an action whose (kind, stage) may not appear on the
# rank raises KeyError, which makes the table lookup double as a check. Tables
# for compute-only programs hold no SEND/RECV: meeting one switches to the
# lowered tables and starts again.

_KIND_MARK = {kind: index + 1 for index, kind in enumerate(ActionKind)}  # nonzero byte per kind
_MARK_I = _KIND_MARK[ActionKind.I]
_ONLY_I = bytes(1 if b == _MARK_I else 0 for b in range(256))
_NONZERO = bytes(1 if b else 0 for b in range(256))


class _Restart(Exception):
    """A compute-only pass met a SEND/RECV: run again with the tables of lowered programs."""


def _rank_tables(space: CodeSpace, lowered: bool, row: Callable[[ActionKind, int, int, int], tuple]) -> list[dict]:
    """Per rank, ``{id(kind): {stage: row(kind, stage, code_base, need_delta)}}`` of what may appear there."""
    S, SM = space.num_stages, space.region_size
    to_rank = space.stage_to_rank
    deltas = space.need_deltas(lowered)
    tables: list[dict[int, dict[int, tuple]]] = [{} for _ in range(max(to_rank) + 1)]
    for kind in ActionKind:
        region = KIND_REGION[kind]
        for s in range(S):
            rank = to_rank[s]
            if kind.is_comm:
                if not lowered:
                    continue
                toward_next = kind in (ActionKind.SEND_F, ActionKind.RECV_B)
                peer = s + 1 if toward_next else s - 1
                if not 0 <= peer < S or to_rank[peer] == rank:
                    continue
            base = region * SM + s * space.num_microbatches
            tables[rank].setdefault(id(kind), {})[s] = row(kind, s, base, deltas[region * S + s])
    return tables


def runs_clean(schedule: Schedule) -> bool:
    """Whether every rank runs to its end, each action once, every pass there (the verifier's fast path).

    False means *something* is wrong (including a malformed action); the
    verifier then finds and words the first violation.
    """
    space = CodeSpace(schedule.num_stages, schedule.num_microbatches, schedule.placement.stage_to_rank)
    if sum(map(len, schedule.programs)) < 2 * space.region_size:
        return False  # fewer actions than forwards + backwards: incomplete (and no tables sized S x M)
    try:
        return _runs_clean(schedule, space, lowered=False)
    except _Restart:
        return _runs_clean(schedule, space, lowered=True)


def _runs_clean(schedule: Schedule, space: CodeSpace, lowered: bool) -> bool:
    programs = schedule.programs
    num_ranks = len(programs)
    M, SM = space.num_microbatches, space.region_size
    tables = _rank_tables(space, lowered, lambda kind, s, base, delta: (base, delta, _KIND_MARK[kind]))
    done = bytearray(space.size)
    done[REGION_NONE * SM :] = b"\x01" * SM
    # A valid schedule has at most one rank waiting for any code (its one consumer on
    # another rank): one slot per code. An overwritten slot belongs to an invalid schedule,
    # which then stops early and goes to the diagnosis anyway.
    waiting: dict[int, int] = {}
    # One iterator per rank, resumed where it stopped. A rank that waits keeps the code and
    # mark of its next action in `pending`; it is woken only once what that action needs is
    # done, so on waking the action runs at once.
    actions = [iter(p) for p in programs]
    pending: list[tuple[int, int] | None] = [None] * num_ranks
    work = list(range(num_ranks - 1, -1, -1))
    action = None
    try:
        while work:
            rank = work.pop()
            head = pending[rank]
            if head is not None:
                pending[rank] = None
                code, mark = head
                done[code] = mark
                if code in waiting:
                    work.append(waiting.pop(code))
            table = tables[rank]
            for action in actions[rank]:
                base, delta, mark = table[id(action.kind)][action.stage]
                microbatch = action.microbatch
                if not 0 <= microbatch < M:
                    return False
                code = base + microbatch
                if not done[code + delta]:
                    waiting[code + delta] = rank
                    pending[rank] = (code, mark)
                    break
                done[code] = mark
                if code in waiting:
                    work.append(waiting.pop(code))
    except KeyError:
        if not lowered and id(getattr(action, "kind", None)) in COMM_KIND_IDS:
            raise _Restart from None
        return False
    except (AttributeError, TypeError, IndexError):
        return False
    if any(head is not None for head in pending):
        return False
    # Every action ran; each wrote its own code once unless duplicated.
    if REGION_NONE * SM - done.count(0, 0, REGION_NONE * SM) != sum(map(len, programs)):
        return False
    if done.find(0, 0, 2 * SM) != -1:  # a forward or a backward missing
        return False
    # A W exactly where the backward was an I (B-then-W and I-without-W both fail).
    gradients, weights = done[SM : 2 * SM], done[2 * SM : 3 * SM]
    return gradients.translate(_ONLY_I) == weights.translate(_NONZERO)


_CALL = object()  # row duration: ask the user's duration callable


def run(schedule: Schedule, duration: Callable[[Action], float], latency: float = 0.0) -> EngineResult:
    """Step every rank's program with timings: each compute action gets a :class:`Span`.

    The schedule should pass :func:`conveyor.schedule.verify.verify` (``simulate``
    verifies first); a malformed one raises the verifier's error. Lowered
    programs run their SEND/RECV explicitly: a send takes no time, a receive
    ends ``latency`` after its send. In compute-only programs an action that
    needs another rank's output starts ``latency`` after it.
    """
    space = CodeSpace(schedule.num_stages, schedule.num_microbatches, schedule.placement.stage_to_rank)
    if sum(map(len, schedule.programs)) < space.region_size:
        # Not every stage can even run forward: say what is missing rather than size tables by S x M.
        from conveyor.schedule.verify import verify

        verify(schedule)
    # A lowered schedule shows a SEND/RECV within its first few actions; knowing it up front
    # spares a compute-only pass that would stop at the first one and start over (the
    # restart below still catches one that does not).
    lowered = any(id(a.kind) in COMM_KIND_IDS for program in schedule.programs for a in program[:4])
    try:
        with gc_paused():
            try:
                return _run(schedule, space, duration, float(latency), lowered=lowered)
            except _Restart:
                return _run(schedule, space, duration, float(latency), lowered=True)
    except (AttributeError, TypeError, IndexError, KeyError) as error:
        from conveyor.schedule.verify import verify

        verify(schedule)
        raise AssertionError(f"engine failed on a schedule that verifies: {error!r}") from error


def _run(schedule: Schedule, space: CodeSpace, duration: Callable[[Action], float], lat: float, lowered: bool):
    programs = schedule.programs
    num_ranks = len(programs)
    SM = space.region_size
    # Every code has a second, "remote" slot, written with the latency added: an action
    # whose need comes from another rank reads that slot, so the hot loop has no branch.
    remote_slot = space.size if lat else 0
    remote = space.remote_needs(lowered)
    S = space.num_stages
    durations = _duration_table(schedule, duration)

    def row(kind: ActionKind, s: int, base: int, delta: int) -> tuple:
        region = KIND_REGION[kind]
        return base, delta + (remote_slot if remote[region * S + s] else 0), durations(kind, s)

    tables = _rank_tables(space, lowered, row)
    done_at: list[float | None] = [None] * (space.size + remote_slot)
    for offset in {0, remote_slot}:
        start = offset + REGION_NONE * SM
        done_at[start : start + SM] = [float("-inf")] * SM
    waiting: dict[int, int] = {}  # one slot per code, as in _runs_clean
    size = space.size
    position = [0] * num_ranks
    clock = [0.0] * num_ranks
    starts: list[list[float]] = [[] for _ in range(num_ranks)]
    ends: list[list[float]] = [[] for _ in range(num_ranks)]
    # As in _runs_clean: a waiting rank keeps (action, code, need, duration) of its next action,
    # which runs as soon as the rank is woken.
    actions = [iter(p) for p in programs]
    pending: list[tuple | None] = [None] * num_ranks
    work = list(range(num_ranks - 1, -1, -1))
    action = None
    try:
        while work:
            rank = work.pop()
            i = position[rank]
            now = clock[rank]
            add_start = starts[rank].append
            add_end = ends[rank].append
            head = pending[rank]
            if head is not None:
                pending[rank] = None
                action, code, need, took = head
                ready = done_at[need]
                if ready > now:
                    now = ready
                if took is not None:
                    if took is _CALL:
                        took = duration(action)
                    add_start(now)
                    now += took
                    add_end(now)
                done_at[code] = now
                if remote_slot:
                    done_at[code + remote_slot] = now + lat
                if code in waiting:
                    work.append(waiting.pop(code))
                i += 1
            table = tables[rank]
            for action in actions[rank]:
                base, delta, took = table[id(action.kind)][action.stage]
                code = base + action.microbatch
                ready = done_at[code + delta]
                if ready is None:
                    # Wait on the code itself (its producer announces that one, not the remote slot).
                    waiting[(code + delta) % size] = rank
                    pending[rank] = (action, code, code + delta, took)
                    break
                if ready > now:
                    now = ready
                if took is not None:
                    if took is _CALL:
                        took = duration(action)
                    add_start(now)
                    now += took
                    add_end(now)
                done_at[code] = now
                if remote_slot:
                    done_at[code + remote_slot] = now + lat
                if code in waiting:
                    work.append(waiting.pop(code))
                i += 1
            position[rank] = i
            clock[rank] = now
    except KeyError:
        if not lowered and id(getattr(action, "kind", None)) in COMM_KIND_IDS:
            raise _Restart from None
        raise
    spans = _spans(programs, starts, ends)
    blocked: tuple[Blocked, ...] = ()
    if any(position[r] < len(programs[r]) for r in range(num_ranks)):
        codes = [space.encode(p) for p in programs]
        deltas = space.need_deltas(lowered)
        blocked = blocked_ranks(schedule, space, codes, [space.needs(c, deltas) for c in codes], position)
    return EngineResult(spans, blocked)


def _duration_table(schedule: Schedule, duration: Callable[[Action], float]) -> Callable[[ActionKind, int], object]:
    """(kind, stage) -> duration, None for communication, or _CALL to ask ``duration`` per action."""
    owner = getattr(duration, "__self__", None)
    if isinstance(owner, CostModel) and getattr(duration, "__func__", None) is CostModel.duration:
        # A CostModel's duration depends on (kind, stage) only: look it up once.
        return lambda kind, s: owner.duration(Action(kind, s, 0)) if kind.is_compute else None
    return lambda kind, s: _CALL if kind.is_compute else None


_span_new = object.__new__
_set_span_fields = tuple(Span.__dict__[name].__set__ for name in ("rank", "action", "start", "end"))


def _spans(programs: Sequence[Sequence[Action]], starts: list[list[float]], ends: list[list[float]]) -> tuple[Span, ...]:
    """Spans of the compute actions, built without Span.__init__ (frozen: 4 object.__setattr__ calls each)."""
    set_rank, set_action, set_start, set_end = _set_span_fields
    out: list[Span] = []
    for rank, program in enumerate(programs):
        count = len(starts[rank])
        if not count:
            continue
        actions = program if count == len(program) else [a for a in program if id(a.kind) not in COMM_KIND_IDS][:count]
        spans = list(map(_span_new, repeat(Span, count)))
        for setter, values in (
            (set_rank, repeat(rank, count)),
            (set_action, actions),
            (set_start, starts[rank]),
            (set_end, ends[rank]),
        ):
            deque(map(setter, spans, values), maxlen=0)  # consume in C
        out.extend(spans)
    return tuple(out)


def blocked_ranks(
    schedule: Schedule,
    space: CodeSpace,
    codes: Sequence[list[int]],
    needs: Sequence[list[int]],
    position: Sequence[int],
) -> tuple[Blocked, ...]:
    """Describe every rank that stopped before the end of its program."""
    stuck = [rank for rank, codes_of_rank in enumerate(codes) if position[rank] < len(codes_of_rank)]
    if not stuck:
        return ()
    where = {code: (rank, i) for rank in range(len(codes)) for i, code in enumerate(codes[rank])}
    blocked = []
    for rank in stuck:
        i = position[rank]
        need = needs[rank][i]
        _, stage, _ = space.split(need)
        producer_rank, producer_position = where.get(need, (space.stage_to_rank[stage], None))
        producer = None if producer_position is None else schedule.programs[producer_rank][producer_position]
        blocked.append(
            Blocked(
                rank,
                i,
                schedule.programs[rank][i],
                space.describe(need),
                producer_rank,
                producer,
                producer_position,
            )
        )
    return tuple(blocked)
