"""One short pipelined training run under torchrun, ended the way ``--teardown`` says.

This is what the launch stress (:mod:`~conveyor.testing.rigs.launches`) starts again and again:
a user's script, from ``init_process_group`` to the end of the process, with the teardown
orders users write. Every order must end with exit code 0 (``exception``: the exception's
code, 1), never with an abort at exit.

Example:
    $ torchrun --standalone --nproc-per-node=2 conveyor/testing/rigs/launch_check.py --teardown drop-first
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from types import MappingProxyType

TEARDOWNS = MappingProxyType({
    "close": "pipe.close(), then dist.destroy_process_group()",
    "with": "the pipeline in a `with` block, then dist.destroy_process_group()",
    "destroy-first": "dist.destroy_process_group() while the pipeline is open, then del pipe",
    "drop-first": "del pipe (no close), then dist.destroy_process_group()",
    "no-destroy": "neither close nor destroy: the interpreter's exit ends everything",
    "exception": "an exception leaves the script with the pipeline open (exit code 1)",
})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchrun ... conveyor/testing/rigs/launch_check.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--teardown", choices=sorted(TEARDOWNS), default="close")
    return parser


class _DeliberateExit(RuntimeError):
    """Raised by ``--teardown exception``: the way out that the launch expects."""


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    import torch
    import torch.distributed as dist

    import conveyor
    import conveyor.schedule as cs
    from conveyor.testing.models import TinyConfig, build_stage, lm_loss, make_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.transport == "hybrid":
        # Two played hosts (one per rank when there are two ranks), so both sides carry payloads.
        os.environ["CONVEYOR_HOST_ID"] = f"host-{rank // 2 if world > 2 else rank}"
    schedule = cs.build(args.schedule, ranks=world, microbatches=args.microbatches)
    cfg = TinyConfig(num_stages=schedule.num_stages, blocks_per_stage=1, dim=16, seq_len=8)
    first, last = schedule.placement.rank_of(0), schedule.placement.rank_of(schedule.num_stages - 1)

    def train(pipe) -> None:
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)  # imports torch._dynamo, as most scripts do
        for step in range(args.steps):
            ids, targets = make_batch(cfg, 2 * args.microbatches, seed=step)
            pipe.step(ids if rank == first else None, target=targets if rank == last else None)
            pipe.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad()
        pipe.timeline()  # a collective right before the end: the abort at exit used to follow one

    def make_pipeline():
        return conveyor.Pipeline([build_stage(s, cfg) for s in schedule.stages_of(rank)], schedule=schedule,
                                 loss_fn=lm_loss,
                                 transfer=conveyor.TransferOptions(transport=args.transport, timeout_s=60))

    if args.teardown == "with":
        with make_pipeline() as pipe:
            train(pipe)
        dist.destroy_process_group()
        return
    pipe = make_pipeline()
    train(pipe)
    if args.teardown == "close":
        pipe.close()
        dist.destroy_process_group()
    elif args.teardown == "destroy-first":
        dist.destroy_process_group()
        del pipe
    elif args.teardown == "drop-first":
        del pipe
        dist.destroy_process_group()
    elif args.teardown == "exception":
        raise _DeliberateExit(f"rank {rank} leaves through an exception, as the launch asked")


if __name__ == "__main__":
    main()
