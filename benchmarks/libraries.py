"""The two pipeline libraries behind one interface, run inside a benchmark rank.

A :class:`Case` names the work (workload, schedule, V, M); :func:`setup` builds
one library's pipeline for it on the calling rank, :func:`timed_step` runs one
training step (forward and backward of every microbatch, no optimizer) and
returns this rank's wall time, :func:`peak_rss_mb` this process's high-water RSS.
Both libraries get the same stage modules (same weights), the same minibatch
and the same loss.

The peer is ``torch.distributed.pipelining`` (torch 2.13): manual
``PipelineStage`` per stage and its schedule classes. Its rules, from its source:

* ``ScheduleGPipe`` / ``Schedule1F1B`` take one stage per rank (stage = rank);
  ``Schedule1F1B`` refuses ``M < P``.
* ``ScheduleInterleaved1F1B`` / ``ScheduleLoopedBFS`` /
  ``ScheduleInterleavedZeroBubble``: looped placement (rank r holds r, r+P, ...);
  the first and zero-bubble refuse ``M % max(1, M // P) != 0``.
* ``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV``: V placement (rank r holds r
  and 2P-1-r), exactly 2 stages per rank; DualPipeV refuses ``M < 2P``.

Example:
    >>> from conveyor.testing.models import Emulated
    >>> case = Case(Emulated(num_ranks=4), "zbv", virtual=2, num_microbatches=8)
    >>> torch_stage_ids(case, rank=1)
    [1, 6]
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from conveyor.processes import Worker
from conveyor.testing.models import Workload

LIBRARIES = ("conveyor", "torch")
# What each library's ranks import before a case (see conveyor.processes.Zygote): its own
# modules only, so that a rank's memory is that library's.
LIBRARY_MODULES = {
    "conveyor": ["benchmarks.libraries", "conveyor.pipe", "conveyor.runtime.transport.shm"],
    "torch": ["benchmarks.libraries", "torch.distributed.pipelining"],
}
SINGLE = "single"  # the whole model in one process: the baseline of the real-compute workload

# conveyor schedule name -> (torch class, placement style, one stage per rank?)
TORCH_SCHEDULES: dict[str, tuple[str, str, bool]] = {
    "gpipe": ("ScheduleGPipe", "looped", True),
    "1f1b": ("Schedule1F1B", "looped", True),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", "looped", False),
    "looped-bfs": ("ScheduleLoopedBFS", "looped", False),
    "zb-h1": ("ScheduleInterleavedZeroBubble", "looped", False),
    "zbv": ("ScheduleZBVZeroBubble", "v", False),
    "dualpipev": ("ScheduleDualPipeV", "v", False),
}


class Refused(ValueError):
    """A library will not run this case (raised while building it, before any step)."""


@dataclass(frozen=True, slots=True)
class Case:
    """One comparison point: the same work for both libraries.

    ``split``: blocks per stage (None: the workload's default cut); ``plan``: the
    ``conveyor.plan.plan()`` result the case runs (its schedule, built for its costs where it
    plans its order by them), None for a built-in schedule by name.
    """

    workload: Workload
    schedule: str
    virtual: int
    num_microbatches: int
    split: tuple[int, ...] | None = None
    plan: Any = field(default=None, compare=False)

    @property
    def num_ranks(self) -> int:
        return self.workload.num_ranks

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.virtual

    def label(self) -> str:
        cut = "" if self.split is None else f" split={'+'.join(map(str, self.split))}"
        return (
            f"{self.workload.name} {self.schedule} P={self.num_ranks} V={self.virtual} "
            f"M={self.num_microbatches}{cut}"
        )

    def build_stage(self, stage: int) -> torch.nn.Module:
        """Stage ``stage`` of this case's cut: the workload's default, or ``split``'s block counts."""
        if self.split is None:
            return self.workload.build_stage(stage, self.num_stages)
        return build_blocks(self.workload, stage, self.split)


def build_blocks(workload: Workload, stage: int, split: tuple[int, ...]) -> torch.nn.Module:
    """Stage ``stage`` of ``workload`` cut into stages of ``split[s]`` blocks (same weights as any cut).

    A GPT stage 0 also holds the embeddings, the last the final norm and head (a stage may hold no
    block besides them).

    Example:
        >>> from conveyor.testing.models import Emulated
        >>> [len(build_blocks(Emulated(num_ranks=2), s, (1, 3)).blocks) for s in range(2)]
        [1, 3]
    """
    from conveyor.testing.models.workloads import BlockStack, GPTStage, SleepBlock, TinyGPT

    start = sum(split[:stage])
    blocks = range(start, start + split[stage])
    if isinstance(workload, TinyGPT):
        return GPTStage(workload, blocks, first=stage == 0, last=stage == len(split) - 1)
    out = []
    for index in blocks:
        torch.manual_seed(workload.seed * 100_003 + index)  # as Emulated.build_stage seeds block ``index``
        out.append(SleepBlock(workload.width, workload.forward_ms / 1e3, workload.input_grad_ms / 1e3,
                              workload.weight_grad_ms / 1e3))
    return BlockStack(out)


def torch_stage_ids(case: Case, rank: int) -> list[int]:
    """The stages torch's schedule for ``case`` expects on ``rank``, in increasing order."""
    if case.schedule not in TORCH_SCHEDULES:
        raise Refused(f"torch.distributed.pipelining ships no {case.schedule!r} schedule")
    _, style, single = TORCH_SCHEDULES[case.schedule]
    num_ranks, virtual = case.num_ranks, case.virtual
    if single and virtual != 1:
        raise Refused(f"{case.schedule} runs one stage per rank in torch, not V={virtual}")
    if style == "v":
        if virtual != 2:
            raise Refused(
                f"{case.schedule} needs exactly 2 stages per rank in torch, not V={virtual}"
            )
        return sorted({rank, 2 * num_ranks - 1 - rank})
    return list(range(rank, num_ranks * virtual, num_ranks))


class TorchRunner:
    """``torch.distributed.pipelining``: one ``PipelineStage`` per stage, its schedule class."""

    def __init__(self, case: Case, rank: int) -> None:
        from torch.distributed import pipelining

        class_name, _, single = TORCH_SCHEDULES.get(case.schedule, ("", "", False))
        self.stage_ids = torch_stage_ids(case, rank)
        workload = case.workload
        self.modules = [workload.build_stage(s, case.num_stages) for s in self.stage_ids]
        stages = [
            pipelining.PipelineStage(module, stage, case.num_stages, torch.device("cpu"))
            for module, stage in zip(self.modules, self.stage_ids)
        ]
        schedule_class = getattr(pipelining, class_name)
        try:
            self.schedule = schedule_class(
                stages[0] if single else stages,
                n_microbatches=case.num_microbatches,
                loss_fn=workload.loss_fn,
            )
        except (ValueError, RuntimeError, AssertionError) as error:
            raise Refused(f"{class_name}: {type(error).__name__}: {error}") from error
        self.has_first = 0 in self.stage_ids
        self.has_last = case.num_stages - 1 in self.stage_ids

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        self.schedule.step(
            *((x,) if self.has_first else ()),
            target=y if self.has_last else None,
            losses=losses,
            return_outputs=False,
        )
        # The minibatch loss, as conveyor returns it (microseconds of work).
        return torch.stack(losses).mean() if losses else None


def option_records(options: dict[str, Any]) -> dict[str, Any]:
    """``--conveyor-option`` keys sorted into the records they are fields of: ``{"stage": StageOptions(...),
    "transfer": TransferOptions(...)}`` (only those given), for ``conveyor.Pipeline``."""
    import dataclasses

    from conveyor.options import StageOptions, TransferOptions

    records, known = {}, set()
    for keyword, record in (("stage", StageOptions), ("transfer", TransferOptions)):
        names = {f.name for f in dataclasses.fields(record)}
        known |= names
        mine = {key: value for key, value in options.items() if key in names}
        if mine:
            records[keyword] = record(**mine)
    unknown = sorted(set(options) - known)
    if unknown:
        raise SystemExit(f"--conveyor-option {unknown}: not a field of StageOptions or TransferOptions; "
                         f"use one of {sorted(known)}")
    return records


class ConveyorRunner:
    """conveyor: ``schedule.build`` then ``Pipeline(modules, schedule, loss_fn).step``.

    ``options`` are fields of conveyor's option records (``fixed_shapes``, ``compile``, ...), none by
    default: the benchmark measures what a user gets without tuning.
    """

    def __init__(self, case: Case, rank: int, options: dict[str, Any] | None = None) -> None:
        import conveyor
        from conveyor.errors import ConveyorError

        try:
            sched = case.plan.schedule_spec() if case.plan is not None else case.schedule
            if isinstance(sched, str):
                sched = conveyor.schedule.build(
                    sched,
                    ranks=case.num_ranks,
                    microbatches=case.num_microbatches,
                    virtual=case.virtual,
                )
        except ConveyorError as error:
            raise Refused(f"{type(error).__name__}: {error}") from error
        self.stage_ids = sched.stages_of(rank)
        self.modules = [case.build_stage(s) for s in self.stage_ids]
        try:
            self.pipe = conveyor.Pipeline(
                self.modules, schedule=sched, loss_fn=case.workload.loss_fn, **option_records(options or {})
            )
        except ConveyorError as error:
            raise Refused(f"conveyor.Pipeline: {type(error).__name__}: {error}") from error

    def step(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        # Data only where it is read, as a user's script passes it (else a warning per case).
        return self.pipe.step(x if self.pipe.needs_inputs else None, target=y if self.pipe.needs_target else None)


class SingleProcessRunner:
    """The whole model in this one process: M microbatches, gradients accumulated.

    Each microbatch's loss is scaled by 1/M, as a single-device gradient
    accumulation loop does; no optimizer step (the pipelines take none either).
    """

    def __init__(self, case: Case) -> None:
        self.stage_ids = [0]
        self.modules = [case.workload.build_stage(0, 1)]
        self.num_microbatches = case.num_microbatches
        self.loss_fn = case.workload.loss_fn

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model, m = self.modules[0], self.num_microbatches
        total = torch.zeros(())
        for xm, ym in zip(x.tensor_split(m), y.tensor_split(m)):
            loss = self.loss_fn(model(xm), ym) / m
            loss.backward()
            total += loss.detach()
        return total


def conveyor_runtime_missing() -> str | None:
    """Why conveyor's runtime cannot run yet (``None`` when ``conveyor.Pipeline`` imports)."""
    try:
        import conveyor

        conveyor.Pipeline  # noqa: B018 - the lazy attribute imports the runtime
    except (ImportError, AttributeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


# ---------------------------------------------------------------------------
# calls run on every rank of a conveyor.processes.RankGroup
# ---------------------------------------------------------------------------


def setup(
    worker: Worker, library: str, case: Case, conveyor_options: dict[str, Any] | None = None
) -> list[int]:
    """Build ``library``'s pipeline for ``case`` on this rank; the stages it holds.

    Also notes the current RSS, so that :func:`peak_rss_mb` can tell what the
    pipeline itself added on top of the forked parent.
    """
    worker.state["rss_at_setup_mb"] = current_rss_mb()
    runner: TorchRunner | ConveyorRunner | SingleProcessRunner
    if library == "conveyor":
        runner = ConveyorRunner(case, worker.rank, conveyor_options)
    elif library == "torch":
        runner = TorchRunner(case, worker.rank)
    elif library == SINGLE:
        runner = SingleProcessRunner(case)
    else:
        raise ValueError(f"library must be one of {(*LIBRARIES, SINGLE)}, got {library!r}")
    worker.state["runner"] = runner
    worker.state["batch"] = case.workload.batch(case.num_microbatches)
    return list(runner.stage_ids)


def timed_step(worker: Worker) -> float:
    """One training step on every rank, started together; this rank's seconds."""
    runner = worker.state["runner"]
    for module in runner.modules:
        module.zero_grad(set_to_none=True)
    x, y = worker.state["batch"]
    if worker.distributed:
        dist.barrier()
    start = time.perf_counter()
    runner.step(x, y)
    return time.perf_counter() - start


def conveyor_timeline(worker: Worker) -> dict | None:
    """conveyor's measured timeline of its last step, summarised (a collective over its ranks).

    Makespan in ms (compute spans only, from the first start to the last end), the
    measured bubble ratio and peak live activations per rank.
    """
    runner = worker.state["runner"]
    timeline = runner.pipe.timeline()
    return {
        "makespan_ms": timeline.makespan * 1e3,
        "bubble_ratio": timeline.bubble_ratio,
        "peak_activations": timeline.peak_activations(),
    }


def current_rss_mb() -> float:
    """This process's resident set size now, in MiB (from /proc/self/statm)."""
    with open("/proc/self/statm") as statm:
        resident_pages = int(statm.read().split()[1])
    return resident_pages * resource.getpagesize() / 2**20


def peak_rss_mb(worker: Worker) -> tuple[float, float]:
    """``(peak, peak - RSS when setup began)`` in MiB; peak is ``getrusage`` maxrss (KiB on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return peak, peak - worker.state.get("rss_at_setup_mb", 0.0)


def gloo_one_way_ms(
    worker: Worker, shape: tuple[int, ...], blocking: bool = False, iterations: int = 200
) -> float:
    """Median one-way time of a gloo message of a ``shape`` float tensor (half a ping-pong).

    By default ``isend`` / ``irecv`` then ``wait``, as pipeline runtimes send; with
    ``blocking=True``, ``dist.send`` / ``dist.recv``.
    """
    buffer = torch.zeros(shape)
    peer = 1 - worker.rank

    def send() -> None:
        if blocking:
            dist.send(buffer, peer)
        else:
            dist.isend(buffer, peer).wait()

    def recv() -> None:
        if blocking:
            dist.recv(buffer, peer)
        else:
            dist.irecv(buffer, peer).wait()

    times = []
    for i in range(iterations + 20):
        start = time.perf_counter()
        if worker.rank == 0:
            send()
            recv()
        else:
            recv()
            send()
        if i >= 20:
            times.append((time.perf_counter() - start) * 1e3 / 2)
    return statistics.median(times)


def measure_costs(worker: Worker, workload: Workload, num_stages: int, repeats: int):
    """:func:`benchmarks.costs.measure_stage_costs` in this (single-thread) process."""
    from benchmarks.costs import measure_stage_costs

    return measure_stage_costs(workload, num_stages, repeats=repeats)


def ideal_setup(worker: Worker, workload: Workload, num_stages: int) -> int:
    """Build every stage of ``workload`` cut in ``num_stages`` in this process, for :func:`ideal_sample`."""
    from benchmarks.costs import StageCostProbe

    worker.state["probe"] = StageCostProbe(workload, num_stages)
    return num_stages


def ideal_sample(worker: Worker):
    """One :class:`~benchmarks.costs.MeasuredCosts` sample: each stage's F, I, B timed once."""
    return worker.state["probe"].sample()
