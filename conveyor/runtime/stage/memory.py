"""Activation memory of a training step, measured: the tensors autograd saves for backward.

With ``measure_memory=True`` a pipeline runs each stage's forward (and, on the last stage,
its loss) under :func:`torch.autograd.graph.saved_tensors_hooks`. Each tensor autograd saves
is counted, in bytes, from the moment it is saved until autograd lets go of it: a full
backward (B) frees a node's saved tensors as it runs it; the input-gradient half (I) frees
the part of the graph only the input gradient needed (what lies between the stage outputs,
or the loss, and the first operation that also leads to a weight), and the weight-gradient
half (W) the rest. What a rank holds is counted once per storage (bytes a tensor and its
views share count once; the slices of one minibatch count slice by slice), without the
stages' parameters and buffers. With ``recompute=True`` autograd saves only
each stage's inputs (the recomputation saves the rest during backward, briefly): that is
what is counted. A forward run in segments, to overlap its all-to-alls
(:mod:`conveyor.runtime.stage.segments`), also keeps what each cut holds for its backward (the
tensors it sent and received, the values that cross the cut): counted as well, until the backward.

Not counted: what a stage holds outside autograd (a tensor a module keeps on ``self``),
transport buffers, gradients, and tensors saved under the model's own saved-tensor hooks
(offloading): those come back to autograd in the form the model's hook gives.

The cost is Python calls per saved tensor (torch's hook machinery alone costs about 10 µs per
stage forward and backward, the counting about 20 µs more): on one CPU thread, 5-9% of a
step of a small GPT (width 128, 2 layers per stage) and 25-30% of a step whose stages take
microseconds, so it is off by default.

Example:
    >>> import torch
    >>> meter = MemoryMeter(0, {})
    >>> meter.start_step()
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> with meter.saving(0, 0):
    ...     y = torch.nn.functional.gelu(x)              # gelu saves x: 4 x 8 floats
    >>> meter.live_bytes, meter.report().stage_bytes
    (128, {0: 128})
    >>> y.sum().backward()                               # the node is freed with its saved x
    >>> meter.live_bytes, meter.report().peak_bytes
    (0, 128)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING

import torch
from torch.autograd.graph import saved_tensors_hooks

from conveyor.errors import PipelineConfigError

if TYPE_CHECKING:
    from conveyor.runtime.stage.runner import StageRunner

Span = tuple[int, int]  # byte offsets [start, end) within a storage


@dataclass(frozen=True)
class MemoryReport:
    """One rank's activation memory in the last training step, in bytes.

    ``peak_bytes``: the most saved activations the rank held at once. ``stage_bytes``:
    per stage of the rank, the most one microbatch's forward saved (one stage-microbatch's
    activations). ``weight_bytes``: per stage whose backward ran split into I and W, the
    most one microbatch still held from its I to its W. ``device_peak_bytes``: on CUDA,
    ``torch.cuda.max_memory_allocated`` over the step (everything: parameters, gradients,
    buffers; in one process, every rank's together), else None.
    """

    rank: int
    peak_bytes: int
    stage_bytes: dict[int, int] = field(default_factory=dict)
    weight_bytes: dict[int, int] = field(default_factory=dict)
    device_peak_bytes: int | None = None


class _Saved:
    """What autograd holds in place of a saved tensor: its death is the tensor's release."""

    __slots__ = ("tensor", "version", "meter", "key", "span")

    def __init__(self, tensor: torch.Tensor, meter: MemoryMeter, key: int | None, span: Span) -> None:
        self.tensor = tensor
        self.version = tensor._version
        self.meter = meter
        self.key = key
        self.span = span

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._release(self.key, self.span)


def _unpack(saved: _Saved) -> torch.Tensor:
    tensor = saved.tensor
    # Autograd skips its own check for tensors that went through hooks; without this one an
    # in-place write to a saved tensor would pass silently only while memory is measured.
    if tensor._version != saved.version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: a {tuple(tensor.shape)} {tensor.dtype} tensor is at version {tensor._version}; "
            f"expected version {saved.version} instead (do not modify a tensor in place after an "
            "operation saved it for backward)"
        )
    return tensor


def _storage_key(tensor: torch.Tensor) -> int | None:
    """The address of the storage ``tensor`` lies in (None: a subclass with no storage of its own)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _span(tensor: torch.Tensor) -> Span:
    """The bytes of its storage ``tensor`` spans."""
    size = tensor.element_size()
    start = tensor.storage_offset() * size
    if tensor.is_contiguous():
        return start, start + tensor.nbytes
    if tensor.numel() == 0:
        return start, start
    extent = 1 + sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride()))
    return start, start + extent * size


def _union(spans: Iterable[Span]) -> int:
    total, reached = 0, None
    for start, end in sorted(spans):
        if reached is None or start > reached:
            total += end - start
            reached = end
        elif end > reached:
            total += end - reached
            reached = end
    return total


class MemoryMeter:
    """Counts, for one rank, the bytes of what autograd saves in its stages' forwards."""

    def __init__(self, rank: int, runners: Mapping[int, StageRunner]) -> None:
        self.rank = rank
        self.runners = runners
        self.live_bytes = 0
        self.peak_bytes = 0
        # Per storage: each span saved from it with how many saved tensors cover it, and the
        # bytes their union covers.
        self._spans: dict[int, dict[Span, int]] = {}
        self._covered: dict[int, int] = {}
        self._own: list[tuple[int, Span]] = []  # what the running forward saved
        self._forward_spans: dict[tuple[int, int], dict[int, set[Span]]] = {}  # per (stage, microbatch), this step
        self._hooks = saved_tensors_hooks(self._pack, _unpack)
        self._excluded: set[int] = set()
        self.forward_bytes: dict[tuple[int, int], int] = {}
        self.stage_bytes: dict[int, int] = {}
        self.weight_bytes: dict[int, int] = {}
        self.device: torch.device | None = None
        self.resets_device_peak = True

    def start_step(self) -> None:
        """Start counting a training step (what earlier steps left held still counts)."""
        self.peak_bytes = self.live_bytes
        self.forward_bytes.clear()
        self._forward_spans.clear()
        self.stage_bytes.clear()
        self.weight_bytes.clear()
        # Parameters and buffers are saved too (a Linear saves its weight); they are not activations.
        modules = [runner.module for runner in self.runners.values()]
        tensors = [t for m in modules for t in chain(m.parameters(), m.buffers())]
        self._excluded = {_storage_key(t) for t in tensors}
        self.device = tensors[0].device if tensors else None
        if self.resets_device_peak and self.device is not None and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    @contextlib.contextmanager
    def saving(self, stage: int, microbatch: int) -> Iterator[None]:
        """The context to run ``stage``'s forward (and loss) on ``microbatch`` in: saved tensors count for it."""
        self._own = []
        try:
            with self._hooks:
                yield
        finally:
            # A forward run in steps (an overlapped pair: conveyor.runtime.stage.segments) enters once per step:
            # what it saved or cut counts once over all its steps (a step's cut may keep what an earlier step saved).
            key = (stage, microbatch)
            spans = self._forward_spans.setdefault(key, {})
            for storage, span in self._own:
                spans.setdefault(storage, set()).add(span)
            self._own = []
            own = self.forward_bytes[key] = sum(_union(found) for found in spans.values())
            self.stage_bytes[stage] = max(self.stage_bytes.get(stage, 0), own)

    def input_pass_done(self, stage: int, microbatch: int, bytes_before: int) -> None:
        """After I of (stage, microbatch), begun with ``bytes_before`` held: note what W keeps."""
        freed = bytes_before - self.live_bytes
        kept = max(0, self.forward_bytes.get((stage, microbatch), 0) - freed)
        self.weight_bytes[stage] = max(self.weight_bytes.get(stage, 0), kept)

    def count_kept(self, tensor: torch.Tensor) -> object:
        """Count ``tensor``, kept for backward outside autograd's saved tensors (selective
        checkpointing keeps operator outputs itself), until the returned handle dies."""
        return self._pack(tensor)

    def report(self) -> MemoryReport:
        """What the last training step held (see :class:`MemoryReport`)."""
        device_peak = None
        if self.device is not None and self.device.type == "cuda":
            device_peak = int(torch.cuda.max_memory_allocated(self.device))
        return MemoryReport(self.rank, self.peak_bytes, dict(self.stage_bytes), dict(self.weight_bytes),
                            device_peak)

    def _pack(self, tensor: torch.Tensor) -> object:
        key = _storage_key(tensor)
        # A detached alias: the tensor itself would tie a saved output to its own grad_fn, a
        # cycle that keeps the graph alive after the runner drops it.
        if key in self._excluded:
            return _Saved(tensor.detach(), self, None, (0, 0))  # held and checked, not counted
        alias = tensor.detach()
        if key is None:  # the alias lives as long as what autograd holds: its id stays unique meanwhile
            key, span = id(alias), (0, tensor.numel() * tensor.element_size())
        else:
            span = _span(tensor)
        saved = _Saved(alias, self, key, span)
        if span[0] == span[1]:
            saved.key = None
            return saved
        self._own.append((key, span))
        spans = self._spans.setdefault(key, {})
        if span in spans:
            spans[span] += 1
            return saved
        spans[span] = 1
        covered = _union(spans)
        self.live_bytes += covered - self._covered.get(key, 0)
        self._covered[key] = covered
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        return saved

    def _release(self, key: int, span: Span) -> None:
        spans = self._spans[key]
        count = spans[span] - 1
        if count:
            spans[span] = count
            return
        del spans[span]
        if not spans:
            del self._spans[key]
            self.live_bytes -= self._covered.pop(key)
            return
        covered = _union(spans)
        self.live_bytes -= self._covered[key] - covered
        self._covered[key] = covered


def memory_report(meter: MemoryMeter | None, pipeline: str) -> MemoryReport:
    """``meter``'s report; a clear error where the pipeline was built without measuring.

    Example:
        >>> memory_report(None, "pipeline")
        Traceback (most recent call last):
        ...
        conveyor.errors.PipelineConfigError: memory() reports what ...
    """
    if meter is None:
        raise PipelineConfigError(
            f"memory() reports what autograd saved in the last step, but this {pipeline} was built without "
            f"measuring it; build it with stage=StageOptions(measure_memory=True) (it slows each step: see "
            f"conveyor.runtime.stage.memory)"
        )
    return meter.report()


def reset_device_peaks(meters: Iterable[MemoryMeter]) -> None:
    """Reset the CUDA peak of every device the meters' ranks use, once each (ranks in one process)."""
    devices = set()
    for meter in meters:
        meter.resets_device_peak = False
        for runner in meter.runners.values():
            device = next((p.device for p in runner.module.parameters()), None)
            if device is not None and device.type == "cuda":
                devices.add(device)
    for device in devices:
        torch.cuda.reset_peak_memory_stats(device)
