"""Two replicas of a two-rank pipeline, a checkpoint, and a resume: run with 4 processes.

    .venv/bin/torchrun --nproc-per-node=4 examples/data_parallel.py [--data-parallel fsdp] [--out ckpt]

Every rank runs this same script. The model is an unchanged ``nn.Module`` cut in two; each
replica reads its own half of every global minibatch (data is opened only on the ranks that
run the first or the last stage); the loss printed is the global minibatch's. After 4 steps
the job saves a checkpoint, trains 2 more, then loads it into a fresh pipeline and trains the
same 2 steps again: the losses are equal bit for bit.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import TensorDataset

import conveyor
import conveyor.checkpoint
from conveyor.parallel.data import data_loader

VOCAB, WIDTH, SEQ = 64, 32, 16


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU())
            for _ in range(4))
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def tokens() -> TensorDataset:
    rows = torch.randint(0, VOCAB, (256, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return TensorDataset(rows[:, :-1], rows[:, 1:])


def build(mesh, kind: str):
    torch.manual_seed(0)  # the same weights on every rank
    model = TinyLM()
    pipe = conveyor.pipeline(model, example_args=(torch.zeros(2, SEQ, dtype=torch.long),), split_points=["blocks.2"],
                             schedule="1f1b", microbatches=4,
                             loss_fn=lambda logits, y: torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                                                         y.flatten()),
                             layout=conveyor.DistributedLayout(mesh=mesh, data_parallel=kind))
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-3)


def train(pipe, optimizer, batches, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x, y = next(batches)
        losses.append(pipe.step(x if pipe.needs_inputs else None, target=y if pipe.needs_target else None).item())
        pipe.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-parallel", default="ddp", choices=["ddp", "fsdp"])
    parser.add_argument("--out", default=None, help="checkpoint folder (default: a temporary one)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))  # pp outermost, as in every example
    out = args.out or (tempfile.mkdtemp(prefix="conveyor-example-") if dist.get_rank() == 0 else None)
    shared = [out]
    dist.broadcast_object_list(shared, src=0)  # one folder for every rank
    out = shared[0]

    with build(mesh, args.data_parallel)[0] as pipe:
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        loader = data_loader(pipe, tokens, batch_size=8, seed=1)  # None on ranks that read no data
        batches = iter(loader) if loader is not None else itertools.repeat((None, None))
        first = train(pipe, optimizer, batches, 4)
        conveyor.checkpoint.save(f"{out}/step_4", pipe, optimizer, extra={"step": 4})
        want = train(pipe, optimizer, batches, 2)

    fresh, fresh_optimizer = build(mesh, args.data_parallel)
    with fresh:
        extra = conveyor.checkpoint.load(f"{out}/step_4", fresh, fresh_optimizer)
        loader = data_loader(fresh, tokens, batch_size=8, seed=1)
        batches = iter(loader) if loader is not None else itertools.repeat((None, None))
        for _ in range(extra["step"]):
            next(batches)  # the data position: the 4 minibatches already trained on
        got = train(fresh, fresh_optimizer, batches, 2)
    if dist.get_rank() == 0:
        print(f"losses {[round(loss, 5) for loss in first + want]}")
        print(f"resumed from step {extra['step']}: {[round(loss, 5) for loss in got]} "
              f"{'bitwise equal' if got == want else 'DIFFERENT'}")
    dist.destroy_process_group()
    if got != want:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
