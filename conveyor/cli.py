"""The ``conveyor`` command: list, simulate and compare pipeline schedules.

Commands:
  conveyor schedules                       every registered schedule, the V it takes, what it does
  conveyor simulate --schedule 1f1b --ranks 4 --microbatches 8 [--png F] [--trace F] [--json]
  conveyor simulate --compare --ranks 4 --microbatches 8      every schedule side by side
  conveyor demo [key=value ...]            every schedule compared (out/compare.png), then the parity demo:
                                           conveyor train configs/demo.yaml, each step checked against one device
  conveyor train [CONFIG.yaml] [key=value ...]   train a model (defaults: a small GPT on the stdlib, 2 ranks)
  conveyor train CONFIG.yaml --dry-run     its split and memory per rank, nothing allocated or started
  conveyor export CHECKPOINT_DIR OUT_DIR   a checkpoint as Hugging Face safetensors (+ config.json)
  conveyor plan MODEL --ranks P --global-batch B --memory-per-rank 4GiB [--top K] [--out plan.json]
                                           the fastest split x schedule x M x V that fits, simulated

User mistakes print ``conveyor: error: ...`` and exit with status 2, never a traceback.

Example:
    >>> from conveyor.cli import main
    >>> main(["simulate", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8", "--json"])  # doctest: +ELLIPSIS
    {"schedule": "1f1b", "ranks": 4, ...}
    0
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import shutil
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

import conveyor.schedule as cs
from conveyor.errors import ConveyorError, UsageError
from conveyor.schedule.compare import (
    DEFAULT_COMPARE_PNG,
    DEFAULT_COSTS,
    Costs,
    check_finite,
    format_compare,
    format_schedule_list,
    format_simulation,
    run_compare,
    simulate_one,
    simulation_summary,
)
from conveyor.schedule.render import png_path, to_png, write_chrome_trace

USAGE_ERROR = 2

__all__ = ["build_parser", "main"]


# --------------------------------------------------------------------------- argument types


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (ranks, microbatches, stages per rank)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (>= 1), got {value}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (latency)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def parse_costs(text: str) -> Costs:
    """argparse type for ``--costs F,B,W``: forward, input-gradient, weight-gradient per stage.

    Example:
        >>> parse_costs("1,2,0.5")
        (1.0, 2.0, 0.5)
    """
    names = ("forward", "input-gradient", "weight-gradient")
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 3 or not all(parts):
        raise argparse.ArgumentTypeError(
            f"expected three comma-separated numbers F,B,W (forward, input-gradient, "
            f"weight-gradient time per stage), e.g. 1,2,1; got {text!r}"
        )
    values = []
    for name, part in zip(names, parts):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"the {name} cost must be a number, got {part!r} in {text!r}"
            ) from None
        if not math.isfinite(value) or value < 0:
            raise argparse.ArgumentTypeError(
                f"the {name} cost must be a finite number >= 0, got {part!r} in {text!r}"
            )
        values.append(value)
    return (values[0], values[1], values[2])


# --------------------------------------------------------------------------- commands


def _command_schedules(args: argparse.Namespace) -> int:
    print(format_schedule_list(cs.available().values()))
    return 0


# Beyond this many compute actions a simulation takes minutes and a picture says nothing.
MAX_SIMULATED_ACTIONS = 20_000_000


def _check_size(ranks: int, microbatches: int, virtual: int | None) -> None:
    stages = ranks * max(virtual or 1, 2)  # V-shaped schedules run 2 stages per rank by default
    actions = 3 * stages * microbatches
    if actions > MAX_SIMULATED_ACTIONS:
        raise UsageError(
            f"{ranks} ranks x {microbatches} microbatches means about {actions:.3g} actions to simulate; "
            f"conveyor simulate takes up to {MAX_SIMULATED_ACTIONS:.0e}: give fewer ranks or microbatches"
        )


def _command_simulate(args: argparse.Namespace) -> int:
    _check_size(args.ranks, args.microbatches, args.virtual)
    if args.compare:
        _print_compare(
            args.ranks,
            args.microbatches,
            args.virtual,
            args.costs,
            args.latency,
            png=png_path(args.png or DEFAULT_COMPARE_PNG),
            trace=args.trace,
            as_json=args.json,
        )
        return 0
    png = png_path(args.png) if args.png is not None else None
    timeline = simulate_one(
        args.schedule, args.ranks, args.microbatches, args.virtual, args.costs, args.latency
    )
    # Ends only grow along a rank's program, so an overflow shows in the last one: no list of every span.
    check_finite("the simulated timeline", [timeline.end])
    written = []
    if png:
        written.append(str(to_png(timeline, png)))
    if args.trace:
        written.append(str(write_chrome_trace(timeline, args.trace)))
    summary = simulation_summary(
        args.schedule, timeline, args.microbatches, args.costs, args.latency
    )
    if args.json:
        summary.update(png=str(png) if png else None, trace=str(args.trace) if args.trace else None)
        print(json.dumps(summary, allow_nan=False))
        return 0
    print(format_simulation(summary))
    for path in written:
        print(f"wrote {path}")
    return 0


def _print_compare(ranks, microbatches, virtual, costs, latency, *, png, trace, as_json) -> None:
    rows = run_compare(ranks, microbatches, virtual, costs, png, latency=latency, trace=trace)
    if as_json:
        drawn = any(row["error"] is None for row in rows)
        print(
            json.dumps(
                {
                    "ranks": ranks,
                    "microbatches": microbatches,
                    "schedules": rows,
                    "png": str(png) if drawn else None,
                    "trace": str(trace) if drawn and trace else None,
                },
                allow_nan=False,
            )
        )
        return
    print(format_compare(rows, ranks, microbatches, costs, png, trace))


def _command_demo(args: argparse.Namespace) -> int:
    """The plan of every schedule for the demo's sizes, then ``conveyor train configs/demo.yaml`` (with parity)."""
    from conveyor.train import launch

    shortcuts = [f"{key}={value}" for key, value in (("parallel.pp", args.ranks), ("train.steps", args.steps),
                                                      ("parallel.schedule", args.schedule)) if value is not None]
    # A wrong key fails here, before anything is drawn; key=value overrides come after the flags and win.
    cfg = launch.prepare([str(demo_recipe()), *shortcuts, *args.overrides])
    _print_compare(
        cfg.parallel.pp, cfg.parallel.microbatches, None, DEFAULT_COSTS, 0.0,
        png=DEFAULT_COMPARE_PNG, trace=None, as_json=False,
    )
    print()
    status = launch.run(cfg)
    timeline = Path(cfg.run.dir) / "timeline.png"
    if status == 0 and args.png is not None and timeline.is_file():
        shutil.copyfile(timeline, args.png)
        print(f"conveyor demo: the last step's timeline, measured beside its simulation: {args.png}")
    return status


CONFIGS = Path(__file__).resolve().parents[1] / "configs"  # the recipes, beside the package in a checkout


def recipe_files() -> list[str]:
    """Every recipe of the checkout (``configs/*.yaml``), as ``conveyor train --help`` lists them: read from
    the folder, so a recipe added there is listed too ([] for an install without the folder).

    Example:
        >>> recipes = recipe_files()
        >>> "configs/gpt.yaml" in recipes and "configs/moe.yaml" in recipes, recipes == sorted(recipes)
        (True, True)
    """
    return [f"{CONFIGS.name}/{path.name}" for path in sorted(CONFIGS.glob("*.yaml"))]


def demo_recipe():
    """``configs/demo.yaml`` beside the package: the recipe ``conveyor demo`` trains.

    Example:
        >>> demo_recipe().name
        'demo.yaml'
    """

    recipe = CONFIGS / "demo.yaml"
    if not recipe.is_file():
        raise UsageError(f"conveyor demo trains {recipe}, which is not there: run it from a checkout of the "
                         f"repository (the configs/ folder beside conveyor/)")
    return recipe


def _command_train(args: argparse.Namespace) -> int:
    """Check the config, then train on local ranks (or as this rank, under torchrun)."""
    from conveyor.train import launch

    if args.dry_run:
        from conveyor.train.dry_run import dry_run

        return dry_run(launch.prepare(args.arguments))
    return launch.main(args.arguments)


def _command_export(args: argparse.Namespace) -> int:
    """A checkpoint as safetensors; the work is conveyor.checkpoint.export's."""
    from conveyor.checkpoint.export import export

    written = export(args.checkpoint, args.out_dir, max_shard_size=args.max_shard_size)
    print(f"wrote {len(written)} safetensors file(s) to {args.out_dir}")
    return 0


# --------------------------------------------------------------------------- parser and entry point


class _Parser(argparse.ArgumentParser):
    """Every parse error reads ``conveyor: error: ...``, subcommands included."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(USAGE_ERROR, f"conveyor: error: {message}\n")


def _attach_option_values(argv: Sequence[str]) -> list[str]:
    # argparse reads "--costs -1,1,1" as a missing value followed by an unknown option;
    # joining it into "--costs=-1,1,1" lets parse_costs report the negative cost instead.
    out: list[str] = []
    for token in argv:
        if out and out[-1] == "--costs" and token.startswith("-") and "," in token:
            out[-1] = f"--costs={token}"
        else:
            out.append(token)
    return out


def _train_options_first(argv: list[str]) -> list[str]:
    # argparse ends `CONFIG.yaml key=value ...` (nargs="*") at the first option and refuses the
    # rest, so "conveyor train c.yaml --dry-run train.steps=3" would fail; the flag moves first.
    if argv[:1] != ["train"]:
        return argv
    rest = argv[1:]
    return ["train", *[a for a in rest if a == "--dry-run"], *[a for a in rest if a != "--dry-run"]]


def _add_demo(commands) -> None:
    demo = commands.add_parser(
        "demo",
        help="plan every schedule, then train a small transformer pipelined over local CPU ranks, each step "
        "checked bitwise against one device: conveyor train configs/demo.yaml [key=value ...]",
        description="Simulate every schedule for the demo's ranks and microbatches (out/compare.png), then run "
        "`conveyor train configs/demo.yaml` with the overrides given: rank 0 also trains the unsplit model on "
        "one device (train.parity) and prints each step's loss and gradient norm beside the pipeline's.",
    )
    demo.add_argument("overrides", nargs="*", metavar="key=value",
                      help="overrides of configs/demo.yaml, e.g. parallel.pp=4 parallel.schedule=zbv train.steps=10")
    demo.add_argument("--ranks", type=positive_int, help="pipeline ranks: short for parallel.pp=N")
    demo.add_argument("--steps", type=positive_int, help="training steps: short for train.steps=N")
    demo.add_argument("--schedule", help="schedule name: short for parallel.schedule=NAME")
    demo.add_argument("--png", help="also copy the last step's timeline picture (<run.dir>/timeline.png) here")
    demo.set_defaults(handler=_command_demo)


def _add_train(commands) -> None:
    from conveyor.train.config import config_reference

    train = commands.add_parser(
        "train", help="train a model pipelined over local CPU ranks: conveyor train [CONFIG.yaml] [key=value ...]",
        description=textwrap.fill("Train from a YAML config and section.key=value overrides (no arguments: a small GPT "
        f"on the Python standard library's sources, over 2 local ranks). Recipes: {_recipe_list()}; model.name "
        "also takes hf:<transformers class> or a local pretrained directory.", width=100), epilog=config_reference(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("arguments", nargs="*", metavar="CONFIG.yaml | key=value",
                       help="an optional YAML config first, then overrides such as train.steps=50")
    train.add_argument("--dry-run", action="store_true",
                       help="start nothing: build the model on the meta device, split it as the run would and "
                       "print each stage's rank, modules and parameters and the predicted memory per rank "
                       "(fp32 parameters, gradients, AdamW state, and the activations the schedule keeps in flight)")
    train.set_defaults(handler=_command_train)


def _recipe_list() -> str:
    recipes = [f"{name} (the defaults)" if name.endswith("/gpt.yaml") else name for name in recipe_files()]
    return ", ".join(recipes) or "the configs/ folder of a checkout of the repository"


def build_parser() -> argparse.ArgumentParser:
    from conveyor.train import generate_command, plan_command

    parser = _Parser(
        prog="conveyor",
        description="Pipeline-parallel training for PyTorch: inspect and compare schedules.",
    )
    commands = parser.add_subparsers(dest="command", metavar="command", required=True)

    listing = commands.add_parser("schedules", help="list the registered schedules")
    listing.set_defaults(handler=_command_schedules)

    simulate = commands.add_parser(
        "simulate",
        help="simulate one schedule (or --compare all of them)",
        description="Simulate a schedule with uniform per-stage costs and report makespan, "
        "bubble ratio and peak activations.",
    )
    which = simulate.add_mutually_exclusive_group(required=True)
    which.add_argument("--schedule", metavar="NAME", help="a name from `conveyor schedules`")
    which.add_argument(
        "--compare",
        action="store_true",
        help="simulate every registered schedule for the same sizes",
    )
    simulate.add_argument("--ranks", "-p", type=positive_int, required=True, metavar="P")
    simulate.add_argument("--microbatches", "-m", type=positive_int, required=True, metavar="M")
    simulate.add_argument(
        "--virtual",
        "-v",
        type=positive_int,
        metavar="V",
        help="stages per rank (default: the schedule's)",
    )
    simulate.add_argument(
        "--costs",
        type=parse_costs,
        default=DEFAULT_COSTS,
        metavar="F,B,W",
        help="per-stage forward, input-gradient and weight-gradient times; a full backward "
        "costs B+W (default 1,1,1)",
    )
    simulate.add_argument(
        "--latency",
        type=non_negative_float,
        default=0.0,
        metavar="L",
        help="time of one p2p message",
    )
    simulate.add_argument(
        "--png", metavar="FILE", help=f"draw the timeline (compare: default {DEFAULT_COMPARE_PNG})"
    )
    simulate.add_argument(
        "--trace", metavar="FILE", help="write a Chrome trace (open in ui.perfetto.dev)"
    )
    simulate.add_argument(
        "--json", action="store_true", help="print one JSON object instead of text"
    )
    simulate.set_defaults(handler=_command_simulate)

    _add_demo(commands)

    _add_train(commands)
    plan_command.add_parser(commands, positive_int)
    generate_command.add_parser(commands, positive_int)

    export = commands.add_parser("export", help="write a checkpoint as Hugging Face safetensors (+ config.json)")
    export.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a checkpoint, or a directory with `latest`")
    export.add_argument("out_dir", metavar="OUT_DIR", help="where the safetensors files go")
    export.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="shard files above this size, e.g. 5GB or 500MiB (default 5GB)")
    export.set_defaults(handler=_command_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``conveyor`` command; returns the exit status (0 ok, 2 usage error).

    Example:
        >>> main(["schedules"])  # doctest: +ELLIPSIS
        gpipe ...
        0
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(_attach_option_values(_train_options_first(argv)))
    except SystemExit as exit_:
        # argparse already printed "conveyor: error: ..." (or the help, with code 0).
        return exit_.code if isinstance(exit_.code, int) else USAGE_ERROR
    try:
        return args.handler(args)
    except (ConveyorError, ValueError) as error:
        print(f"conveyor: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except OSError as error:
        print(f"conveyor: error: cannot write output: {error}", file=sys.stderr)
        return USAGE_ERROR


def command() -> NoReturn:
    """The ``conveyor`` console script (and ``python -m conveyor.cli``): :func:`main`, then the exit.

    After a command returns, its files are closed and its ranks gone; what a normal interpreter exit adds
    is tearing down every module torch and transformers loaded, object by object: 1.1 s of CPU after
    ``conveyor train`` on the 2-core test machine, for nothing the command left behind. So the atexit
    handlers run as at a normal exit (logging's flush, multiprocessing's joins, torch's own), the output
    is flushed, and the process ends with main's status without the teardown. An exception out of main
    is not caught here: it prints its traceback and exits 1 as usual.
    """
    status = main()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    command()
