"""Step per-rank programs in order, each action starting once what it needs is done.

One engine serves the verifier (does every rank reach the end? if not, who
waits for what) and the simulator (when does each action start and end).
Semantics are those of the runtime: a send never blocks; an action that needs
another stage's output waits until that output was produced (plus the message
latency when it crosses ranks).

Dependencies of a compute action on stage ``s``, microbatch ``m``:
  F(s, m)          needs F(s-1, m)                  (none on the first stage)
  B(s, m), I(s, m) need F(s, m) and B/I(s+1, m)     (only F(s, m) on the last stage)
  W(s, m)          needs I(s, m)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from conveyor.schedule.ir import Action, ActionKind, Schedule
from conveyor.schedule.timeline import Span

# What an action produces, keyed as (produced, stage, microbatch):
# "F" = the forward output, "G" = the input gradient (from B or I), "I" = the I pass done.
_Key = tuple[str, int, int]


@dataclass(frozen=True, slots=True)
class Blocked:
    """A rank that cannot go on: its next action waits for ``waits_for`` on ``producer_rank``."""

    rank: int
    position: int
    action: Action
    waits_for: str
    producer_rank: int


@dataclass(frozen=True, slots=True)
class EngineResult:
    spans: tuple[Span, ...]
    blocked: tuple[Blocked, ...]

    @property
    def completed(self) -> bool:
        return not self.blocked


def produced_keys(action: Action) -> tuple[_Key, ...]:
    s, m, kind = action.stage, action.microbatch, action.kind
    if kind is ActionKind.F:
        return (("F", s, m),)
    if kind is ActionKind.B:
        return (("G", s, m),)
    if kind is ActionKind.I:
        # W waits for the I pass specifically, the previous stage for any input gradient.
        return (("G", s, m), ("I", s, m))
    return ()


def needed_keys(action: Action, num_stages: int) -> tuple[_Key, ...]:
    s, m, kind = action.stage, action.microbatch, action.kind
    if kind is ActionKind.F:
        return (("F", s - 1, m),) if s > 0 else ()
    if kind is ActionKind.B or kind is ActionKind.I:
        own = ("F", s, m)
        return (own, ("G", s + 1, m)) if s < num_stages - 1 else (own,)
    if kind is ActionKind.W:
        return (("I", s, m),)
    return ()


def describe_key(key: _Key) -> str:
    what, stage, microbatch = key
    if what == "F":
        return f"the forward output of stage {stage}, microbatch {microbatch} ({stage}F{microbatch})"
    if what == "G":
        return f"the input gradient of stage {stage}, microbatch {microbatch} ({stage}B{microbatch} or {stage}I{microbatch})"
    return f"the input-gradient pass of stage {stage}, microbatch {microbatch} ({stage}I{microbatch})"


def run(schedule: Schedule, duration: Callable[[Action], float], latency: float = 0.0) -> EngineResult:
    """Step every rank's compute actions; communication actions in the programs are skipped."""
    programs = [[a for a in p if a.kind.is_compute] for p in schedule.programs]
    num_stages = schedule.num_stages
    stage_to_rank = schedule.placement.stage_to_rank
    done_at: dict[_Key, float] = {}
    done_rank: dict[_Key, int] = {}
    waiters: dict[_Key, list[int]] = {}
    clock = [0.0] * len(programs)
    position = [0] * len(programs)
    spans: list[Span] = []
    worklist = list(range(len(programs)))
    while worklist:
        rank = worklist.pop()
        program = programs[rank]
        while position[rank] < len(program):
            action = program[position[rank]]
            start = clock[rank]
            missing = None
            for key in needed_keys(action, num_stages):
                ready = done_at.get(key)
                if ready is None:
                    missing = key
                    break
                if done_rank[key] != rank:
                    ready += latency
                start = max(start, ready)
            if missing is not None:
                waiters.setdefault(missing, []).append(rank)
                break
            end = start + duration(action)
            spans.append(Span(rank, action, start, end))
            clock[rank] = end
            position[rank] += 1
            for key in produced_keys(action):
                done_at[key] = end
                done_rank[key] = rank
                worklist.extend(waiters.pop(key, ()))
    blocked = []
    for rank, program in enumerate(programs):
        if position[rank] < len(program):
            action = program[position[rank]]
            for key in needed_keys(action, num_stages):
                if key not in done_at:
                    producer_stage = key[1]
                    producer = stage_to_rank[producer_stage] if 0 <= producer_stage < num_stages else rank
                    blocked.append(Blocked(rank, position[rank], action, describe_key(key), producer))
                    break
    return EngineResult(tuple(spans), tuple(blocked))
