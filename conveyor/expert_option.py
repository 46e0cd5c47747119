"""The expert-parallel option of :class:`conveyor.layout.DistributedLayout`: its checks, before any rank communicates.

``expert_parallel`` ("auto" or {module-name pattern: "ep_dispatch_experts"}) shards a mixture of
experts' experts over ``ep`` of the mesh's "dp" replicas (:mod:`conveyor.parallel.experts`). What
needs only the record is checked here, alike on every rank; what needs the model (experts found,
``ep`` dividing their count) is checked when the stages are placed.

Example:
    >>> from conveyor.layout import DistributedLayout
    >>> try:
    ...     DistributedLayout(ep=2)
    ... except PipelineConfigError as error:
    ...     print(error)
    ep=2 shapes expert parallelism: give expert_parallel='auto' (or a plan) too, or drop ep
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

from conveyor.errors import PipelineConfigError, positive_int

DISPATCHERS = ("ep_dispatch_experts",)  # transformers' name for the all-to-all dispatch of base_model_ep_plan
# The experts module's forward arguments after self (GPT-OSS names them router_indices, routing_weights).
ROUTED_ARGUMENTS = (("hidden_states", "top_k_index", "top_k_weights"),
                    ("hidden_states", "router_indices", "routing_weights"))


def is_stacked_experts(module: Any) -> bool:
    """transformers 5's experts shape: 3-D parameters sharing dim 0, ``forward(hidden, index, weights)``.

    Both the trace (which keeps such a module whole, :mod:`conveyor.frontend.leaves`) and expert
    parallelism (which shards it) find experts by this one test.

    Example:
        >>> import torch
        >>> is_stacked_experts(torch.nn.Linear(2, 2))
        False
    """
    params = list(module.parameters(recurse=False))
    weights = [p for p in params if p.dim() == 3]
    if not weights or any(p.dim() < 2 or p.shape[0] != weights[0].shape[0] for p in params):
        return False
    try:
        arguments = tuple(inspect.signature(type(module).forward).parameters)[1:4]
    except (TypeError, ValueError):
        return False
    return arguments in ROUTED_ARGUMENTS


def check_expert_parallel(layout: Any) -> None:
    """Refuse ``layout``'s expert-parallel option where it cannot work, saying how to fix it.

    It needs replicas or TP ranks (``dp``, ``tp``, or a mesh's "dp" and "tp" dims) whose product ``ep`` divides
    (None: ep = dp).
    """
    plan, ep, capacity, overlap = layout.expert_parallel, layout.ep, layout.expert_capacity, layout.expert_overlap
    if not isinstance(overlap, bool):
        raise PipelineConfigError(f"expert_overlap takes True or False; got {overlap!r}")
    if plan is None:
        if ep is not None or capacity is not None or overlap:
            name, value = (("ep", ep) if ep is not None else ("expert_capacity", capacity) if capacity is not None
                           else ("expert_overlap", overlap))
            raise PipelineConfigError(f"{name}={value} shapes expert parallelism: give expert_parallel='auto' (or a "
                                      f"plan) too, or drop {name}")
        return
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int | float)
                                 or not math.isfinite(capacity) or capacity <= 0):
        raise PipelineConfigError(f"expert_capacity={capacity!r}: expected a capacity factor > 0 (1.0: each expert "
                                  "takes its even share of a rank's routed slots; 1.25 is common), or None to drop "
                                  "no token")
    check_plan(plan)
    if ep is not None and not positive_int(ep):
        raise PipelineConfigError(f"ep takes a positive int (ranks per expert-parallel group); got {ep!r}")
    dims = tuple(getattr(layout.mesh, "mesh_dim_names", None) or ())
    if layout.dp * layout.tp == 1 and not {"dp", "tp"} & set(dims):
        raise PipelineConfigError(
            f"expert_parallel={plan!r} borrows its ranks from the pipeline's replicas (and their TP ranks), and this "
            "layout has none: give dp= (replicas, which ep divides) or a mesh with a 'dp' dim")
    ranks = layout.dp * layout.tp
    if ranks % (ep or layout.dp):
        what = f"dp={layout.dp}" if layout.tp == 1 else f"dp x tp = {layout.dp} x {layout.tp}"
        raise PipelineConfigError(f"ep={ep} does not divide {what}: expert parallelism borrows its ranks from the "
                                  f"replicas and their TP ranks; choose ep among the divisors of {ranks}")


def check_plan(plan: Any) -> None:
    """Refuse a plan that is neither "auto" nor {module-name pattern: "ep_dispatch_experts"}.

    Example:
        >>> check_plan({"layers.*.mlp.experts": "ep_dispatch_experts"})
    """
    if isinstance(plan, str) and plan == "auto":
        return
    if not isinstance(plan, Mapping) or not plan:
        raise PipelineConfigError(f"expert_parallel takes 'auto' or a dict {{module-name pattern: "
                                  f"'ep_dispatch_experts'}} (None: off); got {plan!r}")
    for pattern, dispatcher in plan.items():
        if not isinstance(pattern, str) or dispatcher not in DISPATCHERS:
            raise PipelineConfigError(f"expert_parallel's plan maps {pattern!r} to {dispatcher!r}; it takes "
                                      f"module-name patterns to one of {DISPATCHERS}")
