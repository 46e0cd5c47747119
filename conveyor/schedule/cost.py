"""Per-stage costs for the simulator.

Costs are per stage and per pass, never one number: the zero-bubble paper
measured bubbles far above the closed forms once T_W < T_F < T_B and
communication is not free.

Example:
    >>> from conveyor.schedule.cost import CostModel
    >>> costs = CostModel.uniform(4, forward=1.0, backward_input=1.0, backward_weight=1.0)
    >>> costs.stages[0].full_backward
    2.0
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.errors import CostError
from conveyor.schedule.ir import Action, ActionKind


@dataclass(frozen=True, slots=True)
class StageCosts:
    """Time of each pass of one stage on one microbatch, plus its activation memory.

    ``activation_bytes``: what a forward leaves for backward. ``weight_activation_bytes``: the
    part of it still held from the input-gradient pass (I) to the weight-gradient pass (W),
    the zero-bubble paper's M_W (None: all of it). I frees what only the input gradient
    needed: with conveyor's I/W split, the saved tensors of the operations between the stage's
    outputs (or loss) and its last operation that also leads to a weight, e.g. a final
    activation function's input; :meth:`conveyor.Pipeline.memory` measures both.

    ``exchanges``: the all-to-alls (an MoE layer's dispatch and combine) of one forward pass of one
    microbatch, each taking ``exchange``; its backward (B, or the I of a split one: W exchanges
    nothing) has as many, each as long. A pass with n of them is modelled as its compute in n+1
    equal pieces with an exchange after each of the first n; alone, it waits for each, so it
    takes its compute plus n x exchange (:meth:`CostModel.duration`); overlapped with a pass of
    another microbatch it hides them behind that pass's compute (:mod:`conveyor.schedule.overlap`).

    Example:
        >>> StageCosts(1, 1, 1, activation_bytes=2048, weight_activation_bytes=1536).weight_kept
        1536
        >>> StageCosts(1.0, 2.0, 1.0, exchange=0.25, exchanges=2).exchange_time
        0.5
    """

    forward: float
    backward_input: float
    backward_weight: float
    activation_bytes: float = 0.0
    weight_activation_bytes: float | None = None
    exchange: float = 0.0
    exchanges: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.exchanges, int) or isinstance(self.exchanges, bool) or self.exchanges < 0:
            raise CostError(f"stage cost exchanges (all-to-alls per pass) must be an int >= 0, got {self.exchanges!r}")
        for name in ("forward", "backward_input", "backward_weight", "activation_bytes", "weight_activation_bytes",
                     "exchange"):
            value = getattr(self, name)
            if value is None and name == "weight_activation_bytes":
                continue
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                raise CostError(f"stage cost {name} must be a finite number, got {value!r}")
            if value < 0:
                raise CostError(f"stage cost {name} must be >= 0, got {value}")

        if self.weight_activation_bytes is not None and self.weight_activation_bytes > self.activation_bytes:
            raise CostError(
                f"weight_activation_bytes ({self.weight_activation_bytes}) is what W keeps of activation_bytes "
                f"({self.activation_bytes}), so it cannot be larger; give at most activation_bytes (or None: all)"
            )

    @property
    def full_backward(self) -> float:
        return self.backward_input + self.backward_weight

    @property
    def exchange_time(self) -> float:
        """The all-to-all time of one pass (F, B or I) run alone: ``exchanges`` x ``exchange``."""
        return self.exchanges * self.exchange

    @property
    def weight_kept(self) -> float:
        """The activation bytes held from I until W (all of them unless ``weight_activation_bytes`` says less)."""
        return self.activation_bytes if self.weight_activation_bytes is None else self.weight_activation_bytes


@dataclass(frozen=True, slots=True)
class CostModel:
    """Costs of every stage plus the latency of one point-to-point message."""

    stages: tuple[StageCosts, ...]
    latency: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.stages, tuple) or not self.stages:
            raise CostError("a cost model needs the costs of at least one stage, as a tuple of StageCosts")
        for index, stage in enumerate(self.stages):
            if not isinstance(stage, StageCosts):
                raise CostError(f"the costs of stage {index} must be a StageCosts, got {type(stage).__name__}")
        if (not isinstance(self.latency, int | float) or isinstance(self.latency, bool)
                or not math.isfinite(self.latency) or self.latency < 0):
            raise CostError(f"communication latency must be a finite number >= 0, got {self.latency!r}")

    @property
    def has_exchanges(self) -> bool:
        """Whether any stage's passes make all-to-alls that take time (the simulator then draws them)."""
        return any(stage.exchange_time > 0 for stage in self.stages)

    @classmethod
    def uniform(
        cls,
        num_stages: int,
        forward: float = 1.0,
        backward_input: float = 1.0,
        backward_weight: float = 1.0,
        *,
        latency: float = 0.0,
        activation_bytes: float = 0.0,
        weight_activation_bytes: float | None = None,
        exchange: float = 0.0,
        exchanges: int = 0,
    ) -> CostModel:
        """Every stage costs the same (see :class:`StageCosts` for the bytes and the exchanges)."""
        stage = StageCosts(forward, backward_input, backward_weight, activation_bytes, weight_activation_bytes,
                           exchange, exchanges)
        return cls((stage,) * num_stages, latency)

    @classmethod
    def per_stage(
        cls, costs: Sequence[StageCosts | Sequence[float]], *, latency: float = 0.0
    ) -> CostModel:
        """One entry per stage: a :class:`StageCosts` or ``(forward, backward_input, backward_weight[, bytes[,
        weight bytes]])`` (see :class:`StageCosts`).

        Example:
            >>> CostModel.per_stage([(1, 2, 1), (1, 2, 1, 4096)]).stages[1].activation_bytes
            4096
        """
        stages = []
        for index, entry in enumerate(costs):
            if isinstance(entry, StageCosts):
                stages.append(entry)
            elif isinstance(entry, Sequence) and not isinstance(entry, str) and len(entry) in (3, 4, 5):
                stages.append(StageCosts(*entry))
            else:
                raise CostError(
                    f"the costs of stage {index} must be a StageCosts or (forward, backward_input, "
                    f"backward_weight[, activation_bytes[, weight_activation_bytes]]), got {entry!r}"
                )
        return cls(tuple(stages), latency)

    def check_stages(self, num_stages: int) -> None:
        if len(self.stages) != num_stages:
            raise CostError(
                f"costs given for {len(self.stages)} stages but the schedule has {num_stages}; "
                "give one entry per stage, or use CostModel.uniform(num_stages, ...)"
            )

    def duration(self, action: Action) -> float:
        """Time one compute action takes run alone, its exchanges waited for (communication actions
        take none; latency is separate)."""
        stage = self.stages[action.stage]
        kind = action.kind
        if kind is ActionKind.F:
            return stage.forward + stage.exchange_time if stage.exchanges else stage.forward
        if kind is ActionKind.B:
            return stage.full_backward + stage.exchange_time if stage.exchanges else stage.full_backward
        if kind is ActionKind.I:
            return stage.backward_input + stage.exchange_time if stage.exchanges else stage.backward_input
        if kind is ActionKind.W:
            return stage.backward_weight
        return 0.0


def costs_from_timeline(timeline, num_stages: int, *, latency: float = 0.0) -> CostModel:
    """Per-stage costs measured in a Timeline: the median duration of each pass of each stage.

    A stage seen only with full backwards (B) gets its whole B as the input-gradient
    cost and 0 for the weight gradient, which simulates that same schedule faithfully.

    Example:
        >>> import conveyor.schedule as cs
        >>> simulated = cs.simulate(cs.build("1f1b", ranks=2, microbatches=2))
        >>> costs_from_timeline(simulated, 2).stages[0].forward
        1.0
    """
    durations: dict[tuple[int, ActionKind], list[float]] = {}
    for span in timeline.spans:
        durations.setdefault((span.action.stage, span.action.kind), []).append(span.end - span.start)

    def median(stage: int, kind: ActionKind) -> float | None:
        values = sorted(durations.get((stage, kind), ()))
        return values[len(values) // 2] if values else None

    stages = []
    for stage in range(num_stages):
        forward = median(stage, ActionKind.F)
        if forward is None:
            raise CostError(f"the timeline has no forward of stage {stage}; cannot derive its costs")
        full = median(stage, ActionKind.B)
        backward_input = median(stage, ActionKind.I)
        backward_weight = median(stage, ActionKind.W)
        if backward_input is None:
            backward_input, backward_weight = (full or 0.0), 0.0
        stages.append(StageCosts(forward, backward_input, backward_weight or 0.0))
    return CostModel(tuple(stages), latency)
