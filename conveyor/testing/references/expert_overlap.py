"""Rank functions of the overlap tests: pp=2 x dp=2 on 4 gloo ranks, ep=2, the traced Mixtral.

For each schedule, two pipelines train STEPS AdamW steps from the same weights on the same rows: the plain
one, and one with ``expert_overlap=True``, whose ranks run each forward together with the backward next to
it in their programs, the two passes taking turns at their all-to-alls. The promise is ``torch.equal``:
losses, the first step's gradients and the parameters after the last step, on every rank.
"""

from __future__ import annotations

import torch

import conveyor.schedule as cs
from conveyor.layout import DistributedLayout
from conveyor.schedule.overlap import pairs_of
from conveyor.testing.models.moe import tiny_moe
from conveyor.testing.references.experts import DP, EP, MICROBATCHES, traced_pipeline, train_pipeline


def overlapped_against_plain(rank: int, world_size: int, names: tuple[str, ...], device: str = "cpu") -> dict:
    """Per schedule: whether the overlapped pipeline equals the plain one (losses, gradients, parameters),
    how many pairs this rank ran, and each side's losses; the model and the rows on ``device`` (the GPU
    check's overlap row: 4 gloo ranks sharing one GPU)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh(torch.device(device).type, (2, DP), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    results = {}
    for name in names:
        schedule = cs.build(name, ranks=2, microbatches=MICROBATCHES, virtual=cs.available()[name].default_virtual)
        runs = {}
        for overlap in (False, True):
            layout = DistributedLayout(mesh=mesh, expert_parallel="auto", ep=EP, expert_overlap=overlap,
                                       device=device)
            pipe = traced_pipeline(tiny_moe("mixtral", schedule.num_stages).to(device), schedule, layout, dp_rank,
                                   device=device)
            runs[overlap] = train_pipeline(pipe, pp_rank, dp_rank, device=device)
            if overlap:
                pairs = len(pairs_of(pipe.schedule, pp_rank))
            pipe.close()
        (plain_losses, plain_grads, plain_params), (losses, grads, params) = runs[False], runs[True]
        results[name] = {
            "losses": [float(loss) for loss in losses], "plain losses": [float(loss) for loss in plain_losses],
            "losses equal": all(torch.equal(a, b) for a, b in zip(losses, plain_losses)),
            "grads equal": grads.keys() == plain_grads.keys() and all(
                torch.equal(grads[n], plain_grads[n]) for n in grads),
            "params equal": params.keys() == plain_params.keys() and all(
                torch.equal(params[n], plain_params[n]) for n in params),
            "grads": len(grads), "pairs": pairs,
            "unequal": sorted(n for n in grads if not torch.equal(grads[n], plain_grads.get(n, grads[n] + 1))),
        }
    return results
