"""``python -m benchmarks --overlap``: expert parallelism's all-to-alls with and without overlapped pairs.

The MoE recipe (configs/moe.yaml: Mixtral-style, 4 layers, 4 experts, top-2) at pp=2 x dp=2 with ep=2 on 4
CPU ranks, under a schedule with two stages per rank, M microbatches. Each rank keeps two
pipelines from the same weights: the plain one and one with ``parallel.expert_overlap=true``, whose ranks run
each forward with the backward next to it in their programs, the two passes taking turns at their
all-to-alls. The sides alternate every round (which goes first too), steal recorded per side.

Each case of ``--overlap-cases`` (a schedule, M, and the emulated all-to-all's time; by default one the
simulator says the pairs hide, dualpipev at M=32, and one it says they cannot, zbv at M=16):

1. **Emulated**: each all-to-all of tokens held to a set time (the case's milliseconds; a real all-to-all
   moves the rows, and the wait lasts at least that long after posting), as the emulated stages of the
   comparison take set compute times. Per side: the step time and the **exposed all-to-all share** (the time
   the rank's compute waited for its all-to-alls, over the step; slowest rank), beside the simulator's
   prediction for both sides from the plain side's measured pass times (each pass's compute: its median
   duration less its two token all-to-alls; ``conveyor.schedule.overlap``).
2. **The recipe as is** (gloo's all-to-alls, no set time): the step time per side.

Each side's peak of saved activations per rank (``stage.measure_memory``) and the timelines of the last
emulated step (communication lanes under each rank's compute) are written to benchmarks/results/overlap/.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks.steal import StealMeter
from conveyor.testing.multiprocess import run_ranks

RECIPE = Path(__file__).resolve().parent.parent / "configs" / "moe.yaml"
RESULTS = Path(__file__).resolve().parent / "results" / "overlap"
SIDES = ("plain", "overlap")


def _config(schedule: str, microbatches: int, overlap: bool):
    from conveyor.train.config import load_config

    return load_config(RECIPE, [f"parallel.schedule={schedule}", f"parallel.microbatches={microbatches}",
                                f"train.batch_size={2 * microbatches}", "parallel.dp=2", "parallel.ep=2",
                                "parallel.data_parallel=ddp",
                                f"parallel.expert_overlap={str(overlap).lower()}", "stage.measure_memory=true",
                                "stage.record_timeline=true", "run.dir=/tmp/conveyor-bench-overlap"])


def _rank(rank: int, world_size: int, schedule: str, microbatches: int, rounds: int, steps: int,
          exchange_s: float | None) -> dict:
    import torch
    import torch.distributed as dist

    from conveyor.parallel.experts import ExpertParallel
    from conveyor.train.loop import build_pipeline
    from conveyor.train.models import build_model

    torch.set_num_threads(1)
    pipes = {}
    for side in SIDES:
        cfg = _config(schedule, microbatches, side == "overlap")
        torch.manual_seed(0)
        pipes[side] = build_pipeline(cfg, build_model(cfg, 256))
        pipes[side].ranks.find_part(ExpertParallel).all_to_alls.set_time_s = exchange_s
    batch = torch.randint(0, 256, (cfg.replica_batch_size, cfg.model.seq_len + 1),
                          generator=torch.Generator().manual_seed(rank // 2))
    ids, targets = batch[:, :-1], batch[:, 1:]
    found = {side: {"step_s": [], "waited_s": [], "peak_bytes": 0} for side in SIDES}
    meter = StealMeter()

    def step(side: str, timed: bool) -> None:
        pipe = pipes[side]
        dist.barrier()
        began = time.perf_counter()
        pipe.step(ids if pipe.needs_inputs else None, target=targets if pipe.needs_target else None)
        elapsed = time.perf_counter() - began
        dist.barrier()
        for param in pipe.parameters():
            param.grad = None
        if timed:
            part = pipe.ranks.find_part(ExpertParallel)
            found[side]["step_s"].append(elapsed)
            found[side]["waited_s"].append(part.exchanges()[1])
            found[side]["peak_bytes"] = max(found[side]["peak_bytes"], pipe.memory().peak_bytes)
            # The last timed step's all-to-alls as (posted, waited from, done): matched with the EP peer's below.
            found[side]["spans"] = [(posted, waited, done) for _, posted, waited, done in part.all_to_alls.spans]
            found[side]["ep_ranks"] = dist.get_process_group_ranks(part.group)

    for side in SIDES:
        step(side, timed=False)  # warm
    for index in range(rounds):
        for side in (SIDES if index % 2 == 0 else SIDES[::-1]):
            with meter.window(side):
                for _ in range(steps):
                    step(side, timed=True)
    found["timelines"] = {side: pipes[side].timeline() for side in SIDES}  # the last step's, every rank's
    found["steal"] = meter.ticks
    for pipe in pipes.values():
        pipe.close()
    return found


def _predicted(timeline, schedule: str, microbatches: int) -> dict:
    """Per side: the simulated timeline (step seconds, exposed all-to-all share) from the plain side's measured
    passes."""
    import conveyor.schedule as cs
    from conveyor.schedule.cost import CostModel, StageCosts, costs_from_timeline
    from conveyor.schedule.overlap import pair_forward_backward

    plain = cs.build(schedule, ranks=2, microbatches=microbatches, virtual=cs.available()[schedule].default_virtual)
    tokens = [span.duration for span in timeline.comm_spans if span.label != "counts"]
    exchange = statistics.median(tokens)
    measured = costs_from_timeline(timeline, plain.num_stages)
    # The plain side waits for each of a pass's two token all-to-alls: its compute is the rest.
    costs = CostModel(tuple(StageCosts(max(s.forward - 2 * exchange, 0.0), max(s.backward_input - 2 * exchange, 0.0),
                                       s.backward_weight, exchange=exchange, exchanges=2) for s in measured.stages))
    out = {}
    for side, sched in (("plain", plain), ("overlap", pair_forward_backward(plain))):
        out[side] = cs.simulate(sched, costs, time_unit="s")
    return out


def _summary(per_rank: list[dict], side: str) -> tuple[float, float]:
    """(median step seconds of the slowest rank, median exposed share of the slowest rank) over timed steps."""
    steps = len(per_rank[0][side]["step_s"])
    step = statistics.median(max(r[side]["step_s"][i] for r in per_rank) for i in range(steps))
    share = statistics.median(max(r[side]["waited_s"][i] / r[side]["step_s"][i] for r in per_rank)
                              for i in range(steps))
    return step, share


def _waiting_for_peers(per_rank: list[dict], side: str) -> tuple[float, float]:
    """Over the last timed step, the slowest rank's exposed share, and the part of it the rank waited before its
    EP peer had even posted the same all-to-all (both run the same program, so the k-th all-to-all of one is the
    k-th of the other; perf_counter is the machine's monotonic clock, shared by the processes)."""
    worst = (0.0, 0.0)
    for rank, found in enumerate(per_rank):
        mine = found[side]
        peer = per_rank[next(r for r in mine["ep_ranks"] if r != rank)][side]["spans"]
        step = mine["step_s"][-1]
        waited = sum(done - began for _, began, done in mine["spans"])
        before_peer = sum(max(0.0, min(done, theirs[0]) - began)
                          for (_, began, done), theirs in zip(mine["spans"], peer))
        worst = max(worst, (waited / step, before_peer / step))
    return worst


def _steal(per_rank: list[dict]) -> dict[str, float | None]:
    meter = StealMeter()
    meter.ticks = per_rank[0]["steal"]  # /proc/stat is the host's: rank 0's windows cover every rank
    return meter.percent()


def cases(text: str) -> list[tuple[str, int, float]]:
    """``--overlap-cases``: (schedule, microbatches, all-to-all ms) per case.

    Example:
        >>> cases("dualpipev:32:3,zbv:16:5")
        [('dualpipev', 32, 3.0), ('zbv', 16, 5.0)]
    """
    out = []
    for case in text.split(","):
        parts = case.split(":")
        if len(parts) != 3:
            raise SystemExit(f"--overlap-cases: {case!r} is not SCHEDULE:M:MS (e.g. dualpipev:32:3)")
        out.append((parts[0], int(parts[1]), float(parts[2])))
    return out


def run(args: argparse.Namespace) -> int:
    """Each case: both workloads, both sides: the tables, the memory per rank, the steal; the timelines drawn."""
    for schedule, microbatches, exchange_ms in cases(args.overlap_cases):
        _case(args, schedule, microbatches, exchange_ms)
    return 0


def _case(args: argparse.Namespace, schedule: str, microbatches: int, exchange_ms: float) -> None:
    from conveyor.schedule.render import to_png

    emulated = run_ranks(_rank, 4, args=(schedule, microbatches, args.overlap_rounds, args.overlap_steps,
                                         exchange_ms / 1e3), timeout_s=3000)
    predicted = _predicted(emulated[0]["timelines"]["plain"], schedule, microbatches)
    print(f"\nMoE recipe (configs/moe.yaml) at pp=2 x dp=2, ep=2, {schedule}, M={microbatches}, each all-to-all of "
          f"tokens held to {exchange_ms:g} ms; {args.overlap_rounds} rounds x {args.overlap_steps} "
          "steps per side, the sides alternating")
    print("| side | step ms (measured) | exposed all-to-all share (measured) | step ms (simulated) | exposed share "
          "(simulated) |")
    print("|---|---|---|---|---|")
    for side in SIDES:
        step, share = _summary(emulated, side)
        simulated = predicted[side]
        print(f"| {side} | {step * 1e3:.0f} | {share * 100:.1f}% | {simulated.makespan * 1e3:.0f} | "
              f"{simulated.summary().get('exposed_comm_share', 0.0) * 100:.1f}% |")
    print("steal: " + ", ".join(f"{side} {value:.1f}%" for side, value in _steal(emulated).items()
                                if value is not None))
    print("the last step's exposed share (slowest rank), and the part of it spent before the EP peer had posted "
          "the same all-to-all: " + "; ".join(
              f"{side} {total * 100:.1f}% ({before * 100:.1f}% before the peer)"
              for side in SIDES for total, before in [_waiting_for_peers(emulated, side)]))
    print("peak saved activations per rank (MiB): " + "; ".join(
        f"{side} " + ", ".join(f"{r[side]['peak_bytes'] / 2**20:.2f}" for r in emulated) for side in SIDES))
    RESULTS.mkdir(parents=True, exist_ok=True)
    picture = to_png([emulated[0]["timelines"]["plain"], emulated[0]["timelines"]["overlap"], predicted["plain"],
                      predicted["overlap"]], RESULTS / f"emulated_{schedule}.png",
                     titles=["measured, plain", "measured, overlapped pairs", "simulated, plain",
                             "simulated, overlapped pairs"], share_time=True)
    print(f"timelines (the last emulated step, then the simulator's), all-to-alls on a lane under each rank: {picture}")
    recipe = run_ranks(_rank, 4, args=(schedule, microbatches, args.overlap_rounds, args.overlap_steps, None),
                       timeout_s=3000)
    print("\nthe same recipe, gloo's all-to-alls as they come: step ms (slowest rank, median) " + ", ".join(
        f"{side} {_summary(recipe, side)[0] * 1e3:.0f}" for side in SIDES)
        + f" (overlap / plain {_summary(recipe, 'overlap')[0] / _summary(recipe, 'plain')[0]:.3f}); steal "
        + ", ".join(f"{side} {value:.1f}%" for side, value in _steal(recipe).items() if value is not None))
