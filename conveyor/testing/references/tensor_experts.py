"""Rank functions of the tensor x expert parallel tests: the traced Mixtral on a ("pp", "dp", "tp") mesh.

Tensor parallelism shards the attention and the LM head over "tp"; expert parallelism borrows its ep ranks from
dp x tp (ep=2 at dp=2 x tp=2: each stage's two TP ranks form a group), each TP rank taking its rows of the tokens
into the experts and gathering the output rows back. References:

- **one device** (:func:`conveyor.testing.references.experts.train_one_device`): the unpiped model, whole
  experts, both replicas' microbatches in one process; the test bounds the difference.
- **the other TP ranks**: every TP rank's losses and whole dense gradients and values are bitwise its peers'.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import conveyor.schedule as cs
from conveyor.layout import DistributedLayout
from conveyor.testing.models.moe import tiny_moe
from conveyor.testing.references.experts import (
    DP,
    EP,
    MICROBATCHES,
    against_one_device,
    local_copy,
    traced_pipeline,
    train_one_device,
    train_pipeline,
    whole_value,
)

TP = 2


def tensor_x_expert_parallel(rank: int, world_size: int, pp: int, directory: str | None,
                             sequence_parallel: bool = False) -> dict:
    """pp x dp=2 x tp=2 (``pp`` 1 or 2: 4 or 8 ranks), the traced Mixtral (2 layers) cut into 2 stages (1f1b on 2
    ranks, or interleaved-1f1b's two virtual stages on 1) with
    ``tensor_parallel="auto"`` (``sequence_parallel``: the activations between blocks on sequence shards, each MoE
    block taking the sequence gathered) and ep=2, 3 AdamW steps: at pp=1 against one device (worst relative
    difference of the losses and first gradients, worst absolute of the parameters, this rank's experts of the
    whole ones), against its TP peers (bitwise), the shards' shapes; then (``directory`` given) saved, and loaded at
    pp=1 x dp=4 with neither (every parameter whole)."""
    from torch.distributed.device_mesh import init_device_mesh

    import conveyor.checkpoint

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (pp, DP, TP), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    layers = 2
    device = train_one_device("mixtral:traced", layers) if pp == 1 else None
    # Two stages (cut before the second decoder layer) either way: on one rank (two virtual stages) or on two.
    schedule = (cs.build("1f1b", ranks=2, microbatches=MICROBATCHES) if pp == 2 else
                cs.build("interleaved-1f1b", ranks=1, microbatches=MICROBATCHES, virtual=2))
    layout = DistributedLayout(mesh=mesh, tensor_parallel="auto", sequence_parallel=sequence_parallel,
                               expert_parallel="auto", ep=EP)
    pipe = traced_pipeline(tiny_moe("mixtral", layers), schedule, layout, dp_rank)
    losses, grads, params = train_pipeline(pipe, pp_rank, dp_rank)
    experts = sorted(n for n in params if ".experts." in n)
    dense = (losses, {n: g for n, g in grads.items() if n not in experts},
             {n: p for n, p in params.items() if n not in experts})
    peers: list = [None] * TP
    dist.all_gather_object(peers, dense, group=mesh["tp"].get_group())
    place = (dp_rank * TP + mesh.get_local_rank("tp")) % EP  # which experts this rank keeps
    result = {
        "pp_rank": pp_rank, "dp_rank": dp_rank, "tp_rank": mesh.get_local_rank("tp"), "place": place,
        "losses": losses, "grads": grads, "params": params,
        "expert_shapes": {n: (tuple(params[n].shape), tuple(pipe_param.shape))
                          for n, pipe_param in pipe.named_parameters() if n in experts},
        "sharded_by_tp": sorted(n for n, p in pipe.named_parameters()
                                if ".experts." not in n and any(not q.is_replicate() for q in
                                                                getattr(p, "placements", ()))),
        "tp_peers_equal": all(_equal(peer, dense) for peer in peers),
        "moe_blocks_on_rows": _moe_blocks_on_rows(pipe),
        "finite": all(torch.isfinite(x).all() for x in (*grads.values(), *params.values())),
    }
    if device is not None:
        result["against one device"] = against_one_device((losses, grads, params), device, place)
    if directory is None:
        pipe.close()
        return result
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    conveyor.checkpoint.save(directory, pipe, optimizer)
    saved = {n: whole_value(p) for n, p in pipe.named_parameters()}  # gathered over "tp" or the experts' group
    pipe.close()
    every: list = [None] * world_size
    dist.all_gather_object(every, saved)
    whole = {n: t for part in every for n, t in part.items()}
    flat = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("pp", "dp"))
    loaded = traced_pipeline(tiny_moe("mixtral", layers, seed=1), cs.build("1f1b", ranks=1, microbatches=MICROBATCHES),
                             DistributedLayout(mesh=flat), dp_rank)
    conveyor.checkpoint.load(directory, loaded, torch.optim.AdamW(loaded.parameters(), lr=1e-2))
    got = dict(loaded.named_parameters())
    result["loaded"] = {"names": sorted(got) == sorted(whole),
                        "equal": all(torch.equal(local_copy(p), whole[n]) for n, p in got.items())}
    loaded.close()
    return result


def _equal(a, b) -> bool:
    (losses_a, grads_a, params_a), (losses_b, grads_b, params_b) = a, b
    return (all(torch.equal(x, y) for x, y in zip(losses_a, losses_b, strict=True))
            and sorted(grads_a) == sorted(grads_b) and all(torch.equal(g, grads_b[n]) for n, g in grads_a.items())
            and all(torch.equal(p, params_b[n]) for n, p in params_a.items()))



def _moe_blocks_on_rows(pipe) -> list[str]:
    """The MoE blocks (module paths) whose output a training graph of this rank's stages cuts back to sequence
    rows (``traced_sequence.sequence_shards``): every MoE block under sequence parallelism, none without."""
    from conveyor.parallel.tensor.traced_sequence import sequence_shards

    found = set()
    for module in pipe.modules:
        for node in module._conveyor_graphs[True].nodes:
            if node.target is sequence_shards:
                found |= {path for path, _ in (node.meta.get("nn_module_stack") or {}).values()
                          if path.endswith(".mlp")}
    return sorted(found)
