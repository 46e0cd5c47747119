"""The steps of ``split_model`` that weigh, choose and check a cut.

``split_model`` (:mod:`conveyor.frontend.split`) traces the model and builds the
``ModelSplit``; what it asks along the way lives here: how much each unit weighs under a
``split_method``, where a cut may go, and the dry run on meta tensors that checks a cut and
records what crosses each boundary. A cut by measured time is the planner's
(:mod:`conveyor.plan.time_split`): it hands ``split_model`` the split points.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from conveyor.errors import SplitError, listed
from conveyor.frontend.dynamic import symbolic_dims
from conveyor.frontend.leaves import leaves_as_shapes
from conveyor.frontend.materialize import copy_tensor, named_tensors
from conveyor.frontend.stage import ValueSpec, as_received
from conveyor.frontend.trace import TracedModel
from conveyor.frontend.units import ModuleSpans, Unit

if TYPE_CHECKING:
    from conveyor.frontend.split import ModelSplit

# split_model's messages, under the name they have always had (users filter on it).
logger = logging.getLogger("conveyor.frontend.split")

SPLIT_METHODS = ("uniform", "parameters", "type:<regex>")


def _cut_allowed(
    model: nn.Module,
    units: list[Unit],
    starts: list[int],
    weights: list[float],
    spans: ModuleSpans,
    unsplittable: list[str],
    num_stages: int,
    split_method: str,
) -> list[bool]:
    """Per unit, whether a stage may start with it; raises if too few may for ``num_stages``."""
    cut_allowed = [
        weights[j] > 0 and not any(spans.cuts_inside(starts[j], name) for name in unsplittable)
        for j in range(len(units))
    ]
    if num_stages - 1 > sum(cut_allowed[1:]):
        allowed = [units[j].name for j in range(1, len(units)) if cut_allowed[j]]
        raise SplitError(
            f"cannot split {type(model).__name__} into {num_stages} stages with split_method="
            f"{split_method!r}: only {len(allowed)} unit(s) can start a stage ({listed(allowed)}), "
            f"so at most {len(allowed) + 1} stages. Use fewer stages, or pass split_points naming finer "
            "modules (any path in model.named_modules(), e.g. inside a block)."
        )
    return cut_allowed


def _unit_weights(
    method: str,
    traced: TracedModel,
    units: list[Unit],
    starts: list[int],
    spans: ModuleSpans,
    model: nn.Module,
) -> list[float]:
    ends = [*starts[1:], len(traced.nodes)]
    if method == "uniform":
        if any(unit.blocks for unit in units):
            return [float(unit.blocks) for unit in units]
        return [1.0] * len(units)
    if method == "parameters":
        by_name = dict(named_tensors(model))
        weights = []
        for start, end in zip(starts, ends):
            seen: dict[int, int] = {}
            for node in traced.nodes[start:end]:
                for source in node.all_input_nodes:
                    state = traced.state_inputs.get(source.name)
                    if state is not None and state.kind == "parameter":
                        tensor = by_name[state.target]
                        seen[id(tensor)] = tensor.numel()
            weights.append(float(sum(seen.values())))
        return weights
    if method == "time":
        raise SplitError(
            "split_method='time' measures the model, which is the planner's work: pass the split points "
            "conveyor.plan.time_split.time_split(model, num_stages, example_args=...) chooses, or let "
            "conveyor.pipeline do it (options=PipelineOptions(split=SplitOptions(method='time')))"
        )
    if method.startswith("type:"):
        try:
            pattern = re.compile(method[len("type:") :])
        except re.error as error:
            raise SplitError(
                f"split_method {method!r}: bad regular expression ({error})"
            ) from error
        weights = [0.0] * len(units)
        for name, module in model.named_modules():
            if name and pattern.search(type(module).__name__) and spans.ran(name):
                first = spans.first[name]
                index = max(j for j, start in enumerate(starts) if start <= first)
                weights[index] += 1.0
        if not any(weights):  # no module matched
            classes = sorted(
                {type(m).__name__ for n, m in model.named_modules() if n and spans.ran(n)}
            )
            raise SplitError(
                f"split_method {method!r}: no module class matches; classes that ran: {listed(classes, 12)}"
            )
        return weights
    raise SplitError(f"split_method must be one of {', '.join(SPLIT_METHODS)}; got {method!r}")


def _dry_run(split: ModelSplit) -> None:
    """Run every stage on meta tensors: checks the cut and records the boundary specs."""
    traced = split._traced
    meta = torch.device("meta")
    as_meta = functools.cache(functools.partial(copy_tensor, device=meta))  # once per tensor (hashed by identity)
    split._recipes[0].input_specs = tuple(traced.example)
    values: Any = traced.example_inputs(meta)
    for recipe in split._recipes:
        tensors = {tensor_spec.name: (as_meta(split._source(tensor_spec)), tensor_spec.persistent)
                   for tensor_spec in split._stage_tensors[recipe.stage]}
        module = split._build_stage(recipe.stage, tensors, meta, check_inputs=False)
        leaves_as_shapes(module)
        args, kwargs = values
        try:
            outputs = module(*args, **kwargs)
        except Exception as error:
            autocast = any("autocast" in str(node.target) for node in recipe.nodes)
            advice = (
                "The model enters torch.autocast in forward, which does not apply to the meta tensors "
                "the split is checked on, so no split point helps: build the stages by hand, or move "
                "the autocast region around the call of the model."
                if autocast else "Try other split points, or build the stages by hand."
            )
            raise SplitError(
                f"stage {recipe.stage} failed on meta tensors while checking the split "
                f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). {advice}"
            ) from error
        if recipe.is_last:  # the model's outputs, flattened: which dims vary is not needed there
            recipe.output_specs = tuple(_spec(f"output_{i}", value)
                                        for i, value in enumerate(pytree.tree_leaves(outputs)))
        else:  # the traced nodes the next stage receives, under their names
            recipe.output_specs = tuple(_spec(node.name, value, symbolic_dims(node.meta.get("val")))
                                        for node, value in zip(recipe.outputs, outputs))
            values = tuple(as_received(value) for value in outputs), {}
            split._recipes[recipe.stage + 1].input_specs = recipe.output_specs


def _spec(name: str, value: Any, dynamic: tuple[int, ...] = ()) -> ValueSpec:
    if isinstance(value, torch.Tensor):
        return ValueSpec(name, tuple(value.shape), value.dtype, value.requires_grad, dynamic=dynamic)
    return ValueSpec(name, None, None, False, value)
