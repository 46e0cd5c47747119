"""The FSDP step hooks keep each stage's phase on its module, and refuse a reduce outside a step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conveyor.errors import UsageError
from conveyor.parallel import fsdp


def test_a_reduce_outside_a_step_is_refused_naming_the_stage():
    runner = SimpleNamespace(module=torch.nn.Linear(2, 2), stage=3)
    with pytest.raises(UsageError, match=r"after_last_backward on stage 3 without before_step .*call before_step"):
        fsdp.after_last_backward(runner)


def test_a_second_reduce_in_one_step_is_refused():
    module = torch.nn.Linear(2, 2)
    module.__dict__[fsdp._STEP_PHASE] = fsdp._AWAITING_FINAL  # as the first after_last_backward leaves it
    with pytest.raises(UsageError, match="stage 0 without before_step .or twice in one step."):
        fsdp.after_last_backward(SimpleNamespace(module=module, stage=0))
