"""Rows on 2 and 4 gloo ranks sharing one device (NCCL cannot put two ranks of one communicator
on one GPU): every schedule on every transport, tied GPT-2, clipping and skipping, dp=2 replicas,
and a device that lags the host. Every rank compares its gradients and parameters bitwise with one
process on the same device (rank 0's own reference, at the ranks' one thread).

Example::

    ok, detail = schedules_row(Context(torch.device("cpu")), world=2)
"""

from __future__ import annotations

import math
import time

import torch

import conveyor
import conveyor.schedule as cs
from conveyor.testing.models import lm_loss
from conveyor.testing.references.data_parallel import MLPStage, make_batch

from .common import (
    LR,
    MICROBATCHES_PER_RANK,
    Context,
    by_stage,
    compare,
    cpu,
    deterministic,
    first_failure,
    launch,
    mlp_reference,
    mlp_state,
)

TRANSPORTS = ("process_group", "shared_memory", "ordered")
STEPS = 2
QUICK_SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zbv")


def schedule_names(quick: bool) -> list[str]:
    return [n for n in sorted(cs.available()) if not quick or n in QUICK_SCHEDULES]


def _train_mlp(pipe, stages: dict[int, torch.nn.Module], device: torch.device, *, clip: float | None = None,
               dp: tuple[int, int] = (0, 1)) -> dict:
    """STEPS AdamW steps through ``pipe``; this rank's step-1 grads and final params by "<stage>.<name>"."""
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
    losses, norms, grads = [], [], {}
    dp_rank, dp_size = dp
    for step in range(STEPS):
        ids, targets = (t.chunk(dp_size)[dp_rank].to(device) for t in make_batch(seed=step))
        losses.append(pipe.step(ids if pipe.needs_inputs else None, target=targets if pipe.needs_target else None))
        if clip is not None:
            norms.append(pipe.clip_grad_norm_(clip))
        if step == 0:
            grads = mlp_state(stages, "grad")
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": cpu(losses), "norms": cpu(norms), "grads": grads, "params": mlp_state(stages, "data")}


def _verdict(got: dict, want: dict, what: str = "") -> tuple[bool, str]:
    checks = [compare(dict(enumerate(got["losses"])), dict(enumerate(want["losses"])), f"{what}loss "),
              compare(dict(enumerate(got["norms"])), dict(enumerate(want["norms"])), f"{what}norm "),
              compare(got["grads"], {k: want["grads"][k] for k in got["grads"]}, f"{what}grad "),
              compare(got["params"], {k: want["params"][k] for k in got["params"]}, f"{what}param ")]
    bad = [c for c in checks if not c[0]]
    return bad[0] if bad else (True, "bitwise")


def _schedules_rank(rank: int, world: int, device: str, names: list[str]) -> dict:
    device = torch.device(device)
    deterministic(device)
    results, references = {}, {}
    for name in names:
        virtual = cs.available()[name].default_virtual
        schedule = cs.build(name, ranks=world, microbatches=MICROBATCHES_PER_RANK * world, virtual=virtual)
        if rank == 0 and schedule.num_stages not in references:
            references[schedule.num_stages] = mlp_reference(schedule.num_stages, device, schedule.num_microbatches,
                                                            STEPS)
        for transport in TRANSPORTS:
            stages = {s: MLPStage(s, schedule.num_stages) for s in schedule.stages_of(rank)}
            with conveyor.Pipeline(list(stages.values()), schedule, lm_loss,
                                   transfer=conveyor.TransferOptions(transport=transport, timeout_s=120),
                                   layout=conveyor.DistributedLayout(device=device)) as pipe:
                results[(name, transport)] = (schedule.num_stages, _train_mlp(pipe, stages, device))
    return {"results": results, "references": references}


def schedules_row(ctx: Context, world: int) -> tuple[bool, str]:
    """Every built-in schedule x transport on ``world`` gloo ranks on one device, against one process."""
    names = schedule_names(ctx.quick)
    ranks = launch(_schedules_rank, world, ctx, names, timeout_s=420)
    references = ranks[0]["references"]
    verdicts = {}
    for rank, got in enumerate(ranks):
        for (name, transport), (num_stages, result) in got["results"].items():
            ok, detail = _verdict(result, references[num_stages], f"rank {rank} ")
            key = f"{name}/{transport}"
            if not ok or key not in verdicts:
                verdicts[key] = (ok, detail)
    ok, detail = first_failure(verdicts)
    return ok, f"{detail} ({len(names)} schedules x {len(TRANSPORTS)} transports; losses, grads, params)"


def _clip_skip_rank(rank: int, world: int, device: str) -> dict:
    device = torch.device(device)
    deterministic(device)
    schedule = cs.build("1f1b", ranks=world, microbatches=2 * world)
    stages = {s: MLPStage(s, schedule.num_stages) for s in schedule.stages_of(rank)}
    reference = mlp_reference(schedule.num_stages, device, schedule.num_microbatches, STEPS, clip=0.05) \
        if rank == 0 else None
    with conveyor.Pipeline(list(stages.values()), schedule, lm_loss,
                           transfer=conveyor.TransferOptions(timeout_s=120),
                           layout=conveyor.DistributedLayout(device=device)) as pipe:
        clipped = _train_mlp(pipe, stages, device, clip=0.05)
        # A non-finite loss: the step is dropped on every rank, the optimizer leaves everything alone.
        if pipe.needs_target:
            with torch.no_grad():
                stages[schedule.num_stages - 1].head.weight[0, 0] = float("nan")
        before = mlp_state(stages, "data")
        ids, targets = (t.to(device) for t in make_batch(seed=9))
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
        pipe.step(ids if pipe.needs_inputs else None, target=targets if pipe.needs_target else None,
                  on_nonfinite="skip")
        grads_left = [n for n, p in pipe.named_parameters() if p.grad is not None]
        optimizer.step()
        after = mlp_state(stages, "data")
        return {"clipped": clipped, "reference": reference, "skipped": pipe.skipped_steps, "grads_left": grads_left,
                "before": before, "after": after}


def clip_skip_row(ctx: Context, world: int = 2) -> tuple[bool, str]:
    """clip_grad_norm_ bitwise torch's on one process; on_nonfinite="skip" drops a NaN step everywhere."""
    ranks = launch(_clip_skip_rank, world, ctx)
    want = ranks[0]["reference"]
    for rank, got in enumerate(ranks):
        ok, detail = _verdict(got["clipped"], want, f"rank {rank} clipped: ")
        if not ok:
            return ok, detail
        if got["skipped"] != 1 or got["grads_left"]:
            return False, f"rank {rank}: skipped_steps {got['skipped']}, gradients left {got['grads_left'][:3]}"
        # The NaN written into the head is in both: compare it where it is not NaN (NaN != NaN).
        before = {k: torch.nan_to_num(v, nan=7.0) for k, v in got["before"].items()}
        after = {k: torch.nan_to_num(v, nan=7.0) for k, v in got["after"].items()}
        ok, detail = compare(after, before, f"rank {rank} after the skipped step: ")
        if not ok:
            return ok, detail
    return True, "norm, clipped grads, params bitwise; NaN step skipped on every rank, params untouched"


def _replicas_rank(rank: int, world: int, device: str, kind: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device(device)
    deterministic(device)
    dp = 2
    mesh = init_device_mesh(device.type, (world // dp, dp), mesh_dim_names=("pp", "dp"))
    schedule = cs.build("1f1b", ranks=world // dp, microbatches=2)
    dp_rank, pp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    stages = {s: MLPStage(s, schedule.num_stages) for s in schedule.stages_of(pp_rank)}
    with conveyor.Pipeline(list(stages.values()), schedule, lm_loss,
                           transfer=conveyor.TransferOptions(timeout_s=120),
                           layout=conveyor.DistributedLayout(device=device, mesh=mesh, data_parallel=kind)) as pipe:
        got = _train_mlp(pipe, stages, device, dp=(dp_rank, dp))
    return {"got": got, "reference": _replica_reference(schedule.num_stages, device, dp) if rank == 0 else None}


def _replica_reference(num_stages: int, device: torch.device, dp: int) -> dict:
    """One process: each replica's rows accumulated alone, the gradients averaged in replica order."""
    from conveyor.testing.models import reference_step
    from conveyor.testing.references.data_parallel import MLPStack

    model = MLPStack(num_stages).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        ids, targets = make_batch(seed=step)
        replica_losses, replica_grads = [], []
        for x, y in zip(ids.chunk(dp), targets.chunk(dp)):
            replica_losses.append(reference_step(model, x.to(device), y.to(device), 2, lm_loss))
            replica_grads.append([p.grad for p in model.parameters()])
            optimizer.zero_grad()
        for param, each in zip(model.parameters(), zip(*replica_grads)):
            param.grad = (each[0] + each[1]) / 2
        losses.append((replica_losses[0] + replica_losses[1]) / 2)
        if step == 0:
            grads = cpu(by_stage(model, lambda p: p.grad))
        optimizer.step()
        optimizer.zero_grad()
    params = by_stage(model, lambda p: p)
    return cpu({"losses": losses, "norms": [], "grads": grads, "params": params})


def replicas_row(ctx: Context, kind: str) -> tuple[bool, str]:
    """dp=2 x pp=2 on 4 gloo ranks, ``data_parallel=kind``, against one process averaging two replicas."""
    ranks = launch(_replicas_rank, 4, ctx, kind)
    want = ranks[0]["reference"]
    for rank, got in enumerate(ranks):
        ok, detail = _verdict(got["got"], want, f"rank {rank} ")
        if not ok:
            return ok, detail
    return True, "losses, step-1 grads, params bitwise on all 4 ranks"


class Lagging(torch.nn.Module):
    """``inner`` after ``lag_ms`` of device time: ``torch.cuda._sleep`` on a GPU (the host runs ahead),
    ``time.sleep`` on the CPU (where the host is the device)."""

    def __init__(self, inner: torch.nn.Module, lag_ms: float, cycles_per_ms: float) -> None:
        super().__init__()
        self.inner, self.lag_ms, self.cycles_per_ms = inner, lag_ms, cycles_per_ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            torch.cuda._sleep(int(self.lag_ms * self.cycles_per_ms))
        else:
            time.sleep(self.lag_ms / 1e3)
        return self.inner(x)


def cycles_per_ms(device: torch.device) -> float:
    """How many ``torch.cuda._sleep`` cycles make a millisecond on this GPU (measured with events)."""
    if device.type != "cuda":
        return 0.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm up
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


LAG_MS = 20.0


def _lag_rank(rank: int, world: int, device: str) -> dict:
    device = torch.device(device)
    deterministic(device)
    schedule = cs.build("1f1b", ranks=world, microbatches=2 * world)
    per_ms = cycles_per_ms(device)
    stages = {s: MLPStage(s, schedule.num_stages) for s in schedule.stages_of(rank)}
    lagging = [Lagging(m, LAG_MS, per_ms) for m in stages.values()]
    reference = mlp_reference(schedule.num_stages, device, schedule.num_microbatches, STEPS) if rank == 0 else None
    with conveyor.Pipeline(lagging, schedule, lm_loss,
                           transfer=conveyor.TransferOptions(transport="ordered", timeout_s=120),
                           layout=conveyor.DistributedLayout(device=device)) as pipe:
        got = _train_mlp(pipe, stages, device)
        timeline = pipe.timeline()
    spans = [(s.rank, s.action.kind.name, s.action.stage, s.action.microbatch, s.start, s.end) for s in timeline.spans]
    return {"got": got, "reference": reference, "spans": spans}


def lag_row(ctx: Context) -> tuple[bool, str]:
    """A device that lags the host (every stage's forward sleeps LAG_MS on the device) under the
    in-order transport: bitwise still, and the timeline on the device's clock (events, not enqueues)."""
    ranks = launch(_lag_rank, 2, ctx)
    for rank, got in enumerate(ranks):
        ok, detail = _verdict(got["got"], ranks[0]["reference"], f"rank {rank} ")
        if not ok:
            return ok, detail
    spans = ranks[0]["spans"]
    forwards = [s for s in spans if s[1] == "F"]
    if not forwards:
        return False, "the measured timeline has no forward spans"
    scale = 1e3  # the timeline is in seconds
    durations = [s[5] - s[4] for s in forwards]
    if not all(math.isfinite(d) for d in durations):  # min() would drop a NaN that is not first
        return False, f"the timeline holds a forward whose span is not a finite number: {durations}"
    shortest = min(durations) * scale
    if not shortest >= 0.8 * LAG_MS:
        return False, f"a forward spans {shortest:.2f} ms on the timeline, but the device spent >= {LAG_MS} ms on " \
                      f"it: the timeline shows host enqueue time, not the device's"
    ends = {(s[2], s[3]): s[5] for s in forwards}
    early = [(s[2], s[3]) for s in forwards if s[2] > 0 and s[4] < ends.get((s[2] - 1, s[3]), 0.0) - 1e-4]
    if early:
        return False, f"stage/microbatch {early[0]}'s forward starts before its input's forward ended: the ranks' " \
                      "clocks are not aligned"
    return True, f"bitwise; shortest F {shortest:.1f} ms >= lag {LAG_MS:.0f} ms; every F after its producer"
