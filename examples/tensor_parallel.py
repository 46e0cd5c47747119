"""A two-stage pipeline of a small Llama, each stage split over two tensor-parallel ranks: run with 4 processes.

    .venv/bin/torchrun --nproc-per-node=4 examples/tensor_parallel.py [--out ckpt]

Every rank runs this same script. The mesh's dims are ("pp", "dp", "tp"), as in every example:
pp outermost, tp innermost (a stage's TP ranks are neighbours, so they share a node), here 2 x 1
x 2. ``tensor_parallel="auto"`` splits attention by heads, the MLP by its width and the embedding
and the LM head by the vocabulary, on the unchanged ``transformers`` model: parameters keep their
names, each rank holds its shards. After 2 steps the job saves a checkpoint (each rank its own
shards), trains 2 more, then loads it into a fresh pipeline and trains the same 2 steps again:
the losses are equal bit for bit.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

import conveyor
import conveyor.checkpoint

VOCAB, SEQ, BATCH = 64, 16, 8


def build(mesh):
    torch.manual_seed(0)  # the same weights on every rank
    config = LlamaConfig(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False)
    model = LlamaForCausalLM(config)
    example = {"input_ids": torch.zeros(2, SEQ, dtype=torch.long), "labels": torch.zeros(2, SEQ, dtype=torch.long)}
    # The model computes its own loss from labels= (shifted inside), as transformers does.
    pipe = conveyor.pipeline(model, example_kwargs=example, split_points=["model.layers.2"], schedule="1f1b",
                             microbatches=4, loss_fn=lambda output, _: output.loss,
                             layout=conveyor.DistributedLayout(mesh=mesh, tensor_parallel="auto"))
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-3)


def batch(step: int) -> torch.Tensor:
    """The global minibatch of ``step``: the same on every rank (each takes what its stages need)."""
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def train(pipe, optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        ids = batch(step)
        losses.append(pipe.step(input_ids=ids, labels=ids).item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="checkpoint folder (default: a temporary one)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    out = args.out or (tempfile.mkdtemp(prefix="conveyor-example-") if dist.get_rank() == 0 else None)
    shared = [out]
    dist.broadcast_object_list(shared, src=0)  # one folder for every rank
    out = shared[0]

    pipe, optimizer = build(mesh)
    with pipe:
        first = train(pipe, optimizer, range(2))
        conveyor.checkpoint.save(f"{out}/step_2", pipe, optimizer, extra={"step": 2})
        want = train(pipe, optimizer, range(2, 4))

    fresh, fresh_optimizer = build(mesh)
    with fresh:
        extra = conveyor.checkpoint.load(f"{out}/step_2", fresh, fresh_optimizer)
        got = train(fresh, fresh_optimizer, range(extra["step"], 4))
    if dist.get_rank() == 0:
        print(f"losses {[round(loss, 5) for loss in first + want]}")
        print(f"resumed from step {extra['step']}: {[round(loss, 5) for loss in got]} "
              f"{'bitwise equal' if got == want else 'DIFFERENT'}")
    dist.destroy_process_group()
    if got != want:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
