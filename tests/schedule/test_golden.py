"""Every simulated figure, lowered program and verify() message of a grid of small cases stays as pinned.

The pins (data/golden.json) were taken before the schedule layer moved to integer-coded
programs; ``python -m conveyor.testing.rigs.schedule_golden`` rewrites them.
"""

import json

import pytest

from conveyor.testing.rigs import schedule_golden

PINNED = json.loads(schedule_golden.GOLDEN.read_text())


@pytest.mark.parametrize("key", sorted(PINNED["cases"]))
def test_case_matches_its_pin(key):
    name, ranks, microbatches, virtual = key.split()
    got = schedule_golden.case(name, int(ranks[2:]), int(microbatches[2:]), int(virtual[2:]))
    assert schedule_golden.pin(got) == PINNED["cases"][key]


def test_the_grid_is_the_pinned_one():
    keys = {f"{n} P={p} M={m} V={v}" for n, p, m, v in schedule_golden.grid()}
    assert keys == set(PINNED["cases"])


def test_broken_schedules_get_the_pinned_messages():
    assert schedule_golden.broken() == PINNED["broken"]
