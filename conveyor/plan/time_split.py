"""``split_method="time"``: cut a model where its measured forward + backward time is balanced.

:func:`time_split` profiles every unit with the planner's profiler
(:func:`~conveyor.plan.profile.profile_units`: each unit's forward and its unsplit backward),
cuts the row of unit times with the one min-max partition (:func:`conveyor.frontend.balance.partition`),
then times the stages of that cut whole (:func:`profile_stages`) and re-balances: units
profiled one by one each pay a fixed overhead that a stage of several units pays once, so
summed unit times overstate stages made of many small units. The frontend is handed the
split points (``split_model(..., split_points=...)``); ``conveyor.pipeline`` runs this on
rank 0 and broadcasts them, so every rank cuts alike.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    >>> chosen = time_split(model, 2, example_args=(torch.randn(4, 8),))
    >>> len(chosen.split_points), len(chosen.stage_seconds)
    (1, 2)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from conveyor.errors import SplitError
from conveyor.frontend import split_model
from conveyor.frontend.balance import partition
from conveyor.frontend.stage import as_received
from conveyor.plan.balance import bounds_of
from conveyor.plan.profile import (
    profile_units,
    restore_module_state,
    save_module_state,
    timed,
)
from conveyor.runtime.stage.runner import grad_leaves

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TimedSplit:
    """Where :func:`time_split` cuts (the modules that start stages 1..) and each stage's measured seconds."""

    split_points: tuple[str, ...]
    stage_seconds: tuple[float, ...]


def time_split(model: torch.nn.Module, num_stages: int, *, example_args: Sequence[Any] = (),
               example_kwargs: Mapping[str, Any] | None = None, unsplittable: Sequence[str] = (),
               device: torch.device | str | None = None, repeats: int = 5, rounds: int = 2) -> TimedSplit:
    """The cut of ``model`` into ``num_stages`` stages whose slowest measured stage is fastest.

    ``example_args`` / ``example_kwargs`` are ONE real microbatch; the units and the stages run on
    ``device`` (default: the model's), ``repeats`` timed rounds each (the best kept), and the cut is
    re-balanced with the stages' measured times ``rounds`` times (the best cut measured wins).
    """
    leaves = pytree.tree_leaves((tuple(example_args), dict(example_kwargs or {})))
    if any(isinstance(leaf, torch.Tensor) and leaf.device.type == "meta" for leaf in leaves):
        raise SplitError("split_method='time' runs the model, so example inputs must hold real values (got meta "
                         "tensors); pass real example tensors")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise SplitError("split_method='time' runs the model, but its parameters are on the meta device; build it "
                         "on a real device, or balance by split_method='parameters' (or plan it: conveyor.plan.plan "
                         "costs a meta-device model from its shapes)")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if num_stages == 1:
        return TimedSplit((), (float("nan"),))
    table = profile_units(model, example_args, example_kwargs, device=device, repeats=repeats,
                          unsplittable=unsplittable)
    names = table.names
    weights = [unit.forward + unit.merged_backward for unit in table.units]
    if num_stages > len(weights):
        raise SplitError(f"cannot split {type(model).__name__} into {num_stages} stages with split_method='time': it "
                         f"has {len(weights)} splittable unit(s); use fewer stages, or pass split_points naming finer "
                         "modules")
    logger.info("measured unit costs (s): %s", dict(zip(names, weights)))

    def measure(cuts: list[int]) -> list[float]:
        split = split_model(model, num_stages, example_args=tuple(example_args), example_kwargs=example_kwargs,
                            split_points=[names[j] for j in cuts], unsplittable=unsplittable, device=device)
        return profile_stages(split, example_args, example_kwargs, device, repeats=repeats)

    allowed = [True] * len(weights)
    cuts = partition(weights, num_stages, allowed)
    measured = measure(cuts)
    best, best_measured = cuts, measured
    scaled = list(weights)
    for _ in range(rounds):
        for stage, (a, b) in enumerate(bounds_of(cuts, len(weights))):
            predicted = sum(scaled[a:b])
            if predicted > 0:
                scaled[a:b] = [w * measured[stage] / predicted for w in scaled[a:b]]
        candidate = partition(scaled, num_stages, allowed)
        if candidate == cuts:
            break
        cuts, measured = candidate, measure(candidate)
        logger.info("time balance: slowest stage %.4g s with %s", max(measured), [names[j] for j in cuts])
        if max(measured) < max(best_measured):
            best, best_measured = cuts, measured
    return TimedSplit(tuple(names[j] for j in best), tuple(best_measured))


def profile_stages(split: Any, example_args: Sequence[Any], example_kwargs: Mapping[str, Any] | None,
                   device: torch.device, repeats: int = 3) -> list[float]:
    """Seconds of forward + backward of each stage of ``split`` (a ``conveyor.frontend.ModelSplit``) on ``device``.

    Stages run one after another on the example microbatch, each timed on its own: forward, then
    backward with ones as the gradients of its outputs (made inside the timed span, as a real
    output gradient would arrive). Each of ``repeats`` rounds runs every stage once (after one
    warm-up pass), and a stage keeps its best time over the rounds: a burst of load from other
    processes then spoils one round of a stage, not all its measurements. The model is left as it
    was: gradients, buffers (BatchNorm statistics) and the random generator state are restored.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        >>> x = torch.randn(4, 8)
        >>> len(profile_stages(split_model(model, 2, example_args=(x,)), (x,), None, torch.device("cpu")))
        2
    """
    args, kwargs = pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(device), (tuple(example_args), dict(example_kwargs or {})))
    modules = [split.stage_module(stage, device) for stage in range(split.num_stages)]
    best = [float("inf")] * split.num_stages
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for round_index in range(repeats):
            inputs: tuple[Any, ...] = ()
            for stage, module in enumerate(modules):
                saved = save_module_state(module)
                for _ in range(2 if round_index == 0 else 1):  # the first round warms up first: its last run counts
                    seconds, outputs = _time_once(module, stage, args, kwargs, inputs, device)
                    restore_module_state(module, saved)
                best[stage] = min(best[stage], seconds)
                if stage < split.num_stages - 1:
                    specs = split.stage_output_specs(stage)
                    inputs = tuple(value.detach().requires_grad_(spec.requires_grad)
                                   if isinstance(value, torch.Tensor) else value
                                   for value, spec in zip(outputs, specs))
    return best


def _time_once(module, stage, args, kwargs, inputs, device) -> tuple[float, Any]:
    """Forward, then backward with ones as output gradients; seconds of both."""
    received = tuple(as_received(value) for value in inputs)

    def run():
        outputs = module(*args, **kwargs) if stage == 0 else module(*received)
        tensors = grad_leaves(outputs)
        if tensors:
            torch.autograd.backward(tensors, [torch.ones_like(tensor) for tensor in tensors])
        return outputs

    return timed(run, device)
