"""Execute one rank's lowered program for one step: one handler per action kind.

The executor is a generator: with a transport that can block (torch.distributed)
it never yields; with the in-process transport it yields whenever a receive
has not arrived yet, so a driver can run every rank of a schedule in one
thread (see :func:`run_local`).

Data moves between handlers through four tables keyed by (stage, microbatch):
forward inputs, outputs waiting to be sent, output gradients received, input
gradients waiting to be sent. Stage pairs on the same rank hand over directly.

Transfers go out and are awaited on one path, whatever the transport: before each action
the executor posts the batches the lowered program's posts name there
(:mod:`conveyor.schedule.posts`: the pass chain's ``Executable`` holds them, per rank and
transport discipline); a SEND action has then been posted, and a RECV action waits for its
handle.

Example (the whole pipeline in one process):
    >>> # see conveyor.Pipeline(..., layout=conveyor.InProcessLayout()) for the user-facing form
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping
from typing import Any

import torch

from conveyor.errors import StageExecutionError
from conveyor.runtime.stage.device import to_device
from conveyor.runtime.stage.memory import MemoryMeter
from conveyor.runtime.stage.runner import StageRunner
from conveyor.runtime.stage.segments import interleave, run_to_end, timed
from conveyor.runtime.stage.timing import EventRecorder, StepRecorder
from conveyor.runtime.transport.transport import LocalTransport, Transport, detach_for_next_stage
from conveyor.schedule.ir import Action, ActionKind, Placement
from conveyor.schedule.posts import Batch, RankPosts

_UNRECORDED = frozenset({ActionKind.SEND_F, ActionKind.SEND_B})
_FINISHED = object()  # what run_local's next() gives for a rank whose step has ended


def as_stage_inputs(value: Any) -> tuple[tuple, dict]:
    """How a stage is called with the previous stage's output: a tuple is unpacked, anything else is one argument."""
    return (value, {}) if isinstance(value, tuple) else ((value,), {})


class RankExecutor:
    """Runs ``program`` (a lowered program of ``rank``) on the stage runners of this rank.

    ``device``: the stage device (None: wherever the values already are). What arrives is
    moved there; what leaves is moved to the transport's device (its ``device`` attribute:
    a transport over NCCL says the stage's GPU; without one, the CPU, which gloo and shared
    memory carry; in one process, nowhere). Neither moves anything when both are the CPU.
    """

    def __init__(
        self,
        rank: int,
        placement: Placement,
        runners: dict[int, StageRunner],
        transport: Transport,
        measure_memory: bool = False,
        device: torch.device | None = None,
    ) -> None:
        self.rank = rank
        self.device = device
        wire = getattr(transport, "device", None if isinstance(transport, LocalTransport) else torch.device("cpu"))
        self.wire_device = wire if wire is not None and device is not None and wire != device else None
        self.placement = placement
        self.runners = runners
        self.transport = transport
        self.actions_done = 0
        self.program: tuple[Action, ...] | None = None  # the one running now, None between runs
        self.runs_started = 0
        self.recvs: dict[Action, Any] = {}  # posted receives' handles, until their RECV waits
        # A handler returns None once its action is done, or (a receive) a generator that yields while it waits.
        self.handlers: dict[ActionKind, Callable[[Action], Iterator[None] | None]] = {
            ActionKind.F: self._forward,
            ActionKind.B: self._backward,
            ActionKind.I: self._backward,
            ActionKind.W: self._backward_weight,
            ActionKind.SEND_F: self._posted,
            ActionKind.SEND_B: self._posted,
            ActionKind.RECV_F: self._recv,
            ActionKind.RECV_B: self._recv,
        }
        # What autograd saves in this rank's forwards, counted (see conveyor.runtime.stage.memory).
        self.memory_meter = MemoryMeter(rank, runners) if measure_memory else None
        for runner in runners.values():
            runner.memory_meter = self.memory_meter

    def forget_receives(self) -> None:
        """Drop the handles of posted receives (after a failure: they hold the process group)."""
        self.recvs = {}

    # --- one step -----------------------------------------------------------------
    def run(
        self,
        program: tuple[Action, ...],
        posts: RankPosts,
        first_stage_inputs: list[tuple[tuple, dict]] | None,
        targets: list[Any] | None,
        recorder: StepRecorder | EventRecorder | None,
        *,
        keep_outputs: bool = False,
        gradients_final: Mapping[int, int] | None = None,
        on_gradients_final: Callable[[int], None] | None = None,
        pairs: Mapping[Action, Action] | None = None,
    ) -> Iterator[None]:
        """Run ``program`` once (a generator: see the module docstring), posting ``posts`` (per action,
        the batches posted right before it: the pass chain's, ``Executable.train_posts`` or ``eval_posts``).

        ``on_gradients_final(stage)`` is called right after the action at each index of
        ``gradients_final`` ({index: stage}), when that stage's weight gradients are complete.
        ``pairs`` ({forward: backward}, :func:`conveyor.schedule.overlap.pairs_of`): each forward runs
        together with its backward, the two passes taking turns at their exchanges
        (:func:`conveyor.runtime.stage.segments.interleave`); the backward's own turn in the program
        then finds it done, and its span is the pair's.
        """
        self.forward_inputs: dict[tuple[int, int], tuple[tuple, dict]] = {
            (0, m): inputs for m, inputs in enumerate(first_stage_inputs or ())}
        self.to_send: dict[tuple[ActionKind, int, int], Any] = {}
        self.output_grads: dict[tuple[int, int], list] = {}
        self.targets = targets
        self.keep_outputs = keep_outputs
        if len(posts) != len(program):
            raise ValueError(f"rank {self.rank} was given posts for {len(posts)} actions with a program of "
                             f"{len(program)}: take them from the Executable that gave the program")
        if self.memory_meter is not None and torch.is_grad_enabled():
            self.memory_meter.start_step()
        self.recvs = {}
        self.pairs = Pairs(self.rank, program, pairs or {})
        self.actions_done = 0
        self.program = program
        self.runs_started += 1
        final = gradients_final if on_gradients_final is not None else {}
        for index, action in enumerate(program):
            # Compute actions and receive waits: a wait shows where a rank idled for a peer. Only
            # those are marked (on a GPU each mark records a CUDA event).
            recorded = recorder is not None and action.kind not in _UNRECORDED
            start = recorder.mark() if recorded else None
            batches = posts[index]
            if batches:
                self._post(batches)
            waits = self.handlers[action.kind](action)
            if waits is not None:
                yield from waits
            self.actions_done += 1
            if recorded:
                self.pairs.record(recorder, action, start)
            if index in final:
                on_gradients_final(final[index])  # type: ignore[misc]  # set whenever final is not empty
        self.transport.finish_sends()
        self.program = None

    def position(self) -> dict[str, Any]:
        """Where this rank stands, for "where is everyone" (read from another thread: plain values)."""
        program, index = self.program, self.actions_done
        if program is None:
            return {"rank": self.rank, "running": False, "runs": self.runs_started}
        action = str(program[index]) if index < len(program) else "finishing its sends"
        return {"rank": self.rank, "running": True, "runs": self.runs_started, "index": index,
                "length": len(program), "action": action}

    def _post(self, batches: tuple[Batch, ...]) -> None:
        """Post what the program's posts put before this action: each batch over one channel."""
        for batch in batches:
            if batch.sends:
                self.transport.post_sends(batch.peer, batch.keys, [self._outgoing(a) for a in batch.actions])
            else:
                self.recvs.update(zip(batch.actions, self.transport.post_recvs(batch.peer, batch.keys)))

    def _outgoing(self, action: Action) -> Any:
        """What a SEND action carries, on the transport's device (the SEND_B key is the sending stage's)."""
        value = self.to_send.pop((action.kind, action.stage, action.microbatch))
        return value if self.wire_device is None else to_device(value, self.wire_device)

    # --- handlers -------------------------------------------------------------------
    def _forward(self, action: Action) -> None:
        partner = self.pairs.partner.get(action) if self.pairs.partner else None
        if partner is None:
            self._forward_plain(action)
        else:
            spent = [0.0, 0.0]  # each pass's own stretches: how the pair's span is shared in the timeline
            interleave(timed(self._forward_steps(action), spent, 0), timed(self._backward_steps(partner), spent, 1))
            self.pairs.done[partner] = spent[0]

    def _forward_plain(self, action: Action) -> None:
        runner, inputs, target = self._forward_inputs(action)
        self._forward_output(action, runner, runner.forward(action.microbatch, inputs, target,
                                                            keep_output=self.keep_outputs))

    def _forward_steps(self, action: Action) -> Generator[None, None, None]:
        runner, inputs, target = self._forward_inputs(action)
        self._forward_output(action, runner, (yield from runner.forward_steps(action.microbatch, inputs, target,
                                                                              keep_output=self.keep_outputs)))

    def _forward_inputs(self, action: Action) -> tuple[StageRunner, tuple[tuple, dict], Any]:
        s, m = action.stage, action.microbatch
        runner = self.runners[s]
        inputs = self.forward_inputs.pop((s, m), None)
        if inputs is None:
            raise StageExecutionError(
                f"rank {self.rank} reached {action} but has no input for stage {s}, microbatch {m}"
                + (" (pass the inputs on the rank that runs stage 0)" if s == 0 else "")
            )
        return runner, inputs, self.targets[m] if (runner.is_last and self.targets is not None) else None

    def _forward_output(self, action: Action, runner: StageRunner, output: Any) -> None:
        s, m = action.stage, action.microbatch
        if not runner.is_last:
            if self.placement.rank_of(s + 1) == self.rank:
                self.forward_inputs[(s + 1, m)] = as_stage_inputs(detach_for_next_stage(output))
            else:
                self.to_send[(ActionKind.SEND_F, s, m)] = output

    def _hand_back(self, s: int, m: int, input_grads: list) -> None:
        if s == 0:
            return
        if self.placement.rank_of(s - 1) == self.rank:
            self.output_grads[(s - 1, m)] = input_grads
        else:
            self.to_send[(ActionKind.SEND_B, s, m)] = tuple(input_grads)

    def _backward(self, action: Action) -> None:
        """B, or I (with the memory meter's note of what W keeps), unless it already ran in its pair."""
        if not self.pairs.ran(action):
            run_to_end(self._backward_steps(action))

    def _backward_steps(self, action: Action) -> Generator[None, None, None]:
        """B or I of ``action``, in steps where its forward ran in segments (else at once)."""
        s, m = action.stage, action.microbatch
        split = action.kind is ActionKind.I
        grads = self.output_grads.pop((s, m), None)
        meter = self.memory_meter
        held = meter.live_bytes if meter is not None else 0
        self._hand_back(s, m, (yield from self.runners[s].backward_steps(m, grads, split=split)))
        if split and meter is not None:
            meter.input_pass_done(s, m, held)

    def _backward_weight(self, action: Action) -> None:
        self.runners[action.stage].backward_weight(action.microbatch)

    def _posted(self, action: Action) -> None:
        """A SEND goes out with the batch its posts put it in, at or before it: nothing left to do."""

    def _recv(self, action: Action) -> Iterator[None]:
        handle = self.recvs.pop(action)
        if not self.transport.can_block():
            while not self.transport.ready(handle):
                yield
        s, m = action.stage, action.microbatch
        forward = action.kind is ActionKind.RECV_F
        what = f"the {'input' if forward else 'output gradient'} of stage {s}, microbatch {m} ({action})"
        value = self.transport.wait(handle, what)
        if self.wire_device is not None:
            value = to_device(value, self.device)
        if forward:
            self.forward_inputs[(s, m)] = as_stage_inputs(value)
        else:
            self.output_grads[(s, m)] = list(value)


class Pairs:
    """One run's overlapped pairs (``{forward: backward}``): what the executor runs together, and how a pair's
    span is shared in the timeline: on the CPU's clock each pass gets its own time in it (the forward first); a
    device's events cannot be split, so there the forward's span covers the pair and its backward's is empty."""

    def __init__(self, rank: int, program: tuple[Action, ...], partner: Mapping[Action, Action]) -> None:
        if partner and not set(partner.items()) <= set(zip(program, program[1:])):
            raise StageExecutionError(f"rank {rank} was given pairs that are not adjacent actions of its program "
                                      f"({sorted(map(str, partner))}): take them from the schedule the program "
                                      "came from (conveyor.schedule.overlap.pairs_of(executable.train, rank))")
        self.partner = partner
        self.done: dict[Action, Any] = {}  # a pair's backward: its forward's own seconds, then its span's start

    def ran(self, backward: Action) -> bool:
        """Whether ``backward`` already ran, in its pair."""
        return bool(self.done) and backward in self.done

    def record(self, recorder: StepRecorder | EventRecorder, action: Action, start: Any) -> None:
        """Record ``action``'s span, which ended now (a pair's: its share of the pair)."""
        end = recorder.mark()
        share = self.done.get(self.partner.get(action)) if self.partner else None
        if share is not None:  # a pair's forward: its part, the rest left to its backward
            end = start + share if isinstance(start, float) else end
            self.done[self.partner[action]] = end
        elif self.done and action in self.done:  # a pair's backward, run with its forward
            start = self.done.pop(action)
            end = start if not isinstance(start, float) or start > end else end
        recorder.add(action, start, end)


def run_local(executors: list[RankExecutor], runs: list[Iterator[None]]) -> None:
    """Drive every rank's step in one thread: each runs until it waits for a message."""
    active = list(zip(executors, runs))
    while active:
        before = sum(ex.actions_done for ex, _ in active)
        still = [(executor, run) for executor, run in active if next(run, _FINISHED) is not _FINISHED]
        if len(still) == len(active) and sum(ex.actions_done for ex, _ in still) == before:
            stuck = ", ".join(f"rank {ex.rank} at action {ex.actions_done}" for ex, _ in still)
            raise StageExecutionError(f"in-process run made no progress ({stuck}): the schedule deadlocks")
        active = still
