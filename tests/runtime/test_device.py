"""The stage device: resolution, placement, the executor's moves, and the CUDA-event timeline (on the CPU)."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

import conveyor
from conveyor.errors import PipelineConfigError
from conveyor.runtime.executor import RankExecutor
from conveyor.runtime.stage.device import collective_device, place_modules, resolve_device, to_device
from conveyor.runtime.stage.timing import EventRecorder, StepRecorder, make_recorder
from conveyor.runtime.transport.transport import LocalMailbox, LocalTransport
from conveyor.schedule import build
from conveyor.testing.multiprocess import run_ranks


def _loss(y, t):
    return (y - t).pow(2).mean()


@pytest.fixture
def cuda(monkeypatch):
    """Pretend this machine has 4 GPUs (nothing is allocated: only names are resolved)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_the_default_is_the_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("cpu") == resolve_device(torch.device("cpu")) == torch.device("cpu")


def test_the_default_is_the_local_ranks_gpu_with_cuda(cuda, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert resolve_device(None) == torch.device("cuda", 2)
    monkeypatch.delenv("LOCAL_RANK")
    assert resolve_device(None) == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)  # an index, so that it compares with tensors'
    assert resolve_device("cuda:3") == torch.device("cuda", 3)


def test_more_local_ranks_than_gpus_share_them_round_robin_with_a_warning(cuda, monkeypatch, caplog):
    # Before: cuda:<LOCAL_RANK> raised for LOCAL_RANK >= the GPUs this process sees (pp=2 on one GPU,
    # the test harness's LOCAL_RANK=rank, launchers that give each process one GPU).
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "5")
    with caplog.at_level(logging.WARNING, logger="conveyor.runtime.stage.device"):
        assert resolve_device(None) == torch.device("cuda", 1)
    assert "LOCAL_RANK=5 but this process sees 4 CUDA device(s): it runs on cuda:1" in caplog.text
    assert "NCCL needs one GPU per rank" in caplog.text


def test_a_process_given_its_own_gpu_runs_on_it_whatever_its_local_rank(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # the launcher's: GPU 3 alone, seen as cuda:0
    with caplog.at_level(logging.WARNING, logger="conveyor.runtime.stage.device"):
        assert resolve_device(None) == resolve_device("cuda") == torch.device("cuda", 0)
    assert caplog.text == ""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # one GPU for every local rank: shared, and said so
    with caplog.at_level(logging.WARNING, logger="conveyor.runtime.stage.device"):
        assert resolve_device(None) == torch.device("cuda", 0)
    assert "cuda:0, which other local ranks share" in caplog.text


def test_cuda_without_an_index_is_this_processes_gpu_not_cuda0_everywhere(cuda, monkeypatch):
    # Before: device="cuda" took the current device, cuda:0 on every rank that had not set one.
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert resolve_device("cuda") == resolve_device(torch.device("cuda")) == torch.device("cuda", 2)
    monkeypatch.delenv("LOCAL_RANK")  # no launcher: the GPU the script made current
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device("cuda") == resolve_device(None) == torch.device("cuda", 3)


def test_a_device_that_does_not_exist_is_a_clear_error(cuda, monkeypatch):
    with pytest.raises(PipelineConfigError, match=r"cuda:7.*sees 4 CUDA device\(s\) \(cuda:0..cuda:3\)"):
        resolve_device("cuda:7")
    with pytest.raises(PipelineConfigError, match="'gpu0' is not a device torch knows"):
        resolve_device("gpu0")
    with pytest.raises(PipelineConfigError, match="meta"):
        resolve_device("meta")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(PipelineConfigError, match="sees no CUDA device"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PipelineConfigError, match="CUDA is not available here.*device='cpu'"):
        resolve_device("cuda:0")


def test_explicit_cpu_runs_and_moves_cpu_inputs_nowhere():
    pipe = conveyor.Pipeline([torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)], "1f1b", microbatches=2,
                             loss_fn=_loss, layout=conveyor.InProcessLayout(device="cpu"))
    assert pipe.device == torch.device("cpu")
    assert pipe.step(torch.ones(4, 4), target=torch.zeros(4, 1)).device == torch.device("cpu")


def test_a_module_on_another_device_is_named_in_the_error():
    with torch.device("meta"):
        late = torch.nn.Linear(4, 1)
    with pytest.raises(PipelineConfigError, match=r"stage 1: 'weight' is on meta, but the pipeline's device is cpu.*"
                                                  r"materialise it first"):
        conveyor.Pipeline([torch.nn.Linear(4, 4), late], "1f1b", microbatches=2, loss_fn=_loss,
                          layout=conveyor.InProcessLayout(device="cpu"))


def test_cpu_modules_are_moved_in_place_keeping_their_parameters():
    layer = torch.nn.Linear(2, 2)
    weight = layer.weight
    place_modules([layer], [0], torch.device("cpu"))
    assert layer.weight is weight
    x = torch.ones(2, requires_grad=True)
    assert to_device(x, torch.device("cpu")) is x
    moved = to_device({"a": x, "n": 1}, torch.device("meta"))
    assert moved["a"].device.type == "meta" and moved["a"].is_leaf and moved["a"].requires_grad and moved["n"] == 1


def _meta_stage(rank, world_size):
    with torch.device("meta"):
        module = torch.nn.Linear(4, 4)
    try:
        conveyor.Pipeline([module], "gpipe", _loss, microbatches=2, layout=conveyor.DistributedLayout(device="cpu"))
    except PipelineConfigError as exc:
        return str(exc)
    return "no error"


@pytest.mark.distributed
def test_pipeline_refuses_a_meta_stage_before_talking_to_anyone():
    [message] = run_ranks(_meta_stage, 1, timeout_s=60)
    assert "stage 0: 'weight' is on meta, but the pipeline's device is cpu" in message


def test_nccl_refuses_a_stage_device_it_cannot_carry():
    # NCCL carries CUDA tensors only: the loss, the norms and the non-finite flags travel on the stage device.
    assert collective_device("nccl", torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert collective_device("gloo", torch.device("cuda", 1)) == torch.device("cpu")
    with pytest.raises(PipelineConfigError, match="backend 'nccl'.*device cpu.*device='cuda:<LOCAL_RANK>'.*gloo"):
        collective_device("nccl", torch.device("cpu"))


def _nccl_cpu_stage(rank, world_size):
    import torch.distributed as dist

    dist.get_backend = lambda group=None: "nccl"  # this forked rank only: gloo underneath, NCCL to the pipeline
    try:
        conveyor.Pipeline([torch.nn.Linear(2, 2)], build("gpipe", ranks=1, microbatches=1), _loss,
                          layout=conveyor.DistributedLayout(device="cpu"))
    except PipelineConfigError as exc:
        return str(exc)
    return "no error"


@pytest.mark.distributed
def test_a_pipeline_on_nccl_with_a_cpu_stage_device_fails_before_talking_to_anyone():
    [message] = run_ranks(_nccl_cpu_stage, 1, timeout_s=60)
    assert "backend 'nccl'" in message and "device cpu" in message


class _Wire:
    """A transport stand-in: only what RankExecutor reads when it is built."""

    def __init__(self, device=None):
        if device is not None:
            self.device = device


def test_the_executor_moves_payloads_only_between_different_devices():
    schedule = build("gpipe", ranks=1, microbatches=1)
    runners = {}
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")

    def wire_of(transport, device):
        return RankExecutor(0, schedule.placement, runners, transport, device=device).wire_device

    assert wire_of(_Wire(), cpu) is None  # gloo and shared memory on the CPU: nothing moves
    assert wire_of(_Wire(), gpu) == cpu  # gloo under a GPU stage: through the CPU
    assert wire_of(_Wire(gpu), gpu) is None  # NCCL: the stage's own GPU
    assert wire_of(LocalTransport(LocalMailbox(), 0), gpu) is None  # one process: nowhere
    assert wire_of(_Wire(), None) is None


class FakeEvent:
    """torch.cuda.Event's interface, with a fake device clock in milliseconds."""

    clock = 0.0
    synchronized = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at = None

    def record(self, stream=None) -> None:
        FakeEvent.clock += 1.0
        self.at = FakeEvent.clock

    def synchronize(self) -> None:
        FakeEvent.synchronized += 1

    def elapsed_time(self, other: FakeEvent) -> float:
        return other.at - self.at


def test_a_gpu_stage_times_its_actions_with_events_resolved_once():
    assert isinstance(make_recorder(torch.device("cpu")), StepRecorder)
    assert isinstance(make_recorder(None), StepRecorder)
    assert isinstance(make_recorder(torch.device("cuda", 1), FakeEvent), EventRecorder)
    FakeEvent.synchronized = 0
    recorder = EventRecorder(FakeEvent)
    first = recorder.mark()
    recorder.add("0F0", first, recorder.mark())
    recorder.add("0B0", recorder.mark(), recorder.mark())
    assert FakeEvent.synchronized == 0  # nothing waits while the step runs
    (a, a0, a1), (b, b0, b1) = recorder.events
    assert recorder.events is recorder.events and FakeEvent.synchronized == 1
    assert (a, b) == ("0F0", "0B0")
    assert (a1 - a0, b0 - a0, b1 - a0) == pytest.approx((1e-3, 2e-3, 3e-3))


def test_a_timeline_from_events_has_every_action(monkeypatch):
    monkeypatch.setattr(conveyor.pipe.ranks, "make_recorder", lambda device: EventRecorder(FakeEvent))
    FakeEvent.synchronized = 0
    pipe = conveyor.Pipeline([torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)], "1f1b", microbatches=2,
                             loss_fn=_loss, layout=conveyor.InProcessLayout())
    pipe.step(torch.ones(4, 4), target=torch.zeros(4, 1))
    timeline = pipe.timeline()
    assert FakeEvent.synchronized == 2  # one per rank's recorder, when read
    assert sorted(str(span.action) for span in timeline.spans if span.action.kind.name in "FB") == \
        ["0B0", "0B1", "0F0", "0F1", "1B0", "1B1", "1F0", "1F1"]


def test_a_gpu_stage_device_becomes_the_current_cuda_device(monkeypatch):
    # NCCL makes its communicators and object collectives on the current device: a rank whose
    # stage is cuda:1 must not leave cuda:0 current (every rank of a node would share it).
    from conveyor.runtime.stage.device import make_current

    current, chosen = [0], []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: (chosen.append(device), current.__setitem__(0, 1)))
    make_current(torch.device("cuda", 1))
    make_current(torch.device("cuda", 1))  # already current: no second call
    make_current(torch.device("cpu"))
    assert chosen == [torch.device("cuda", 1)]


def test_stages_all_on_meta_without_a_device_are_named_not_blamed_on_a_device_argument():
    with torch.device("meta"):
        stages = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)]
    with pytest.raises(PipelineConfigError, match=r"stage 0: 'weight' is on meta.*to_empty") as info:
        conveyor.Pipeline(stages, "1f1b", microbatches=2, loss_fn=_loss, layout=conveyor.InProcessLayout())
    assert "device='meta'" not in str(info.value)  # the caller passed no device; running on meta is no fix


def _fake_gpus(monkeypatch_like, count: int = 2) -> list:
    """Pretend ``count`` GPUs, with cuda:0 current; returns the list set_device appends to."""
    chosen: list = []
    current = [0]
    monkeypatch_like.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch_like.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch_like.setattr(torch.cuda, "current_device", lambda: current[0])

    def set_device(device):
        chosen.append(torch.device(device))
        current[0] = torch.device(device).index

    monkeypatch_like.setattr(torch.cuda, "set_device", set_device)
    return chosen


def _gpu_stage_under(rank, world_size, backend):
    import torch.distributed as dist

    import conveyor.pipe

    patch = pytest.MonkeyPatch()
    chosen = _fake_gpus(patch)
    patch.setattr(dist, "get_backend", lambda group=None: backend)  # gloo underneath in this forked rank
    patch.setattr(conveyor.pipe.distributed, "place_modules", lambda modules, stages, device: device)  # nothing to move
    with contextlib.suppress(Exception):  # no real GPU: what follows fails; the device was chosen before
        conveyor.Pipeline([torch.nn.Linear(2, 2)], build("gpipe", ranks=1, microbatches=1), _loss,
                          layout=conveyor.DistributedLayout(device="cuda:1"))
    return chosen[:1]


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["gloo", "undefined"])
def test_a_gpu_stage_is_made_current_whatever_the_backend(backend):
    # Before: only the backend string "nccl" made the stage's GPU current; under gloo or a backend-less
    # init_process_group() ("undefined": cpu:gloo,cuda:nccl) FSDP2 and replicate put every rank on cuda:0.
    assert run_ranks(_gpu_stage_under, 1, args=(backend,), timeout_s=60) == [[torch.device("cuda", 1)]]


class _Stop(Exception):
    pass


@pytest.mark.parametrize(("schedule", "method"), [("auto", "parameters"), ("1f1b", "time")])
def test_pipeline_makes_the_gpu_current_before_its_first_broadcast(monkeypatch, schedule, method):
    # Before: schedule="auto" and split method "time" broadcast rank 0's choice before the device was
    # set, so NCCL ran every rank's object collective on cuda:0; device="cuda" also meant cuda:0.
    import torch.distributed as dist

    import conveyor.build
    import conveyor.frontend
    import conveyor.plan.planner
    import conveyor.plan.time_split

    chosen = _fake_gpus(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "1")
    for name, value in {"is_available": True, "is_initialized": True, "get_world_size": 2, "get_rank": 0}.items():
        monkeypatch.setattr(dist, name, lambda *a, value=value, **k: value)
    monkeypatch.setattr(conveyor.plan.planner, "plan", lambda *a, **k: "rank 0's plan")
    monkeypatch.setattr(conveyor.plan.time_split, "time_split", lambda *a, **k: type("Split", (), {"split_points": []}))
    current_at_broadcast = []

    def broadcast(objects, src=None, group=None, device=None, group_src=None):  # torch's signature
        current_at_broadcast.append(torch.cuda.current_device())
        raise _Stop

    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    with pytest.raises(_Stop):
        conveyor.build.pipeline(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)),
                                example_args=(torch.ones(1, 2),), microbatches=2, schedule=schedule,
                                layout=conveyor.DistributedLayout(device="cuda"),
                                options=conveyor.PipelineOptions(split=conveyor.SplitOptions(method=method)))
    assert chosen == [torch.device("cuda", 1)] and current_at_broadcast == [1]
