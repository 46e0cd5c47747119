"""The ``conveyor`` command: list, simulate and compare pipeline schedules.

Commands:
  conveyor schedules                       every registered schedule, the V it takes, what it does
  conveyor simulate --schedule 1f1b --ranks 4 --microbatches 8 [--png F] [--trace F] [--json]
  conveyor simulate --compare --ranks 4 --microbatches 8      every schedule side by side
  conveyor demo                            the compare for P=4, M=8, drawn to out/compare.png
  conveyor export CHECKPOINT_DIR OUT_DIR   a checkpoint as Hugging Face safetensors (+ config.json)

User mistakes print ``conveyor: error: ...`` and exit with status 2, never a traceback.

Example:
    >>> from conveyor.cli import main
    >>> main(["simulate", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8", "--json"])  # doctest: +ELLIPSIS
    {"schedule": "1f1b", "ranks": 4, ...}
    0
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from conveyor.errors import ConveyorError

logger = logging.getLogger(__name__)

DEFAULT_COMPARE_PNG = "out/compare.png"
USAGE_ERROR = 2

# (forward, input-gradient, weight-gradient) time per stage and microbatch.
Costs = tuple[float, float, float]
DEFAULT_COSTS: Costs = (1.0, 1.0, 1.0)


class UsageError(ConveyorError, ValueError):
    """A command-line argument that cannot work; printed as ``conveyor: error: ...``."""


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


# --------------------------------------------------------------------------- library-facing helpers


def virtual_description(info) -> str:
    """The stages per rank a registered schedule takes, e.g. ``"V=1"`` or ``"V>=1 (default 2)"``."""
    if info.virtual_choices is None:
        return f"V>=1 (default {info.default_virtual})"
    if len(info.virtual_choices) == 1:
        return f"V={info.virtual_choices[0]}"
    choices = ",".join(map(str, info.virtual_choices))
    return f"V in {choices} (default {info.default_virtual})"


def simulate_one(
    schedule: str,
    ranks: int,
    microbatches: int,
    virtual: int | None = None,
    costs: Costs = DEFAULT_COSTS,
    latency: float = 0.0,
):
    """Build, verify and simulate one registered schedule on uniform per-stage costs.

    Example:
        >>> round(simulate_one("1f1b", 4, 8).bubble_ratio, 3)
        0.273
    """
    import conveyor.schedule as cs

    # simulate() verifies the schedule itself; build(check=True) would verify it twice.
    built = cs.build(schedule, ranks=ranks, microbatches=microbatches, virtual=virtual, check=False)
    forward, backward_input, backward_weight = costs
    model = cs.CostModel.uniform(
        built.num_stages, forward, backward_input, backward_weight, latency=latency
    )
    return cs.simulate(built, model)


def run_compare(
    ranks: int,
    microbatches: int,
    virtual: int | None = None,
    costs: Costs | None = None,
    png: str | Path | None = DEFAULT_COMPARE_PNG,
    *,
    latency: float = 0.0,
    trace: str | Path | None = None,
    same_model: bool = True,
) -> list[dict]:
    """Simulate every registered schedule for the same sizes; one row per schedule.

    Each schedule runs its default V, or ``virtual`` where it accepts that value.
    With ``same_model`` (the default) every schedule simulates the same model:
    ``costs`` are those of 1/P of it, so a schedule with V stages per rank runs
    each stage at ``costs / V`` and makespans compare directly;
    ``peak_activation_share`` is the peak divided by V, in units of one
    (1/P-model, microbatch) activation. A schedule that cannot serve the sizes
    gets a row whose ``error`` holds the rule it breaks instead of figures. All
    simulated ones are drawn into ``png`` on one time axis (``None`` draws
    nothing) and, if given, into one Chrome trace.

    Example:
        >>> rows = run_compare(4, 8, png=None)
        >>> [(r["schedule"], r["makespan"], r["peak_activations_max"]) for r in rows][:2]
        [('gpipe', 33.0, 8), ('1f1b', 33.0, 4)]
    """
    import conveyor.schedule as cs

    costs = DEFAULT_COSTS if costs is None else costs
    rows, timelines = [], []
    for name, info in cs.available().items():
        accepts = virtual is not None and (
            info.virtual_choices is None or virtual in info.virtual_choices
        )
        chosen = virtual if accepts else info.default_virtual
        divisor = chosen if same_model else 1
        stage_costs = (costs[0] / divisor, costs[1] / divisor, costs[2] / divisor)
        row: dict = {"schedule": name, "virtual": chosen, "stage_costs": list(stage_costs)}
        try:
            timeline = simulate_one(name, ranks, microbatches, chosen, stage_costs, latency)
        except ConveyorError as error:
            # The rule is the first line; deadlock reports add rank-by-rank detail below it.
            row.update(
                makespan=None,
                bubble_ratio=None,
                peak_activations=None,
                peak_activations_max=None,
                peak_activation_share=None,
                error=str(error).splitlines()[0],
            )
        else:
            peaks = timeline.peak_activations()
            row.update(
                makespan=timeline.makespan,
                bubble_ratio=timeline.bubble_ratio,
                peak_activations=peaks,
                peak_activations_max=max(peaks),
                peak_activation_share=max(peaks) / divisor,
                error=None,
            )
            timelines.append(timeline)
        rows.append(row)
    _check_finite("a simulated makespan", [row["makespan"] for row in rows if row["error"] is None])
    if timelines and png is not None:
        from conveyor.schedule.render import to_png

        to_png(timelines, png, share_time=True)
    if timelines and trace is not None:
        from conveyor.schedule.render import write_chrome_trace

        write_chrome_trace(timelines, trace)
    return rows


def _number(value: float) -> str:
    # Two decimals at most, no trailing zeros, never exponent notation: 33, 28.5, 18.67, 3261.
    return f"{value:.2f}".rstrip("0").rstrip(".")


def format_compare_table(rows: Sequence[dict]) -> str:
    """The rows of :func:`run_compare` as an aligned text table.

    Example:
        >>> print(format_compare_table([{"schedule": "1f1b", "virtual": 1, "makespan": 33.0,
        ...     "bubble_ratio": 3 / 11, "peak_activations_max": 4,
        ...     "peak_activation_share": 4.0, "error": None}]))
        schedule  V  makespan  bubble  peak act.  = x model/P
        1f1b      1        33   27.3%          4            4
    """
    header = ("schedule", "V", "makespan", "bubble", "peak act.", "= x model/P")
    cells = []
    for row in rows:
        if row["error"] is None:
            figures = (
                _number(row["makespan"]),
                f"{row['bubble_ratio']:.1%}",
                str(row["peak_activations_max"]),
                _number(row["peak_activation_share"]),
            )
            note = ""
        else:
            figures = ("-", "-", "-", "-")
            note = f"cannot serve: {row['error']}"
        cells.append((row["schedule"], str(row["virtual"]), *figures, note))
    name_width = max([len(header[0])] + [len(c[0]) for c in cells]) + 1
    widths = [name_width, 2, 10, 8, 11, 13]

    def line(values: Sequence[str]) -> str:
        text = f"{values[0]:<{widths[0]}}"
        return text + "".join(f"{v:>{w}}" for v, w in zip(values[1:], widths[1:]))

    out = [line(header)]
    for *values, note in cells:
        out.append(f"{line(values)}  {note}" if note else line(values))
    return "\n".join(out)


# --------------------------------------------------------------------------- commands


def _command_schedules(args: argparse.Namespace) -> int:
    import conveyor.schedule as cs

    infos = list(cs.available().values())
    name_width = max(len(info.name) for info in infos)
    v_width = max(len(virtual_description(info)) for info in infos)
    for info in infos:
        print(
            f"{info.name:<{name_width}}  {virtual_description(info):<{v_width}}  {info.description}".rstrip()
        )
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


def _check_finite(what: str, values) -> None:
    if not all(math.isfinite(v) for v in values):
        raise UsageError(
            f"{what} overflows a float with these costs and latency (a sum reached inf); give smaller numbers"
        )


def _png_of(path):
    if path is None:
        return None
    from conveyor.schedule.render import png_path

    return png_path(path)


def _command_simulate(args: argparse.Namespace) -> int:
    _check_size(args.ranks, args.microbatches, args.virtual)
    if args.compare:
        return _print_compare(
            args.ranks,
            args.microbatches,
            args.virtual,
            args.costs,
            args.latency,
            png=_png_of(args.png or DEFAULT_COMPARE_PNG),
            trace=args.trace,
            as_json=args.json,
        )
    png = _png_of(args.png)
    timeline = simulate_one(
        args.schedule, args.ranks, args.microbatches, args.virtual, args.costs, args.latency
    )
    _check_finite("the simulated timeline", [span.end for span in timeline.spans])
    written = []
    if png:
        from conveyor.schedule.render import to_png

        written.append(str(to_png(timeline, png)))
    if args.trace:
        from conveyor.schedule.render import write_chrome_trace

        written.append(str(write_chrome_trace(timeline, args.trace)))
    forward, backward_input, backward_weight = args.costs
    peaks = timeline.peak_activations()
    result = {
        "schedule": args.schedule,
        "ranks": timeline.num_ranks,
        "virtual": timeline.metadata["virtual"],
        "stages": timeline.num_ranks * timeline.metadata["virtual"],
        "microbatches": args.microbatches,
        "costs": {
            "forward": forward,
            "backward_input": backward_input,
            "backward_weight": backward_weight,
        },
        "latency": args.latency,
        "makespan": timeline.makespan,
        "bubble_ratio": timeline.bubble_ratio,
        "peak_activations": peaks,
        "busy": _busy_per_rank(timeline),
        "png": str(png) if png else None,
        "trace": str(args.trace) if args.trace else None,
    }
    if args.json:
        print(json.dumps(result, allow_nan=False))
        return 0
    print(
        f"{args.schedule}: {result['ranks']} ranks x {result['virtual']} stage(s) per rank = "
        f"{result['stages']} stages, {args.microbatches} microbatches"
    )
    print(
        f"costs per stage: forward {forward:g}, input-gradient {backward_input:g}, "
        f"weight-gradient {backward_weight:g} (full backward {backward_input + backward_weight:g}); "
        f"latency {args.latency:g}"
    )
    print(f"makespan          {timeline.makespan:g} units")
    print(f"bubble ratio      {timeline.bubble_ratio:.1%}")
    print("peak activations  " + " ".join(f"r{rank}:{peak}" for rank, peak in enumerate(peaks)))
    print("                  (live microbatch-stages per rank)")
    for path in written:
        print(f"wrote {path}")
    return 0


def _busy_per_rank(timeline) -> list[float]:
    # One pass over the spans; Timeline.busy_time(rank) scans them all once per rank.
    busy = [0.0] * timeline.num_ranks
    for span in timeline.spans:
        if span.action.kind.is_compute:
            busy[span.rank] += span.end - span.start
    return busy


def _print_compare(ranks, microbatches, virtual, costs, latency, *, png, trace, as_json) -> int:
    rows = run_compare(ranks, microbatches, virtual, costs, png, latency=latency, trace=trace)
    drawn = any(row["error"] is None for row in rows)
    if as_json:
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
        return 0
    print(
        f"P={ranks} ranks, M={microbatches} microbatches; costs F,B,W = "
        f"{','.join(f'{c:g}' for c in costs)} per 1/P of the model (each of V stages per rank: costs/V)"
    )
    print(format_compare_table(rows))
    print(
        "peak act.: live (stage, microbatch) activations on the busiest rank; x model/P: that / V"
    )
    if drawn:
        print(f"wrote {png}")
        if trace:
            print(f"wrote {trace}")
    else:
        print("no schedule can serve these sizes; nothing drawn")
    return 0


def _command_demo(args: argparse.Namespace) -> int:
    """The plan of every schedule for the demo's sizes, then the real pipelined training run."""
    from conveyor.train import demo

    options = demo.build_parser().parse_args(args.options)
    demo.check_options(options)  # a wrong option fails before anything is printed or drawn
    status = _print_compare(
        options.ranks, options.microbatches, None, DEFAULT_COSTS, 0.0,
        png=DEFAULT_COMPARE_PNG, trace=None, as_json=False,
    )
    if status:
        return status
    print()
    return demo.launch(args.options)


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


def build_parser() -> argparse.ArgumentParser:
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

    demo = commands.add_parser(
        "demo",
        help="plan every schedule, then train a small transformer pipelined over local CPU ranks "
        "(options: conveyor demo -- --help)",
    )
    demo.add_argument("options", nargs=argparse.REMAINDER, help="options of the training demo")
    demo.set_defaults(handler=_command_demo)

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
        if argv[:1] == ["demo"]:
            # The demo's own options belong to the training demo's parser, not this one.
            args = argparse.Namespace(handler=_command_demo, options=argv[1:])
        else:
            args = parser.parse_args(_attach_option_values(argv))
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


if __name__ == "__main__":
    sys.exit(main())
