"""``conveyor train --dry-run`` under ``parallel.ep``: the experts each rank keeps.

Expert parallelism (:mod:`conveyor.parallel.experts`) groups ``ep`` consecutive data-parallel replicas at each
pipeline rank; the replica at place ``i`` of its group keeps experts ``i*E/ep .. (i+1)*E/ep - 1`` of every experts
module of its stages (dim 0 of the 3-D weights). The trainer's mesh is ("dp", "pp"): replica ``r``'s pipeline rank
``k`` is global rank ``r * pp + k``.

Example:
    >>> from types import SimpleNamespace
    >>> expert_places(SimpleNamespace(pp=2, dp=4, ep=2), 1)
    [(0, [0, 2], [1, 5]), (1, [1, 3], [3, 7])]
"""

from __future__ import annotations

import math
from typing import Any

from conveyor.expert_option import is_stacked_experts


def expert_size(parallel: Any) -> int:
    """The expert-parallel group's size: ``parallel.ep``, or ``parallel.dp`` for "auto"."""
    return parallel.dp if parallel.ep == "auto" else parallel.ep


def expert_places(parallel: Any, pipeline_rank: int) -> list[tuple[int, list[int], list[int]]]:
    """For each place in an expert group: (place, the replicas at it, their global ranks at ``pipeline_rank``)."""
    ep = expert_size(parallel)
    return [(place, [r for r in range(parallel.dp) if r % ep == place],
             [r * parallel.pp + pipeline_rank for r in range(parallel.dp) if r % ep == place]) for place in range(ep)]


def expert_shard_lines(cfg: Any, model: Any, split: Any, schedule: Any) -> list[str]:
    """The dry run's lines for ``parallel.ep``: per pipeline rank and place in an expert group, which experts of
    which experts modules its ranks keep, each tensor's whole and local shape, and the bytes kept."""
    p = cfg.parallel
    ep = expert_size(p)
    modules = {name: module for name, module in model.named_modules() if is_stacked_experts(module)}
    lines = [f"expert parallel: ep={ep}, groups of {ep} consecutive dp replicas at each pipeline rank; each expert's "
             f"gradient summed over the {p.dp // ep} replica(s) keeping it; the rank table counts whole experts"]
    if not modules:
        return [*lines, "  no experts modules in this model: the pipeline will refuse parallel.ep"]
    for rank in sorted({schedule.placement.rank_of(stage) for stage in range(split.num_stages)}):
        names = {n for stage in schedule.stages_of(rank) for n in split.stage_parameter_names(stage)}
        held = [name for name in modules if any(n.startswith(name + ".") for n in names)]
        tensors = [(f"{name}.{t}", tuple(param.shape)) for name in held
                   for t, param in modules[name].named_parameters(recurse=False)]
        for place, replicas, ranks in expert_places(p, rank):
            count = tensors[0][1][0] // ep if tensors else 0
            local = sum(math.prod(shape) // ep for _, shape in tensors) * 4
            lines.append(f"  pipeline rank {rank}, replicas {replicas} (global ranks {ranks}): experts "
                         f"{place * count}-{(place + 1) * count - 1} of each of {len(held)} experts modules, "
                         f"{local / 2**20:.2f} MiB of fp32 parameters")
        for name, shape in tensors:
            lines.append(f"    {name:<40} {str(shape):<18}-> {str((shape[0] // ep, *shape[1:]))}")
    return lines
