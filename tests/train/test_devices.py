"""The trainer's devices (issue 33): data, loss and collectives go where the stage is (checked with meta
tensors, another device than the CPU, and NCCL's rule, CUDA tensors only, standing in as "meta only"),
and `conveyor train` picks NCCL with a GPU per rank, gloo otherwise (GPUs faked by monkeypatching)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import conveyor.runtime.stage.device
from conveyor.errors import ConfigError
from conveyor.train import launch
from conveyor.train.config import load_config
from conveyor.train.data import ResumableLoader, TokenBlocks, resumable_loader
from conveyor.train.launch import choose_devices, prepare
from conveyor.train.loop import build_pipeline, evaluate, validation_sums

META, CPU = torch.device("meta"), torch.device("cpu")


class _Pipe:
    """A last-stage rank's pipeline stand-in: logits on its stage device, as pipe.forward gives them."""

    needs_inputs = needs_target = True
    dp_rank, dp_size = 0, 1

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def forward(self, x):
        return SimpleNamespace(logits=torch.zeros(*x.shape, 7, device=self.device))


class _CpuBatches:
    """A user's loader: (ids, targets) on the CPU, whatever the stage device."""

    def restart(self):
        pass

    def __next__(self):
        return torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long)


class _Reduced(Exception):
    pass


@pytest.fixture
def nccl_rule(monkeypatch):
    """The default group reports NCCL, which here carries meta tensors only (as NCCL carries CUDA ones);
    all_reduce records where its tensor is and stops (a meta tensor holds no number to read back)."""
    reduced = []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(conveyor.runtime.stage.device, "collective_device", lambda backend, device: META)

    def all_reduce(tensor, *args, **kwargs):
        reduced.append((tensor.device, tensor.dtype, tuple(tensor.shape)))
        raise _Reduced

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return reduced


def _run(pipe, data=None):
    return SimpleNamespace(pipe=pipe, val_data=data or _CpuBatches(), cfg=SimpleNamespace(train=SimpleNamespace(
        eval_batches=2)))


def test_validation_scores_cpu_targets_where_the_stage_logits_are(nccl_rule):
    # Before: cross_entropy(logits on the stage device, targets from the CPU loader) raised a device
    # mismatch on any GPU, at step 0 of the default config.
    sums = validation_sums(_run(_Pipe(META)))
    assert (sums.device, sums.dtype, tuple(sums.shape)) == (META, torch.float64, (2,))
    with pytest.raises(_Reduced):
        evaluate(_run(_Pipe(META)))
    assert nccl_rule == [(META, torch.float64, (2,))]


def test_the_validation_reduce_takes_its_tensor_on_the_groups_device(nccl_rule):
    # Before: a CPU tensor was all-reduced on the default group, which NCCL refuses.
    with pytest.raises(_Reduced):
        evaluate(_run(_Pipe(CPU)))
    assert nccl_rule == [(META, torch.float64, (2,))]


def test_on_the_cpu_the_validation_loss_is_what_it_was(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *a, **k: None)  # one rank: the sum is its own
    loss = torch.nn.functional.cross_entropy(torch.zeros(8, 7), torch.ones(8, dtype=torch.long))
    assert evaluate(_run(_Pipe(CPU))) == float(torch.tensor([loss.item()], dtype=torch.float64))


def test_the_loader_hands_batches_over_on_the_stage_device():
    blocks = TokenBlocks(torch.arange(100), 4)
    x, y = next(resumable_loader(_Pipe(META), lambda: blocks, 2))
    assert x.device == y.device == META and x.shape == y.shape == (2, 4)
    x, y = next(resumable_loader(_Pipe(CPU), lambda: blocks, 2))
    want = next(ResumableLoader(blocks, 2))
    assert torch.equal(x, want[0]) and torch.equal(y, want[1]) and x.device == CPU


# --- conveyor train's devices and backend (issue 33, finding 12) ------------------------------

def _cfg(*overrides):
    return load_config(None, list(overrides))


@pytest.mark.parametrize("overrides, ranks, gpus, want", [
    ((), 2, 0, ("gloo", "cpu")),  # no GPU: as always
    ((), 2, 2, ("nccl", "cuda")),  # a GPU per rank
    ((), 2, 8, ("nccl", "cuda")),
    ((), 1, 1, ("nccl", "cuda")),  # pp=1 on one GPU
    ((), 2, 1, ("gloo", "cpu")),  # the default pp=2 on one GPU: the CPU, with a note
    (("run.share_gpus=true",), 2, 1, ("gloo", "cuda")),  # asked for: shared, over gloo, with a warning
    (("run.share_gpus=true",), 2, 2, ("nccl", "cuda")),  # nothing to share
    (("run.device=cpu",), 2, 2, ("gloo", "cpu")),
    (("run.device=cuda", "run.share_gpus=true"), 4, 2, ("gloo", "cuda")),
])
def test_the_backend_is_nccl_with_a_gpu_per_rank_and_gloo_otherwise(overrides, ranks, gpus, want):
    devices = choose_devices(_cfg(*overrides), ranks, gpus=gpus)
    assert (devices.backend, devices.device) == want
    if want == ("gloo", "cpu") and gpus and not overrides:
        assert devices.note == (f"{ranks} ranks but {gpus} GPU here: training on the CPU; set parallel.pp x "
                                f"parallel.dp = 1 to train on the GPU, or run.share_gpus=true to put the 2 ranks "
                                f"on it (over gloo, slower)")
    elif devices.backend == "gloo" and devices.device == "cuda":
        assert devices.note.startswith(f"warning: {ranks} ranks but {gpus} GPU") and "over gloo" in devices.note
    else:
        assert devices.note is None


def test_insisting_on_gpus_that_cannot_serve_is_a_config_error(monkeypatch):
    with pytest.raises(ConfigError, match="run.device='cuda', but torch sees no CUDA GPU"):
        choose_devices(_cfg("run.device=cuda"), 2, gpus=0)
    with pytest.raises(ConfigError, match=r"needs a GPU per rank \(NCCL\): 4 ranks but 2 GPUs.*run.share_gpus=true"):
        choose_devices(_cfg("run.device=cuda"), 4, gpus=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA GPU"):  # before any rank starts
        prepare(["run.device=cuda", "data.max_bytes=200000", "train.eval_interval=0", "data.val_fraction=0"])


@pytest.fixture
def rank1_of_2(monkeypatch):
    """This process as rank 1 of 2 on one machine; returns set_device's calls (GPUs are faked per test)."""
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    chosen = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: chosen.append(torch.device(device)))
    return chosen


def _gpus(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("gpus, backend, current", [(2, "nccl", [torch.device("cuda", 1)]), (1, "gloo", [])])
def test_each_rank_joins_the_chosen_backend_on_its_own_gpu(monkeypatch, rank1_of_2, gpus, backend, current):
    # Before: every rank joined gloo, whatever GPUs there were, and none set its GPU before the group.
    import conveyor.train.loop

    _gpus(monkeypatch, gpus)
    joined = []
    monkeypatch.setattr(launch, "join_group", lambda backend="gloo": joined.append(backend))
    monkeypatch.setattr(conveyor.train.loop, "train", lambda cfg, startup=None: {"stopped": None})
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    launch.worker(_cfg())
    assert joined == [backend] and rank1_of_2 == current


@pytest.mark.parametrize("gpus, device", [(2, torch.device("cuda", 1)), (1, CPU), (0, CPU)])
def test_the_pipeline_is_built_on_the_chosen_device(monkeypatch, rank1_of_2, gpus, device):
    # Before: no device was passed, so the pipeline's default (cuda:<LOCAL_RANK>) ran on one GPU too.
    import conveyor

    _gpus(monkeypatch, gpus)
    built = {}
    monkeypatch.setattr(conveyor, "pipeline", lambda model, **kwargs: built.update(kwargs))
    build_pipeline(_cfg(), torch.nn.Linear(2, 2))
    assert built["layout"].device == device


def test_the_launcher_says_why_a_one_gpu_machine_trains_on_the_cpu(monkeypatch, capsys):
    import torch.distributed.launcher.api as api

    _gpus(monkeypatch, 1)
    calls = []
    monkeypatch.setattr(api, "elastic_launch", lambda config, fn: lambda *args: calls.append(args) or {0: {}, 1: {}})
    assert launch.launch(_cfg()) == 0
    out = capsys.readouterr().out
    assert "2 local ranks (pp=2 x dp=1) on the CPU over gloo" in out
    assert out.count("2 ranks but 1 GPU here: training on the CPU") == 1 and "Traceback" not in out
    assert calls[0][1:] == (False, False)  # the ranks do not say it again


@pytest.mark.parametrize("gpus, method, entry", [(0, "fork", "forked_worker"), (2, "spawn", "worker")])
def test_cpu_ranks_are_forked_from_the_launcher_and_gpu_ranks_spawned(monkeypatch, capsys, gpus, method, entry):
    # Before: every rank was spawned, a fresh interpreter importing torch and conveyor again (seconds of CPU each).
    import torch.distributed.launcher.api as api

    _gpus(monkeypatch, gpus)
    seen = {}

    def elastic_launch(config, fn):
        seen.update(method=config.start_method, entry=fn.__name__)
        return lambda *args: {0: {}, 1: {}}

    monkeypatch.setattr(api, "elastic_launch", elastic_launch)
    assert launch.launch(_cfg()) == 0
    assert seen == {"method": method, "entry": entry}


def test_a_forked_rank_drops_the_launchers_signal_handlers_and_log(monkeypatch, tmp_path):
    # A forked rank inherits the elastic agent's SIGTERM handler (which raises, where a blocked collective
    # may never see it) and the launcher's log handlers; a spawned rank has neither.
    import logging
    import signal

    from conveyor.train.failures import LAUNCHER_LOGGERS, launcher_log

    def worker(cfg, exit_when_stopped, say_note):
        loggers = [logging.getLogger(name) for name in LAUNCHER_LOGGERS]
        return {"sigterm": signal.getsignal(signal.SIGTERM), "sigint": signal.getsignal(signal.SIGINT),
                "handlers": [h for logger in loggers for h in logger.handlers],
                "propagate": all(logger.propagate for logger in loggers)}

    monkeypatch.setattr(launch, "worker", worker)
    numbers = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    before = {number: signal.getsignal(number) for number in numbers}
    try:
        with launcher_log(tmp_path / "launch.log"):
            signal.signal(signal.SIGTERM, lambda *args: None)  # as torch's elastic agent does before it forks
            seen = launch.forked_worker(_cfg(), False, False)
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)
    assert seen == {"sigterm": signal.SIG_DFL, "sigint": signal.default_int_handler, "handlers": [],
                    "propagate": True}
