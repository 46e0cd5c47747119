"""conveyor: pipeline-parallel training for PyTorch.

The top level is lazy so that ``import conveyor.schedule`` never imports torch.

Example:
    >>> import conveyor
    >>> sched = conveyor.schedule.build("1f1b", ranks=4, microbatches=8)
    >>> sched.stages_of(0)
    [0]
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = MappingProxyType({
    "Pipeline": "conveyor.pipe",
    "pipeline": "conveyor.build",
    "MasterWeights": "conveyor.runtime.stage.main_grad",
    "LossScaling": "conveyor.runtime.stage.loss_scale",
    "Microbatches": "conveyor.microbatch",
    "Plan": "conveyor.plan.result",
    "StageOptions": "conveyor.options",
    "RecomputePolicy": "conveyor.options",
    "TransferOptions": "conveyor.options",
    "InProcessLayout": "conveyor.layout",
    "DistributedLayout": "conveyor.layout",
    "WholeModel": "conveyor.options",
    "SplitOptions": "conveyor.options",
    "PipelineOptions": "conveyor.options",
})

if TYPE_CHECKING:
    from conveyor.build import pipeline  # noqa: F401
    from conveyor.layout import DistributedLayout, InProcessLayout  # noqa: F401
    from conveyor.microbatch import Microbatches  # noqa: F401
    from conveyor.options import (  # noqa: F401
        PipelineOptions,
        RecomputePolicy,
        SplitOptions,
        StageOptions,
        TransferOptions,
        WholeModel,
    )
    from conveyor.pipe import Pipeline  # noqa: F401
    from conveyor.plan.result import Plan  # noqa: F401
    from conveyor.runtime.stage.loss_scale import LossScaling  # noqa: F401
    from conveyor.runtime.stage.main_grad import MasterWeights  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in {"schedule", "errors", "runtime", "frontend", "testing", "checkpoint", "parallel", "plan", "options"}:
        return importlib.import_module(f"conveyor.{name}")
    raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
