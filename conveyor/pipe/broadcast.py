"""Tensors of any count, shapes and dtypes from one rank to every rank of a group, with no object collective.

What the last stage computes outside a step (log-probs, generated tokens) reaches the other ranks
of its pipeline this way: the sender's count, dtypes and shapes go first as one small integer
tensor, then every tensor's bytes in one flat buffer per dtype. The receivers learn the shapes from
the header, so nothing has to be agreed beforehand and no Python object is pickled.

Example (every rank of ``group``; ``src`` a global rank)::

    logprobs = broadcast_tensors([lp] if rank == src else None, src, group, device, comm_device)
"""

from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool)
HEADER_DIMS = 8  # the most dimensions a tensor may have; a header row per tensor: dtype, ndim, dims


def header_of(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A row per tensor: its dtype's index in :data:`DTYPES`, its ndim, its dims (zero-padded).

    Example:
        >>> header_of([torch.zeros(2, 3), torch.zeros(4, dtype=torch.long)]).tolist()
        [[0, 2, 2, 3, 0, 0, 0, 0, 0, 0], [4, 1, 4, 0, 0, 0, 0, 0, 0, 0]]
    """
    rows = torch.zeros(len(tensors), 2 + HEADER_DIMS, dtype=torch.long)
    for index, tensor in enumerate(tensors):
        if tensor.dtype not in DTYPES or tensor.dim() > HEADER_DIMS:
            raise ValueError(f"broadcast_tensors sends {[str(d) for d in DTYPES]} tensors of at most {HEADER_DIMS} "
                             f"dimensions; got {tensor.dtype} of shape {tuple(tensor.shape)}: convert it first")
        rows[index, 0], rows[index, 1] = DTYPES.index(tensor.dtype), tensor.dim()
        rows[index, 2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.long)
    return rows


def broadcast_tensors(tensors: list[torch.Tensor] | None, src: int, group, device: torch.device,
                      comm_device: torch.device) -> list[torch.Tensor]:
    """``tensors`` (given on global rank ``src``, None elsewhere) on every rank of ``group``, on ``device``.

    Collectives take their tensors on ``comm_device`` (NCCL: the GPU; gloo: the CPU). Three
    broadcasts: the count, the header (:func:`header_of`), then the data, one flat buffer per dtype.
    """
    import torch.distributed as dist

    sending = tensors is not None
    count = torch.tensor([len(tensors) if sending else 0], dtype=torch.long, device=comm_device)
    dist.broadcast(count, src=src, group=group)
    header = header_of(tensors).to(comm_device) if sending else \
        torch.zeros(int(count.item()), 2 + HEADER_DIMS, dtype=torch.long, device=comm_device)
    dist.broadcast(header, src=src, group=group)
    rows = header.tolist()
    shapes = [tuple(row[2:2 + row[1]]) for row in rows]
    result: list[torch.Tensor | None] = [None] * len(rows)
    for code in sorted({row[0] for row in rows}):
        members = [index for index, row in enumerate(rows) if row[0] == code]
        sizes = [torch.Size(shapes[index]).numel() for index in members]
        if sending:
            flat = torch.cat([tensors[index].detach().reshape(-1).to(comm_device) for index in members])
        else:
            flat = torch.empty(sum(sizes), dtype=DTYPES[code], device=comm_device)
        dist.broadcast(flat, src=src, group=group)
        for index, part in zip(members, flat.split(sizes)):
            result[index] = tensors[index] if sending else part.view(shapes[index]).to(device)
    return [tensor for tensor in result if tensor is not None]
