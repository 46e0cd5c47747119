"""The verifier's messages on a fixed corpus of damaged schedules, one line each: diff two runs to
show that a refactor changed no message.

The corpus is the damage of tests/schedule/test_properties.py made deterministic: built-ins at
small sizes (compute-only and lowered) with an action dropped, duplicated, moved to another rank,
two actions swapped, a send or receive dropped, and a few malformed actions. Each damaged schedule
is made inside each step's try: a Schedule refuses a malformed action when it is made, with the
verifier's message.

    PYTHONPATH=$PWD .venv/bin/python tools/verify_messages.py > messages.txt
"""

from __future__ import annotations

import random
import sys


def damaged(sched, rng: random.Random):  # noqa: ANN001, ANN201 - a Schedule; yields (label, a maker of one)
    from conveyor.schedule.ir import Action, ActionKind

    programs = [list(p) for p in sched.programs]
    ranks = [r for r, p in enumerate(programs) if p]

    def with_rank(rank: int, program: list) -> object:
        new = list(map(tuple, programs))
        new[rank] = tuple(program)
        return lambda: sched.with_programs(new)

    for trial in range(6):
        rank = rng.choice(ranks)
        program = list(programs[rank])
        i = rng.randrange(len(program))
        yield f"drop {rank}:{i}", with_rank(rank, program[:i] + program[i + 1:])
        j = rng.randrange(len(program) + 1)
        yield f"dup {rank}:{i}->{j}", with_rank(rank, program[:j] + [program[i]] + program[j:])
        if len(program) > 1:
            a, b = sorted(rng.sample(range(len(program)), 2))
            swapped = list(program)
            swapped[a], swapped[b] = swapped[b], swapped[a]
            yield f"swap {rank}:{a}<->{b}", with_rank(rank, swapped)
            # neighbours: the swaps most likely to deadlock rather than to be merely reordered
            a = rng.randrange(len(program) - 1)
            swapped = list(program)
            swapped[a], swapped[a + 1] = swapped[a + 1], swapped[a]
            yield f"swap {rank}:{a}<->{a + 1}", with_rank(rank, swapped)
        if len(ranks) > 1:
            target = rng.choice([r for r in range(len(programs)) if r != rank])
            new = list(map(tuple, programs))
            moved = program[i]
            new[rank] = tuple(program[:i] + program[i + 1:])
            destination = list(programs[target])
            k = rng.randrange(len(destination) + 1)
            new[target] = tuple(destination[:k] + [moved] + destination[k:])
            yield f"move {rank}:{i}->{target}:{k}", lambda new=new: sched.with_programs(new)
        junk = [Action(ActionKind.F, sched.num_stages, 0), Action(ActionKind.B, 0, sched.num_microbatches),
                Action("F", 0, 0), Action(ActionKind.W, 0, 1.0), Action(ActionKind.SEND_F, sched.num_stages - 1, 0),
                Action(ActionKind.RECV_B, 0, -1)][trial]
        yield f"junk {junk!r} at {rank}:{i}", with_rank(rank, program[:i] + [junk] + program[i:])


def main() -> int:
    import conveyor.schedule as cs
    from conveyor.errors import ScheduleError
    from conveyor.schedule.verify import verify

    for name, info in cs.available().items():
        virtuals = info.virtual_choices if info.virtual_choices is not None else (1, 2)
        for P in (2, 3, 4):
            for M in (P, 2 * P):
                for V in virtuals:
                    sched = cs.build(name, ranks=P, microbatches=M, virtual=V)
                    for form, source in (("compute", sched), ("lowered", cs.lower(sched))):
                        rng = random.Random(f"{name} {P} {M} {V} {form}")
                        for label, make in damaged(source, rng):
                            outcomes = []
                            for step in (verify, cs.simulate, cs.lower):
                                try:
                                    step(make())
                                    outcomes.append("ok")
                                except ScheduleError as error:
                                    outcomes.append(f"{type(error).__name__}: {error}")
                            shown = " || ".join(outcomes).replace("\n", " | ")
                            print(f"{name} P={P} M={M} V={V} {form} {label} => {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
