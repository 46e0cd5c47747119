"""Real torchrun launches of a short training script end cleanly, whatever the teardown order.

The full run (300 launches) is `python tools/launch_stress.py`; CI keeps 9, enough to cover
every rank count, transport, schedule and teardown order once, so that an abort at exit shows.
"""

from __future__ import annotations

import pytest

from tests.rigs import launches


def test_the_short_run_covers_every_value_of_every_dimension():
    cases = launches.launch_cases(9)
    assert {launch.ranks for launch in cases} == {2, 4}
    assert {launch.transport for launch in cases} == {"shared_memory", "process_group", "hybrid"}
    assert {launch.schedule for launch in cases} == {"1f1b", "zb-h1", "zbv"}
    assert {launch.teardown for launch in cases} == {"close", "with", "destroy-first", "drop-first",
                                                    "no-destroy", "exception"}
    assert {(launch.ranks, launch.transport) for launch in cases} == {
        (ranks, transport) for ranks in (2, 4) for transport in ("shared_memory", "process_group", "hybrid")}


@pytest.mark.timeout(900)
def test_nine_launches_all_exit_cleanly():
    lines: list[str] = []
    results = launches.run_cases(9, report=lines.append, timeout_s=180)
    failed = [r for r in results if not r.clean]
    assert not failed, launches.summary(results) + "\n" + "\n\n".join(f"{r.launch.describe()}:\n{r.problem}" for r in failed)
