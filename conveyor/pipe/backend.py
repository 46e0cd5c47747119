"""The ranks backend contract: all that :class:`conveyor.Pipeline` asks of where its ranks are.

Two backends implement it completely, as subclasses that take its defaults (one replica, no stage
parts: :meth:`RanksBackend.find_part` over theirs): :class:`~conveyor.pipe.ranks.InProcessRanks`
(every rank in this process) and :class:`~conveyor.pipe.distributed.DistributedRanks` (one rank per
process over torch.distributed, with its stage parts). The pipeline, its steps and its gradient
checks call nothing else of them.

Example:
    >>> import torch, conveyor
    >>> pipe = conveyor.Pipeline([torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)], "1f1b", microbatches=2,
    ...                          layout=conveyor.InProcessLayout())
    >>> isinstance(pipe.ranks, RanksBackend), pipe.ranks.parts
    (True, ())
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from conveyor.options import StageOptions, WholeModel
from conveyor.parallel.clipping import NormExchange
from conveyor.parallel.part import StagePart
from conveyor.runtime.stage.memory import MemoryReport
from conveyor.runtime.stage.runner import StageRunner
from conveyor.schedule.ir import Schedule
from conveyor.schedule.timeline import Timeline

Part = TypeVar("Part", bound=StagePart)


@runtime_checkable
class RanksBackend(Protocol):
    """Where a pipeline's ranks are and how they run, combine and stop; the pipeline holds one."""

    in_process: bool  # every rank in this process
    rank: int  # this process's pipeline position (in process: 0)
    local_ranks: list[int]  # the ranks this process runs
    dp_rank: int = 0  # this process's replica (0: one replica)
    dp_size: int = 1  # how many replicas train together
    checkpoint_group: Any = None  # the group that writes checkpoints together (None: this process alone)
    device: torch.device  # the stage device, once placed
    comm_device: torch.device  # where the pipeline's collectives take their tensors (NCCL: the stage GPU)
    parts: Sequence[StagePart] = ()  # what wraps this rank's stages (in process: none)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""

    # --- building, in this order -------------------------------------------------------------
    def resolve(self, schedule: Schedule | str, microbatches: int | None, virtual: int | None,
                modules: Sequence[torch.nn.Module]) -> Schedule:
        """The schedule, checked against the ranks there are."""

    def place(self, modules: Sequence[torch.nn.Module] | torch.nn.Module,
              model: WholeModel) -> dict[int, list[torch.nn.Module]]:
        """The modules on the stage device, wrapped by the parts, by the rank that runs them."""

    def connect(self, runners: dict[int, StageRunner], stage: StageOptions, model: WholeModel,
                built: dict[str, str], owner: object) -> None:
        """Agree with every rank on ``built``, then ready the runs; released when ``owner`` is collected."""

    # --- a step ------------------------------------------------------------------------------
    def start(self, train: bool, record: bool) -> None:
        """Before a step (``train``: a training step; ``record``: time its actions)."""

    def run(self, train: bool, first: list | None, targets: list | None, keep_outputs: bool) -> None:
        """Every program this process holds, on the given microbatches (None where not read)."""

    def finish_step(self, runners: dict[int, StageRunner]) -> torch.Tensor:
        """After a training step: gradients complete, and the minibatch's loss on every rank."""

    def finish_forward(self) -> None:
        """After a forward-only step."""

    # --- across ranks ------------------------------------------------------------------------
    def guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, stopping every rank with the reason if it raises."""

    def combine_flags(self, flags: torch.Tensor) -> torch.Tensor:
        """Non-finite flags, their max over every rank and part."""

    def norm_exchange(self) -> NormExchange:
        """What gathers every rank's gradient norms for clipping."""

    def memory(self, all_ranks: bool) -> MemoryReport | list[MemoryReport]:
        """This rank's memory report, or every rank's."""

    def timeline(self) -> Timeline:
        """The last step's measured timeline, every rank's."""

    def from_last_stage(self, tensors: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """The tensors the last stage made (given where it runs, None elsewhere), on every rank of this
        pipeline (a collective over its group; each replica its own)."""

    def find_part(self, kind: type[Part]) -> Part | None:
        """This backend's part of type ``kind`` (None: it has none)."""
        return next((part for part in self.parts if isinstance(part, kind)), None)

    def close(self) -> None:
        """Release what the backend holds (idempotent)."""
