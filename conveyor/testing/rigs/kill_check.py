"""One rank of a short training run in which rank ``--victim`` dies at ``--point``: what the kill trials start.

The ranks are started as plain processes (not through torchrun, whose agent would end
the survivors itself): what is measured is how the survivors find out on their own.
Points: ``forward`` / ``backward`` (inside the victim's stage, microbatch 1 of step 1),
``waiting`` (while the victim waits for its input: rank 0 is slow that step),
``clip`` (on its way into ``clip_grad_norm_``'s exchange), ``optimizer`` (in the user's
optimizer step, between pipeline calls). Deaths: ``SIGKILL``, ``SIGTERM`` (a preempted
node) or ``MemoryError`` (raised where the point is).

Example (what :mod:`~conveyor.testing.rigs.kill_trials` runs for each rank, in a forked process: the same as)::

    RANK=1 WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 \\
        python conveyor/testing/rigs/kill_check.py --point forward --death SIGKILL --transport shared_memory
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time

import torch

POINTS = ("forward", "backward", "waiting", "clip", "optimizer")
DEATHS = ("SIGKILL", "SIGTERM", "MemoryError")


def die(death: str, where: str) -> None:
    if death == "MemoryError":
        raise MemoryError(f"injected at {where}")
    os.kill(os.getpid(), getattr(signal, death))
    time.sleep(60)  # a signal may take a moment to land


class _Trap(torch.autograd.Function):
    """Identity whose forward or backward calls ``die`` when armed."""

    @staticmethod
    def forward(ctx, x, trap):
        ctx.trap = trap
        trap.fire("forward")
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.trap.fire("backward")
        return grad, None


class Trap(torch.nn.Module):
    """Placed after a stage: counts its passes and dies at the chosen one."""

    def __init__(self, point: str | None, death: str, step_of: list[int]) -> None:
        super().__init__()
        self.point, self.death, self.step_of = point, death, step_of
        self.passes = {"forward": 0, "backward": 0}

    def fire(self, kind: str) -> None:
        self.passes[kind] += 1
        if kind == self.point and self.step_of[0] == 1 and self.passes[kind] % 4 == 2:  # step 1, microbatch 1
            die(self.death, f"{kind} of microbatch 1")

    def forward(self, x):
        return _Trap.apply(x, self)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--point", choices=POINTS, required=True)
    parser.add_argument("--death", choices=DEATHS, default="SIGKILL")
    parser.add_argument("--victim", type=int, default=1)
    parser.add_argument("--transport", default="shared_memory")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args(argv)

    import torch.distributed as dist

    import conveyor
    import conveyor.schedule as cs
    from conveyor.testing.models import TinyConfig, build_stage, lm_loss, make_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.transport == "hybrid":
        os.environ["CONVEYOR_HOST_ID"] = f"host-{rank // 2}"
    schedule = cs.build("1f1b", ranks=world, microbatches=4)
    cfg = TinyConfig(num_stages=world, blocks_per_stage=1, dim=16, seq_len=8)
    step_of = [0]
    victim = rank == args.victim
    trap = Trap(args.point if victim else None, args.death, step_of)

    class Trapped(torch.nn.Module):
        """The rank's stage with the trap on its output (rank 0 slow in step 1 when the victim must wait)."""

        def __init__(self) -> None:
            super().__init__()
            self.stage, self.trap = build_stage(rank, cfg), trap

        def forward(self, *inputs):
            if args.point == "waiting" and rank == 0 and step_of[0] == 1:
                time.sleep(3)
            out = self.stage(*inputs)
            if isinstance(out, tuple):
                return (self.trap(out[0]), *out[1:])
            return self.trap(out)

    stage = Trapped()
    pipe = conveyor.Pipeline([stage], schedule=schedule, loss_fn=lm_loss,
                             transfer=conveyor.TransferOptions(transport=args.transport, timeout_s=args.timeout_s))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    for step in range(3):
        step_of[0] = step
        if victim and args.point == "waiting" and step == 1:
            threading.Timer(1.0, die, (args.death if args.death != "MemoryError" else "SIGKILL",
                                       "a wait")).start()
        ids, targets = make_batch(cfg, 8, seed=step)
        pipe.step(ids if rank == 0 else None, target=targets if rank == world - 1 else None)
        if victim and args.point == "clip" and step == 1:
            die(args.death, "clip_grad_norm_'s exchange")
        pipe.clip_grad_norm_(1.0)
        if victim and args.point == "optimizer" and step == 1:
            die(args.death, "the optimizer step")
        optimizer.step()
        optimizer.zero_grad()
    pipe.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
