"""Pipeline x data parallelism (pp=2 x dp=2): parity with one process, and the reduction's cost.

Parity: for 1f1b, interleaved-1f1b and zbv, with ``data_parallel="ddp"`` and ``"fsdp"``, the
worst relative difference of losses and parameters after 3 AdamW steps to the two
one-process references of :mod:`conveyor.testing.references.data_parallel` (0: bitwise).

Overlap: each stage's gradients are reduced across replicas right after its last backward of
the step ("early"), or all at the step's end ("at end", what a reduction after the pipeline
would cost). Steps alternate the two; the share of the reduction hidden behind pipeline work
is ``(step at end - step early) / reduction time``, the reduction time being what the ranks
spent in the reduction calls at the end (from the measured timeline's data-parallel spans).

Run through the one benchmark command:
    .venv/bin/python -m benchmarks --parallel [--parallel-steps 12]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.steal import StealMeter
from conveyor.testing.multiprocess import run_ranks
from conveyor.testing.references.data_parallel import max_relative_difference

CASES = (("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2))
WIDTH, BLOCKS = 512, 4  # per stage: enough weight for a reduction the clock can see


class _Stage(torch.nn.Module):
    def __init__(self, stage: int) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(stage)
            self.blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU())
                                                for _ in range(BLOCKS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.blocks(x)


def _timed(rank: int, world_size: int, kind: str, name: str, virtual: int, steps: int) -> list[dict]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import conveyor
    import conveyor.schedule as cs

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    schedule = cs.build(name, ranks=2, microbatches=8, virtual=virtual)
    stages = [_Stage(s) for s in schedule.stages_of(mesh.get_local_rank("pp"))]
    pipe = conveyor.Pipeline(stages, schedule=schedule, loss_fn=lambda y, t: (y - t).pow(2).mean(),
                             transfer=conveyor.TransferOptions(timeout_s=120),
                             layout=conveyor.DistributedLayout(mesh=mesh, data_parallel=kind))
    early = pipe.ranks.runs.gradients_final
    x = torch.randn(32, WIDTH, generator=torch.Generator().manual_seed(pipe.dp_rank))
    records = []
    for step in range(steps):
        at_end = step % 2 == 1  # alternate, so that a busy spell of the machine slows both alike
        # Without the positions the replicas reduce every stage when the step ends.
        object.__setattr__(pipe.ranks.runs, "gradients_final", (lambda r: {}) if at_end else early)
        dist.barrier()
        start = time.perf_counter()
        pipe.step(x if pipe.needs_inputs else None, target=x if pipe.needs_target else None)
        dist.barrier()
        elapsed = time.perf_counter() - start
        spans = pipe.replicas.spans()
        reducing = sum(end - begin for _, begin, end in spans)
        records.append({"at_end": at_end, "step_s": elapsed, "reduce_s": reducing, "warm": step >= 2})
        for param in pipe.parameters():
            param.grad = None
    pipe.close()
    return records


def _overlap(kind: str, name: str, virtual: int, steps: int) -> str:
    per_rank = run_ranks(_timed, 4, args=(kind, name, virtual, steps), timeout_s=600)
    steps_early, steps_end, reduce_end = [], [], []
    for index in range(steps):
        records = [ranks[index] for ranks in per_rank]
        if not records[0]["warm"]:
            continue
        step = max(r["step_s"] for r in records)
        if records[0]["at_end"]:
            steps_end.append(step)
            reduce_end.append(max(r["reduce_s"] for r in records))
        else:
            steps_early.append(step)
    early, end, reduction = (statistics.median(v) for v in (steps_early, steps_end, reduce_end))
    hidden = (end - early) / reduction if reduction > 0 else float("nan")
    return (f"| {name} | {virtual} | {kind} | {early * 1e3:.1f} | {end * 1e3:.1f} | {reduction * 1e3:.1f} | "
            f"{hidden:.0%} |")


def run(args: argparse.Namespace) -> int:
    """Print the parity table, then the overlap table (medians over the warm steps)."""
    meter = StealMeter()
    if not args.quick:
        with meter.window("parity"):
            _parity()
    with meter.window("overlap"):
        _overlaps(args.parallel_steps)
    print("\nCPU steal: " + ", ".join(f"{side} {value:.1f}%" for side, value in meter.percent().items()))
    return 0


def _parity() -> None:
    print("parity, pp=2 x dp=2, 3 AdamW steps (max relative difference; 0 = bitwise):")
    print("| schedule | V | data_parallel | vs per-replica reference | vs accumulated reference |")
    print("|---|---|---|---|---|")
    for kind in ("ddp", "fsdp"):
        for name, virtual in CASES:
            worst = max_relative_difference(name, virtual, kind)
            print(f"| {name} | {virtual} | {kind} | {worst['per_replica']:.3g} | {worst['accumulated']:.3g} |",
                  flush=True)


def _overlaps(steps: int) -> None:
    print(f"\noverlap, pp=2 x dp=2, M=8, {BLOCKS} x {WIDTH}-wide blocks per stage "
          f"(medians of {steps // 2 - 1} warm steps each way, alternating):")
    print("| schedule | V | data_parallel | step, early (ms) | step, at end (ms) | reduction (ms) | hidden |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("ddp", "fsdp"):
        for name, virtual in CASES:
            print(_overlap(kind, name, virtual, steps), flush=True)
