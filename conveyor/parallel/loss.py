"""The step's loss on every rank: summed on the last stage, sent to the pipeline's other ranks.

Example (what :class:`conveyor.Pipeline` does after a step)::

    loss = broadcast_loss(runners.get(last_stage), src=global_rank_of_the_last_stage, group=group, num_ranks=P)
"""

from __future__ import annotations

import torch

from conveyor.runtime.runner import StageRunner

_FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def summed_loss(last: StageRunner) -> torch.Tensor:
    """Sum of the microbatch losses (each already divided by M), in microbatch order."""
    losses = [last.losses[m] for m in range(last.num_microbatches)]
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss
    return total


def broadcast_loss(last: StageRunner | None, src: int, group, num_ranks: int) -> torch.Tensor:
    """The minibatch loss, on every rank of ``group``: the last stage's runner sums it (``last``
    there, None elsewhere) and ``src`` (its global rank) sends value and dtype in one message."""
    import torch.distributed as dist

    packet = torch.zeros(2, dtype=torch.float64)
    if last is not None:
        total = summed_loss(last)
        packet[0] = total.double()
        packet[1] = _FLOAT_DTYPES.index(total.dtype) if total.dtype in _FLOAT_DTYPES else 0
    if num_ranks > 1:
        dist.broadcast(packet, src=src, group=group)
    if last is not None:
        return total
    return packet[0].to(_FLOAT_DTYPES[int(packet[1])])
