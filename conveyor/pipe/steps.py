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
from conveyor.microbatch import check_given_microbatches, merge_outputs, split_microbatches, split_value
from conveyor.parallel.loss import set_loss_divisor
from conveyor.runtime.stage.device import to_device
from conveyor.runtime.stage.rng import step_random_streams

log = logging.getLogger("conveyor.pipe")


def train_step(pipe: Any, args: tuple, kwargs: dict, target: Any, return_outputs: bool,
               on_nonfinite: str | None, normalize_by: Any,
               given: tuple[Any, Any, bool] = (None, None, False)) -> tuple[Any, str]:
    """One training step of ``pipe`` (a :class:`~conveyor.pipe.Pipeline`): ``(loss or (loss, outputs),
    the non-finite report)``; the report is empty unless ``on_nonfinite`` asked for the check.
    ``given``: ``(microbatches, targets, whether the caller split them)`` (each list may be None
    where this rank does not read it)."""
    microbatches, given_targets, presplit = given
    if presplit:
        first, targets = _given_inputs_for_step(pipe, args, kwargs, target, microbatches, given_targets)
    else:
        first, targets = _inputs_for_step(pipe, args, kwargs, target)
    pipe._given_microbatches = presplit
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


def presplit(kwargs: dict) -> tuple[Any, Any, bool]:
    """Take ``microbatches=`` and ``targets=`` out of :meth:`Pipeline.step`'s keywords: ``(microbatches,
    targets, whether the caller split the minibatch itself)``.

    ``microbatches=[mb_0, ..., mb_{M-1}]`` (None where stage 0 does not run): each a dict of keyword
    inputs or a tuple of positional ones, each with its own shapes (sequence length, batch size);
    ``targets=[t_0, ...]`` likewise (optional, as ``target=``). ``targets`` given as a tensor without
    ``microbatches`` stays a model input of that name. Outputs come back as a list, one per microbatch.

    Example:
        >>> keywords = {"microbatches": [(1,), (2,)], "mask": None}
        >>> presplit(keywords), keywords
        (([(1,), (2,)], None, True), {'mask': None})
        >>> loss = pipe.step(microbatches=[{"ids": a}, {"ids": b}], targets=[ta, tb])   # doctest: +SKIP
    """
    given = "microbatches" in kwargs or isinstance(kwargs.get("targets"), list | tuple)
    return kwargs.pop("microbatches", None), kwargs.pop("targets", None) if given else None, given


def forward_only(pipe: Any, args: tuple, kwargs: dict) -> Any:
    """Forward of every microbatch without autograd state: the merged outputs where the last stage
    runs, None elsewhere."""
    first = _split_inputs(pipe, args, kwargs) if pipe.needs_inputs else None
    pipe._given_microbatches = False  # a minibatch cut here: its outputs come back merged
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
    outputs = [last.outputs[m] for m in range(pipe.schedule.num_microbatches)]
    if not getattr(pipe, "_given_microbatches", False):  # microbatches given one by one come back so
        outputs = merge_outputs(outputs)
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


def _given_inputs_for_step(pipe: Any, args: tuple, kwargs: dict, target: Any, microbatches: Any,
                           given_targets: Any):
    """``microbatches=`` / ``targets=``: the caller's own microbatches, each with its own shapes."""
    if args or kwargs or target is not None:
        raise PipelineConfigError(
            "pipe.step(microbatches=..., targets=...) takes the microbatches already split: pass no "
            f"positional inputs, keyword inputs or target= beside them (got {len(args)} positional, "
            f"keywords {sorted(kwargs)}, target {'given' if target is not None else 'None'})"
        )
    num = pipe.schedule.num_microbatches
    first = None
    if pipe.needs_inputs:
        if microbatches is None:
            raise PipelineConfigError(
                f"rank {pipe.ranks.rank} runs stage 0 and was given targets= but no microbatches=: pass the "
                f"{num} microbatches there"
            )
        first = check_given_microbatches(microbatches, num)
        if pipe.device.type != "cpu":
            first = to_device(first, pipe.device)
    targets = None
    if pipe.needs_target:
        targets = [None] * num if given_targets is None else list(given_targets)
        if len(targets) != num:
            raise PipelineConfigError(
                f"targets= holds {len(targets)} targets, but the schedule runs {num} microbatches: pass one "
                "target per microbatch (or None)"
            )
        if pipe.device.type != "cpu":
            targets = to_device(targets, pipe.device)
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
