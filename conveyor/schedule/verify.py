"""Check a schedule before anything runs: nothing missing, nothing twice, no deadlock.

(First version: completeness and deadlock on compute programs. Send/receive
matching on lowered programs and the step x rank grid come with lower.py.)
"""

from __future__ import annotations

from collections import Counter

from conveyor.errors import ScheduleError
from conveyor.schedule.engine import run
from conveyor.schedule.ir import ActionKind, Schedule


def verify(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` naming the first violation; return None when valid."""
    S, M = schedule.num_stages, schedule.num_microbatches
    counts = Counter()
    for rank, program in enumerate(schedule.programs):
        for action in program:
            if not action.kind.is_compute:
                continue
            if not (0 <= action.stage < S and 0 <= action.microbatch < M):
                raise ScheduleError(f"rank {rank} runs {action}, outside stages 0..{S-1} / microbatches 0..{M-1}")
            owner = schedule.placement.rank_of(action.stage)
            if owner != rank:
                raise ScheduleError(f"rank {rank} runs {action} but stage {action.stage} is placed on rank {owner}")
            counts[(action.kind, action.stage, action.microbatch)] += 1
    for s in range(S):
        for m in range(M):
            f = counts[(ActionKind.F, s, m)]
            b, i, w = (counts[(k, s, m)] for k in (ActionKind.B, ActionKind.I, ActionKind.W))
            if f != 1:
                raise ScheduleError(f"stage {s} microbatch {m} is forwarded {f} times ({s}F{m}); expected exactly once")
            if not ((b == 1 and i == 0 and w == 0) or (b == 0 and i == 1 and w == 1)):
                raise ScheduleError(
                    f"stage {s} microbatch {m} has backward actions B x{b}, I x{i}, W x{w}; "
                    f"expected exactly one {s}B{m}, or one {s}I{m} followed by one {s}W{m}"
                )
    result = run(schedule, lambda a: 1.0)
    if result.blocked:
        lines = [f"schedule {schedule.name!r} deadlocks:"]
        for b in result.blocked:
            lines.append(
                f"  rank {b.rank} stops at step {b.position} ({b.action}), waiting for {b.waits_for} on rank {b.producer_rank}"
            )
        raise ScheduleError("\n".join(lines))
