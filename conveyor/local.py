"""LocalPipeline: every rank of a schedule in one process and one thread, for debugging and fast tests.

Its numerics are :class:`conveyor.Pipeline`'s, bit for bit: the same executor runs every
rank's program, with an in-process mailbox for a transport.

Example:
    >>> import torch, conveyor
    >>> stages = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)]
    >>> pipe = conveyor.LocalPipeline(stages, schedule="1f1b", microbatches=2,
    ...                               loss_fn=lambda y, t: (y - t).pow(2).mean())
    >>> loss = pipe.step(torch.ones(4, 4), target=torch.zeros(4, 1))
    >>> loss.shape
    torch.Size([])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from conveyor.errors import PipelineClosed, PipelineConfigError
from conveyor.microbatch import merge_outputs
from conveyor.parallel.clipping import check_nonfinite_mode
from conveyor.parallel.loss import set_loss_divisor, summed_loss
from conveyor.pipe import _PipelineBase
from conveyor.runtime.compile import CompileSpec
from conveyor.runtime.device import module_device, place_modules, resolve_device
from conveyor.runtime.executor import RankExecutor, run_local
from conveyor.runtime.main_grad import param_precision
from conveyor.runtime.memory import MemoryReport, memory_report, reset_device_peaks
from conveyor.runtime.rng import step_random_streams
from conveyor.runtime.runner import LossFn, StageRunner, build_runners
from conveyor.runtime.timing import EventRecorder, StepRecorder, make_recorder
from conveyor.runtime.transport import LocalMailbox, LocalTransport, Transport
from conveyor.schedule import available
from conveyor.schedule.ir import Schedule
from conveyor.schedule.passes import executable
from conveyor.schedule.registry import resolve_schedule
from conveyor.schedule.timeline import Timeline, measured_timeline


class LocalPipeline(_PipelineBase):
    """Every rank of a schedule in one process and one thread, with the numerics of :class:`Pipeline`.

    ``modules`` holds one module per stage, indexed by stage. For debugging and fast tests.
    The keywords mean what they mean to :class:`Pipeline` (``random_streams`` included).
    ``device``: the one device every stage runs on (CPU modules are moved there); by default
    where the modules already are (the CPU for modules without tensors).
    """

    def __init__(
        self,
        modules: Sequence[torch.nn.Module],
        schedule: Schedule | str,
        loss_fn: LossFn | None = None,
        *,
        microbatches: int | None = None,
        virtual: int | None = None,
        ranks: int | None = None,
        checkpoint_activations: bool = False,
        tied_parameters: Sequence = (),
        parameter_order: Mapping[str, int] | None = None,
        random_streams: bool = True,
        autocast: str | torch.dtype | None = None,
        param_dtype: str | torch.dtype | None = None,
        grad_accum_dtype: str | torch.dtype | None = None,
        measure_memory: bool = False,
        compile: CompileSpec = False,
        device: torch.device | str | None = None,
    ) -> None:
        modules = list(modules)
        self.random_streams = random_streams
        if isinstance(schedule, str) and ranks is None:
            # One module per stage: the rank count follows from the schedule's stages per rank.
            info = available().get(schedule)
            stages_per_rank = virtual or (info.default_virtual if info is not None else 1)
            ranks = max(1, len(modules) // stages_per_rank)
        self.schedule = resolve_schedule(schedule, microbatches, virtual, ranks or 1)
        if len(modules) != self.schedule.num_stages:
            raise PipelineConfigError(
                f"schedule {self.schedule.name!r} has {self.schedule.num_stages} stages; pass one module per "
                f"stage (got {len(modules)})"
            )
        self.device = resolve_device(device if device is not None else module_device(modules) or "cpu")
        place_modules(modules, range(len(modules)), self.device)
        self.mailbox = LocalMailbox()
        self.runs = executable(self.schedule)
        self.executors: list[RankExecutor] = []
        precision = param_precision(param_dtype, grad_accum_dtype)
        self.runners: dict[int, StageRunner] = {}
        for rank in range(self.schedule.num_ranks):
            stages = self.schedule.stages_of(rank)
            runners = build_runners(self.schedule, rank, [modules[s] for s in stages], loss_fn,
                                    checkpoint_activations, autocast, compile, precision)
            self.runners.update(runners)
            transport: Transport = LocalTransport(self.mailbox, rank)
            self.executors.append(RankExecutor(rank, self.schedule.placement, runners, transport,
                                               measure_memory=measure_memory, device=self.device))
        # In one process every copy of a tied parameter can simply be the same Parameter.
        self._tie(tied_parameters, parameter_order)
        self._recorders: list[StepRecorder | EventRecorder] = []
        self.closed = False

    def close(self) -> None:
        """Refuse later calls (one process holds nothing else to release); as :meth:`Pipeline.close`."""
        self.closed = True
        self.mailbox.messages.clear()

    def _check_open(self) -> None:
        if self.closed:
            raise PipelineClosed("this pipeline was closed (close() or the end of its `with` block); "
                                 "build a new LocalPipeline to go on")

    def step(self, *args: Any, target: Any = None, return_outputs: bool = False,
             on_nonfinite: str | None = None, normalize_by: float | torch.Tensor | None = None, **kwargs: Any):
        """One training step on the whole minibatch, as :meth:`Pipeline.step` (one replica).

        Example (a per-token loss: ``loss_fn`` sums, the step divides by the token count)::

            loss = pipe.step(x, target=y, normalize_by=conveyor.parallel.count_tokens(pipe, y))
        """
        self._check_open()
        check_nonfinite_mode(on_nonfinite)
        first = self._split_inputs(args, kwargs)
        targets = self._split_target(target)
        set_loss_divisor(self.runners, self.schedule.num_stages, normalize_by)
        for runner in self.runners.values():
            runner.reset()
        self.mailbox.messages.clear()  # a step that raised may have left messages behind
        self._recorders = [make_recorder(self.device) for _ in self.executors]
        meters = [ex.memory_meter for ex in self.executors if ex.memory_meter is not None]
        if meters:
            reset_device_peaks(meters)  # ranks share this process's devices: reset each once
        with torch.enable_grad(), step_random_streams(self.runners.values(), self.random_streams):
            run_local(self.executors, [
                ex.run(self.runs.train_program(r), first if r == self.schedule.placement.rank_of(0) else None,
                       targets, self._recorders[r], keep_outputs=return_outputs)
                for r, ex in enumerate(self.executors)
            ])
        last = self.runners[self.schedule.num_stages - 1]
        loss = summed_loss(last)
        result = (loss, merge_outputs([last.outputs[m] for m in range(self.schedule.num_microbatches)])
                  ) if return_outputs else loss
        report = self._nonfinite_report() if on_nonfinite else ""
        if report:
            self._after_nonfinite(report, on_nonfinite)
        return result

    def forward(self, *args: Any, **kwargs: Any):
        self._check_open()
        first = self._split_inputs(args, kwargs)
        for runner in self.runners.values():
            runner.reset()
        self.mailbox.messages.clear()
        with torch.no_grad(), step_random_streams(self.runners.values(), self.random_streams):
            run_local(self.executors, [
                ex.run(self.runs.eval_program(r), first if r == self.schedule.placement.rank_of(0) else None,
                       None, None)
                for r, ex in enumerate(self.executors)
            ])
        last = self.runners[self.schedule.num_stages - 1]
        outputs = merge_outputs([last.outputs[m] for m in range(self.schedule.num_microbatches)])
        last.outputs.clear()
        return outputs

    __call__ = forward

    def memory(self) -> list[MemoryReport]:
        """Each rank's activation memory in the last training step (``measure_memory=True``), by rank.

        Peak bytes autograd held for backward, and one stage-microbatch's bytes: see
        :class:`conveyor.runtime.memory.MemoryReport`.

        Example:
            >>> import torch, conveyor
            >>> pipe = conveyor.LocalPipeline([torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)], "gpipe",
            ...                               microbatches=2, measure_memory=True,
            ...                               loss_fn=lambda y, t: (y - t).sum())
            >>> _ = pipe.step(torch.ones(8, 4), target=torch.zeros(8, 1))
            >>> [(r.peak_bytes, r.stage_bytes) for r in pipe.memory()]   # each Linear saves its 4 x 4 input
            [(128, {0: 64}), (128, {1: 64})]
        """
        return [memory_report(ex.memory_meter, "LocalPipeline") for ex in self.executors]

    def timeline(self) -> Timeline:
        return measured_timeline(self.schedule, [[(str(a), s, e) for a, s, e in r.events] for r in self._recorders])
