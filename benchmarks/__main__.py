"""The one benchmark command: ``.venv/bin/python -m benchmarks`` (from the repository root).

Flags pick what runs (several may be given; none means ``--compare``):

    --compare    conveyor vs torch.distributed.pipelining on identical work (benchmarks/compare.py)
    --schedule   the schedule layer on a big schedule: build, lower, verify, simulate (benchmarks/schedule.py)
    --split      the frontend: splitting a 1.5B meta-device Llama, time-balanced splits (benchmarks/split.py)
    --soak       1,000 steps at P=4, watching each rank for leaks and drift (benchmarks/soak.py)
    --parallel   pp=2 x dp=2: parity with one process, and the share of the reduction hidden (benchmarks/parallel.py)
    --data       where data is read: each rank's peak RSS with a 200 MB dataset (benchmarks/data.py)
    --checkpoint checkpoint save / load of a 100M-parameter model, pretrained bytes per rank (benchmarks/checkpoint.py)
    --train      conveyor train: tokens/s at pp=2 vs pp=1, peak RSS per rank on a 200 MB corpus (benchmarks/train.py)
    --compile    compile=True vs eager: the GPT workload's step time at P=2 (benchmarks/compile.py)
    --schedule-scale  every built-in at P=256, M=2048: seconds and MB; one rank's start-up at P=64
                 (benchmarks/schedule_scale.py)
    --plan       predicted vs measured step time, plan by plan, emulated and GPT at P=2, 4 (benchmarks/plan.py)
    --tp-parity  pp=2 x dp=2 x tp=2 on 8 ranks: torch.equal to TP x DP without the pipeline (benchmarks/tp_parity.py)
    --tp         conveyor train's llama at pp=2 x tp=2 vs pp=2: each rank's parameter, gradient and AdamW bytes,
                 the step-time ratio with steal (benchmarks/tp_memory.py)
    --ep         pp=2 x dp=2 MoE at ep=2 vs ep=1: each rank's expert parameter, gradient and AdamW bytes, step
                 time and the all-to-all share of it, with steal (benchmarks/ep_memory.py)
    --varlen     batching by length vs padding to the longest at pp=2: tokens/s, padding, simulated step;
                 with --varlen-parity the schedule x transport parity table instead (benchmarks/varlen.py)
    --recompute  recomputation policies on the llama recipe at pp=2: peak memory per rank, predicted
                 and measured, and step time (benchmarks/recompute.py)
    --generate   pipe.generate at pp=2: decode tokens/s with 1 lane, 2 lanes, and the unsplit model's loop
                 (benchmarks/generate.py)
    --overlap    the MoE recipe at pp=2 x dp=2, ep=2: exposed all-to-all share and step time with and without
                 overlapped pairs, beside the simulator's; peak memory per rank (benchmarks/overlap.py)

``--quick`` shrinks the comparison's grid and the split's measurements. This module only
reads arguments; each part is a module with a ``run(args)``. benchmarks/README.md says how
the comparison measures.

Example:
    >>> args = build_parser().parse_args(["--compare", "--quick", "--workloads", "emulated"])
    >>> selected(args), args.quick, args.workloads
    (['compare'], True, 'emulated')
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

PARTS = (
    "compare", "schedule", "schedule_scale", "split", "soak", "parallel", "data", "checkpoint", "train", "compile",
    "plan", "tp_parity", "tp_memory", "ep_memory", "varlen", "recompute", "generate", "overlap",
)
RESULTS = Path(__file__).resolve().parent / "results"
# (schedule, stages per rank) compared by default; torch ships all but zb-h2.
DEFAULT_VARIANTS = (
    "gpipe:1,1f1b:1,interleaved-1f1b:2,looped-bfs:2,zb-h1:1,zb-h1:2,zb-h2:1,zbv:2,dualpipev:2"
)


def _add_compare(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--compare (conveyor vs torch.distributed.pipelining)")
    add = group.add_argument
    add("--workloads", default="emulated,overhead,gpt", help="comma list of emulated,overhead,gpt")
    add("--schedules", default=DEFAULT_VARIANTS, help="comma list of name:V (default: %(default)s)")
    add("--ranks", default="2,4,8", help="P values for the emulated workload")
    add("--microbatches", default="8,16,32", help="M values for the emulated workload")
    add("--overhead-ranks", default="2,4", help="P values for the overhead workload")
    add("--overhead-microbatches", default="64", help="M values for the overhead workload")
    add("--gpt-microbatches", default="8,16,32", help="M values for the GPT workload (P=2)")
    add("--sleep-ms", type=float, default=5.0, help="emulated F, I and W time per block")
    add("--repeats", type=int, default=5, help="timed steps per library per case")
    add("--warmup", type=int, default=2, help="untimed steps per library per case")
    add("--libraries", default="conveyor,torch", help="which sides to run")
    add("--step-timeout-s", type=float, default=120.0, help="a step slower than this fails the case")
    add(
        "--conveyor-option", action="append", default=[], metavar="KEY=VALUE",
        help="extra keyword for conveyor.Pipeline, e.g. fixed_shapes=True (repeatable; default none)",
    )
    add("--out", default=str(RESULTS), help="output folder (default: benchmarks/results)")
    add(
        "--render-only", action="store_true",
        help="redraw compare.md / .png from the summary compare.json, measuring nothing",
    )


def _add_others(parser: argparse.ArgumentParser) -> None:
    sizes = parser.add_argument_group("--schedule (the schedule layer on a big schedule)")
    sizes.add_argument("--schedule-name", default=None, metavar="NAME",
                      help="schedule to time (default: interleaved-1f1b, else looped-bfs, else 1f1b)")
    sizes.add_argument("--schedule-ranks", type=int, default=64, metavar="P")
    sizes.add_argument("--schedule-virtual", type=int, default=2, metavar="V")
    sizes.add_argument("--schedule-microbatches", type=int, default=1024, metavar="M")
    sizes.add_argument("--schedule-repeat", type=int, default=3, metavar="N", help="best of N")
    scale = parser.add_argument_group("--schedule-scale (every built-in at P=256, M=2048, in fresh processes)")
    scale.add_argument("--scale-ranks", type=int, default=256, metavar="P")
    scale.add_argument("--scale-microbatches", type=int, default=2048, metavar="M")
    scale.add_argument("--scale-schedules", default=None, metavar="A,B", help="default: every built-in")
    scale.add_argument("--scale-root", default=None, metavar="PATH", help="run another checkout's conveyor")
    scale.add_argument("--startup-ranks", type=int, default=64, metavar="P")
    scale.add_argument("--startup-microbatches", type=int, default=1024, metavar="M")
    scale.add_argument("--startup-schedules", default=None, metavar="A,B",
                       help="default: interleaved-1f1b,zbv")
    soak = parser.add_argument_group("--soak (leaks and drift over many steps)")
    soak.add_argument("--soak-steps", type=int, default=1000)
    soak.add_argument("--soak-ranks", type=int, default=4)
    soak.add_argument("--soak-schedule", default="zbv")
    soak.add_argument("--soak-microbatches", type=int, default=8)
    soak.add_argument("--soak-transport", default="auto")
    others = parser.add_argument_group("--parallel, --data, --checkpoint")
    others.add_argument("--parallel-steps", type=int, default=12, help="steps per overlap case (half each way)")
    others.add_argument("--data-mb", type=int, default=200, help="dataset size for --data")
    others.add_argument("--ckpt-layers", type=int, default=9, help="GPT-2-like layers for --checkpoint (9: ~100M)")
    others.add_argument("--ckpt-out", default=None, help="scratch folder for --checkpoint (default: a temporary one)")
    train = parser.add_argument_group("--train (conveyor train end to end)")
    train.add_argument("--train-rounds", type=int, default=3, help="pp=1 / pp=2 pairs, sides alternating")
    train.add_argument("--train-steps", type=int, default=12, help="steps per throughput run (the first 4 untimed)")
    train.add_argument("--train-skip-throughput", action="store_true", help="measure memory only")
    train.add_argument("--train-skip-memory", action="store_true", help="measure throughput only")
    predict = parser.add_argument_group("--plan (predicted vs measured step time)")
    predict.add_argument("--predict-workloads", default="emulated,gpt", help="comma list of emulated,gpt")
    predict.add_argument("--predict-ranks", default="2,4", help="P values (default: %(default)s)")
    predict.add_argument("--predict-schedules", default="1f1b:1,zb-h1:1,interleaved-1f1b:2,gpipe:1",
                         help="plans as name:V, the default split (default: %(default)s)")
    predict.add_argument("--predict-microbatches", type=int, default=8, metavar="M")
    predict.add_argument("--predict-rounds", type=int, default=4, help="timed rounds, plans rotating")
    predict.add_argument("--predict-steps", type=int, default=3, help="timed steps per plan per round")
    predict.add_argument("--predict-warmup", type=int, default=2, help="untimed steps per plan first")
    predict.add_argument("--predict-no-chosen", action="store_true",
                         help="leave out conveyor.plan.plan()'s own plan (by default measured with the others)")
    predict.add_argument("--predict-out", default=str(RESULTS / "plan"), help="output folder")
    recompute = parser.add_argument_group("--recompute (activation recomputation policies)")
    recompute.add_argument("--recompute-rounds", type=int, default=2, help="rounds, the policies rotating")
    recompute.add_argument("--recompute-steps", type=int, default=2, help="timed steps per policy per round")
    compiled = parser.add_argument_group("--compile (compile=True vs eager)")
    compiled.add_argument("--compile-rounds", type=int, default=6, help="rounds, the side going first alternating")
    compiled.add_argument("--compile-steps", type=int, default=3, help="timed steps per side per round")
    tp = parser.add_argument_group("--tp (tensor parallelism in conveyor train)")
    tp.add_argument("--tp-steps", type=int, default=8, help="steps per side, the first 2 untimed and the last measured")
    ep = parser.add_argument_group("--ep (expert parallelism: bytes per rank, all-to-all share)")
    ep.add_argument("--ep-steps", type=int, default=8, help="steps per side, the first 2 untimed")
    varlen = parser.add_argument_group("--varlen (batching by length vs padding to the longest)")
    varlen.add_argument("--varlen-parity", action="store_true", help="the schedule x transport parity table instead")
    varlen.add_argument("--varlen-bytes", type=int, default=600_000, help="bytes of stdlib definitions read")
    varlen.add_argument("--varlen-rounds", type=int, default=4, help="rounds, the side going first alternating")
    varlen.add_argument("--varlen-steps", type=int, default=4, help="steps per side per round (the first untimed)")
    generate = parser.add_argument_group("--generate (decode tokens/s: lanes, and the unsplit model)")
    generate.add_argument("--generate-rounds", type=int, default=3, help="timed rounds, the sides' order rotating")
    generate.add_argument("--generate-unsplit-threads", type=int, default=2, help="threads of the unsplit side")
    overlap = parser.add_argument_group("--overlap (expert parallelism's all-to-alls in overlapped pairs)")
    overlap.add_argument("--overlap-cases", default="dualpipev:32:3,zbv:16:5", metavar="SCHEDULE:M:MS,...",
                         help="each case: a schedule with 2 stages per rank, its microbatches, and the emulated "
                              "all-to-all of tokens' set time in ms (default: one the simulator says the pairs "
                              "hide, one it says they cannot)")
    overlap.add_argument("--overlap-rounds", type=int, default=3, help="rounds, the side going first alternating")
    overlap.add_argument("--overlap-steps", type=int, default=2, help="timed steps per side per round")


def build_parser() -> argparse.ArgumentParser:
    """Every flag of the command; the parts' own flags are grouped under each part's name."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n\n")[1], allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parts = parser.add_argument_group("what runs (none given: --compare)")
    parts.add_argument("--compare", action="store_true", help="conveyor vs torch.distributed.pipelining")
    parts.add_argument("--schedule", action="store_true", help="time the schedule layer on a big plan")
    parts.add_argument("--schedule-scale", action="store_true",
                       help="every built-in schedule at P=256, M=2048: seconds and MB (fresh processes)")
    parts.add_argument("--split", action="store_true", help="time the frontend's splitter")
    parts.add_argument("--soak", action="store_true", help="many steps, watching for leaks and drift")
    parts.add_argument("--parallel", action="store_true", help="pipeline x data parallelism: parity and overlap")
    parts.add_argument("--data", action="store_true", help="peak RSS per rank with a 200 MB dataset")
    parts.add_argument("--checkpoint", action="store_true", help="checkpoint and pretrained-weight I/O")
    parts.add_argument("--train", action="store_true", help="conveyor train: pp=2 speed-up, memory per rank")
    parts.add_argument("--compile", action="store_true", help="compile=True vs eager step time, GPT at P=2")
    parts.add_argument("--plan", action="store_true", help="predicted vs measured step time per plan")
    parts.add_argument("--tp-parity", action="store_true",
                       help="pp=2 x dp=2 x tp=2 (8 ranks), ddp and fsdp, 1f1b and zbv: parity without the pipeline")
    parts.add_argument("--tp", dest="tp_memory", action="store_true",
                       help="tensor parallelism in conveyor train: bytes per rank and step time, tp=2 vs tp=1")
    parts.add_argument("--ep", dest="ep_memory", action="store_true",
                       help="expert parallelism: expert bytes per rank and step time, ep=2 vs ep=1")
    parts.add_argument("--varlen", action="store_true", help="batching by length vs padding, at pp=2")
    parts.add_argument("--recompute", action="store_true",
                       help="recomputation policies: predicted and measured peak memory per rank, step time")
    parts.add_argument("--generate", action="store_true", help="decode tokens/s at pp=2: 1 lane, 2 lanes, unsplit")
    parts.add_argument("--overlap", action="store_true",
                       help="expert parallelism's all-to-alls with and without overlapped pairs (MoE, pp=2 x ep=2)")
    parts.add_argument(
        "--quick", action="store_true",
        help="compare: small grid, 3 repeats (~3 min); split: one Llama stage, fewer repeats; parallel: overlap only; "
        "plan: the GPT at P=2, 1f1b and zb-h1 and the planner's plan, one round (results/plan-quick)",
    )
    _add_compare(parser)
    _add_others(parser)
    return parser


def selected(args: argparse.Namespace) -> list[str]:
    """The parts to run, in a fixed order."""
    return [part for part in PARTS if getattr(args, part)] or ["compare"]


def main(argv: list[str] | None = None) -> int:
    """Run every selected part, one after the other; the worst exit status."""
    args = build_parser().parse_args(argv)
    status = 0
    for part in selected(args):
        module = importlib.import_module(f"benchmarks.{part}")
        if part in ("compare", "plan"):  # the parts that write results record the command
            status = max(status, module.run(args, argv))
        else:
            status = max(status, module.run(args))
    return status


if __name__ == "__main__":
    sys.exit(main())
