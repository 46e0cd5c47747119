"""LocalPipeline: every rank of a schedule in one process and one thread, for debugging and fast tests.

A :class:`conveyor.Pipeline` over the in-process ranks backend: the same class, the same methods,
numerics bit for bit those of the distributed pipeline (the same executor runs every rank's
program, with an in-process mailbox for a transport).

Example:
    >>> import torch, conveyor
    >>> stages = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)]
    >>> pipe = conveyor.LocalPipeline(stages, schedule="1f1b", microbatches=2,
    ...                               loss_fn=lambda y, t: (y - t).pow(2).mean())
    >>> loss = pipe.step(torch.ones(4, 4), target=torch.zeros(4, 1))
    >>> loss.shape, type(pipe).__name__
    (torch.Size([]), 'Pipeline')
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from conveyor.options import Layout, StageOptions, WholeModel
from conveyor.pipe import Pipeline
from conveyor.runtime.stage.runner import LossFn
from conveyor.schedule.ir import Schedule


def LocalPipeline(modules: Sequence[torch.nn.Module], schedule: Schedule | str, loss_fn: LossFn | None = None, *,
                  microbatches: int | None = None, virtual: int | None = None, ranks: int | None = None,
                  device: torch.device | str | None = None, stage: StageOptions = StageOptions(),
                  model: WholeModel = WholeModel()) -> Pipeline:
    """A :class:`conveyor.Pipeline` of one module per stage, every rank in this process.

    ``ranks`` (None: the module count over the schedule's stages per rank) and ``device`` (None:
    where the modules are) fill the in-process :class:`~conveyor.options.Layout`; the rest means
    what it means to :class:`~conveyor.Pipeline`.

    Example:
        >>> pipe = LocalPipeline([torch.nn.Linear(2, 1)], "gpipe", microbatches=1)
        >>> pipe.needs_inputs and pipe.needs_target
        True
    """
    return Pipeline(modules, schedule, loss_fn, microbatches=microbatches, virtual=virtual, stage=stage,
                    model=model, layout=Layout(in_process=True, ranks=ranks, device=device))
