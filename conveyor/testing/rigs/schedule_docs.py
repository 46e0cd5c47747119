"""The rendered 4-rank example each built-in schedule's module docstring carries.

``tests/schedule/test_builtin.py`` keeps every docstring equal to what the builder produces;
after changing a builder, print the new block with
``.venv/bin/python -m conveyor.testing.rigs.schedule_docs NAME`` and paste it over the old one.
"""

from __future__ import annotations

import sys
from textwrap import indent

import conveyor.schedule as cs
from conveyor.schedule.builtin._program import listing

EXAMPLE_RANKS = 4
EXAMPLE_MICROBATCHES = 8


def example_block(name: str) -> str:
    """The docstring block of schedule ``name``: its 4-rank programs and their simulated figures."""
    schedule = cs.build(name, ranks=EXAMPLE_RANKS, microbatches=EXAMPLE_MICROBATCHES)
    timeline = cs.simulate(schedule)
    header = (
        f'Programs of build("{name}", ranks={EXAMPLE_RANKS}, microbatches={EXAMPLE_MICROBATCHES}), '
        f"V={schedule.virtual}, one line per rank::"
    )
    footer = (
        f"Simulated with F=I=W=1 (so B=2), no latency: makespan {timeline.makespan:g}, "
        f"idle fraction {timeline.bubble_ratio:.3f},\n"
        f"peak live activations per rank {timeline.peak_activations()}."
    )
    return f"{header}\n\n{indent(listing(schedule, width=92), '    ')}\n\n{footer}"


if __name__ == "__main__":
    for schedule_name in sys.argv[1:] or list(cs.available()):
        print(example_block(schedule_name), end="\n\n")
