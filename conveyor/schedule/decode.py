"""Token-by-token decoding as one schedule: each token step's stages as further stages of a deeper pipeline.

Generation through a pipeline of ``S`` stages with a key/value cache feeds each token the last stage
picks back into stage 0. Run a step at a time (every lane through every stage, then the tokens
handed back), a step of ``L`` lanes on ``P`` ranks takes ``L + P - 1`` stage times for ``L`` tokens:
at ``L = P`` lanes, ``2P - 1`` for ``P``. :func:`decode_schedule` instead unrolls ``steps`` token steps
into a pipeline of ``S x steps`` stages: stage ``k`` is stage ``k % S`` at token step ``k // S``, on
the rank that runs stage ``k % S``, and the boundary from stage ``t S + S - 1`` to ``(t + 1) S``
carries the picked token of each lane to the next step's stage 0 as an ordinary boundary value.
So a lane's next step starts as soon as its token is picked, while the other lanes' steps still run
elsewhere: with ``L >= P`` lanes every rank stays busy after the first ``P - 1`` stage times.

Each rank runs its forward actions in the order of ``(k + lane, lane)``: the time each would start
with unit stage costs and no rank busy, a topological order of the forwards (stage ``k`` of a lane
after stage ``k - 1``); each rank's program is a subsequence of it, so no rank waits on an action
that its peer runs later. The backward actions follow in the reverse order: a schedule is a training
program, and decoding runs its forward-only program (:func:`~conveyor.schedule.passes.forward_only`).

Example:
    >>> from conveyor.schedule.ir import Placement
    >>> decode = decode_schedule(Placement.looped(2), lanes=2, steps=2)
    >>> decode.placement.stage_to_rank
    (0, 1, 0, 1)
    >>> [str(a) for a in decode.programs[0] if a.kind.value == "F"]
    ['0F0', '0F1', '2F0', '2F1']
"""

from __future__ import annotations

from conveyor.errors import ScheduleError, positive_int
from conveyor.schedule.ir import Action, ActionKind, Placement, Schedule


def decode_schedule(placement: Placement, lanes: int, steps: int) -> Schedule:
    """The schedule of ``steps`` token steps of ``lanes`` lanes through the stages of ``placement``, unrolled into
    ``placement.num_stages x steps`` stages (see the module docstring).

    Example:
        >>> decode_schedule(Placement.vshape(2), lanes=2, steps=3).num_stages
        12
    """
    for name, value in (("lanes", lanes), ("steps", steps)):
        if not positive_int(value):
            raise ScheduleError(f"decode_schedule: {name} must be a whole number >= 1, got {value!r}")
    depth = placement.num_stages
    deep = Placement(placement.num_ranks, tuple(placement.rank_of(k % depth) for k in range(depth * steps)))
    programs = []
    for rank in range(placement.num_ranks):
        actions = sorted(((stage, lane) for stage in deep.stages_of(rank) for lane in range(lanes)),
                         key=lambda pair: (pair[0] + pair[1], pair[1]))
        programs.append([Action(ActionKind.F, stage, lane) for stage, lane in actions]
                        + [Action(ActionKind.B, stage, lane) for stage, lane in reversed(actions)])
    return Schedule.from_programs(f"decode x{steps}", deep, lanes, programs)
