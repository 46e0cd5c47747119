"""Timelines on a GPU come from when the device ran the work, not from when the host queued it.

A fake GPU (a host clock, and per stream the time its queued work ends) stands in for CUDA:
its events are recorded when the stream reaches them, ``synchronize`` advances the host to
that point, ``elapsed_time`` is in milliseconds, as ``torch.cuda.Event``'s. A GPU that lags
the host (still busy with earlier work) runs each action seconds after the host queued it.
"""

from __future__ import annotations

import types

import pytest
import torch

import conveyor.plan.calibration as calibration
from conveyor.parallel import replicas as replicas_module
from conveyor.parallel.replicas import Replicas
from conveyor.runtime.stage.timing import EventRecorder, SpanTimer
from conveyor.testing.models import Emulated


class FakeGpu:
    """The host's clock and, per stream (None: the current one), when its queued work ends."""

    def __init__(self, busy_for: float = 0.0) -> None:
        self.host = 100.0
        self.busy: dict[object, float] = {None: self.host + busy_for}

    def clock(self) -> float:
        return self.host

    def run(self, seconds: float, stream: object = None) -> None:
        """Queue ``seconds`` of work on ``stream`` (the host moves on at once)."""
        self.busy[stream] = max(self.busy.get(stream, self.host), self.host) + seconds
        self.host += 1e-4

    def wait_stream(self, stream: object, on: object) -> None:
        self.busy[stream] = max(self.busy.get(stream, self.host), self.busy.get(on, self.host))

    def event(self, enable_timing: bool = False) -> FakeEvent:
        assert enable_timing
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu, self.at = gpu, None

    def record(self, stream: object = None) -> None:
        gpu = self.gpu
        self.at = max(gpu.busy.get(stream, gpu.host), gpu.host)
        gpu.busy[stream] = self.at
        gpu.host += 1e-5

    def synchronize(self) -> None:
        self.gpu.host = max(self.gpu.host, self.at)

    def elapsed_time(self, other: FakeEvent) -> float:
        return (other.at - self.at) * 1e3


def test_a_gpu_that_lags_the_host_gives_the_timeline_of_the_device_not_of_the_host():
    gpu = FakeGpu(busy_for=3.0)  # the previous step's kernels still run for 3 s
    recorder = EventRecorder(gpu.event, clock=gpu.clock)
    queued_at = gpu.host
    for action, seconds in (("0F0", 0.5), ("0B0", 0.25)):
        start = recorder.mark()
        gpu.run(seconds)
        recorder.add(action, start, recorder.mark())
    assert gpu.host < queued_at + 0.01  # the host queued everything at once, and waited for nothing
    (f, f0, f1), (b, b0, b1) = recorder.events
    assert (f, b) == ("0F0", "0B0")
    assert (f0, f1, b0, b1) == pytest.approx((103.0, 103.5, 103.5, 103.75), abs=1e-3)


def test_a_gpu_in_step_with_the_host_gives_the_host_times():
    gpu = FakeGpu()
    recorder = EventRecorder(gpu.event, clock=gpu.clock)
    start = recorder.mark()
    gpu.run(0.5)
    recorder.add("0F0", start, recorder.mark())
    gpu.host += 7.0  # the timeline is read long after the step
    ((_, f0, f1),) = recorder.events
    assert (f0, f1) == pytest.approx((100.0, 100.5), abs=1e-3)


def test_a_span_on_a_side_stream_ends_where_that_stream_finished():
    gpu = FakeGpu(busy_for=1.0)
    timer = SpanTimer(torch.device("cuda"), event_class=gpu.event, clock=gpu.clock)
    started = timer.start()  # the gradients are ready when the compute stream gets here: 101
    gpu.wait_stream("reduce", None)
    gpu.run(2.0, "reduce")  # the reduction: 101 -> 103 on its own stream
    timer.end("0", started, ["reduce"])
    assert gpu.host < 100.01
    (what, start, end), = timer.spans()
    assert what == "0" and (start, end) == pytest.approx((101.0, 103.0), abs=1e-3)
    timer.clear()
    assert timer.spans() == []


def test_replicas_time_each_reduction_with_events_on_the_streams_it_ran_on(monkeypatch):
    gpu = FakeGpu(busy_for=2.0)

    def reduce(runner):  # FSDP's post-backward: queued on its reduce-scatter stream
        gpu.wait_stream("reduce-scatter", None)
        gpu.run(1.5, "reduce-scatter")

    def finish(runners):  # FSDP's final callback: the compute stream waits for the reductions
        gpu.wait_stream(None, "reduce-scatter")

    monkeypatch.setattr(replicas_module.fsdp, "before_step", lambda runners: None)
    monkeypatch.setattr(replicas_module.fsdp, "after_last_backward", reduce)
    monkeypatch.setattr(replicas_module.fsdp, "reduction_streams", lambda runner: ["reduce-scatter"])
    monkeypatch.setattr(replicas_module.fsdp, "after_step", finish)
    replicas = object.__new__(Replicas)  # the timing only: no group, no FSDP
    replicas.runners = {0: None, 1: None}
    replicas.timer = SpanTimer(torch.device("cuda"), event_class=gpu.event, clock=gpu.clock)
    replicas.start_step()
    replicas.stage_done(1)
    gpu.run(0.5)  # stage 0's last backward
    replicas.stage_done(0)
    replicas.finish_step()
    assert gpu.host < 100.01  # nothing waited inside the step
    spans = replicas.spans()
    assert [what for what, _, _ in spans] == ["0", "1", "wait"]
    assert [t for _, s, e in spans for t in (s, e)] == pytest.approx([102.5, 105.0, 102.0, 103.5, 102.5, 105.0],
                                                                     abs=1e-3)


def test_calibration_reads_its_clocks_only_after_the_device_caught_up(monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(calibration, "synchronize", lambda device: log.append("sync"))
    monkeypatch.setattr(calibration, "time", types.SimpleNamespace(perf_counter=lambda: log.append("clock") or 0.0))
    calibration.passes_alone(Emulated(1, 0.0, 0.0, 0.0), 1, repeats=2)
    assert log == ["sync", "clock", "sync", "clock", "sync", "clock"] * 3
    log.clear()
    pipe = types.SimpleNamespace(device=torch.device("cpu"), needs_inputs=True, needs_target=True,
                                 step=lambda *args, **kwargs: log.append("step"))
    monkeypatch.setattr(calibration.dist, "barrier", lambda: log.append("barrier"))
    calibration._rank_step(types.SimpleNamespace(state={"pipe": pipe, "batch": (None, None)}))
    assert log == ["sync", "barrier", "clock", "step", "sync", "clock"]
