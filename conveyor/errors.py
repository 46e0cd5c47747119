"""Errors raised by conveyor.

Every user mistake is a ``ValueError`` subclass whose message says what was
expected, what came, and how to fix it. Failures of a running job name the
rank, stage and microbatch involved.
"""

from __future__ import annotations


class ConveyorError(Exception):
    """Base class of every error conveyor raises on purpose."""


class ScheduleError(ConveyorError, ValueError):
    """A schedule is invalid: unknown name, bad sizes, missing or deadlocking actions.

    ``grid`` holds the rendered step x rank grid (if one helps), already included
    in the message.
    """

    def __init__(self, message: str, grid: str | None = None) -> None:
        self.grid = grid
        super().__init__(message if grid is None else f"{message}\n{grid}")


class CostError(ConveyorError, ValueError):
    """Costs given to the simulator are missing, negative or of the wrong length."""


class PipelineConfigError(ConveyorError, ValueError):
    """The pipeline was set up with arguments that cannot work (checked before any communication)."""


class StageExecutionError(ConveyorError, RuntimeError):
    """A stage failed while running an action; the message names rank, stage and microbatch."""


class SpecMismatchError(StageExecutionError, ValueError):
    """A tensor crossing stages differs from what the receiving stage was told (shape, dtype, structure)."""


class CommTimeout(ConveyorError, TimeoutError):
    """A blocking receive waited longer than its timeout; names what it waited for and from whom."""


class PeerFailure(ConveyorError, RuntimeError):
    """Another rank failed; this rank stopped instead of waiting for it. Carries the peer's message."""


class PipelineStopped(ConveyorError, RuntimeError):
    """The pipeline stopped after a failure (its own process groups are closed); build a new one to go on."""


class PipelineClosed(ConveyorError, RuntimeError):
    """The pipeline was closed (``close()`` or the end of its ``with`` block); build a new one to go on."""


class NonFiniteError(ConveyorError, FloatingPointError):
    """A step's loss or gradients were not finite (``on_nonfinite="raise"``); names microbatch and stages."""


class CheckpointError(ConveyorError, ValueError):
    """A checkpoint cannot be written or read as asked (a bad path, a value JSON cannot hold, I/O)."""


class CheckpointIncompleteError(CheckpointError):
    """A directory is not a complete conveyor checkpoint: an interrupted save, or a file missing or cut short."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint does not fit what it is loaded into; names the first missing or mismatched key and the shapes."""


class PretrainedWeightsError(CheckpointError):
    """Pretrained weights (safetensors) do not fit the model: a tensor missing, or of another shape."""
