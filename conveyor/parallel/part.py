"""The stage-part contract: what wraps a rank's stages beside the pipeline, one object per concern.

Data-parallel replicas, tensor-parallel stages and tied copies summed across ranks each act at
the same few moments of a distributed pipeline's life. Each is a :class:`StagePart`; the
distributed ranks backend holds a list of them (:func:`conveyor.parallel.parts.parts_for` picks
them for a layout) and calls every part, in list order, at each hook, naming none of them. A new
parallelism is one more part, its option field and its tests.

The hooks, in the order a pipeline reaches them: tracing and cutting (``trace_leaves``,
``materialize_stages``, ``parameter_placements``: classmethods, asked before the parts exist),
building (``program``, ``wrap_stages``, ``runner_context``, ``agree``, ``wrap``, ``boundary_examples``), each
training step (``start_step``, ``stage_done``, ``finish_step``, ``step_loss``), and on request
(``whole_norms``, ``flags``, ``spans``, ``exchanges``, ``release``).

A part that reduces some parameters' gradients over groups of its own (expert parallelism) claims
them with :func:`claim_reduction` in ``wrap_stages``; parts that reduce a whole stage (the
replicas) leave the claimed parameters out.

Example (a part that doubles every gradient at the end of a step)::

    class Doubled(StagePart):
        def agree(self, site):
            self.runners = site.runners
        def finish_step(self):
            for runner in self.runners.values():
                for param in runner.params:
                    param.grad.mul_(2)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.layout import DistributedLayout
from conveyor.options import WholeModel
from conveyor.parallel.mesh import MeshLayout
from conveyor.runtime.lifecycle.rank import RankLifecycle
from conveyor.runtime.stage.runner import StageRunner
from conveyor.schedule.ir import Schedule

Span = tuple[str, float, float]  # (what, start, end) on the step's clock


@dataclass(frozen=True, slots=True)
class PartSite:
    """What a part is given once the rank holds its own groups: where it runs and what it wraps."""

    schedule: Schedule
    rank: int  # this rank's pipeline position
    runners: Mapping[int, StageRunner]  # this rank's stages, by stage
    life: RankLifecycle  # the pipeline's groups: agreement, subgroups, the job group
    layout: DistributedLayout
    mesh_layout: MeshLayout | None  # None: a plain process group, one replica
    device: torch.device  # the stage device
    model: WholeModel
    built: Mapping[str, str]  # what every rank agreed on (RankLifecycle.agree's fields)


class StagePart:
    """One concern wrapped around a rank's stages; every hook does nothing unless a part overrides it.

    Example:
        >>> part = StagePart()
        >>> part.step_loss(torch.tensor(2.0)), part.flags(torch.zeros(1)), part.spans()
        (tensor(2.), tensor([0.]), [])
    """

    #: Whether checkpoints of a pipeline with this part are written by every rank of the job together.
    wants_checkpoint_group: bool = False

    #: Whether this part materializes a meta-device model's stages itself, each rank only what it holds (tensor
    #: parallelism: its shards): the cut then leaves them on meta and hands them to :meth:`materialize_stages`.
    materializes_meta_stages: bool = False

    @classmethod
    def materialize_stages(cls, modules: list[torch.nn.Module], model: torch.nn.Module, seed: int,
                           device: torch.device, materialize: Callable[..., Any]) -> list[torch.nn.Module]:
        """This rank's stage modules, left on meta by the cut, made to materialize what this part keeps of them
        (``materialize``: the model's own initialisation, seeded as one device's)."""
        return modules

    @classmethod
    def parameter_placements(cls, model: torch.nn.Module, layout: DistributedLayout,
                             tied_groups: Sequence[Sequence[str]]) -> dict[str, Any] | None:
        """The unchanged model's parameters placed over this part's ranks, by original name, the same on every
        rank (tensor parallelism's plan; traced stages are parallelized by it); None: this part places none."""
        return None

    @classmethod
    def trace_leaves(cls, model: torch.nn.Module) -> list[str]:
        """Names of ``model``'s modules that the trace must keep whole, each then called by the stage holding it,
        for this part to find and wrap after the split (expert parallelism: the experts modules, whose routing
        depends on the tokens). Asked of the class: the model is traced before the parts exist. Each must be
        shaped as an experts module is (:mod:`conveyor.frontend.leaves`)."""
        return []

    def program(self, schedule: Schedule) -> Schedule:
        """The schedule this part needs the pipeline to run, given the one asked for: the same, unless the part
        runs passes together (expert parallelism's overlapped pairs)."""
        return schedule

    def wrap_stages(self, modules: Mapping[int, torch.nn.Module], schedule: Schedule, model: WholeModel) -> None:
        """Change this rank's stage modules ({stage: module}) in place before their runners read them."""

    def runner_context(self, stage: int) -> Callable[[], contextlib.AbstractContextManager] | None:
        """What stage ``stage``'s passes run under (None: nothing)."""
        return None

    def agree(self, site: PartSite) -> None:
        """Build this part's groups and check, across the ranks concerned, that they built alike."""

    def wrap(self) -> None:
        """After every part agreed: wrap the runners (they re-read their parameters)."""

    def boundary_examples(self, shapes: dict[int, Any]) -> dict[int, Any]:
        """``TransferOptions.shapes``'s examples as this rank sends them across stage boundaries."""
        return shapes

    def start_step(self) -> None:
        """Before a training step's first action."""

    def stage_done(self, stage: int) -> None:
        """Right after ``stage``'s last backward action of the step on this rank."""

    def finish_step(self) -> None:
        """After the rank's last action of the step; gradients are complete once every part ran."""

    def step_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss as this rank reports it (given the pipeline's loss, on every rank)."""
        return loss

    def whole_norms(self, grads: Sequence[torch.Tensor], norms: list[torch.Tensor],
                    norm_type: float) -> list[torch.Tensor]:
        """Each gradient's norm over what this part splits of it (given this rank's part's norms)."""
        return norms

    def flags(self, flags: torch.Tensor) -> torch.Tensor:
        """The non-finite flags combined over this part's group (given the pipeline's)."""
        return flags

    def spans(self) -> list[Span]:
        """What this part timed in the last step, on the step's clock."""
        return []

    def exchanges(self) -> tuple[list[Span], float]:
        """The communication this part's stages did inside their passes in the last step (label, start, end), drawn
        on the timeline's communication lane, and the seconds this rank's compute waited for it (the exposed part)."""
        return [], 0.0

    def describe_spans(self, by_rank: list[list[Span]]) -> tuple[str, dict] | None:
        """Every rank's spans (relative to the step's start) as a timeline metadata entry (key, value)."""
        return None

    def release(self) -> None:
        """After a failure: forget whatever holds the pipeline's groups."""


# A parameter whose gradient one part reduces across ranks itself carries the part's name here;
# parts that reduce every gradient of a stage over their own group (the replicas) leave it out.
_REDUCED_BY = "_conveyor_reduced_by"


def claim_reduction(param: torch.nn.Parameter, owner: str) -> None:
    """Say that ``owner`` (a part) reduces ``param``'s gradient across ranks itself, in its own groups.

    Called from a part's ``wrap_stages`` (before any part wraps): expert parallelism claims the
    experts' shards, whose gradients reduce over the expert-data-parallel group, not over "dp".

    Example:
        >>> param = torch.nn.Parameter(torch.zeros(2))
        >>> claim_reduction(param, "expert parallelism"); reduced_by(param)
        'expert parallelism'
    """
    setattr(param, _REDUCED_BY, owner)


def reduced_by(param: torch.Tensor) -> str | None:
    """The part that claimed ``param``'s reduction (None: the stage's usual reductions apply)."""
    return getattr(param, _REDUCED_BY, None)


def claimed_parameters(module: torch.nn.Module) -> set[torch.nn.Parameter]:
    """``module``'s parameters some part claimed the reduction of (see :func:`claim_reduction`)."""
    return {param for param in module.parameters() if reduced_by(param) is not None}
