"""A rank SIGKILLed mid-run: `conveyor train` with run.max_restarts=1 restarts by itself and ends bit for bit
where an uninterrupted run ends; with run.max_restarts=0 it stops promptly, naming the rank.

The runs are real commands (the elastic launcher, 2 local ranks); the test finds a rank among
the launcher's child processes and kills it once the first checkpoint exists, long before the
last step. The tiny steps take ~10-40 ms on 2 shared cores, so STEPS leaves seconds to spare.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
STEPS, INTERVAL, EVAL = 60, 6, 20
TINY = [f"train.steps={STEPS}", "model.layers=2", "model.width=32", "model.heads=2", "model.seq_len=32",
        "data.max_bytes=100000", "data.val_fraction=0.3", "parallel.pp=2", "train.batch_size=4",
        "parallel.microbatches=2", "optim.warmup_steps=1", f"train.eval_interval={EVAL}", "train.eval_batches=1",
        f"checkpoint.interval={INTERVAL}", "checkpoint.keep_last=2", "run.log_interval=25",
        "train.sample_tokens=0", "run.tensorboard=false"]


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                                                            "TORCHELASTIC_RESTART_COUNT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


class Job:
    """A `conveyor train` command in the background; its output goes to files (a full pipe would stall it)."""

    def __init__(self, where: Path, *args: str) -> None:
        self.where, self.run_dir = where, where / "run"
        self.out, self.err = open(where / "stdout", "w+"), open(where / "stderr", "w+")  # noqa: SIM115
        self.process = subprocess.Popen([sys.executable, "-m", "conveyor.cli", "train", *TINY, *args,
                                         f"run.dir={self.run_dir}"], cwd=where, env=environment(),
                                        stdout=self.out, stderr=self.err, text=True)
        self.seen: set[int] = set()  # every rank process the launcher had

    def ranks(self) -> list[int]:
        """The launcher's rank processes now (its children bar multiprocessing's resource tracker), by pid."""
        # Forked ranks (on the CPU) carry the launcher's command line, spawned ones multiprocessing's spawn_main.
        found = [pid for pid, command in children(self.process.pid) if "resource_tracker" not in command]
        self.seen.update(found)
        return sorted(found)

    def wait_for(self, what: str, ready, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.process.poll() is not None:
                pytest.fail(f"the run ended (status {self.process.returncode}) before {what}:\n{self.output()}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} after {timeout_s:g} s:\n{self.output()}")
            self.ranks()
            time.sleep(0.01)

    def finish(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while self.process.poll() is None:
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"the run did not end within {timeout_s:g} s (killed now):\n{self.output()}")
            self.ranks()
            time.sleep(0.1)
        return self.process.returncode

    def stop(self) -> None:
        """Kill whatever of the job still runs (a failed test leaves no process behind)."""
        if self.process.poll() is None:
            for pid in self.ranks():  # still the launcher's children: not some later process with a reused pid
                os.kill(pid, signal.SIGKILL)
            self.process.kill()
        self.process.wait()
        self.out.close()
        self.err.close()

    def output(self) -> str:
        return (self.where / "stdout").read_text() + (self.where / "stderr").read_text()[-6000:]

    def checkpoint(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / f"step_{step:06d}"


@pytest.fixture
def start(tmp_path):
    """``start(name, *overrides)``: a Job in ``tmp_path/name``, stopped at the end of the test whatever happens."""
    jobs: list[Job] = []

    def start_job(name: str, *args: str) -> Job:
        (tmp_path / name).mkdir()
        jobs.append(Job(tmp_path / name, *args))
        return jobs[-1]

    yield start_job
    for job in jobs:
        job.stop()


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the processes whose parent is ``pid``, from /proc."""
    tasks = Path(f"/proc/{pid}/task")
    try:
        # Each thread's children file lists those it started (Linux >= 3.5, CONFIG_PROC_CHILDREN).
        pids = {int(p) for task in tasks.iterdir() for p in (task / "children").read_text().split()}
    except FileNotFoundError:
        pids = {int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and parent_of(int(e.name)) == pid}
    except OSError:
        return []  # it has ended
    found = []
    for child in sorted(pids):
        try:
            found.append((child, Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except OSError:
            continue  # it ended while we looked
    return found


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_a_rank_after_the_first_checkpoint(job: Job, which: int) -> int:
    job.wait_for("the first checkpoint", lambda: (job.checkpoint(INTERVAL) / "conveyor.json").is_file(), timeout_s=150)
    victim = job.ranks()[which]
    logged = [m["step"] for m in records(job.run_dir) if "loss" in m]
    # Normally a step or two after the checkpoint; later only when this process was starved of CPU.
    assert logged and logged[-1] < STEPS - 2 * INTERVAL, f"killing at step {logged[-1:]}: too late to tell"
    os.kill(victim, signal.SIGKILL)
    return victim


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds (model, optimizer, RNG), read in this one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from conveyor.checkpoint.files import SafeFileSystemReader, quiet_single_process

    reader = SafeFileSystemReader(path)
    entries = reader.read_metadata().state_dict_metadata
    state = {key: torch.empty(entry.size, dtype=entry.properties.dtype) for key, entry in entries.items()
             if isinstance(entry, TensorStorageMetadata)}
    with quiet_single_process():
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def comparable_meta(path: Path) -> dict:
    meta = json.loads((path / "conveyor.json").read_text())
    return {key: meta[key] for key in ("extra", "lr_scheduler", "optimizer", "model")}


@pytest.mark.timeout(300)
def test_a_killed_rank_restarts_from_the_last_checkpoint_and_ends_bitwise_like_an_uninterrupted_run(start):
    shm_before = {p.name for p in Path("/dev/shm").iterdir()} if Path("/dev/shm").is_dir() else set()
    # Side by side, for less wall time: much of a run is waiting (rendezvous, the launcher's polls).
    whole = start("whole")
    killed = start("killed", "run.max_restarts=1")
    started = time.monotonic()
    victim = kill_a_rank_after_the_first_checkpoint(killed, which=0)
    assert killed.finish(timeout_s=150) == 0, killed.output()
    assert whole.finish(timeout_s=60) == 0, whole.output()
    print(f"killed rank pid {victim}; the job restarted and ended {time.monotonic() - started:.1f} s after it began")
    out, err = (killed.where / "stdout").read_text(), (killed.where / "stderr").read_text()
    assert re.search(rf"conveyor train: rank \d \(pid {victim}\) failed \(SIGKILL\); the launcher stops this "
                     r"round's ranks", err), err[-3000:]
    assert "Traceback" not in err  # the launcher's own log, tracebacks and all, is in launch.log
    assert f"(pid: {victim})" in (killed.run_dir / "launch.log").read_text()
    assert out.count("2 local ranks") == 1 and "up to 1 restart(s)" in out
    resumed = re.search(r"restart 1 after a failed round: resumed from (\S+) at step (\d+)", out)
    assert resumed, out
    step = int(resumed.group(2))
    assert INTERVAL <= step < STEPS and step % INTERVAL == 0
    assert f"done: {STEPS} steps" in out

    # The final checkpoints: every tensor (parameters, AdamW's moments, torch's and Python's RNGs) equal, bit for bit.
    want, got = checkpoint_tensors(whole.checkpoint(STEPS)), checkpoint_tensors(killed.checkpoint(STEPS))
    assert sorted(got) == sorted(want) and any(k.startswith("optim.") for k in want)
    unequal = [key for key in want if not torch.equal(want[key], got[key])]
    assert not unequal, f"{len(unequal)} tensors differ, e.g. {unequal[:5]}"
    assert comparable_meta(killed.checkpoint(STEPS)) == comparable_meta(whole.checkpoint(STEPS))

    # The log has every step once, with the uninterrupted run's values.
    def values(run_dir: Path) -> list[tuple]:
        return [(m["step"], m.get("loss"), m.get("lr"), m.get("val_loss")) for m in records(run_dir)]

    logged = records(killed.run_dir)
    assert [m["step"] for m in logged if "loss" in m] == list(range(1, STEPS + 1))
    assert [m["step"] for m in logged if "val_loss" in m] == list(range(0, STEPS + 1, EVAL))
    assert values(killed.run_dir) == values(whole.run_dir)

    # Nothing of the killed round is left: no rank process, no half-written checkpoint, no shared memory.
    assert not [pid for pid in killed.seen if alive(pid)], "rank processes outlived the job"
    assert len(killed.seen) == 4  # two rounds of two ranks
    assert not [p.name for p in (killed.run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    shm_after = {p.name for p in Path("/dev/shm").iterdir()} if Path("/dev/shm").is_dir() else set()
    assert not [name for name in shm_after - shm_before if "conveyor" in name]


@pytest.mark.timeout(180)
def test_without_restarts_a_killed_rank_ends_the_job_promptly_naming_it(start):
    job = start("job", "run.max_restarts=0")
    victim = kill_a_rank_after_the_first_checkpoint(job, which=1)
    killed_at = time.monotonic()
    status = job.finish(timeout_s=60)
    took = time.monotonic() - killed_at
    print(f"killed rank pid {victim}; the job ended {took:.1f} s later")
    err = (job.where / "stderr").read_text()
    assert status == 1, job.output()  # ended, and before finish()'s 60 s cut-off that would fail the test
    last = err.rstrip().splitlines()[-3:]  # the cause, last: which rank, how, what to do
    assert re.fullmatch(rf"conveyor train: rank \d \(pid {victim}\) died of SIGKILL", last[0]), err[-3000:]
    assert last[1].startswith(f"conveyor train: no restarts were allowed (run.max_restarts=0); every rank's "
                              f"traceback is in {job.run_dir / 'launch.log'}, its stderr (faulthandler's dump "
                              f"included) in {job.run_dir / 'logs'}/rank")
    assert last[2].startswith("conveyor train: what to do: find out what stopped the rank")
    assert "resumed" not in (job.where / "stdout").read_text()
    assert not [pid for pid in job.seen if alive(pid)], "rank processes outlived the job"
