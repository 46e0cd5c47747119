"""``conveyor train --dry-run`` under ``parallel.ep``: the experts each rank keeps.

Expert parallelism (:mod:`conveyor.parallel.experts`) groups ``ep`` consecutive data-parallel replicas at each
pipeline rank; the replica at place ``i`` of its group keeps experts ``i*E/ep .. (i+1)*E/ep - 1`` of every experts
module of its stages (dim 0 of the 3-D weights). With ``parallel.tp`` the groups are ``ep`` consecutive (replica,
TP rank) positions, position ``r * tp + t`` at place ``(r * tp + t) % ep``. The trainer's mesh is ("pp", "dp", "tp"),
pp outermost: TP rank ``t`` of replica ``r``'s pipeline rank ``k`` is global rank ``(k * dp + r) * tp + t``.

Example:
    >>> from types import SimpleNamespace
    >>> expert_places(SimpleNamespace(pp=2, dp=4, ep=2), 1)
    [(0, [0, 2], [4, 6]), (1, [1, 3], [5, 7])]
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
    ep, tp = expert_size(parallel), getattr(parallel, "tp", 1)
    positions = range(parallel.dp * tp)  # (replica, TP rank) as r * tp + t
    return [(place, sorted({c // tp for c in positions if c % ep == place}),
             [pipeline_rank * parallel.dp * tp + c for c in positions if c % ep == place]) for place in range(ep)]


def expert_shard_lines(cfg: Any, model: Any, split: Any, schedule: Any) -> list[str]:
    """The dry run's lines for ``parallel.ep``: per pipeline rank and place in an expert group, which experts of
    which experts modules its ranks keep, each tensor's whole and local shape, and the bytes kept."""
    p = cfg.parallel
    ep = expert_size(p)
    modules = {name: module for name, module in model.named_modules() if is_stacked_experts(module)}
    units = "dp replicas" if p.tp == 1 else f"(replica, TP rank) positions (tp={p.tp}: each TP rank its rows)"
    lines = [f"expert parallel: ep={ep}, groups of {ep} consecutive {units} at each pipeline rank; each expert's "
             f"gradient summed over the {p.dp * p.tp // ep} rank(s) keeping it; the rank table counts whole experts"]
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


def expert_parallel_option(model: Any, ep: int, dp: int, seq_len: int, *, tp: int = 1) -> Any:
    """What ``ep`` does to ``model``'s experts modules, for ``conveyor plan --ep``: each module's expert parameters
    and the bytes per sample one of its all-to-alls moves (``seq_len`` tokens x top-k x the hidden size x the
    activations' element size, dispatch and combine in the forward, their gradients in the backward), or why
    that ep cannot run (no experts, ep not dividing ``dp`` x ``tp`` or an expert count). With ``tp`` TP ranks,
    each moves its ``1 / tp`` of the tokens and all-gathers the output rows (``seq_len`` x hidden x element size).

    Example:
        >>> import torch
        >>> option = expert_parallel_option(torch.nn.Linear(2, 2), 2, 2, 8)
        >>> option.ep, option.refused
        (2, 'the model has no experts modules (transformers 5 mixture-of-experts blocks)')
    """
    from conveyor.parallel.experts.discover import num_experts_of
    from conveyor.plan.expert_search import ExpertParallelOption
    from conveyor.plan.tensor_search import ModuleSplit

    modules = [(name, module) for name, module in model.named_modules() if is_stacked_experts(module)]
    if not modules:
        return ExpertParallelOption(ep, refused="the model has no experts modules (transformers 5 mixture-of-experts "
                                                "blocks)", tp=tp)
    if (dp * tp) % ep:
        where = f"--dp {dp}" if tp == 1 else f"--dp x tp = {dp} x {tp}"
        return ExpertParallelOption(ep, refused=f"ep={ep} does not divide {where} (ep borrows the replicas' ranks"
                                                f"{' and their TP ranks' if tp > 1 else ''})", tp=tp)
    counts = sorted({num_experts_of(module) for _, module in modules})
    if any(count % ep for count in counts):
        return ExpertParallelOption(ep, refused=f"ep={ep} does not divide the experts modules' expert counts "
                                                f"({', '.join(map(str, counts))})", tp=tp)
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    top_k = getattr(text, "num_experts_per_tok", None) or getattr(text, "top_k", None) or 1
    first = next(modules[0][1].parameters(recurse=False))
    hidden = getattr(text, "hidden_size", None) or first.shape[-1]
    moved = seq_len * top_k * hidden * first.element_size() / tp  # one TP rank's rows of the tokens
    return ExpertParallelOption(ep, tuple(
        ModuleSplit(name, sharded_parameters=sum(p.numel() for p in module.parameters(recurse=False)),
                    forward_bytes=moved, backward_bytes=moved, forward_collectives=2, backward_collectives=2)
        for name, module in modules), tp=tp, active=min(1.0, top_k / counts[0]),
        gather_bytes=seq_len * hidden * first.element_size() if tp > 1 else 0.0)


def dropped_slots(pipe: Any) -> int:
    """The (token, choice) slots the whole job's experts dropped over capacity in the last step: each rank's count
    (:attr:`~conveyor.parallel.experts.ExpertParallel.dropped_slots`: the slots of the tokens it dispatched, its own
    rows under tensor parallelism, at its own layers) summed over every rank. A collective: every rank calls it
    after each step, as the trainer does under ``parallel.expert_capacity``.

    Example::

        record["dropped_slots"] = dropped_slots(run.pipe)
    """
    import torch
    import torch.distributed as dist

    from conveyor.parallel.experts import ExpertParallel

    counts = [part.dropped_slots for part in pipe.ranks.parts if isinstance(part, ExpertParallel)]
    total = torch.tensor([sum(counts)], dtype=torch.long)
    if dist.is_initialized():
        dist.all_reduce(total)
    return int(total.item())
