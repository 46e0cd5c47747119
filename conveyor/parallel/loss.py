"""The step's loss: how each microbatch's loss is scaled, and the sum sent to every rank.

Two normalizations, chosen per step by ``normalize_by`` (see :meth:`conveyor.Pipeline.step`):

- ``None`` (default): ``loss_fn`` returns each microbatch's MEAN, the last stage divides it by
  M (the microbatch count), so the step's loss and gradients are the mean over microbatches:
  ``(loss_fn(model(x_i), y_i) / M).backward()`` for each i, bit for bit.
- ``N`` (a number): ``loss_fn`` returns each microbatch's SUM over its tokens (e.g.
  ``cross_entropy(..., reduction="sum", ignore_index=-100)``), and the last stage divides it by
  N, the target-token count of the whole GLOBAL minibatch (every microbatch of every replica,
  ignored labels excluded; :func:`count_tokens` counts it): the per-token mean of Megatron,
  ``(loss_fn_sum(model(x_i), y_i) / N).backward()`` for each i. Dividing each microbatch by
  its own count instead (the mean per microbatch, then over microbatches) weighs a token of a
  short microbatch more than one of a long microbatch (what torchtitan's issue 2972 reported).

With dp replicas each replica's gradients and loss are AVERAGED over the replicas (see
:mod:`conveyor.parallel.replicas`), so each replica divides by N / dp: replica r's gradient is
``g_r = dp / N * sum over its tokens of dl``, and the mean ``(1/dp) * sum_r g_r`` is
``(1/N) * sum over every token of dl``, the one-process per-token gradient; the loss alike.
When dp is a power of two, N / dp and the halvings of the average are exact (N < 2**24 in
float32), so the pipeline equals a one-process reference that sums each replica's
``loss_sum / N`` on its own and then averages, bit for bit; against one ``.grad`` accumulated
over the whole batch it is equal to rounding.

Example (what :class:`conveyor.Pipeline` does around a step)::

    set_loss_divisor(runners, num_stages, normalize_by, dp_size)     # before it
    broadcast = LossBroadcast(src=global_rank_of_the_last_stage, num_ranks=P)   # once
    loss = broadcast(runners.get(last_stage), group)                             # after it
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from conveyor.errors import PipelineConfigError
from conveyor.runtime.stage.runner import StageRunner

_CPU = torch.device("cpu")
_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def summed_loss(last: StageRunner) -> torch.Tensor:
    """Sum of the microbatch losses (each already divided by M), in microbatch order."""
    total = functools.reduce(operator.add, [last.losses[m] for m in range(last.num_microbatches)])
    # Under tensor parallelism's loss_parallel() the loss is a replicated DTensor: its whole value
    # (each TP rank holds all of it), for the broadcast and the caller.
    return whole_value(total)


def whole_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor of tensor parallelism (loss_parallel's loss and log-probs, vocabulary-sharded logits) whole, the
    same on every TP rank; any other tensor as it is."""
    whole = getattr(tensor, "full_tensor", None)
    return whole() if whole is not None else tensor


class LossBroadcast:
    """The minibatch loss, on every rank of ``group``, with no host read after the first step.

    The last stage's runner sums it; ``src`` (that rank's global rank) broadcasts value and
    dtype over ``group`` (given per call: holding the group would keep its connections open
    after a failure closed it) as one float64 tensor on ``comm_device`` (the backend's: the stage's GPU with NCCL,
    the CPU with gloo). The other ranks read the dtype once, in the first step, and from then
    on only convert: the loss comes back on ``device`` (the stage device), as a device tensor.
    A loss whose dtype changes after the first step is an error on the last stage's rank.
    """

    def __init__(self, src: int, num_ranks: int, device: torch.device = _CPU,
                 comm_device: torch.device = _CPU) -> None:
        self.src, self.num_ranks = src, num_ranks
        self.device, self.comm_device = device, comm_device
        self.dtype: torch.dtype | None = None

    def __call__(self, last: StageRunner | None, group) -> torch.Tensor:
        """The step's loss (``last``: this rank's last-stage runner, None where it runs elsewhere)."""
        total = None
        if last is not None:
            total = summed_loss(last)
            if self.dtype is not None and total.dtype != self.dtype:
                raise PipelineConfigError(
                    f"the loss was {self.dtype} in the first step and is {total.dtype} now (rank {last.rank}); "
                    "the other ranks return it in the first step's dtype: keep loss_fn's dtype fixed, or "
                    "build a new pipeline"
                )
            self.dtype = total.dtype
            if self.num_ranks == 1:
                return total
        packet = torch.zeros(2, dtype=torch.float64, device=self.comm_device)
        if total is not None:
            packet[0].copy_(total.detach())  # a copy on the device the backend takes (gloo: to the CPU)
            # fill_, not item assignment: assigning a Python number copies it from the host, a sync on a GPU
            packet[1].fill_(_FLOAT_DTYPES.index(total.dtype) if total.dtype in _FLOAT_DTYPES else 0)
        dist.broadcast(packet, src=self.src, group=group)
        if total is not None:
            return total
        if self.dtype is None:
            self.dtype = _FLOAT_DTYPES[int(packet[1])]  # the first step's one host read
        return packet[0].to(self.device, self.dtype)


def loss_divisor(normalize_by: int | float | torch.Tensor | None, num_microbatches: int, dp_size: int = 1,
                 rank: int = 0) -> int | float:
    """What each microbatch's loss is divided by: M, or ``normalize_by / dp_size`` (a float).

    Raises :class:`PipelineConfigError`, naming ``rank`` and the value, unless ``normalize_by``
    is None or one positive finite number (a Python number or a one-element tensor).

    Example:
        >>> loss_divisor(None, 4), loss_divisor(100, 4), loss_divisor(torch.tensor(100), 4, dp_size=2)
        (4, 100.0, 50.0)
    """
    if normalize_by is None:
        return num_microbatches  # an int, as before: the mean over microbatches stays bitwise
    value = normalize_by
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()  # a count from a collective; a Python number divides alike on every device
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        shown = f"a tensor of shape {tuple(normalize_by.shape)}" if isinstance(normalize_by, torch.Tensor) \
            and normalize_by.numel() != 1 else repr(normalize_by)
        raise PipelineConfigError(
            f"normalize_by must be a positive finite number, the global minibatch's target-token count "
            f"(see conveyor.parallel.count_tokens); got {shown} on rank {rank}, which runs the last stage"
        )
    # float() first: N / dp is exact for any dp that is a power of two (and N < 2**53).
    return float(value) / dp_size


def set_loss_divisor(runners: Mapping[int, StageRunner], num_stages: int,
                     normalize_by: int | float | torch.Tensor | None, dp_size: int = 1) -> None:
    """Before a step: tell the last stage's runner, where this process runs it, what to divide by.

    ``normalize_by`` is read only there (the loss is scaled on the last stage); elsewhere it is
    ignored, so a rank without the last stage may pass None.

    Example:
        >>> runner = StageRunner(0, 1, torch.nn.Linear(2, 1), loss_fn=None, num_microbatches=2)
        >>> set_loss_divisor({0: runner}, 1, 12, dp_size=2); runner.loss_divisor
        6.0
    """
    last = runners.get(num_stages - 1)
    if last is not None:
        last.loss_divisor = loss_divisor(normalize_by, last.num_microbatches, dp_size, last.rank)


def count_tokens(pipe: Any, target: torch.Tensor | None, ignore_index: int | None = -100) -> int | None:
    """The target-token count of the global minibatch: what to pass as ``pipe.step(normalize_by=)``.

    Counts the elements of ``target`` (this replica's minibatch, as passed to ``pipe.step``)
    that are not ``ignore_index`` (None: every element), summed over the data-parallel replicas.
    Call it on every rank: on the ranks that run the last stage (``pipe.needs_target``), which
    must pass ``target``, it returns that global count (with replicas: a sum across the
    last-stage ranks of every replica, which all call it); on the other ranks, which pass
    None (a target given there is ignored), it communicates nothing and returns None, which
    ``pipe.step(normalize_by=None)`` ignores there as it ignores ``target``. Count
    padding as ``ignore_index`` in ``target`` (as ``cross_entropy`` skips it) for it to be
    excluded; a target that is not one tensor: count it yourself and pass the number.

    Example:
        >>> y = torch.tensor([[1, 2, -100], [3, -100, -100]])
        >>> pipe = conveyor.Pipeline(stages, "1f1b", sum_loss, microbatches=2,
        ...                          layout=conveyor.InProcessLayout())                   # doctest: +SKIP
        >>> count_tokens(pipe, y)                                                     # doctest: +SKIP
        3
        >>> loss = pipe.step(x, target=y, normalize_by=count_tokens(pipe, y))              # doctest: +SKIP
    """
    if pipe.schedule.num_stages - 1 not in pipe.runners:
        return None
    if not isinstance(target, torch.Tensor):
        raise PipelineConfigError(
            f"count_tokens needs this replica's targets as one tensor on the rank that runs the last stage; "
            f"got {type(target).__name__} (count them yourself and pass pipe.step(normalize_by=...))"
        )
    mine = target.numel() if ignore_index is None else (target != ignore_index).sum()
    # The count travels where the pipeline's collectives do (NCCL: the stage GPU), wherever the targets are.
    count = torch.as_tensor(mine, dtype=torch.int64, device=pipe.ranks.comm_device).reshape(1)
    if pipe.replicas is not None:
        pipe.ranks.guarded(dist.all_reduce, count, dist.ReduceOp.SUM, pipe.replicas.group)  # a failed peer is named
    return int(count.item())
