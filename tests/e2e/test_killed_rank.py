"""A rank killed mid-step (SIGKILL in its stage's forward) stops every survivor on its death, naming it.

Stopping on the death means a PeerFailure, not the CommTimeout of the ranks' 120 s receive timeout
(the rig refuses a survivor that timed out); how soon is the figure of `python tools/kill_trials.py`
(limit 30 s), not a test's.

The ranks are plain processes, not torchrun's, so nothing but the pipeline tells a survivor
that its peer is gone. The full grid (every point, death and transport, many trials) is
`python tools/kill_trials.py`; CI keeps one trial per transport.
"""

from __future__ import annotations

import pytest

from conveyor.testing.rigs import kill_trials


@pytest.mark.timeout(200)
@pytest.mark.parametrize("transport", kill_trials.TRANSPORTS)
def test_survivors_of_a_killed_rank_stop_on_its_death_naming_it(transport):
    trial = kill_trials.Trial("forward", "SIGKILL", transport)
    result = kill_trials.run_trial(trial, limit_s=float("inf"), hard_limit_s=150.0)
    assert result.passed, result.problem
