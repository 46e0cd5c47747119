"""What a restarted round relies on, without ranks: the round's store prefix, the job's start, which
checkpoint is this job's, the metrics log cut back to the resumed step, and the failure's one-line name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conveyor.errors import ConfigError
from conveyor.train.config import load_config
from conveyor.train.failures import describe_failure
from conveyor.train.restarts import (
    continue_log,
    job_started,
    restart_checkpoint,
    restart_round,
    round_prefix,
)

ROOT = Path(__file__).resolve().parents[2]


def test_each_round_has_its_own_store_prefix():
    assert restart_round({}) == 0 and round_prefix({}) == "conveyor/round0"
    assert round_prefix({"TORCHELASTIC_RESTART_COUNT": "2"}) == "conveyor/round2"


def test_max_restarts_is_a_checked_run_key():
    assert load_config(None).run.max_restarts == 0
    assert load_config(None, ["run.max_restarts=3"]).run.max_restarts == 3
    with pytest.raises(ConfigError, match=r"run.max_restarts=-1: expected a value >= 0"):
        load_config(None, ["run.max_restarts=-1"])


def test_job_started_is_when_the_parent_process_started():
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        started = job_started(child.pid)
    finally:
        child.kill()
        child.wait()
    assert started is not None and before - 2 <= started <= time.time() + 2
    assert job_started(2**22 + 12345) is None  # no such process


def test_the_launcher_is_the_nearest_ancestor_that_is_not_a_rank():
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "job"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    rank = "from conveyor.train.restarts import launcher_pid; print(launcher_pid())"
    wrapper = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {rank!r}], check=True)"
    # pytest (no TORCHELASTIC_RUN_ID) -> a wrapper (has it) -> the rank (has it): the launcher is pytest.
    done = subprocess.run([sys.executable, "-c", wrapper], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == os.getpid()


def fake_checkpoint(parent, name, saved_at):
    path = parent / name
    path.mkdir(parents=True)
    (path / "conveyor.json").write_text(json.dumps({"format": "conveyor-checkpoint", "saved_at": saved_at}))
    return path


def test_a_restart_resumes_only_from_a_checkpoint_this_job_wrote(tmp_path):
    now = time.time()
    fake_checkpoint(tmp_path, "step_000500", now - 3600)  # an older run's, in the same directory
    assert restart_checkpoint(tmp_path, started=now - 60) is None
    ours = fake_checkpoint(tmp_path, "step_000010", now - 30)
    fake_checkpoint(tmp_path, ".step_000020.partial-abc", now - 10)  # a save cut short
    assert restart_checkpoint(tmp_path, started=now - 60) == ours
    assert restart_checkpoint(tmp_path, started=None) == ours  # unknown start: the newest
    assert restart_checkpoint(tmp_path / "none", started=None) is None


def test_the_log_continues_after_the_resumed_step(tmp_path):
    log = tmp_path / "metrics.jsonl"
    lines = [{"step": 0, "val_loss": 5.0}, {"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.0},
             {"step": 2, "val_loss": 3.5}, {"step": 3, "loss": 2.0}]
    log.write_text("".join(json.dumps(m) + "\n" for m in lines) + '{"step": 4, "lo')
    with continue_log(log, 2) as f:
        f.write(json.dumps({"step": 3, "loss": 2.5}) + "\n")
    assert [json.loads(line) for line in log.read_text().splitlines()] == lines[:4] + [{"step": 3, "loss": 2.5}]
    continue_log(log, 0).close()
    assert log.read_text() == ""
    continue_log(tmp_path / "new.jsonl", 5).close()  # resumed into a fresh run directory
    assert (tmp_path / "new.jsonl").read_text() == ""


def test_the_failure_named_is_the_rank_that_died_not_a_peer_that_noticed():
    peer = SimpleNamespace(pid=11, exitcode=1, timestamp=100, signal_name=lambda: "<N/A>")
    dead = SimpleNamespace(pid=12, exitcode=-9, timestamp=101, signal_name=lambda: "SIGKILL")
    line = describe_failure(SimpleNamespace(failures={0: peer, 1: dead}), 2)
    assert line == "rank 1 (pid 12) died of SIGKILL; after 2 restart(s), none left (run.max_restarts=2)"
    assert describe_failure(SimpleNamespace(failures={0: peer}), 0).startswith("rank 0 (pid 11) exited with status 1")
