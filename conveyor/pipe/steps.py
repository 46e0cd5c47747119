"""What one call of :meth:`Pipeline.step` or :meth:`Pipeline.forward` does, on either ranks backend.

The minibatch is cut into the schedule's microbatches exactly as a one-device loop would cut it
(:mod:`conveyor.microbatch`), moved to the stage device where it came from a CPU loader, and
handed to the ranks backend, which runs every program this process holds; the loss (on every
rank) and the last stage's merged outputs come back.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from conveyor.errors import PipelineConfigError
from conveyor.microbatch import merge_outputs, split_microbatches, split_value
from conveyor.parallel.loss import set_loss_divisor
from conveyor.runtime.device import to_device
from conveyor.runtime.rng import step_random_streams

log = logging.getLogger("conveyor.pipe")


def train_step(pipe: Any, args: tuple, kwargs: dict, target: Any, return_outputs: bool,
               on_nonfinite: str | None, normalize_by: Any) -> tuple[Any, str]:
    """One training step of ``pipe`` (a :class:`~conveyor.pipe.Pipeline`): ``(loss or (loss, outputs),
    the non-finite report)``; the report is empty unless ``on_nonfinite`` asked for the check."""
    first, targets = _inputs_for_step(pipe, args, kwargs, target)
    set_loss_divisor(pipe.runners, pipe.schedule.num_stages, normalize_by, pipe.dp_size)
    for runner in pipe.runners.values():
        runner.reset()
    pipe.ranks.start(True, pipe.stage.record_timeline)
    with torch.enable_grad(), step_random_streams(pipe.runners.values(), pipe.stage.random_streams):
        pipe.ranks.run(True, first, targets, return_outputs)
    loss = pipe.ranks.finish_step(pipe.runners)
    report = pipe._nonfinite_report() if on_nonfinite else ""
    if return_outputs:
        return (loss, last_outputs(pipe, clear=False)), report
    return loss, report


def forward_only(pipe: Any, args: tuple, kwargs: dict) -> Any:
    """Forward of every microbatch without autograd state: the merged outputs where the last stage
    runs, None elsewhere."""
    first = _split_inputs(pipe, args, kwargs) if pipe.needs_inputs else None
    for runner in pipe.runners.values():
        runner.reset()
    pipe.ranks.start(False, False)
    with torch.no_grad(), step_random_streams(pipe.runners.values(), pipe.stage.random_streams):
        pipe.ranks.run(False, first, None, False)
    pipe.ranks.finish_forward()
    return last_outputs(pipe, clear=True)


def last_outputs(pipe: Any, clear: bool) -> Any:
    """The last stage's outputs of every microbatch, merged as the model would return them for the
    whole minibatch (None where the last stage does not run)."""
    last = pipe.runners.get(pipe.schedule.num_stages - 1)
    if last is None:
        return None
    outputs = merge_outputs([last.outputs[m] for m in range(pipe.schedule.num_microbatches)])
    if clear:
        last.outputs.clear()
    return outputs


def _inputs_for_step(pipe: Any, args: tuple, kwargs: dict, target: Any):
    first = _split_inputs(pipe, args, kwargs) if pipe.needs_inputs else None
    if target is not None and not pipe.needs_target and not pipe._warned_target:
        pipe._warned_target = True
        log.warning("conveyor: rank %d was given target=, but the last stage runs on rank %d: ignored here "
                    "(pass target= there; None elsewhere)", pipe.ranks.rank,
                    pipe.schedule.placement.rank_of(pipe.schedule.num_stages - 1))
    targets = _split_target(pipe, target) if pipe.needs_target else None
    return first, targets


def _split_inputs(pipe: Any, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]]:
    if all(a is None for a in args) and not kwargs:
        raise PipelineConfigError(
            "inputs are missing on the rank that runs stage 0: pass the minibatch to pipe.step(...) there"
        )
    if pipe.device.type != "cpu":  # the minibatch may come from a CPU data loader
        args, kwargs = to_device((args, kwargs), pipe.device)
    return split_microbatches(args, kwargs, pipe.schedule.num_microbatches)


def _split_target(pipe: Any, target: Any) -> list[Any]:
    if target is None:
        return [None] * pipe.schedule.num_microbatches
    if pipe.device.type != "cpu":
        target = to_device(target, pipe.device)
    return split_value(target, pipe.schedule.num_microbatches, "target")
