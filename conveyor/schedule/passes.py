"""The pass chain: from a schedule to the programs its ranks run, in one place.

A schedule says which compute actions each rank runs, in order. What a rank executes
differs from it in three ways, each a pure pass over programs:

  training:    verify -> :func:`~conveyor.schedule.lower.lower` (sends and receives)
               -> :func:`merge_adjacent_backward_halves` (an I right before its own W runs as B)
  evaluation:  :func:`forward_only` -> lower
  posts:       per rank, :func:`~conveyor.schedule.posts.rank_channels` (what its channels
               carry, in which order) -> :func:`~conveyor.schedule.posts.place_posts` (which
               sends and receives are posted together before each action, per discipline)

:func:`executable` runs the whole chain once and is the only entry point: both pipelines,
``conveyor simulate`` and the measured-vs-simulated pictures take their programs from it, so
the simulator times exactly the program that runs, and the runtime posts what it holds.

Example:
    >>> import conveyor.schedule as cs
    >>> runs = executable(cs.build("zb-h1", ranks=2, microbatches=2))
    >>> [str(a) for a in runs.train.programs[0]]   # stage 0's I and W meet: one B
    ['0F0', '0SEND_F0', '0F1', '0SEND_F1', '0RECV_B0', '0B0', '0RECV_B1', '0B1']
    >>> [str(a) for a in runs.eval.programs[1]]
    ['1RECV_F0', '1F0', '1RECV_F1', '1F1']
    >>> posts = runs.train_posts(1, "in_order")   # before 1SEND_B0: its send, and the next receive
    >>> [[str(a) for a in batch.actions] for batch in posts[3]]
    [['1SEND_B0'], ['1RECV_F1']]
    >>> sorted(runs.in_order_channels(1))   # (direction, sending stage): each arrives in its sender's order
    [(0, 0), (1, 1), (2, 0)]
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Callable, Iterable, Sequence
from itertools import compress, islice, repeat
from operator import and_, floordiv, sub
from typing import Any

from conveyor.errors import ScheduleError
from conveyor.schedule.ir import Action, ActionKind, PackedProgram, Schedule
from conveyor.schedule.lower import lower
from conveyor.schedule.posts import (
    BACKWARD,
    EVAL_FORWARD,
    FORWARD,
    IN_ORDER,
    Channel,
    RankChannels,
    RankPosts,
    place_posts,
    rank_channels,
)
from conveyor.schedule.verify import verify


class Executable:
    """What the ranks of ``schedule`` run: its training and evaluation programs, and their posts.

    ``train`` (lowered: sends and receives in place) verifies and simulates like any other
    schedule; ``compute`` is its compute actions alone, which time exactly like it in the
    simulator and come without lowering (``conveyor simulate`` at P=256 steps it).
    ``eval`` (lowered forwards; verify() calls it incomplete: it has no backward) is built
    when first read. A rank's programs, posts (:mod:`conveyor.schedule.posts`, per
    discipline) and in-order channels are made when that rank first asks, from its program
    and its peers' only. Evaluation runs without gradients, so its forwards travel as
    ``EVAL_FORWARD``.
    """

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        # What a rank asked for (its programs as Actions, posts, channels), by what it is: see _once().
        self._made: dict[tuple, object] = {}

    def _once(self, key: tuple, make: Callable[[], Any]) -> Any:
        """``make()``, made the first time ``key`` is asked for: a rank's executor reads it every step."""
        found = self._made.get(key)
        if found is None:
            found = self._made[key] = make()
        return found

    def _lowered(self, program: str) -> tuple[Schedule, int]:
        """The lowered ``program`` (``"train"`` or ``"eval"``) and the direction its forwards travel."""
        return (self.train, FORWARD) if program == "train" else (self.eval, EVAL_FORWARD)

    @functools.cached_property
    def compute(self) -> Schedule:
        """The training programs' compute actions (:func:`merge_backward_halves` of the source)."""
        return merge_backward_halves(self.schedule)

    @functools.cached_property
    def train(self) -> Schedule:
        """The training programs, lowered (what each rank's executor runs)."""
        return lower(self.compute)  # records that it verifies and times like ``compute``

    @functools.cached_property
    def eval(self) -> Schedule:
        """The forward-only (evaluation) programs, lowered."""
        return lower(forward_only(self.schedule))

    @functools.cached_property
    def train_in_order(self) -> frozenset[tuple[ActionKind, int]]:
        """Every rank's in-order training channels, named (send kind, sending stage) (for tools and
        tests: a rank reads its own, :meth:`in_order_channels`)."""
        return self._named_in_order("train", {FORWARD: ActionKind.SEND_F, BACKWARD: ActionKind.SEND_B})

    @functools.cached_property
    def eval_in_order(self) -> frozenset[tuple[ActionKind, int]]:
        """Every rank's in-order evaluation channels, named (send kind, sending stage)."""
        return self._named_in_order("eval", {EVAL_FORWARD: ActionKind.SEND_F})

    def _named_in_order(self, program: str, kinds: dict[int, ActionKind]) -> frozenset[tuple[ActionKind, int]]:
        """Every rank's in-order ``program`` channels, each as (the send kind of its direction, sending stage)."""
        return frozenset((kinds[direction], stage) for rank in range(self.schedule.num_ranks)
                         for direction, stage in self._rank_channels(program, rank).in_order)

    def _rank_channels(self, program: str, rank: int) -> RankChannels:
        lowered, forward = self._lowered(program)
        return self._once(("channels", program, rank), lambda: rank_channels(lowered, rank, forward))

    def in_order_channels(self, rank: int) -> frozenset[Channel]:
        """The channels (direction, sending stage) ``rank`` sends or receives on, in training or
        evaluation, whose receiver consumes them in the order the sender sends them."""
        return self._rank_channels("train", rank).in_order | self._rank_channels("eval", rank).in_order

    def train_posts(self, rank: int, discipline: str) -> RankPosts:
        """Where ``rank`` posts the transfers of its training program under ``discipline``: per action
        (the index of :meth:`train_program`'s), the batches posted right before it."""
        return self._placed("train", rank, discipline)

    def eval_posts(self, rank: int, discipline: str) -> RankPosts:
        """Where ``rank`` posts the transfers of its evaluation program under ``discipline``."""
        return self._placed("eval", rank, discipline)

    def _placed(self, program: str, rank: int, discipline: str) -> RankPosts:
        def place() -> RankPosts:
            lowered, forward = self._lowered(program)
            channels = self._rank_channels(program, rank) if discipline == IN_ORDER else None  # peers' orders
            return place_posts(lowered, rank, discipline, forward=forward, channels=channels)

        return self._once(("posts", program, rank, discipline), place)

    def train_program(self, rank: int) -> tuple[Action, ...]:
        """The actions ``rank`` runs in a training step, in order (only this rank's are lowered)."""
        return self._once(("train", rank), lambda: tuple(self.train.programs[rank]))

    def eval_program(self, rank: int) -> tuple[Action, ...]:
        """The actions ``rank`` runs in a forward-only (evaluation) pass, in order."""
        return self._once(("eval", rank), lambda: tuple(self.eval.programs[rank]))

    def gradients_final(self, rank: int) -> dict[int, int]:
        """{index in ``rank``'s training program: the stage whose weight gradients are final
        once that action is done} (see :func:`last_weight_passes`); found once, read every step."""
        return self._once(("gradients final", rank), lambda: last_weight_passes(self.train_program(rank)))


def executable(schedule: Schedule) -> Executable:
    """Verify ``schedule``; the pass chain's programs for every rank (each built when first read).

    Lowering and merging a verified schedule keep it deadlock-free and complete (property
    tests in tests/schedule check every built-in and random schedules); the training programs
    come from lower(), so verify() and simulate() check them through their compute actions
    (``Schedule.lowered_from``), a third of the actions.

    Example:
        >>> import conveyor.schedule as cs
        >>> runs = executable(cs.build("1f1b", ranks=2, microbatches=2))
        >>> [str(a) for a in runs.train_program(1)]
        ['1RECV_F0', '1F0', '1B0', '1SEND_B0', '1RECV_F1', '1F1', '1B1', '1SEND_B1']
    """
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"executable() expects a Schedule, got {type(schedule).__name__}")
    verify(schedule)
    return Executable(schedule)


def merge_backward_halves(schedule: Schedule) -> Schedule:
    """``schedule`` with each I that lowering leaves right before its own W merged with it into one B.

    That is stage 0's (no input gradient to send) and those whose input gradient stays on the
    rank (the previous stage runs there); elsewhere lowering puts the send between them. It
    neither checks ``schedule`` nor needs it lowered: ``simulate()`` of the result, which checks
    it, times exactly what the ranks run. Each program is merged when first read (a rank's
    runtime reads its own).

    Example:
        >>> import conveyor.schedule as cs
        >>> [str(a) for a in merge_backward_halves(cs.build("zb-h1", ranks=2, microbatches=1)).programs[0]]
        ['0F0', '0B0']
    """
    placement = schedule.placement
    programs, pairs = [], []
    for rank, program in enumerate(schedule.programs):
        keeps_gradient = frozenset(s for s in placement.stages_of(rank) if s == 0 or placement.rank_of(s - 1) == rank)
        merge = functools.partial(_merged_codes, program, keeps_gradient)
        programs.append(PackedProgram(merge, program.num_stages, program.num_microbatches, program.compute_only))
        if schedule.overlapped:
            pairs.append(_merged_pairs(program, keeps_gradient, schedule.overlapped[rank]))
    return schedule.with_programs(programs, tuple(pairs))


def _merged_pairs(program: PackedProgram, stages: frozenset[int], pairs: tuple) -> tuple:
    """``pairs`` of ``program`` with each backward I that merging turns into a B named as that B."""
    if not any(backward.kind is ActionKind.I and backward.stage in stages for _, backward in pairs):
        return pairs
    SM = program.num_stages * program.num_microbatches
    codes = program.codes
    position = dict(zip(codes, range(len(codes))))
    merged = []
    for forward, backward in pairs:
        at = position.get(program.code_of(backward))
        if (backward.kind is ActionKind.I and backward.stage in stages and at is not None and at + 1 < len(codes)
                and codes[at + 1] == codes[at] + SM):  # its own W follows: one B (see _merged_codes)
            backward = Action(ActionKind.B, backward.stage, backward.microbatch)
        merged.append((forward, backward))
    return tuple(merged)


def merge_adjacent_backward_halves(program: PackedProgram, stages: Iterable[int] | None = None) -> PackedProgram:
    """``program`` with each I directly followed by its own W run as one B.

    A split backward pays for itself by sending the input gradient before the weight
    gradient is computed. Where nothing comes between I and W (stage 0, whose inputs need
    no gradient; a hand-over to a stage on the same rank) the split only costs: two
    engine runs and the I/W bookkeeping instead of one run. B gives the same gradients
    bit for bit (the runtime's split is built to match it) at the same point of the
    program, so the rank's step differs only in taking less time. ``stages`` limits the
    merging to those stages (None: every stage); in a lowered program a send sits between an
    I and its W wherever the input gradient leaves the rank, so lowering then merging gives
    what merging the stages that keep it, then lowering, gives.

    Example:
        >>> program = PackedProgram.of(map(Action.parse, ["0F0", "0I0", "0W0", "1I0", "1SEND_B0", "1W0"]), 2, 1)
        >>> [str(a) for a in merge_adjacent_backward_halves(program)]
        ['0F0', '0B0', '1I0', '1SEND_B0', '1W0']
    """
    stages = range(program.num_stages) if stages is None else stages
    return PackedProgram(_merged_codes(program, stages), program.num_stages, program.num_microbatches,
                         program.compute_only)


def _merged_codes(program: PackedProgram, stages: Iterable[int]) -> array:
    """:func:`merge_adjacent_backward_halves` on codes: an I's code plus S x M is its own W's, minus it its B's."""
    codes, S, M = program.codes, program.num_stages, program.num_microbatches
    merged_inputs = frozenset(2 * S + s for s in stages)  # the keys of the I's that may merge
    if not merged_inputs or len(codes) < 2:
        return codes
    SM = S * M
    next_is_own_weight = map(SM.__eq__, map(sub, islice(codes, 1, None), codes))
    merges = map(merged_inputs.__contains__, map(floordiv, codes, repeat(M)))
    at = list(compress(range(len(codes) - 1), map(and_, next_is_own_weight, merges)))
    if not at:
        return codes
    merged, keep = array("q", codes), bytearray(b"\x01") * len(codes)
    for i in at:
        merged[i] -= SM  # the I becomes a B
        keep[i + 1] = 0  # and its W goes
    return array("q", compress(merged, keep))


def forward_only(schedule: Schedule) -> Schedule:
    """The forward actions of ``schedule``, in the same per-rank order (for evaluation; no overlapped
    pairs: a pair needs a backward).

    Example:
        >>> import conveyor.schedule as cs
        >>> [str(a) for a in forward_only(cs.build("1f1b", ranks=2, microbatches=2)).programs[1]]
        ['1F0', '1F1']
    """
    forwards = (schedule.num_stages * schedule.num_microbatches).__gt__  # F codes come first
    return schedule.with_programs([
        PackedProgram(functools.partial(_filtered, forwards, p), p.num_stages, p.num_microbatches, True)
        for p in schedule.programs
    ], overlapped=())


def _filtered(keep: Callable[[int], bool], program: PackedProgram) -> array:
    return array("q", filter(keep, program.codes))


def last_weight_passes(program: Sequence[Action]) -> dict[int, int]:
    """{index of each stage's last B or W in ``program``: that stage}.

    After that action the stage's weight gradients of the step are complete, so a reduction
    across data-parallel replicas can start while the rank runs the rest of its program.

    Example:
        >>> program = tuple(map(Action.parse, ["1F0", "0F0", "0B0", "1I0", "1W0", "0F1"]))
        >>> last_weight_passes(program)
        {2: 0, 4: 1}
    """
    last: dict[int, int] = {}
    for index, action in enumerate(program):
        if action.kind is ActionKind.B or action.kind is ActionKind.W:
            last[action.stage] = index
    return {index: stage for stage, index in sorted(last.items(), key=lambda item: item[1])}
