"""Real torchrun launches of a short training script end cleanly, whatever the teardown order.

The full run (300 launches) is `python tools/launch_stress.py`; CI keeps the first 6 of its plan,
which pair each teardown order with another (rank count, transport) and cycle the schedules, so
every value of every dimension, and every (rank count, transport) pair, is launched once and an
abort at exit shows. (CI ran 9 before: launches 7-9 were the stress walk's first repeats of values
already covered, about 20 s each on 2 loaded cores; the stress tool still walks them.) The six run
two at a time: a launch mostly waits on rendezvous and the launcher's polls.
"""

from __future__ import annotations

import pytest

from conveyor.testing.rigs import launches

CI_LAUNCHES = 6


def test_the_short_run_covers_every_value_of_every_dimension():
    cases = launches.launch_cases(CI_LAUNCHES)
    assert {launch.ranks for launch in cases} == {2, 4}
    assert {launch.transport for launch in cases} == {"shared_memory", "process_group", "hybrid"}
    assert {launch.schedule for launch in cases} == {"1f1b", "zb-h1", "zbv"}
    assert {launch.teardown for launch in cases} == {"close", "with", "destroy-first", "drop-first",
                                                    "no-destroy", "exception"}
    assert {(launch.ranks, launch.transport) for launch in cases} == {
        (ranks, transport) for ranks in (2, 4) for transport in ("shared_memory", "process_group", "hybrid")}


@pytest.mark.timeout(900)
def test_the_ci_launches_all_exit_cleanly():
    lines: list[str] = []
    results = launches.run_cases(CI_LAUNCHES, report=lines.append, timeout_s=180, at_once=2)
    failed = [r for r in results if not r.clean]
    problems = "\n\n".join(f"{r.launch.describe()}:\n{r.problem}" for r in failed)
    assert not failed, launches.summary(results) + "\n" + problems
