"""Gradient norms and non-finite checks over every stage of a pipeline and every replica.

The numbers clipping and the non-finite check need from this rank: each gradient's norm,
tagged with its place in the unsplit model's parameter order (see :mod:`conveyor.runtime.clip`
for why the place matters to the bits), and which stages' gradients or which microbatch's
loss stopped being finite. With data parallelism a gradient may be a DTensor: a replicated
one counts whole, a sharded one by its shard's norm combined over the replicas.

Example (what :meth:`conveyor.Pipeline.clip_grad_norm_` does)::

    places, grads, norms = local_norms(runners, tied_copies, parameter_order, 2.0, None, replicas)
    total = norm_exchange.total(places, grads, norms, 2.0, None)   # a NormExchange
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from conveyor.errors import PipelineConfigError
from conveyor.runtime.clip import parameter_norms
from conveyor.runtime.main_grad import gradient
from conveyor.runtime.runner import StageRunner


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a gradient: itself, or a data-parallel DTensor's local tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def local_norms(runners: Mapping[int, StageRunner], tied_copies: set[int], parameter_order: Mapping[str, int] | None,
                norm_type: float, foreach: bool | None, replicas=None,
                ) -> tuple[list[tuple[int, ...]], list[torch.Tensor], list[torch.Tensor]]:
    """This rank's gradients' places in the unsplit model's order, the gradients, and their norms
    (device tensors: nothing read on the host).

    ``tied_copies``: ids of copies the unsplit model counts elsewhere (skipped);
    ``parameter_order``: name -> index in the unsplit model (else stage by stage after it);
    ``replicas``: a :class:`~conveyor.parallel.replicas.Replicas` whose sharded gradients'
    norms are combined over the replicas (a collective over them), or None.
    """
    places, grads = [], []
    seen: set[int] = set(tied_copies)
    for stage in sorted(runners):
        for position, (name, param) in enumerate(runners[stage].module.named_parameters()):
            grad = gradient(param)  # main_grad where the gradient accumulates there
            if id(param) not in seen and grad is not None:
                known = parameter_order is not None and name in parameter_order
                places.append((parameter_order[name],) if known else (len(parameter_order or ()), stage, position))
                grads.append(local_part(grad))
            seen.add(id(param))
    norms = parameter_norms(grads, norm_type, foreach)
    if replicas is not None:
        norms = replicas.whole_norms(norms, norm_type)  # a sharded gradient's norm from its shards
    return places, grads, norms


def nonfinite_flags(runners: Mapping[int, StageRunner], num_stages: int, num_microbatches: int,
                    device: torch.device | None = None) -> torch.Tensor:
    """Per stage, 1 where one of its gradients here is not finite; last, 1 + the first microbatch
    whose loss is not (0: none). Combine every rank's with an all-reduce MAX.

    A float64 tensor on ``device`` (the stage device; default the CPU), computed there without a
    host read: only :func:`describe_nonfinite` reads it, once.
    """
    flags = torch.zeros(num_stages + 1, dtype=torch.float64, device=device)
    for stage, runner in runners.items():
        grads = [local_part(g) for g in map(gradient, runner.module.parameters()) if g is not None]
        if grads:
            norms = torch.stack([g.detach().float().norm() for g in grads])
            flags[stage] = (~norms.isfinite().all()).to(flags.device, torch.float64)
    last = runners.get(num_stages - 1)
    if last is not None:
        bad = ~torch.stack([last.losses[m].isfinite().all() for m in range(num_microbatches)])
        numbers = torch.arange(1, num_microbatches + 1, device=bad.device)
        first = torch.where(bad, numbers, 0).masked_fill(~bad, num_microbatches + 1).min()
        flags[num_stages] = torch.where(first <= num_microbatches, first, 0).to(flags.device, torch.float64)
    return flags


def check_nonfinite_mode(on_nonfinite: str | None) -> None:
    """Refuse an ``on_nonfinite`` other than None, ``"raise"`` or ``"skip"``.

    Example:
        >>> check_nonfinite_mode("skip")
    """
    if on_nonfinite not in (None, "raise", "skip"):
        raise PipelineConfigError(f"on_nonfinite must be None, 'raise' or 'skip'; got {on_nonfinite!r}")


def describe_nonfinite(flags: torch.Tensor) -> str:
    """Empty, or the step's non-finite loss and gradients in words, from every rank's combined flags.

    Example:
        >>> describe_nonfinite(torch.tensor([0.0, 1.0, 3.0]))
        'the loss of microbatch 2 (stage 1, the first such microbatch) and the gradients of stage(s) [1] are not finite'
    """
    values = flags.tolist()  # the check's one host read (on a GPU, its one synchronisation)
    num_stages = len(values) - 1
    stages = [s for s in range(num_stages) if values[s]]
    microbatch = int(values[num_stages]) - 1
    parts = []
    if microbatch >= 0:
        parts.append(f"the loss of microbatch {microbatch} (stage {num_stages - 1}, the first such microbatch)")
    if stages:
        parts.append(f"the gradients of stage(s) {stages}")
    return " and ".join(parts) + " are not finite" if parts else ""
