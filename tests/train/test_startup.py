"""What `conveyor train` says before its first step: a phase that lasts is named, a crowded machine is warned of."""

from __future__ import annotations

import threading
import time

from conveyor.train.config import load_config
from conveyor.train.launch import Devices, oversubscribed
from conveyor.train.startup import StartupPhases


def said_within(said: list[str], count: int, timeout_s: float = 30.0) -> list[str]:
    """``said`` once it holds ``count`` lines (the watcher is a thread: on a loaded machine it runs late)."""
    deadline = time.monotonic() + timeout_s
    while len(said) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return list(said)


def test_a_phase_that_lasts_is_named_with_its_progress_and_a_quick_one_is_not():
    said: list[str] = []
    phases = StartupPhases(quiet_s=0.05, repeat_s=3600, say=said.append)
    phases.phase("joining the process group (waiting for all 4 ranks to start)")
    lines = said_within(said, 1)
    assert lines[0].startswith("conveyor train: joining the process group (waiting for all 4 ranks to start) ("), lines
    assert " s so far, " in lines[0] and lines[0].endswith(" s since the start)")
    phases.progress("1,000 of 5,874 documents cut into pieces")  # progress moves: said again, with it
    lines = said_within(said, 2)
    assert lines[1].startswith("conveyor train: still joining the process group (waiting for all 4 ranks to start): "
                               "1,000 of 5,874 documents cut into pieces ("), lines
    phases.close()
    time.sleep(0.2)
    assert len(said) == 2  # closed: nothing more, however long

    quick: list[str] = []
    with StartupPhases(quiet_s=3600, say=quick.append) as fast:
        fast.phase("building the model (gpt)")
        fast.phase("tracing the model and splitting it into 2 stages")
    assert quick == []  # a fast start-up prints nothing extra
    assert not [t for t in threading.enumerate() if t.name == "conveyor-startup" and t.is_alive()]


def test_a_disabled_startup_says_nothing_and_starts_no_thread():
    said: list[str] = []
    phases = StartupPhases(enabled=False, quiet_s=0.0, say=said.append)
    phases.phase("building the model (gpt)")
    phases.progress("half")
    time.sleep(0.1)
    phases.close()
    assert said == [] and phases._watcher is None


def test_more_ranks_than_cores_is_warned_of_before_the_ranks_start_but_not_refused():
    llama_tp = load_config("configs/llama-tp.yaml")
    assert llama_tp.world_size == 8  # the recipe as written: pp=4 x tp=2
    warning = oversubscribed(llama_tp, Devices("gloo", "cpu"), cores=2)
    assert warning.startswith("warning: 8 ranks (pp=4 x dp=1 x tp=2) but 2 CPU cores here: ")
    assert warning.endswith("set parallel.pp x parallel.dp x parallel.tp <= 2 for a rank per core")
    assert oversubscribed(llama_tp, Devices("gloo", "cpu"), cores=8) is None
    assert oversubscribed(llama_tp, Devices("nccl", "cuda"), cores=2) is None  # GPU ranks: the cores are not it
    in_process = load_config(None, ["parallel.pp=4", "parallel.in_process=true"])
    assert oversubscribed(in_process, Devices("gloo", "cpu"), cores=1) is None  # one process
