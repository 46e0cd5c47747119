"""The pass chain: from a schedule to the programs its ranks run, in one place.

A schedule says which compute actions each rank runs, in order. What a rank executes
differs from it in three ways, each a pure pass over programs:

  training:    verify -> :func:`~conveyor.schedule.lower.lower` (sends and receives)
               -> :func:`merge_adjacent_backward_halves` (an I right before its own W runs as B)
  evaluation:  :func:`forward_only` -> lower
  transport:   :func:`in_order_channels` (channels whose receiver consumes in the order the
               sender sends, so their receives can be posted ahead)

:func:`executable` runs the whole chain once and is the only entry point: both pipelines,
``conveyor simulate`` and the measured-vs-simulated pictures take their programs from it, so
the simulator times exactly the program that runs.

Example:
    >>> import conveyor.schedule as cs
    >>> runs = executable(cs.build("zb-h1", ranks=2, microbatches=2))
    >>> [str(a) for a in runs.train.programs[0]]   # stage 0's I and W meet: one B
    ['0F0', '0SEND_F0', '0F1', '0SEND_F1', '0RECV_B0', '0B0', '0RECV_B1', '0B1']
    >>> [str(a) for a in runs.eval.programs[1]]
    ['1RECV_F0', '1F0', '1RECV_F1', '1F1']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.errors import ScheduleError
from conveyor.schedule.ir import Action, ActionKind, Schedule
from conveyor.schedule.lower import lower
from conveyor.schedule.verify import verify

# A channel is named by the kind of the send that feeds it and the sending stage.
Channel = tuple[ActionKind, int]


@dataclass(frozen=True)
class Executable:
    """What the ranks of ``schedule`` run: its training and evaluation programs, lowered.

    ``train`` and ``eval`` are schedules (one program per rank); ``train`` verifies and
    simulates like any other (``eval`` has no backward, which verify() calls incomplete).
    ``train_in_order`` and ``eval_in_order`` are their FIFO channels.
    """

    schedule: Schedule
    train: Schedule
    eval: Schedule
    train_in_order: frozenset[Channel]
    eval_in_order: frozenset[Channel]

    def train_program(self, rank: int) -> tuple[Action, ...]:
        """The actions ``rank`` runs in a training step, in order."""
        return self.train.programs[rank]

    def eval_program(self, rank: int) -> tuple[Action, ...]:
        """The actions ``rank`` runs in a forward-only (evaluation) pass, in order."""
        return self.eval.programs[rank]

    def gradients_final(self, rank: int) -> dict[int, int]:
        """{index in ``rank``'s training program: the stage whose weight gradients are final
        once that action is done} (see :func:`last_weight_passes`)."""
        return last_weight_passes(self.train.programs[rank])


def executable(schedule: Schedule) -> Executable:
    """Verify ``schedule`` and run the pass chain: the programs every rank executes.

    Example:
        >>> import conveyor.schedule as cs
        >>> runs = executable(cs.build("1f1b", ranks=2, microbatches=2))
        >>> [str(a) for a in runs.train_program(1)]
        ['1RECV_F0', '1F0', '1B0', '1SEND_B0', '1RECV_F1', '1F1', '1B1', '1SEND_B1']
    """
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"executable() expects a Schedule, got {type(schedule).__name__}")
    verify(schedule)
    lowered = lower(schedule)
    train = lowered.with_programs([merge_adjacent_backward_halves(p) for p in lowered.programs])
    evaluation = lower(forward_only(schedule))
    _derived_from_verified(train, lowered)
    return Executable(schedule, train, evaluation, in_order_channels(train), in_order_channels(evaluation))


def forward_only(schedule: Schedule) -> Schedule:
    """The forward actions of ``schedule``, in the same per-rank order (for evaluation).

    Example:
        >>> import conveyor.schedule as cs
        >>> [str(a) for a in forward_only(cs.build("1f1b", ranks=2, microbatches=2)).programs[1]]
        ['1F0', '1F1']
    """
    return schedule.with_programs([[a for a in p if a.kind is ActionKind.F] for p in schedule.programs])


def merge_adjacent_backward_halves(program: Sequence[Action]) -> tuple[Action, ...]:
    """``program`` with each I directly followed by its own W run as one B.

    A split backward pays for itself by sending the input gradient before the weight
    gradient is computed. Where nothing comes between I and W (stage 0, whose inputs need
    no gradient; a hand-over to a stage on the same rank) the split only costs: two
    engine runs and the I/W bookkeeping instead of one run. B gives the same gradients
    bit for bit (the runtime's split is built to match it) at the same point of the
    program, so the rank's step differs only in taking less time.

    Example:
        >>> program = tuple(map(Action.parse, ["0F0", "0I0", "0W0", "1I0", "1SEND_B0", "1W0"]))
        >>> [str(a) for a in merge_adjacent_backward_halves(program)]
        ['0F0', '0B0', '1I0', '1SEND_B0', '1W0']
    """
    merged: list[Action] = []
    for action in program:
        previous = merged[-1] if merged else None
        if (action.kind is ActionKind.W and previous is not None and previous.kind is ActionKind.I
                and previous.stage == action.stage and previous.microbatch == action.microbatch):
            merged[-1] = Action(ActionKind.B, action.stage, action.microbatch)
        else:
            merged.append(action)
    return tuple(merged)


def in_order_channels(lowered: Schedule) -> frozenset[Channel]:
    """Channels (send kind, sending stage) whose receiver consumes in the order the sender sends.

    A transport may post such a channel's receives ahead and assume each transfer looks like
    the last one; on the others it must match transfers by microbatch.

    Example:
        >>> import conveyor.schedule as cs
        >>> sorted((k.name, s) for k, s in in_order_channels(cs.lower(cs.build("1f1b", ranks=2, microbatches=2))))
        [('SEND_B', 1), ('SEND_F', 0)]
    """
    sent: dict[Channel, list[int]] = {}
    received: dict[Channel, list[int]] = {}
    for program in lowered.programs:
        for a in program:
            if a.kind is ActionKind.SEND_F or a.kind is ActionKind.SEND_B:
                sent.setdefault((a.kind, a.stage), []).append(a.microbatch)
            elif a.kind is ActionKind.RECV_F:
                received.setdefault((ActionKind.SEND_F, a.stage - 1), []).append(a.microbatch)
            elif a.kind is ActionKind.RECV_B:
                received.setdefault((ActionKind.SEND_B, a.stage + 1), []).append(a.microbatch)
    return frozenset(c for c, order in sent.items() if received.get(c) == order)


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


def _derived_from_verified(result: Schedule, lowered: Schedule) -> None:
    """Record what holds of ``result`` by construction, so simulate() need not find it again.

    Lowering and merging a verified schedule keep it deadlock-free and complete (property
    tests in tests/schedule check every built-in), so ``result`` is marked verified. When the
    lowering put every receive right before its consumer and every send right after its
    producer, the program times exactly like its compute actions alone, which the engine
    steps about 40% faster; merging changes only an I directly followed by its W, which no
    communication separates, so that holds of the merged program too.
    """
    result._checked["verified"] = True
    if "lowered_from" in lowered._checked:
        result._checked["lowered_from"] = result.compute_only()
