"""A schedule straight from lower() simulates exactly like its compute-only source."""

from __future__ import annotations

import pytest

import conveyor.schedule as cs
from conveyor.schedule.lower import lower
from conveyor.schedule.simulate import step_timed as run


def _by_action(timeline):
    return {(s.rank, s.action): (s.start, s.end) for s in timeline.spans}


@pytest.mark.parametrize(("name", "virtual"), [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 2),
                                                ("zbv", 2), ("dualpipev", 2), ("looped-bfs", 3)])
@pytest.mark.parametrize("latency", [0.0, 0.7])
def test_lowered_schedule_times_like_its_source(name, virtual, latency):
    source = cs.build(name, ranks=4, microbatches=9, virtual=virtual)
    costs = cs.CostModel.per_stage(
        [(1.0 + s % 3, 2.0, 0.5 + (s % 2)) for s in range(source.num_stages)], latency=latency
    )
    lowered = lower(source)
    fast = cs.simulate(lowered, costs)
    # The same lowered programs stepped action by action, SEND/RECV included.
    explicit = run(lowered.with_programs(lowered.programs), costs.duration, costs.latency)
    assert _by_action(fast) == {(s.rank, s.action): (s.start, s.end) for s in explicit.spans}
    assert _by_action(fast) == _by_action(cs.simulate(source, costs))
