"""Errors raised by conveyor.

Every user mistake is a ``ValueError`` subclass whose message says what was
expected, what came, and how to fix it. Failures of a running job name the
rank, stage and microbatch involved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class ConveyorError(Exception):
    """Base class of every error conveyor raises on purpose."""


class ScheduleError(ConveyorError, ValueError):
    """A schedule is invalid: unknown name, bad sizes, missing or deadlocking actions.

    ``grid`` holds the rendered step x rank grid (if one helps), already included
    in the message; ``message`` the text without it (for a caller that words it again).
    """

    def __init__(self, message: str, grid: str | None = None) -> None:
        self.message, self.grid = message, grid
        super().__init__(message if grid is None else f"{message}\n{grid}")


class CostError(ConveyorError, ValueError):
    """Costs given to the simulator are missing, negative or of the wrong length."""


class UsageError(ConveyorError, ValueError):
    """A command-line argument that cannot work; printed as ``conveyor: error: ...``."""


class PipelineConfigError(ConveyorError, ValueError):
    """The pipeline was set up with arguments that cannot work (checked before any communication)."""


class SplitError(PipelineConfigError):
    """The model cannot be split as asked (unknown split point, too many stages, ...).

    Found before any communication, like every :class:`PipelineConfigError`.
    """


class TracingError(SplitError):
    """torch.export could not trace the model; the message names the module and the operation."""


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


class PlanError(ConveyorError, ValueError):
    """A pipeline plan cannot be made or used: no candidate fits the memory, a plan file is malformed,
    or a plan disagrees with the run (its ranks, its modules)."""


class ConfigError(ConveyorError, ValueError):
    """A training config cannot work: an unknown key (with the allowed keys and a close match),
    or a value of the wrong type, outside its choices or range; found before anything starts."""


class LostConnection(RuntimeError):
    """A wait broke because a connection of the group closed; says what this rank waited for.

    Internal: the pipeline's lifecycle turns it into :class:`PeerFailure` naming the rank to
    blame (one that published a failure, exited, or stopped its heartbeat).
    """


# --- local ranks in processes of their own: conveyor.processes.RankGroup (the calibration's, the
# benchmarks') and conveyor.testing.run_ranks (tests') raise these to their callers ------------

class HarnessConfigError(ConveyorError, ValueError):
    """``run_ranks`` or a ``RankGroup`` was given arguments that cannot work (checked before any process starts)."""


@dataclass(frozen=True, slots=True)
class RankError:
    """How one rank failed.

    ``kind`` is ``"exception"`` (``fn`` or ``init_process_group`` raised), ``"result"``
    (the return value could not be sent back) or ``"exit"`` (the process died without a
    Python exception). ``details`` is the traceback text, or the crash stack if any.
    """

    rank: int
    kind: str
    summary: str
    details: str
    exit_code: int | None = None
    phase: str = "fn"
    seen_at: float = 0.0

    @property
    def label(self) -> str:
        """A few words: the exception type, or the exit code."""
        if self.kind == "exit":
            return f"exit code {self.exit_code}"
        if self.kind == "result":
            return "result not sent back"
        return self.summary.split(":", 1)[0] if self.phase == "fn" else "init_process_group"

    def render(self) -> str:
        title = f"--- rank {self.rank}: {self.summary} ---"
        return f"{title}\n{self.details.rstrip()}" if self.details.strip() else title


def _rebuilt_from_fields(error: Any) -> tuple[Any, ...]:
    """How a dataclass error pickles (a rank's failure crosses processes): its class and its fields,
    from which it makes its message again."""
    return type(error), tuple(getattr(error, f.name) for f in dataclasses.fields(error))


@dataclass(eq=False, repr=False)  # an exception's own identity, hash and repr
class RankFailure(ConveyorError, RuntimeError):
    """One or more ranks failed; the others were stopped.

    ``errors`` holds one :class:`RankError` per failed rank, likely root causes first
    (ranks that died, then ranks that raised, in the order they raised); ``killed`` the ranks
    still running when the harness killed them; ``finished`` the ranks that had returned.
    """

    errors: Sequence[RankError]
    killed: Sequence[int]
    finished: Sequence[int]
    world_size: int

    def __post_init__(self) -> None:
        self.errors, self.killed, self.finished = tuple(self.errors), tuple(self.killed), tuple(self.finished)
        super().__init__(self._message())

    __reduce__ = _rebuilt_from_fields

    @property
    def failed(self) -> tuple[int, ...]:
        return tuple(error.rank for error in self.errors)

    def _message(self) -> str:
        failed = ", ".join(f"rank {error.rank} ({error.label})" for error in self.errors)
        lines = [f"{len(self.errors)} of {self.world_size} ranks failed: {failed}"]
        if self.killed:
            lines.append(f"killed while still running: {_rank_list(self.killed)}")
        if self.finished:
            lines.append(f"finished: {_rank_list(self.finished)}")
        header = "; ".join(lines) + "."
        return "\n\n".join([header, *(error.render() for error in self.errors)])


@dataclass(eq=False, repr=False)
class RankTimeout(ConveyorError, TimeoutError):
    """The run (or a group's call, named by ``what``) outlived its timeout.

    ``stacks`` maps each unfinished rank to where it was stuck.
    """

    timeout_s: float
    unfinished: Sequence[int]
    stacks: Mapping[int, str]
    finished: Sequence[int]
    world_size: int
    what: str = "run_ranks"

    def __post_init__(self) -> None:
        self.unfinished, self.stacks, self.finished = tuple(self.unfinished), dict(self.stacks), tuple(self.finished)
        super().__init__(self._message())

    __reduce__ = _rebuilt_from_fields

    def _message(self) -> str:
        header = (
            f"{self.what} timed out after {self.timeout_s:g} s: "
            f"{_rank_list(self.unfinished)} of {self.world_size} had not finished"
        )
        if self.finished:
            header += f" ({_rank_list(self.finished)} finished)"
        header += ". Python stacks at the timeout, most recent call first:"
        sections = [
            f"--- rank {rank} ---\n{self.stacks.get(rank, '').rstrip() or _NO_STACK}"
            for rank in self.unfinished
        ]
        return "\n\n".join([header, *sections])



_NO_STACK = "(no stack: the rank died or had not yet installed its stack-dump handler)"


def _rank_list(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    if not ranks:
        return "no rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(rank) for rank in ranks)


class ZygoteFailure(ConveyorError, RuntimeError):
    """A zygote could not import its modules, or died, or stopped answering; it is closed."""


class GroupClosed(ConveyorError, RuntimeError):
    """A call on a rank group that was closed or killed (a failed call kills its group)."""


# Pieces of the messages above, shared by every layer (this module imports nothing of conveyor's or torch's).


def positive_int(value: object) -> bool:
    """Whether ``value`` is an int of at least 1 (a bool, though an int, is not).

    Example:
        >>> positive_int(2), positive_int(0), positive_int(True), positive_int(2.0)
        (True, False, False, False)
    """
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def listed(names: Sequence[str], most: int = 8) -> str:
    """``a, b, c``: the first ``most`` names and how many in all when there are more; ``none`` when empty.

    Example:
        >>> listed(["a", "b", "c"], most=2), listed([])
        ('a, b, ... (3 in all)', 'none')
    """
    shown = ", ".join(names[:most])
    return (shown + f", ... ({len(names)} in all)" if len(names) > most else shown) or "none"
