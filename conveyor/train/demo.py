"""The demo: pipelined training of a small transformer on local CPU ranks, checked against one device.

``conveyor demo`` (the README's first command) launches this module through
torchrun on ``--ranks`` local processes. Every step, rank 0 prints the
pipeline's loss beside the loss of the same step trained on a single device
(gradient accumulation over the same microbatches), and whether the two are
bitwise equal. At the end it draws the measured timeline of the last step
under its simulation (fed with the stage costs measured in that step) into
one PNG.

Example:
    $ conveyor demo --ranks 4 --schedule 1f1b --microbatches 8 --steps 5
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

# One rank per core, up to 4: with more processes than cores a rank waits for a core, and the
# measured timeline shows that waiting as bubble the simulation (a device per rank) cannot have.
DEFAULTS = {"ranks": max(2, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 4)), "schedule": "1f1b", "microbatches": 8, "steps": 6, "batch_size": 16,
            "virtual": None, "png": "out/demo_timeline.png", "lr": 1e-2,
            "clip": 0.5}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor demo", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=DEFAULTS["ranks"], help="pipeline ranks (local processes; default: one per core, 2 to 4)")
    parser.add_argument("--schedule", default=DEFAULTS["schedule"], help="schedule name (see `conveyor schedules`)")
    parser.add_argument("--virtual", type=int, default=DEFAULTS["virtual"], help="stages per rank, if the schedule takes it")
    parser.add_argument("--microbatches", type=int, default=DEFAULTS["microbatches"])
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    parser.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"])
    parser.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    parser.add_argument("--clip", type=float, default=DEFAULTS["clip"],
                        help="clip the gradients' total norm to this (0: no clipping)")
    parser.add_argument("--png", default=DEFAULTS["png"], help="where to draw the measured vs simulated timeline")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def check_options(args: argparse.Namespace) -> None:
    """Raise a ConveyorError (ValueError) naming the first option the demo cannot run with."""
    import conveyor.schedule as cs

    for name in ("ranks", "microbatches", "steps", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    cs.build(args.schedule, ranks=args.ranks, microbatches=args.microbatches, virtual=args.virtual)


def launch(argv: Sequence[str] | None = None) -> int:
    """Validate the arguments here, then run the workers under torchrun; returns its exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)  # `python -m conveyor.train.demo --png ...` too
    args = build_parser().parse_args(argv)
    check_options(args)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
               "-m", "conveyor.train.demo", "--worker", *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.call(command, env=env)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import conveyor
    import conveyor.schedule as cs
    from conveyor.schedule.cost import costs_from_timeline
    from conveyor.schedule.render import side_by_side_png
    from conveyor.train.tiny_lm import (
        TinyConfig,
        build_stage,
        lm_loss,
        make_batch,
        reference_model,
        reference_step,
    )

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    schedule = cs.build(args.schedule, ranks=dist.get_world_size(), microbatches=args.microbatches,
                        virtual=args.virtual)
    cfg = TinyConfig(num_stages=schedule.num_stages, blocks_per_stage=2, dim=32, seq_len=16)
    mine = schedule.stages_of(rank)
    pipe = conveyor.Pipeline([build_stage(s, cfg) for s in mine], schedule=schedule, loss_fn=lm_loss)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    reference = reference_optimizer = None
    if rank == 0:
        reference = reference_model(cfg)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr)
        print(f"conveyor demo: {schedule.name}, {schedule.num_ranks} ranks x {schedule.virtual} stage(s), "
              f"{schedule.num_microbatches} microbatches, {sum(p.numel() for p in reference.parameters())} parameters")
    first, last = schedule.placement.rank_of(0), schedule.placement.rank_of(schedule.num_stages - 1)
    all_equal = True
    for step in range(args.steps):
        ids, targets = make_batch(cfg, args.batch_size, seed=step)
        # Every rank starts the step together: rank 0 checks the last step on one device between
        # steps, and without the barrier the timeline drew that work as the other ranks' waiting.
        dist.barrier()
        loss = pipe.step(ids if rank == first else None, target=targets if rank == last else None)
        norm = pipe.clip_grad_norm_(args.clip) if args.clip > 0 else None  # every rank takes part
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            want = reference_step(reference, ids, targets, schedule.num_microbatches, lm_loss)
            want_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), args.clip) if norm is not None else None
            reference_optimizer.step()
            reference_optimizer.zero_grad()
            equal = torch.equal(loss, want) and (norm is None or torch.equal(norm, want_norm))
            all_equal &= equal
            norms = "" if norm is None else f"   grad norm {norm.item():.6f} / {want_norm.item():.6f}"
            print(f"step {step}: pipeline loss {loss.item():.7f}   single-device loss {want.item():.7f}{norms}   "
                  f"{'bitwise equal' if equal else 'DIFFERENT'}", flush=True)
    measured = pipe.timeline()
    pipe.close()  # its process groups and rings go now, not at interpreter exit
    if rank == 0:
        # The program the ranks ran (I+W pairs merged), timed with the costs they measured.
        plan = cs.simulate(cs.executable(schedule).compute, costs_from_timeline(measured, schedule.num_stages),
                           time_unit="s")
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        side_by_side_png(plan, measured, args.png)
        print(f"last step: measured {measured.makespan * 1e3:.1f} ms, bubble {measured.bubble_ratio:.3f}; "
              f"simulated with the measured stage costs {plan.makespan * 1e3:.1f} ms, bubble {plan.bubble_ratio:.3f}")
        print(f"timeline (measured under simulated): {args.png}")
        print("every step bitwise equal to single-device training" if all_equal
              else "MISMATCH with single-device training")
    dist.destroy_process_group()
    if not all_equal:
        sys.exit(1)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    return launch(argv)


if __name__ == "__main__":
    sys.exit(main())
