"""Which modules of a stage are a mixture of experts' experts, by their structure or by a plan.

"auto" finds transformers 5's experts modules (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-OSS,
DeepSeek-V3): every expert's weights stacked into 3-D parameters sharing dim 0 (``gate_up_proj``
``[experts, 2 x intermediate, hidden]``, ``down_proj`` ``[experts, hidden, intermediate]``, their
biases ``[experts, ...]`` where the model has them) and a forward taking ``(hidden_states,
top_k_index, top_k_weights)``: the router stays outside, in the block, so routing is the
model's own and only the experts move. Where the module's config carries ``base_model_ep_plan``
(each transformers MoE config does), only the modules it names as ``ep_dispatch_experts`` are taken.

An explicit plan maps module-name patterns (``fnmatch``, matched against the whole name or any
tail of it: ``layers.*.mlp.experts`` matches ``model.layers.3.mlp.experts``) to the dispatcher,
``"ep_dispatch_experts"`` (the only one: all-to-all, :mod:`conveyor.parallel.experts.dispatch`).

A ``nn.ModuleList`` of expert MLPs behind a router (hand-built and older models) is found too,
and refused with the way out: its routing loop lives in the block's own forward, which indexes
every expert, so the tokens cannot be moved without rewriting it (stack the experts' weights
into a transformers-style experts module).

Example:
    >>> import torch
    >>> find_experts(torch.nn.Linear(2, 2), "auto")
    {}
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn

from conveyor.errors import PipelineConfigError
from conveyor.expert_option import is_stacked_experts


def find_experts(module: nn.Module, plan: Any) -> dict[str, nn.Module]:
    """``module``'s experts modules by name ({} if none): ``plan`` "auto" (by structure) or a dict
    {module-name pattern: "ep_dispatch_experts"}.

    Example:
        >>> find_experts(nn.Sequential(), {"layers.*.experts": "ep_dispatch_experts"})
        {}
    """
    found: dict[str, nn.Module] = {}
    for name, child in module.named_modules():
        if is_stacked_experts(child) and _planned(name, child, plan):
            found[name] = child
        elif plan == "auto" and _expert_list(child):
            raise PipelineConfigError(
                f"module {name!r} keeps its experts as an nn.ModuleList of {len(child.experts)} MLPs behind a router "
                f"({type(child).__name__}); expert parallelism moves tokens to experts stacked into 3-D "
                "parameters (transformers 5's experts modules: forward(hidden_states, top_k_index, top_k_weights)). "
                "Stack the experts' weights into such a module, or drop expert_parallel")
    return found


def num_experts_of(experts: nn.Module) -> int:
    """How many experts ``experts`` holds: the common dim 0 of its 3-D parameters."""
    return next(p.shape[0] for p in experts.parameters(recurse=False))


def _planned(name: str, module: nn.Module, plan: Any) -> bool:
    if plan == "auto":
        config_plan = getattr(getattr(module, "config", None), "base_model_ep_plan", None)
        if not config_plan:
            return True
        patterns = [p for p, how in config_plan.items() if how == "ep_dispatch_experts"]
        return not patterns or any(matches(name, p) for p in patterns)
    return any(matches(name, p) for p in plan)


def matches(name: str, pattern: str) -> bool:
    """Whether module ``name`` is ``pattern`` or ends with it (a pattern relative to the base model).

    Example:
        >>> matches("model.layers.3.mlp.experts", "layers.*.mlp.experts")
        True
    """
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def _expert_list(module: nn.Module) -> bool:
    """A block holding ``experts``, an nn.ModuleList of alike modules, and a router beside it."""
    experts = getattr(module, "experts", None)
    return (isinstance(experts, nn.ModuleList) and len(experts) >= 2 and len({type(e) for e in experts}) == 1
            and any(name in dict(module.named_children()) for name in ("gate", "router")))
