"""Rank functions of the FSDP x TP checkpoint test: a tiny GPT-2 at pp x dp=2 x tp=2 (FSDP2 over "dp").

Under FSDP2 on a TP-sharded GPT-2, the fused ``c_attn.bias`` is strided twice,
``(_StridedShard(0, sf=2), _StridedShard(0, sf=3))``, a placement torch 2.13's ``full_tensor()``
and ``distribute_tensor`` get wrong (``conveyor.checkpoint.shards``). Every parameter is first set
to distinct random values (GPT-2 starts its biases at zero, and AdamW's first steps move many
elements by the same amount: a misplaced element would go unseen).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import conveyor
import conveyor.checkpoint as ckpt
from conveyor.microbatch import split_microbatches
from conveyor.options import PipelineOptions, SplitOptions, TransferOptions
from conveyor.testing.references.tensor_data_parallel import gathered
from conveyor.testing.rigs.checkpoint_tensor_parallel import MICROBATCHES, TIED, batch, build_model


def distinct_model(seed: int) -> torch.nn.Module:
    """The tiny GPT-2 with every parameter drawn from a normal distribution (small: the loss stays finite)."""
    model = build_model(seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model


def _pipeline(mesh, seed: int):
    example = next(kwargs for _, kwargs in split_microbatches((), batch(0), MICROBATCHES))
    return conveyor.pipeline(distinct_model(seed), example_kwargs=example, schedule="1f1b", microbatches=MICROBATCHES,
                             loss_fn=lambda output, target: output.loss,
                             options=PipelineOptions(split=SplitOptions(method="uniform"),
                                                     transfer=TransferOptions(timeout_s=120)),
                             layout=conveyor.DistributedLayout(mesh=mesh, data_parallel="fsdp", tensor_parallel="auto"))


def _locals(pipe) -> dict[str, torch.Tensor]:
    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in pipe.named_parameters()}


def save_load_and_gather(rank: int, world_size: int, path: str) -> dict:
    """pp x dp=2 x tp=2 (pp = world / 4), FSDP2: 2 AdamW steps, save; this rank's whole parameters (gathered one
    mesh dim at a time), the logits (None off the last stage); a new pipeline with other values loads the
    checkpoint: its local shards against the saved ones."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size // 4, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    pipe = _pipeline(mesh, seed=0)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(2):
        pipe.step(**batch(step))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    ckpt.save(path, pipe, optimizer, extra={"step": 2})
    saved = _locals(pipe)
    placements = {n: str(getattr(p, "placements", "whole")) for n, p in pipe.named_parameters()}
    whole = {TIED.get(n, n): gathered(p.detach()).clone() for n, p in pipe.named_parameters()}
    output = pipe.forward(**batch(9))  # traced in train mode; every dropout is 0
    logits = None if output is None else output.logits.detach().clone()
    pipe.close()
    pipe = _pipeline(mesh, seed=3)
    before = _locals(pipe)
    ckpt.load(path, pipe)
    loaded = _locals(pipe)
    pipe.close()
    return {
        "placements": placements,
        "whole": whole,
        "logits": logits,
        "differed_before": sorted(n for n in saved if not torch.equal(before[n], saved[n])),
        "loaded_unequal": sorted(n for n in saved if not torch.equal(loaded[n], saved[n])),
    }
