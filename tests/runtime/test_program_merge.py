"""An I directly followed by its own W runs as one B; every other action stays where it was."""

from __future__ import annotations

import pytest

import conveyor.schedule as cs
from conveyor.runtime.executor import merge_adjacent_backward_halves
from conveyor.schedule.ir import Action, ActionKind
from conveyor.schedule.lower import lower


def _merged(*texts: str) -> list[str]:
    return [str(a) for a in merge_adjacent_backward_halves(tuple(map(Action.parse, texts)))]


def test_only_a_w_right_after_its_own_i_merges():
    assert _merged("0I0", "0W0") == ["0B0"]
    assert _merged("1I0", "1SEND_B0", "1W0") == ["1I0", "1SEND_B0", "1W0"]  # the send goes first
    assert _merged("0I0", "0W1") == ["0I0", "0W1"]  # another microbatch
    assert _merged("0I0", "1W0") == ["0I0", "1W0"]  # another stage
    assert _merged("0W0", "0I0") == ["0W0", "0I0"]
    assert _merged("0I0", "0W0", "0I1", "0W1", "0B2") == ["0B0", "0B1", "0B2"]
    assert _merged() == []


@pytest.mark.parametrize(("name", "num_ranks", "virtual"), [
    ("zb-h1", 2, 1), ("zb-h1", 4, 2), ("zb-h2", 4, 1), ("zbv", 2, 2), ("zbv", 4, 2), ("dualpipev", 4, 2),
    ("1f1b", 4, 1),
])
def test_merging_keeps_every_other_action_in_order(name, num_ranks, virtual):
    lowered = lower(cs.build(name, ranks=num_ranks, microbatches=8, virtual=virtual))
    for program in lowered.programs:
        merged = merge_adjacent_backward_halves(program)
        expanded = []
        for action in merged:
            if action.kind is ActionKind.B and action not in program:
                expanded += [Action(ActionKind.I, action.stage, action.microbatch),
                             Action(ActionKind.W, action.stage, action.microbatch)]
            else:
                expanded.append(action)
        assert tuple(expanded) == program
        # Stage 0 sends no input gradient, so its I and W always meet.
        assert not any(a.kind in (ActionKind.I, ActionKind.W) and a.stage == 0 for a in merged)
