"""Whole weights by the unsplit model's names, straight from the stages: an inference engine's weight update.

An RL loop trains with the pipeline and generates with another engine (vLLM, SGLang, a second
process); after each update that engine needs the new weights, ideally without a checkpoint on
disk. :func:`named_weights` yields this process's stages' tensors under the names the unsplit
model's ``state_dict()`` gives them (traced stages keep the original names; a hand-built stage's
are ``stages.<s>.<name>``, as a ``ModuleList`` called ``stages`` would name them, the
checkpoints' convention), each whole: tensor-parallel shards and FSDP shards gathered. A tied
tensor comes under each of its names, on each stage that uses it, as the unsplit
``state_dict()`` lists it.

A sharded tensor is gathered one mesh dim at a time, the outermost first (FSDP's "dp", then
"tp"): torch 2.13's one-step ``full_tensor()`` misplaces elements of a packed projection sharded
on both dims (see :mod:`conveyor.checkpoint.shards`). A gather is a collective over the tensor's
mesh: every rank of a stage's TP and FSDP groups must iterate to the end, in the same order.

Example:
    >>> import torch, conveyor
    >>> pipe = conveyor.Pipeline([torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)], "1f1b", microbatches=2,
    ...                          layout=conveyor.InProcessLayout())
    >>> [(name, tuple(tensor.shape)) for name, tensor in named_weights(pipe.runners)]
    [('stages.0.weight', (2, 2)), ('stages.0.bias', (2,)), ('stages.1.weight', (1, 2)), ('stages.1.bias', (1,))]
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from conveyor.frontend import StageModule
from conveyor.runtime.stage.runner import StageRunner


def replicated(tensor: torch.Tensor) -> torch.Tensor:
    """The DTensor ``tensor`` replicated on every mesh dim, gathered one dim at a time, the outermost first (a
    collective over its mesh; the checkpoints' packed shards are written so too).

    Example (every rank of ``weight``'s mesh)::

        whole = replicated(weight).to_local()
    """
    from torch.distributed.tensor import Replicate

    placements = list(tensor.placements)
    for dim in range(tensor.device_mesh.ndim):
        if not placements[dim].is_replicate():
            placements[dim] = Replicate()
            tensor = tensor.redistribute(placements=placements)
    return tensor


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached and whole: a DTensor gathered by :func:`replicated` (a collective), any other as is.

    Example:
        >>> whole_tensor(torch.nn.Parameter(torch.ones(2))).requires_grad
        False
    """
    tensor = tensor.detach()
    return replicated(tensor).to_local() if hasattr(tensor, "device_mesh") else tensor


def named_weights(runners: Mapping[int, StageRunner]) -> Iterator[tuple[str, torch.Tensor]]:
    """(the unsplit model's name, the whole tensor) of each tensor of each stage in ``runners``, by stage."""
    traced = all(isinstance(runner.module, StageModule) for runner in runners.values())
    for stage, runner in sorted(runners.items()):
        for name, tensor in runner.module.state_dict(keep_vars=True).items():
            yield (name if traced else f"stages.{stage}.{name}"), whole_tensor(tensor)
