"""The planner's settings as typed option records, grouped by concern (the pipeline's are :mod:`conveyor.options`).

:func:`conveyor.plan.plan` takes its everyday choices as keywords (``ranks``, ``global_batch``,
``memory_per_rank``, ``schedules``, ``microbatches``) and the rest as three records:
:class:`SearchSpace` (what else the search tries and reports), :class:`Machine` (what the ranks
run on: links, throughput, optimizer state, cores, threads, a calibration) and
:class:`Measurement` (how unit costs are obtained). :class:`PlanOptions` holds all of it for
``conveyor.pipeline(schedule="auto", options=PipelineOptions(plan_options=...))``. Each record
checks and normalises its own fields; importing this module does not import torch.

Example:
    >>> SearchSpace(virtual=[1, 2, 4], top=3).virtual
    (1, 2, 4)
    >>> Machine(bandwidth=0)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    conveyor.errors.PlanError: Machine.bandwidth must be a positive number (bytes per second between
        neighbouring ranks), got 0; drop it for the default 2e+09
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from conveyor.errors import PlanError, positive_int
from conveyor.options import _f, _set
from conveyor.plan.result import parse_size

# How far (relative) a lighter split's slowest stage may exceed the fastest split's.
DEFAULT_BALANCE_TOLERANCE = 0.03
# Point-to-point bandwidth (bytes/s) and latency (s) between neighbouring ranks when not given:
# two processes on one host exchanging through shared memory.
DEFAULT_BANDWIDTH = 2e9
DEFAULT_LATENCY = 50e-6
# The cost model's device, used only when costs cannot be measured: an H100 at ~40% of its bf16 peak
# (FLOP/s), and its HBM3 (bytes/s).
DEFAULT_FLOPS_PER_SECOND = 400e12
DEFAULT_BYTES_PER_SECOND = 2.0e12


def _positive(record: Any, name: str, what: str, default: Any, *, zero: bool = False) -> None:
    value = getattr(record, name)
    ok = isinstance(value, int | float) and not isinstance(value, bool) and (value >= 0 if zero else value > 0)
    if not ok or value != value:
        kind = "a non-negative" if zero else "a positive"
        raise PlanError(f"{type(record).__name__}.{name} must be {kind} number ({what}), got {value!r}; drop it "
                        f"for the default {default:g}")


def _positive_ints(record: Any, name: str, value: Any, fix: str) -> tuple[int, ...] | None:
    """``value`` as a tuple of positive ints (None stays None), else a PlanError naming ``fix``."""
    if value is None:
        return None
    items = (value,) if isinstance(value, int) else value
    if isinstance(items, str | bytes) or not isinstance(items, Sequence) or not items or not all(
            map(positive_int, items)):
        raise PlanError(f"{type(record).__name__}.{name} must be positive ints, got {value!r}; {fix}")
    return tuple(items)


def _names(record: Any, name: str, value: Any, fix: str) -> tuple[str, ...] | None:
    """``value`` (a name, or several) as a tuple of names (None stays None)."""
    if value is None:
        return None
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, Sequence) or not all(isinstance(v, str) and v for v in items):
        raise PlanError(f"{type(record).__name__}.{name} must be names, got {value!r}; {fix}")
    return tuple(items)


def _auto_count(record: Any, name: str, fix: str) -> None:
    value = getattr(record, name)
    if value is None or value == "auto":
        return
    if not positive_int(value):
        raise PlanError(f"{type(record).__name__}.{name} must be a positive int, 'auto' or None, got {value!r}; "
                        f"{fix}")


@dataclass(frozen=True)
class SearchSpace:
    """What the search tries beyond the schedules and microbatch counts, and what it reports.

    Example:
        >>> SearchSpace(top=0)
        Traceback (most recent call last):
        ...
        conveyor.errors.PlanError: SearchSpace.top must be a positive int, got 0; list at least the chosen plan (top=1)
    """

    virtual: Sequence[int] = _f((1, 2), "stages per rank to try (V); a schedule runs only the Vs it supports")
    balance_tolerance: float = _f(DEFAULT_BALANCE_TOLERANCE,
                                  "how far (relative) a lighter split's slowest stage may exceed the fastest "
                                  "split's and still be preferred when memory is short")
    top: int = _f(5, "plans the result lists (the chosen one first)")
    tensor_parallel: Sequence[Any] = _f((), "tensor-parallel sizes to try, as conveyor.plan.tensor_search."
                                            "TensorParallelOption records (what each tp does to the model); "
                                            "given, the ranks are pp x tp (empty: tp=1, the ranks are pp)")
    expert_parallel: Sequence[Any] = _f((), "expert-parallel sizes to try, as conveyor.plan.expert_search."
                                            "ExpertParallelOption records (what each ep does to the experts; ep "
                                            "borrows the replicas' ranks, the ranks stay pp); empty: ep=1. With "
                                            "tensor_parallel too, (tp, ep) pairs are searched: each ep option "
                                            "is sized for one tp (ExpertParallelOption.tp)")
    expert_overlap: bool = _f(True, "with expert parallelism, also simulate each candidate with its all-to-alls "
                                    "overlapped in the schedule's forward/backward pairs (parallel.expert_overlap), "
                                    "what the forwards run in segments keep counted; the faster that fits wins")

    def __post_init__(self) -> None:
        if not isinstance(self.expert_overlap, bool):
            raise PlanError(f"SearchSpace.expert_overlap must be True or False, got {self.expert_overlap!r}")
        _set(self, "virtual", _positive_ints(self, "virtual", self.virtual, "e.g. virtual=(1, 2)"))
        for name, size, record in (("tensor_parallel", "tp", "tensor_search.TensorParallelOption"),
                                   ("expert_parallel", "ep", "expert_search.ExpertParallelOption")):
            given = tuple(getattr(self, name) or ())
            if not all(hasattr(option, size) and hasattr(option, "modules") for option in given):
                raise PlanError(f"SearchSpace.{name} takes conveyor.plan.{record} records (one per {size} to try), "
                                f"got {getattr(self, name)!r}")
            _set(self, name, given)
        options, experts = self.tensor_parallel, self.expert_parallel
        if experts and options:
            sized = {option.tp for option in options}
            if not all(option.tp in sized for option in experts):
                raise PlanError("SearchSpace: with tensor_parallel sizes to try, each ExpertParallelOption is sized "
                                "for one of their tp (ExpertParallelOption.tp, ep dividing dp x tp); got ep options "
                                f"for tp {sorted({option.tp for option in experts})}, tensor options for tp "
                                f"{sorted(sized)}")
        if self.virtual is None:
            raise PlanError("SearchSpace.virtual must be positive ints, got None; e.g. virtual=(1, 2)")
        _positive(self, "balance_tolerance", "a fraction of the fastest split's slowest stage",
                  DEFAULT_BALANCE_TOLERANCE, zero=True)
        if not positive_int(self.top):
            raise PlanError(f"SearchSpace.top must be a positive int, got {self.top!r}; list at least the chosen "
                            "plan (top=1)")


@dataclass(frozen=True)
class Machine:
    """What the ranks run on: how fast they talk and compute, optimizer state, cores, threads, calibration.

    Example:
        >>> Machine(cores=0)  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        conveyor.errors.PlanError: Machine.cores must be a positive int, 'auto' or None, got 0; give the CPU
            cores the ranks share, None for a device per rank
    """

    bandwidth: float = _f(DEFAULT_BANDWIDTH, "bytes per second between neighbouring ranks (without a calibration)")
    latency: float = _f(DEFAULT_LATENCY, "seconds per message between neighbouring ranks (without a calibration)")
    tensor_bandwidth: float | None = _f(None, "bytes per second inside a tensor-parallel group, one node (None: "
                                              "bandwidth)")
    flops_per_second: float = _f(DEFAULT_FLOPS_PER_SECOND,
                                 "sustained device throughput, for costs from the cost model (a meta-device model)")
    bytes_per_second: float = _f(DEFAULT_BYTES_PER_SECOND,
                                 "device memory bandwidth, for costs from the cost model (a meta-device model)")
    optimizer_bytes_per_parameter: float = _f(8.0, "optimizer state per parameter (AdamW in fp32: 8 bytes)")
    cores: int | str | None = _f("auto", "CPU cores the ranks share, with a calibration ('auto': the machine's "
                                         "when the model computes on the CPU; None: a device per rank)")
    threads: int | str | None = _f("auto", "CPU threads each rank computes with, which a CPU model is profiled at "
                                           "('auto': OMP_NUM_THREADS, else the cores shared by the ranks; None: "
                                           "this process's torch setting)")
    calibration: Any = _f(None, "a conveyor.plan.calibration.Calibration (or its as_dict()): predict each step "
                                "as a real step is checked against (measure one with calibrate())")

    def __post_init__(self) -> None:
        _positive(self, "bandwidth", "bytes per second between neighbouring ranks", DEFAULT_BANDWIDTH)
        _positive(self, "latency", "seconds per message", DEFAULT_LATENCY, zero=True)
        if self.tensor_bandwidth is not None:
            _positive(self, "tensor_bandwidth", "bytes per second inside a tensor-parallel group", DEFAULT_BANDWIDTH)
        _positive(self, "flops_per_second", "sustained FLOP/s of one device", DEFAULT_FLOPS_PER_SECOND)
        _positive(self, "bytes_per_second", "memory bytes per second of one device", DEFAULT_BYTES_PER_SECOND)
        _positive(self, "optimizer_bytes_per_parameter", "bytes of optimizer state per parameter", 8.0, zero=True)
        _auto_count(self, "cores", "give the CPU cores the ranks share, None for a device per rank")
        _auto_count(self, "threads", "give the CPU threads per rank, None for this process's torch setting")


@dataclass(frozen=True)
class Measurement:
    """How the units' costs are obtained: measured where and how often, or given.

    Example:
        >>> Measurement(repeats=0)  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        conveyor.errors.PlanError: Measurement.repeats must be a positive int, got 0; time each unit at least
            once (repeats=1)
    """

    device: Any = _f(None, "where the units are profiled (a torch.device or its name; None: the model's)")
    repeats: int = _f(3, "timed rounds per unit (the fastest is kept)")
    costs: Any = _f(None, "a conveyor.plan.CostTable to plan with instead of measuring (e.g. from an earlier run)")
    unsplittable: Sequence[str] = _f((), "module paths never cut inside")

    def __post_init__(self) -> None:
        if not positive_int(self.repeats):
            raise PlanError(f"Measurement.repeats must be a positive int, got {self.repeats!r}; time each unit at "
                            "least once (repeats=1)")
        _set(self, "unsplittable", _names(self, "unsplittable", self.unsplittable,
                                          "give module paths such as 'model.layers.0'") or ())
        if self.costs is not None and not hasattr(self.costs, "units"):
            raise PlanError(f"Measurement.costs must be a conveyor.plan.CostTable, got {type(self.costs).__name__}; "
                            "drop it to measure the model")


@dataclass(frozen=True)
class PlanOptions:
    """Every choice of :func:`conveyor.plan.plan` beside the model, its example and the rank count:
    what ``conveyor.pipeline(schedule="auto")`` plans with (``PipelineOptions(plan_options=...)``).

    Example:
        >>> PlanOptions(global_batch=8, memory_per_rank="1GiB", microbatches=4).microbatches
        (4,)
        >>> PlanOptions(memory_per_rank="8GiB").memory_per_rank
        8589934592.0
    """

    global_batch: int | None = _f(None, "samples per optimizer step (None: the pipeline's microbatches, or 2 x "
                                        "ranks, times the example's batch)")
    memory_per_rank: float | str = _f(math.inf, "memory each rank may use, bytes or a size such as '8GiB' "
                                                "(default: no limit)")
    schedules: Sequence[str] | None = _f(None, "schedules to try (None: every registered one)")
    microbatches: Sequence[int] | None = _f(None, "microbatch counts to try (None: the pipeline's microbatches if "
                                                  "given, else every divisor of the global batch >= ranks)")
    space: SearchSpace = field(default_factory=SearchSpace, metadata={"help": "what else the search tries"})
    machine: Machine = field(default_factory=Machine, metadata={"help": "what the ranks run on"})
    measure: Measurement = field(default_factory=Measurement, metadata={"help": "how unit costs are obtained"})

    def __post_init__(self) -> None:
        if self.global_batch is not None and not positive_int(self.global_batch):
            raise PlanError(f"PlanOptions.global_batch must be a positive int or None, got {self.global_batch!r}; "
                            "drop it for the pipeline's microbatches times the example's batch")
        _set(self, "memory_per_rank", parse_size(self.memory_per_rank))  # names the units it takes
        _set(self, "schedules", _names(self, "schedules", self.schedules, "e.g. schedules=('1f1b', 'zbv')"))
        _set(self, "microbatches", _positive_ints(self, "microbatches", self.microbatches, "e.g. microbatches=(8,)"))
        for name, kind in (("space", SearchSpace), ("machine", Machine), ("measure", Measurement)):
            if not isinstance(getattr(self, name), kind):
                raise PlanError(f"PlanOptions.{name} takes a {kind.__name__}; got {type(getattr(self, name)).__name__}")
