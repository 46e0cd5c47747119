"""Gradient norms and non-finite checks over every stage of a pipeline and every replica.

The numbers clipping and the non-finite check need from this rank: each gradient's norm,
tagged with its place in the unsplit model's parameter order (see :mod:`conveyor.runtime.clip`
for why the place matters to the bits), and which stages' gradients or which microbatch's
loss stopped being finite. With data parallelism a gradient may be a DTensor: a replicated
one counts whole, a sharded one by its shard's norm combined over the replicas.

Example (what :meth:`conveyor.Pipeline.clip_grad_norm_` does)::

    mine = encoded_norms(runners, tied_copies, parameter_order, 2.0, None, replicas)
    total = total_norm(everyone_s(mine), 2.0, device)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from conveyor.errors import PipelineConfigError
from conveyor.runtime.clip import EncodedNorms, encode_norms, parameter_norms
from conveyor.runtime.main_grad import gradient
from conveyor.runtime.runner import StageRunner


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a gradient: itself, or a data-parallel DTensor's local tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def encoded_norms(runners: Mapping[int, StageRunner], tied_copies: set[int], parameter_order: Mapping[str, int] | None,
                  norm_type: float, foreach: bool | None, replicas=None) -> EncodedNorms:
    """This rank's gradient norms, each with its place in the unsplit model's order.

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
    return encode_norms(places, grads, norms)


def nonfinite_flags(runners: Mapping[int, StageRunner], num_stages: int, num_microbatches: int) -> torch.Tensor:
    """Per stage, 1 where one of its gradients here is not finite; last, 1 + the first microbatch
    whose loss is not (0: none). Combine every rank's with an all-reduce MAX."""
    flags = torch.zeros(num_stages + 1, dtype=torch.float64)
    for stage, runner in runners.items():
        grads = [local_part(g) for g in map(gradient, runner.module.parameters()) if g is not None]
        if grads and not bool(torch.stack([g.detach().float().norm() for g in grads]).isfinite().all()):
            flags[stage] = 1
    last = runners.get(num_stages - 1)
    if last is not None:
        bad = [m for m in range(num_microbatches) if not bool(last.losses[m].isfinite().all())]
        flags[num_stages] = bad[0] + 1 if bad else 0
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
    num_stages = len(flags) - 1
    stages = [s for s in range(num_stages) if flags[s]]
    microbatch = int(flags[num_stages]) - 1
    parts = []
    if microbatch >= 0:
        parts.append(f"the loss of microbatch {microbatch} (stage {num_stages - 1}, the first such microbatch)")
    if stages:
        parts.append(f"the gradients of stage(s) {stages}")
    return " and ".join(parts) + " are not finite" if parts else ""
