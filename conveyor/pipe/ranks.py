"""What differs between a pipeline in one process and over many: its ranks backend.

:class:`conveyor.Pipeline` is written once; it asks its backend (the contract:
:class:`~conveyor.pipe.backend.RanksBackend`) for what depends on where the ranks are: which ranks
this process runs, how their programs run, how a step's loss reaches every rank, how flags and
norms are combined across ranks, and what closing releases.

- :class:`InProcessRanks`: every rank here, in one thread, over an in-process mailbox
  (:func:`conveyor.runtime.executor.run_local`), for debugging, fast tests and a trainer on one
  machine without a launcher. Its numerics are the distributed backend's, bit for bit.
- :class:`DistributedRanks` (:mod:`conveyor.pipe.distributed`): one rank per process over
  torch.distributed: the pipeline's own groups and lifecycle, a transport, replicas.

Example:
    >>> import torch, conveyor
    >>> pipe = conveyor.Pipeline([torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)], "1f1b", microbatches=2,
    ...                          loss_fn=lambda y, t: (y - t).pow(2).mean(), layout=conveyor.InProcessLayout())
    >>> type(pipe.ranks).__name__, pipe.ranks.local_ranks
    ('InProcessRanks', [0, 1])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from conveyor.errors import PipelineClosed, PipelineConfigError
from conveyor.layout import InProcessLayout
from conveyor.options import StageOptions, TransferOptions, WholeModel
from conveyor.parallel.clipping import NormExchange
from conveyor.parallel.loss import summed_loss
from conveyor.pipe.backend import RanksBackend
from conveyor.runtime.executor import RankExecutor, run_local
from conveyor.runtime.stage.device import module_device, place_modules, resolve_device
from conveyor.runtime.stage.memory import MemoryReport, memory_report, reset_device_peaks
from conveyor.runtime.stage.runner import StageRunner
from conveyor.runtime.stage.timing import EventRecorder, StepRecorder, make_recorder
from conveyor.runtime.transport.transport import LocalMailbox, LocalTransport
from conveyor.schedule import available
from conveyor.schedule.ir import Schedule
from conveyor.schedule.passes import executable
from conveyor.schedule.registry import resolve_schedule
from conveyor.schedule.timeline import Timeline, measured_timeline


class InProcessRanks(RanksBackend):
    """Every rank of the schedule in this process and thread; the pipeline acts as rank 0 of one replica, with
    the contract's defaults: whole stages (no parts: parallelisms span processes), one process writing every tensor.

    ``modules`` are one per stage, indexed by stage; ``layout.ranks`` (None: the module count over
    the schedule's stages per rank) is the rank count of a schedule given by name.
    """

    in_process = True
    rank = 0
    closed = False  # until close()

    def __init__(self, layout: InProcessLayout, transfer: TransferOptions) -> None:
        self.layout, self.transfer = layout, transfer
        self._recorders: list[StepRecorder | EventRecorder] = []

    def resolve(self, schedule: Schedule | str, microbatches: int | None, virtual: int | None,
                modules: Sequence[torch.nn.Module] | torch.nn.Module) -> Schedule:
        """The schedule, its rank count following from one module per stage when it is a name."""
        modules = list(modules)  # one per stage (a Sequential: its children)
        ranks = self.layout.ranks
        if isinstance(schedule, str) and ranks is None:
            info = available().get(schedule)
            stages_per_rank = virtual or (info.default_virtual if info is not None else 1)
            ranks = max(1, len(modules) // stages_per_rank)
        resolved = resolve_schedule(schedule, microbatches, virtual, ranks or 1)
        if len(modules) != resolved.num_stages:
            raise PipelineConfigError(
                f"schedule {resolved.name!r} has {resolved.num_stages} stages; an in-process pipeline takes one "
                f"module per stage (got {len(modules)})"
            )
        self.schedule = resolved
        self.local_ranks = list(range(resolved.num_ranks))
        return resolved

    def place(self, modules: Sequence[torch.nn.Module] | torch.nn.Module,
              model: WholeModel) -> dict[int, list[torch.nn.Module]]:
        """The one device every stage runs on (by default where the modules are), and each rank's modules."""
        modules = list(modules)  # one per stage (a Sequential: its children)
        device = self.layout.device
        self.device = resolve_device(device if device is not None else module_device(modules) or "cpu")
        self.comm_device = self.device  # nothing crosses processes: combined where the stages are
        place_modules(modules, range(len(modules)), self.device)
        return {r: [modules[s] for s in self.schedule.stages_of(r)] for r in self.local_ranks}

    def connect(self, runners: dict[int, StageRunner], stage: StageOptions, model: WholeModel,
                built: dict[str, str], owner: object) -> None:
        """The mailbox and an executor per rank (nothing to agree on: one process built every rank)."""
        self.mailbox = LocalMailbox()
        self.runs = executable(self.schedule)
        self.executors = [
            RankExecutor(rank, self.schedule.placement, {s: runners[s] for s in self.schedule.stages_of(rank)},
                         LocalTransport(self.mailbox, rank), measure_memory=stage.measure_memory,
                         device=self.device)
            for rank in self.local_ranks
        ]

    # --- a step ----------------------------------------------------------------------------
    def start(self, train: bool, record: bool) -> None:
        self.mailbox.messages.clear()  # a step that raised may have left messages behind
        if not train:
            return
        self._recorders = [make_recorder(self.device) for _ in self.executors] if record else []
        meters = [ex.memory_meter for ex in self.executors if ex.memory_meter is not None]
        if meters:
            reset_device_peaks(meters)  # ranks share this process's devices: reset each once

    def run(self, train: bool, first: list | None, targets: list | None, keep_outputs: bool) -> None:
        first_rank = self.schedule.placement.rank_of(0)
        runs = self.runs
        programs, posts = (runs.train_program, runs.train_posts) if train else (runs.eval_program, runs.eval_posts)
        run_local(self.executors, [
            ex.run(programs(r), posts(r, LocalTransport.discipline), first if r == first_rank else None,
                   targets if train else None, self._recorders[r] if train and self._recorders else None,
                   keep_outputs=keep_outputs)
            for r, ex in enumerate(self.executors)
        ])

    def finish_step(self, runners: dict[int, StageRunner]) -> torch.Tensor:
        return summed_loss(runners[self.schedule.num_stages - 1])

    def finish_forward(self) -> None:
        pass  # nothing travels between steps in one process

    # --- across ranks ----------------------------------------------------------------------
    def guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.closed:
            raise PipelineClosed("this pipeline was closed (close() or the end of its `with` block); "
                                 "build a new pipeline to go on")
        return fn(*args)

    def combine_flags(self, flags: torch.Tensor) -> torch.Tensor:
        return flags  # every rank's stages are here: the flags already cover them

    def norm_exchange(self) -> NormExchange:
        return NormExchange(lambda mine: [mine], lambda vector: vector, self.device, self.device)

    def memory(self, all_ranks: bool) -> MemoryReport | list[MemoryReport]:
        reports = [memory_report(ex.memory_meter, "pipeline") for ex in self.executors]
        return reports if all_ranks else reports[0]

    def timeline(self) -> Timeline:
        return measured_timeline(self.schedule, [[(str(a), s, e) for a, s, e in r.events] for r in self._recorders])

    def from_last_stage(self, tensors: list[torch.Tensor] | None) -> list[torch.Tensor]:
        assert tensors is not None, "every stage runs in this process, the last one too"
        return tensors

    def close(self) -> None:
        self.closed = True
        if hasattr(self, "mailbox"):
            self.mailbox.messages.clear()
