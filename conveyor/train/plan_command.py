"""``conveyor plan MODEL``: the model a name stands for, its plan, the table, the plan file.

``MODEL`` is a recipe (``gpt``, ``llama``, ``mpt``), ``hf:<transformers class>``, a config YAML
as ``conveyor train`` takes (its ``model`` section; ``--set section.key=value`` overrides any
key, e.g. ``--set model.layers=8 --set model.hf_config.rope_theta=5e5``), or
``package.module:function`` returning ``(model, example_microbatch)``. Config models get one
microbatch of token ids of ``model.seq_len`` for the smallest microbatch the search may pick.
``--analytic`` builds the model on the meta device and costs it from its shapes instead of
running it (a 70B config plans in seconds). ``--tp`` (default ``auto``: every divisor of ``--ranks``)
tries each tensor-parallel size with ``pp = ranks / tp`` pipeline ranks (tp innermost), the model's
units costed as one TP rank runs them (:mod:`conveyor.plan.tensor_search`), and prints a line per tp with
its best plan and why it won or lost (a size tp does not divide, over memory, how much slower);
``--tp 1`` plans a pipeline of ``--ranks`` ranks alone. ``--ep`` (with ``--dp`` replicas) tries each
expert-parallel size for a mixture-of-experts model at the same pipeline ranks, its units costed as one EP
rank runs them (:mod:`conveyor.plan.expert_search`: the experts' parameters divided by ep, two all-to-alls
in each forward and backward of an experts module), and prints a line per ep.

Example:
    >>> from conveyor.cli import main
    >>> main(["plan", "gpt", "--ranks", "2", "--global-batch", "4", "--memory-per-rank", "1GiB", "--analytic",
    ...       "--set", "model.layers=2", "--set", "model.width=32"])  # doctest: +ELLIPSIS
    tensor parallel: 2 ranks as pp x tp (tp innermost, inside a node)...
       1    2  ...
       2    1  ...
      #  schedule ...
    0
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import time
from typing import Any

from conveyor.errors import UsageError


def add_parser(commands: Any, positive_int: Any) -> None:
    """The ``plan`` subcommand's options, on the ``conveyor`` parser's ``commands``; :func:`run` handles it."""
    plan = commands.add_parser(
        "plan", help="choose split, schedule, microbatches and stages per rank for a model under a memory budget",
        description="Profile each splittable unit of MODEL (F, I, W time; activation and parameter memory), "
        "simulate every schedule x microbatch count x stages per rank on the best split for it, and print the "
        "fastest plans that fit --memory-per-rank (parameters, gradients, AdamW state and activations).")
    plan.add_argument("model", metavar="MODEL",
                      help="gpt | llama | mpt | hf:<class> | CONFIG.yaml | package.module:function")
    plan.add_argument("--ranks", "-p", type=positive_int, required=True, metavar="P")
    plan.add_argument("--global-batch", "-b", type=positive_int, required=True, metavar="B",
                      help="samples per optimizer step over the pipeline")
    plan.add_argument("--memory-per-rank", default="inf", metavar="SIZE", help="e.g. 4GiB, 80GB (default: no limit)")
    plan.add_argument("--top", type=positive_int, default=5, metavar="K",
                      help="plans to list (SearchSpace.top; default 5)")
    plan.add_argument("--out", metavar="PLAN.json", help="write the chosen plan here")
    plan.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="a config override for recipe/config models, e.g. model.layers=8 (repeatable)")
    plan.add_argument("--schedules", metavar="A,B", help="only these schedules (default: every registered one)")
    plan.add_argument("--analytic", action="store_true",
                      help="cost the model from its shapes on the meta device instead of running it")
    plan.add_argument("--flops", type=float, default=None, metavar="FLOP/S",
                      help="sustained device throughput for --analytic (Machine.flops_per_second; default 4e14)")
    plan.add_argument("--repeats", type=positive_int, default=3,
                      help="timed rounds per unit, best kept (Measurement.repeats)")
    plan.add_argument("--tp", default="auto", metavar="auto|T,T",
                      help="tensor-parallel sizes to try, each with pp = P / tp (tp innermost, inside a node): 'auto' "
                           "(default): every divisor of --ranks; '1': a pipeline of P ranks alone "
                           "(SearchSpace.tensor_parallel)")
    plan.add_argument("--dp", type=positive_int, default=1, metavar="D",
                      help="replicas of the pipeline, for --ep to borrow from (--global-batch stays one replica's)")
    plan.add_argument("--ep", default="1", metavar="auto|E,E",
                      help="expert-parallel sizes to try for a mixture-of-experts model, each dividing --dp and the "
                           "expert count: the experts of each module shared by ep replicas, their tokens moved "
                           "all-to-all ('auto': every divisor of --dp; default 1: none). With --tp, (tp, ep) pairs "
                           "are searched, ep among the divisors of --dp x tp (each TP rank's tokens moved) "
                           "(SearchSpace.expert_parallel)")
    plan.add_argument("--calibrate", action="store_true",
                      help="measure this machine's runtime overheads first (a few seconds) and predict the step "
                           "with them and each rank's AdamW step: the step a real run is checked against "
                           "(Machine.calibration)")
    plan.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Build the model, plan it, print the table, write the file."""
    from conveyor.plan import Machine, Measurement, SearchSpace, format_plan, parse_size
    from conveyor.plan.planner import plan
    from conveyor.plan.search import microbatch_choices

    limit = parse_size(args.memory_per_rank)
    started = time.perf_counter()
    smallest = args.global_batch // max(microbatch_choices(args.global_batch, args.ranks))
    model, example = resolve_model(args.model, args.set, analytic=args.analytic, microbatch=smallest)
    machine = Machine() if args.flops is None else Machine(flops_per_second=args.flops)
    if args.calibrate:
        import conveyor
        from conveyor.plan.calibration import calibrate

        machine = dataclasses.replace(machine, calibration=calibrate(conveyor.Pipeline, ranks=args.ranks))
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()] if args.schedules else None
    dp, ep, tp = args.dp, args.ep, args.tp
    options = tensor_parallel_options(model, example, args.ranks, tp)
    if ep.strip() != "1" and options:  # (tp, ep) pairs: each ep sized for each tp, dividing dp x tp
        experts = tuple(option for tensor in options
                        for option in expert_parallel_options(model, example, dp, ep, tp=tensor.tp))
    else:
        experts = expert_parallel_options(model, example, dp, ep)
    chosen = plan(model, example, ranks=args.ranks, global_batch=args.global_batch, memory_per_rank=limit,
                  schedules=schedules, space=SearchSpace(top=args.top, tensor_parallel=options,
                                                         expert_parallel=experts),
                  machine=machine, measure=Measurement(repeats=args.repeats))
    print(format_plan(chosen, top=args.top))
    print(f"planned in {time.perf_counter() - started:.1f} s")
    if args.out:
        print(f"wrote {chosen.save(args.out)}")
    return 0


def tensor_parallel_options(model: Any, example: Any, ranks: int, spec: str) -> tuple:
    """The :class:`~conveyor.plan.tensor_search.TensorParallelOption` records ``--tp`` asks for (empty for tp=1 alone:
    the ranks are the pipeline's, as before tensor parallelism).

    Example:
        >>> model, example = resolve_model("llama", ["model.layers=2", "model.width=32", "model.heads=2"],
        ...                                analytic=True, microbatch=1)
        >>> [(o.tp, o.refused is None) for o in tensor_parallel_options(model, example, 4, "auto")]
        [(1, True), (2, True), (4, False)]
    """
    from conveyor.train.tensor_parallel import tensor_parallel_option

    sizes = _sizes("--tp", spec, "tensor-parallel", ranks, "--ranks", "pp = ranks / tp")
    if sizes == [1]:
        return ()
    seq_len = int(example.shape[1]) if getattr(example, "dim", lambda: 0)() >= 2 else 1
    return tuple(tensor_parallel_option(model, tp, seq_len) for tp in sizes)


def expert_parallel_options(model: Any, example: Any, dp: int, spec: str, *, tp: int | None = None) -> tuple:
    """The :class:`~conveyor.plan.expert_search.ExpertParallelOption` records ``--ep`` asks for (empty for ep=1
    alone: the experts stay whole on every replica). With ``tp`` (planned beside ``--tp``): the options sized for
    that tp, ep among the divisors of ``dp x tp`` ('auto'), a size that does not divide it refused, ep=1 kept.

    Example:
        >>> model, example = resolve_model("moe", ["model.layers=2", "model.width=32", "model.heads=2"],
        ...                                analytic=True, microbatch=1)
        >>> [(o.ep, o.refused is None) for o in expert_parallel_options(model, example, 4, "auto")]
        [(1, True), (2, True), (4, True)]
    """
    from conveyor.plan.tensor_search import tp_sizes
    from conveyor.train.expert_shards import expert_parallel_option

    seq_len = int(example.shape[1]) if getattr(example, "dim", lambda: 0)() >= 2 else 1
    if tp is not None:
        sizes = tp_sizes(dp * tp) if spec.strip() == "auto" else [1, *_listed("--ep", spec, "expert-parallel")]
        return tuple(expert_parallel_option(model, ep, dp, seq_len, tp=tp) for ep in sorted(set(sizes)))
    sizes = _sizes("--ep", spec, "expert-parallel", dp, "--dp", "ep borrows the replicas' ranks")
    if sizes == [1]:
        return ()
    return tuple(expert_parallel_option(model, ep, dp, seq_len) for ep in sizes)


def _sizes(flag: str, spec: str, what: str, total: int, total_flag: str, why: str) -> list[int]:
    """The sizes ``flag`` asks for: 'auto' (every divisor of ``total``) or a comma list, each dividing ``total``.

    Example:
        >>> _sizes("--tp", "auto", "tensor-parallel", 4, "--ranks", "pp = ranks / tp")
        [1, 2, 4]
    """
    from conveyor.plan.tensor_search import tp_sizes

    divisors = tp_sizes(total)
    if spec.strip() == "auto":
        return divisors
    sizes = _listed(flag, spec, what)
    if any(total % size for size in sizes):
        raise UsageError(f"{flag} {spec!r}: each size must divide {total_flag} {total} ({why}); try some of "
                         f"{', '.join(map(str, divisors))}")
    return sizes


def _listed(flag: str, spec: str, what: str) -> list[int]:
    """The positive sizes of a comma list such as ``1,2,4``, ascending (a UsageError naming ``flag`` otherwise)."""
    try:
        sizes = sorted({int(part) for part in spec.split(",") if part.strip()})
    except ValueError:
        raise UsageError(f"{flag} {spec!r}: expected 'auto' or {what} sizes such as 1,2,4") from None
    if not sizes or sizes[0] < 1:
        raise UsageError(f"{flag} {spec!r}: expected 'auto' or {what} sizes >= 1 such as 1,2,4")
    return sizes


def resolve_model(spec: str, overrides: list[str], *, analytic: bool, microbatch: int) -> tuple[Any, Any]:
    """``(model, example microbatch)`` for ``MODEL``: a ``module:function``'s result, else the model
    a ``conveyor train`` config describes with ``microbatch`` sequences of ``model.seq_len`` zeros.

    Example:
        >>> model, example = resolve_model("gpt", ["model.layers=2", "model.width=32"], analytic=True, microbatch=2)
        >>> type(model).__name__, tuple(example.shape), next(model.parameters()).device.type
        ('GPT2LMHeadModel', (2, 128), 'meta')
    """
    import torch

    if ":" in spec and not spec.startswith("hf:") and not spec.endswith((".yaml", ".yml")):
        if overrides:
            raise UsageError(f"--set applies to recipe and config models, not to {spec!r} (a Python function)")
        return _from_function(spec, analytic)
    from conveyor.train.config import load_config
    from conveyor.train.data import load_tokenizer
    from conveyor.train.models import build_model

    is_file = spec.endswith((".yaml", ".yml"))
    cfg = load_config(spec if is_file else None, ([] if is_file else [f"model.name={spec}"]) + list(overrides))
    vocab = load_tokenizer(cfg.data.tokenizer).vocab_size
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, vocab, device="meta" if analytic else None)
    model.train()
    return model, torch.zeros(microbatch, cfg.model.seq_len, dtype=torch.long)


def _from_function(spec: str, analytic: bool) -> tuple[Any, Any]:
    module_name, _, function_name = spec.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise UsageError(f"MODEL {spec!r}: cannot load {function_name!r} from module {module_name!r} ({error}); "
                         "expected package.module:function returning (model, example_microbatch)") from None
    result = function()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise UsageError(f"MODEL {spec!r}: {function_name}() returned {type(result).__name__}; expected a pair "
                         "(model, example_microbatch)")
    model, example = result
    if analytic:
        model = model.to("meta")
    return model, example

