"""The schedule IR: actions, placements and per-rank programs, as plain data.

An :class:`Action` is ``(kind, stage, microbatch)``. A :class:`Schedule` is a
:class:`Placement` (which rank runs each stage) plus one ordered sequence of
compute actions per rank. Communication actions (``SEND_F`` ...) are inserted
by :func:`conveyor.schedule.lower.lower`; users never have to write them.

Every program is held as a :class:`PackedProgram`: one integer code per action
(8 bytes, where an Action object takes 56), read as a sequence of Actions (its own
type, not a tuple); a 256-rank schedule has millions of actions. A Schedule refuses
an action it cannot pack (not an Action, a kind that is no ActionKind, a stage or
microbatch that is no int in range) when it is made, with the message
:func:`~conveyor.schedule.verify.verify` gives for it; verify() checks the rest.

Actions print and parse in the compact form of ``torch.distributed.pipelining``
(``2F0`` = stage 2 forward of microbatch 0, ``1SEND_B3``), so schedules written
for torchtitan load unchanged.

Example:
    >>> from conveyor.schedule.ir import Action, Placement, Schedule
    >>> sched = Schedule.from_programs(
    ...     "tiny", Placement.looped(2, 1), 1, [["0F0", "0B0"], ["1F0", "1B0"]]
    ... )
    >>> sched.stages_of(1)
    [1]
    >>> str(sched.programs[1][0])
    '1F0'
"""

from __future__ import annotations

import gc
import hashlib
import re
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import repeat
from operator import add, floordiv, mod, mul
from types import MappingProxyType

from conveyor.errors import ScheduleError, positive_int


class ActionKind(StrEnum):
    """What a rank does for one (stage, microbatch)."""

    F = "F"  # forward
    B = "B"  # full backward: input and weight gradients together
    I = "I"  # noqa: E741  backward for the input gradient only (zero-bubble split)
    W = "W"  # backward for the weight gradient only, after I
    SEND_F = "SEND_F"  # send the forward output of `stage` to the rank of stage + 1
    RECV_F = "RECV_F"  # receive the forward input of `stage` from the rank of stage - 1
    SEND_B = "SEND_B"  # send the input gradient of `stage` to the rank of stage - 1
    RECV_B = "RECV_B"  # receive the output gradient of `stage` from the rank of stage + 1

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return not self.is_compute


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W})
# Longest kind names first so that "SEND_F" is not read as "S" + ...
_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of a rank's program: ``kind`` of ``stage`` for ``microbatch``.

    Example:
        >>> Action.parse("3I5")
        Action(kind=<ActionKind.I: 'I'>, stage=3, microbatch=5)
        >>> str(Action(ActionKind.SEND_F, 1, 0))
        '1SEND_F0'
    """

    kind: ActionKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the compact form ``{stage}{kind}{microbatch}`` (``2F0``, ``1SEND_B3``)."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ScheduleError(
                f"cannot read action {text!r}: expected {{stage}}{{kind}}{{microbatch}} "
                f"with kind one of {', '.join(k.value for k in ActionKind)}, e.g. '2F0' or '1SEND_B3'"
            )
        stage, kind, microbatch = match.groups()
        return cls(ActionKind(kind), int(stage), int(microbatch))



def in_bulk(cls: type, count: int, slots: Mapping[str, Iterable]) -> list:
    """``count`` new ``cls``, each slot named in ``slots`` set from its values in turn, made without
    ``__init__``: a frozen dataclass's costs 4x more than setting its slots directly (``cls`` has
    no ``__post_init__`` that this would skip).

    The cyclic garbage collector is paused meanwhile: hundreds of thousands of fresh Actions or
    Spans trigger collections that traverse every live object again and again (2-3x the run time);
    none of them form reference cycles, so nothing is lost by collecting afterwards.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        made = list(map(object.__new__, repeat(cls, count)))
        for name, values in slots.items():
            deque(map(cls.__dict__[name].__set__, made, values), maxlen=0)
    finally:
        if was_enabled:
            gc.enable()
    return made

# -- packed programs ---------------------------------------------------------------------------------

KINDS: tuple[ActionKind, ...] = tuple(ActionKind)
"""Kind indices of packed codes: F, B, I, W (compute, 0..3), then SEND_F, RECV_F, SEND_B, RECV_B."""
KIND_INDEX: Mapping[int, int] = MappingProxyType({id(kind): index for index, kind in enumerate(KINDS)})
NUM_COMPUTE_KINDS = 4


class PackedProgram(Sequence[Action]):
    """One rank's program as integer codes ``(kind_index * S + stage) * M + microbatch``.

    A read-only sequence of :class:`Action` of its own type, not a tuple: 8 bytes per action
    instead of an object (a 256-rank schedule has millions of actions). Actions are made when
    read; a slice is a PackedProgram; it equals (and hashes like) a PackedProgram of the same
    sizes and codes only, so compare ``tuple(program)`` with a tuple. ``source`` (a function
    returning the codes) defers the work until the program is first read: a rank's runtime
    lowers only its own program.

    Example:
        >>> program = PackedProgram.of([F(1, 0), B(1, 0)], num_stages=2, num_microbatches=1)
        >>> [str(a) for a in program], tuple(program) == (F(1, 0), B(1, 0)), len(program)
        (['1F0', '1B0'], True, 2)
        >>> program == (F(1, 0), B(1, 0)), [str(a) for a in program[1:]]
        (False, ['1B0'])
    """

    __slots__ = ("_codes", "_source", "num_stages", "num_microbatches", "compute_only", "__weakref__")

    def __init__(self, codes: array | Callable[[], array], num_stages: int, num_microbatches: int,
                 compute_only: bool | None = None) -> None:
        self._codes, self._source = (codes, None) if isinstance(codes, array) else (None, codes)
        self.num_stages, self.num_microbatches = num_stages, num_microbatches
        # Known without reading the codes where the maker knows it (builders, merging, lowering).
        self.compute_only = compute_only

    @classmethod
    def of(cls, actions: Iterable[Action], num_stages: int, num_microbatches: int) -> PackedProgram | None:
        """``actions`` packed, or None unless each is an Action with int ids in range."""
        actions = list(actions)
        if actions and set(map(type, actions)) != {Action}:
            return None
        return cls.from_fields([a.kind for a in actions], [a.stage for a in actions],
                               [a.microbatch for a in actions], num_stages, num_microbatches)

    @classmethod
    def from_fields(cls, kinds: Sequence[ActionKind], stages: Sequence[int], microbatches: Sequence[int],
                    num_stages: int, num_microbatches: int) -> PackedProgram | None:
        """Pack three parallel sequences; None unless every field is an in-range int or ActionKind."""
        S, M = num_stages, num_microbatches
        if kinds:
            try:
                indices = list(map(KIND_INDEX.__getitem__, map(id, kinds)))
            except KeyError:
                return None
            if (set(map(type, stages)) != {int} or set(map(type, microbatches)) != {int}
                    or min(stages) < 0 or max(stages) >= S or min(microbatches) < 0 or max(microbatches) >= M):
                return None
            compute_only = max(indices) < NUM_COMPUTE_KINDS
        else:
            indices, compute_only = [], True
        keys = map(add, map(mul, indices, repeat(S)), stages)
        codes = array("q", map(add, map(mul, keys, repeat(M)), microbatches))
        return cls(codes, S, M, compute_only)

    @property
    def codes(self) -> array:
        """The codes (made now if the program was deferred)."""
        if self._codes is None:
            self._codes = self._source()
            self._source = None
        return self._codes

    @property
    def made(self) -> bool:
        """Whether the codes exist yet (False: deferred, not read so far)."""
        return self._codes is not None

    @property
    def holds_comms(self) -> bool:
        """Whether the program holds a SEND/RECV (known without reading the codes where its maker knew it)."""
        if self.compute_only is None:
            codes, first_comm = self.codes, NUM_COMPUTE_KINDS * self.num_stages * self.num_microbatches
            self.compute_only = not codes or max(codes) < first_comm
        return not self.compute_only

    def fields(self) -> tuple[list[ActionKind], list[int], list[int]]:
        """(kinds, stages, microbatches) of every action, in order."""
        codes, S, M = self.codes, self.num_stages, self.num_microbatches
        keys = list(map(floordiv, codes, repeat(M)))
        return (list(map(KINDS.__getitem__, map(floordiv, keys, repeat(S)))), list(map(mod, keys, repeat(S))),
                list(map(mod, codes, repeat(M))))

    def actions(self) -> list[Action]:
        """Every action, made in bulk (:func:`in_bulk`: several times faster than calling ``Action``)."""
        kinds, stages, microbatches = self.fields()
        return in_bulk(Action, len(kinds), {"kind": kinds, "stage": stages, "microbatch": microbatches})

    def action_of(self, code: int) -> Action:
        key, microbatch = divmod(code, self.num_microbatches)
        index, stage = divmod(key, self.num_stages)
        return Action(KINDS[index], stage, microbatch)

    def code_of(self, action: object) -> int | None:
        """The code of ``action``, None if it cannot be in this program."""
        if type(action) is not Action or type(action.stage) is not int or type(action.microbatch) is not int:
            return None
        index = KIND_INDEX.get(id(action.kind))
        if index is None or not (
            0 <= action.stage < self.num_stages and 0 <= action.microbatch < self.num_microbatches
        ):
            return None
        return (index * self.num_stages + action.stage) * self.num_microbatches + action.microbatch

    def __len__(self) -> int:
        return len(self.codes)

    def __getitem__(self, index):  # noqa: ANN001, ANN204 - int or slice, as a tuple's
        if isinstance(index, slice):
            return PackedProgram(self.codes[index], self.num_stages, self.num_microbatches, self.compute_only or None)
        return self.action_of(self.codes[index])

    def __iter__(self) -> Iterator[Action]:
        return iter(self.actions())

    def __reversed__(self) -> Iterator[Action]:
        return reversed(self.actions())

    def __contains__(self, action: object) -> bool:
        code = self.code_of(action)
        return code is not None and code in self.codes

    def count(self, action: object) -> int:
        code = self.code_of(action)
        return 0 if code is None else self.codes.count(code)

    def index(self, action: object, start: int = 0, stop: int | None = None) -> int:
        code = self.code_of(action)
        if code is None:
            raise ValueError(f"{action!r} is not in the program")
        return self.codes.index(code, start, len(self) if stop is None else stop)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedProgram):
            return NotImplemented
        return (other.num_stages, other.num_microbatches) == (self.num_stages, self.num_microbatches) and (
            self.codes == other.codes
        )

    def __hash__(self) -> int:
        return hash((self.num_stages, self.num_microbatches, self.codes.tobytes()))

    def __repr__(self) -> str:
        # Cheap and deterministic (the runtime hashes every rank's repr to check that ranks agree).
        codes = self.codes
        digest = hashlib.sha1(codes.tobytes()).hexdigest()[:12]
        shown = " ".join(map(str, self[:3])) + (" ..." if len(codes) > 3 else "")
        return (
            f"PackedProgram({len(codes)} actions: {shown}; "
            f"S={self.num_stages} M={self.num_microbatches} sha1 {digest})"
        )


def packed_programs(programs: Sequence[Sequence[Action]], num_stages: int, num_microbatches: int) -> list | None:
    """Every program as a :class:`PackedProgram` of these sizes, or None if one cannot be packed.

    Example:
        >>> [len(p) for p in packed_programs([[F(0, 0), B(0, 0)], []], 1, 1)], packed_programs([["0F0"]], 1, 1)
        ([2, 0], None)
    """
    out = [p if type(p) is PackedProgram and (p.num_stages, p.num_microbatches) == (num_stages, num_microbatches)
           else PackedProgram.of(p, num_stages, num_microbatches) for p in programs]
    return None if None in out else out


def F(stage: int, microbatch: int) -> Action:  # noqa: N802 - reads like the papers
    """Forward of ``stage`` on ``microbatch``."""
    return Action(ActionKind.F, stage, microbatch)


def B(stage: int, microbatch: int) -> Action:  # noqa: N802
    """Full backward (input and weight gradients) of ``stage`` on ``microbatch``."""
    return Action(ActionKind.B, stage, microbatch)


def I(stage: int, microbatch: int) -> Action:  # noqa: N802, E743
    """Input-gradient backward of ``stage`` on ``microbatch``."""
    return Action(ActionKind.I, stage, microbatch)


def W(stage: int, microbatch: int) -> Action:  # noqa: N802
    """Weight-gradient backward of ``stage`` on ``microbatch`` (after its ``I``)."""
    return Action(ActionKind.W, stage, microbatch)


@dataclass(frozen=True, slots=True)
class Placement:
    """Which rank runs each stage: ``stage_to_rank[stage] == rank``.

    Example:
        >>> Placement.looped(2, 2).stage_to_rank
        (0, 1, 0, 1)
        >>> Placement.vshape(2).stage_to_rank
        (0, 1, 1, 0)
    """

    num_ranks: int
    stage_to_rank: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.num_ranks, int) or isinstance(self.num_ranks, bool):
            raise ScheduleError(f"a placement's num_ranks must be an int, got {self.num_ranks!r}")
        if self.num_ranks < 1:
            raise ScheduleError(f"a placement needs at least 1 rank, got {self.num_ranks}")
        if isinstance(self.stage_to_rank, list):
            object.__setattr__(self, "stage_to_rank", tuple(self.stage_to_rank))
        if not isinstance(self.stage_to_rank, tuple):
            raise ScheduleError(
                f"stage_to_rank must be a tuple of ranks, one per stage, got {type(self.stage_to_rank).__name__}"
            )
        wrong = [r for r in self.stage_to_rank if type(r) is not int]
        if wrong:
            raise ScheduleError(f"stage_to_rank must hold int ranks, got {wrong[0]!r}")
        if not self.stage_to_rank:
            raise ScheduleError("a placement needs at least 1 stage, got none")
        bad = [r for r in self.stage_to_rank if not 0 <= r < self.num_ranks]
        if bad:
            raise ScheduleError(
                f"placement maps stages to ranks {sorted(set(bad))}, outside 0..{self.num_ranks - 1}"
            )
        idle = sorted(set(range(self.num_ranks)) - set(self.stage_to_rank))
        if idle:
            raise ScheduleError(f"placement leaves ranks {idle} without any stage")

    @classmethod
    def looped(cls, num_ranks: int, virtual: int = 1) -> Placement:
        """Stage ``s`` on rank ``s % num_ranks`` (GPipe, 1F1B, interleaved, looped BFS)."""
        _check_positive(num_ranks=num_ranks, virtual=virtual)
        return cls(num_ranks, tuple(s % num_ranks for s in range(num_ranks * virtual)))

    @classmethod
    def vshape(cls, num_ranks: int) -> Placement:
        """Two stages per rank folded into a V: rank r runs stages r and 2P-1-r (ZB-V, DualPipeV)."""
        _check_positive(num_ranks=num_ranks)
        down = list(range(num_ranks))
        return cls(num_ranks, tuple(down + down[::-1]))

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    def rank_of(self, stage: int) -> int:
        return self.stage_to_rank[stage]

    def stages_of(self, rank: int) -> list[int]:
        """The stages ``rank`` runs, in increasing order."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not positive_int(value):
            raise ScheduleError(f"{name} must be a positive integer, got {value!r}")


_PROGRAM_TYPES = (tuple, list, PackedProgram)


@dataclass(frozen=True, slots=True, weakref_slot=True)
class Schedule:
    """A placement plus one ordered program of actions per rank.

    ``programs`` normally hold compute actions only (F, B, I, W); a lowered
    schedule (see :func:`conveyor.schedule.lower.lower`) also holds SEND/RECV, and
    ``lowered_from`` names the compute-only schedule it was lowered from. ``overlapped``
    (keyword, default ``()``: none) holds per rank the (forward, backward) pairs it runs
    together (:mod:`conveyor.schedule.overlap`); verify() checks them. Each
    program given is packed into a :class:`PackedProgram`; an action that cannot be
    (not an Action, or ids that are no ints in range) raises :class:`ScheduleError`
    here, with the message :func:`~conveyor.schedule.verify.verify` gives for it.

    Example:
        >>> import conveyor.schedule as cs
        >>> sched = cs.build("1f1b", ranks=2, microbatches=2)
        >>> [str(a) for a in sched.programs[0]]
        ['0F0', '0F1', '0B0', '0B1']
    """

    name: str
    placement: Placement
    num_microbatches: int
    programs: tuple[PackedProgram, ...]
    # The compute-only schedule that lower() made this one from (None otherwise): such a schedule
    # verifies and times exactly like its source, which has a third of the actions (see lower()).
    # Provenance, not content: two schedules with equal programs are equal wherever they came from.
    lowered_from: Schedule | None = field(default=None, repr=False, compare=False, kw_only=True)
    # Per rank, the (forward, backward) pairs it runs overlapped (conveyor.schedule.overlap): content,
    # since it changes what runs; () where no rank has any. Shown by str(), not repr() (unchanged).
    overlapped: tuple[tuple[tuple[Action, Action], ...], ...] = field(default=(), repr=False, kw_only=True)
    # Set by verify() once this schedule passed: a pure function of content that never changes, kept
    # with it (outside equality), so that build() -> executable() -> simulate() step the programs once.
    _verified: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_positive(num_microbatches=self.num_microbatches)
        if not isinstance(self.placement, Placement):
            raise ScheduleError(
                f"schedule {self.name!r}: placement must be a Placement (e.g. Placement.looped(num_ranks, virtual)), "
                f"got {type(self.placement).__name__}"
            )
        programs = self.programs
        if not isinstance(programs, tuple | list) or any(not isinstance(p, _PROGRAM_TYPES) for p in programs):
            raise ScheduleError(
                f"schedule {self.name!r}: programs must be one sequence of actions per rank, got "
                f"{programs!r:.80}; Schedule.from_programs(...) also reads action strings such as '2F0'"
            )
        if len(programs) != self.placement.num_ranks:
            raise ScheduleError(
                f"schedule {self.name!r} has programs for {len(programs)} ranks "
                f"but its placement has {self.placement.num_ranks} ranks"
            )
        packed = packed_programs(programs, self.placement.num_stages, self.num_microbatches)
        if packed is None:  # validate early, in the verifier's words (verify imports this module)
            from conveyor.schedule.verify import check_actions

            check_actions(self.placement, self.num_microbatches, programs)
            raise AssertionError(f"schedule {self.name!r}: a program could not be packed, yet every action is valid")
        object.__setattr__(self, "programs", tuple(packed))
        if self.lowered_from is not None and not isinstance(self.lowered_from, Schedule):
            raise ScheduleError(
                f"schedule {self.name!r}: lowered_from must be the Schedule lower() started from, "
                f"got {type(self.lowered_from).__name__}"
            )
        if self.overlapped:
            object.__setattr__(self, "overlapped", _checked_pairs(self.name, self.num_ranks, self.overlapped))

    @classmethod
    def from_programs(
        cls,
        name: str,
        placement: Placement | None,
        num_microbatches: int | None,
        programs: Sequence[Iterable[Action | str]],
    ) -> Schedule:
        """Build from per-rank sequences of :class:`Action` or their strings (``"2F0"``).

        ``placement=None`` infers it from where each stage's actions are;
        ``num_microbatches=None`` takes the largest microbatch id + 1. Strings
        that do not parse raise a :class:`ScheduleError` naming rank and column.
        """
        from conveyor.schedule.csv_io import schedule_from_rows

        return schedule_from_rows(programs, name=name, placement=placement, num_microbatches=num_microbatches)

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    @property
    def virtual(self) -> int:
        """Stages per rank (V); 1 for GPipe and 1F1B, 2 for ZB-V."""
        return self.num_stages // self.num_ranks

    @property
    def splits_backward(self) -> bool:
        """Whether any stage runs its backward as I then W."""
        SM = self.num_stages * self.num_microbatches
        is_split = range(2 * SM, 3 * SM).__contains__  # I's codes
        return any(any(map(is_split, p.codes)) for p in self.programs)

    @property
    def is_lowered(self) -> bool:
        """Whether any program holds a SEND/RECV (a program lower() made counts as lowered)."""
        return any(p.holds_comms for p in self.programs)

    def stages_of(self, rank: int) -> list[int]:
        """The stages ``rank`` runs, in increasing order (pass one module per stage, in this order)."""
        if not 0 <= rank < self.num_ranks:
            raise ScheduleError(
                f"rank {rank} is outside schedule {self.name!r}, which has ranks 0..{self.num_ranks - 1}"
            )
        return self.placement.stages_of(rank)

    def compute_only(self) -> Schedule:
        """The same schedule (its overlapped pairs too) with communication actions removed."""
        S, M = self.num_stages, self.num_microbatches
        below = (NUM_COMPUTE_KINDS * S * M).__gt__
        programs = tuple(p if p.compute_only else PackedProgram(array("q", filter(below, p.codes)), S, M, True)
                         for p in self.programs)
        return Schedule(self.name, self.placement, self.num_microbatches, programs, overlapped=self.overlapped)

    def with_programs(self, programs: Sequence[Sequence[Action]], overlapped: tuple | None = None) -> Schedule:
        """This schedule's name, placement and microbatches with other programs (checked as any Schedule's),
        and its overlapped pairs (``overlapped``: other pairs, ``()`` for none)."""
        programs = tuple(p if isinstance(p, PackedProgram) else tuple(p) for p in programs)
        pairs = self.overlapped if overlapped is None else overlapped
        return Schedule(self.name, self.placement, self.num_microbatches, programs, overlapped=pairs)

    def __str__(self) -> str:
        lines = [
            f"schedule {self.name}: {self.num_ranks} ranks, {self.num_stages} stages, "
            f"{self.num_microbatches} microbatches"
        ]
        for rank, program in enumerate(self.programs):
            lines.append(f"rank {rank}: " + " ".join(map(str, program)))
        for rank, pairs in enumerate(self.overlapped):
            lines.append(f"rank {rank} overlaps: " + " ".join(f"{f}+{b}" for f, b in pairs))
        return "\n".join(lines)


def _checked_pairs(name: str, num_ranks: int, overlapped: object) -> tuple:
    """``overlapped`` as tuples, or ScheduleError unless it is one sequence of (Action, Action) pairs per rank.

    Only the shape: verify() checks what the pairs say (kinds, ranks, adjacency, no deadlock).
    """
    how = ("give one sequence of (forward, backward) Action pairs per rank (() for a rank without pairs), "
           "e.g. conveyor.schedule.overlap.pair_forward_backward(schedule)")
    if not isinstance(overlapped, tuple | list) or len(overlapped) != num_ranks:
        got = f"{len(overlapped)} entries" if isinstance(overlapped, tuple | list) else type(overlapped).__name__
        raise ScheduleError(f"schedule {name!r}: overlapped must have {num_ranks} entries, one per rank, "
                            f"got {got}; {how}")
    out = []
    for rank, pairs in enumerate(overlapped):
        if not isinstance(pairs, tuple | list) or not all(
                isinstance(pair, tuple | list) and len(pair) == 2 and type(pair[0]) is Action
                and type(pair[1]) is Action for pair in pairs):
            raise ScheduleError(f"schedule {name!r}: overlapped[{rank}] must hold (Action, Action) pairs, "
                                f"got {pairs!r:.80}; {how}")
        out.append(tuple(map(tuple, pairs)))
    return tuple(out)
