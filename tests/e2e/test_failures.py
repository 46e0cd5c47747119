"""How a failed `conveyor train` ends, as a user sees it: the cause is the last thing printed.

A checkpoint the ranks would refuse is refused before any rank starts (one ``conveyor: error``
line, status 2); a rank that raises mid-run ends the job with three lines naming the rank, its
error and what to do, while torch elastic's tracebacks go to ``<run.dir>/launch.log``; a rank that dies
of a signal leaves its faulthandler dump in ``<run.dir>/logs/rank<R>.stderr``, whose frames the last lines quote.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.e2e.test_restart import INTERVAL, Job, alive, environment
from tests.train.test_preflight import SIZES, saved_checkpoint


@pytest.mark.timeout(120)
def test_a_truncated_resume_checkpoint_is_refused_before_any_rank_starts(tmp_path):
    path = saved_checkpoint(tmp_path)
    (data,) = [p for p in path.iterdir() if p.suffix == ".distcp"]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    done = subprocess.run([sys.executable, "-m", "conveyor.cli", "train", *SIZES, f"checkpoint.resume={path}",
                           f"run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=environment(),
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "local ranks" not in done.stdout  # no rank was started
    last = done.stderr.rstrip().splitlines()[-1]
    assert last.startswith(f"conveyor: error: checkpoint.resume='{path}' cannot be resumed from: checkpoint {path} "
                           f"is incomplete: "), done.stderr
    assert f"stored in {data.name}, which has" in last and "Traceback" not in done.stderr


@pytest.fixture
def job(tmp_path):
    """The tiny `conveyor train` of test_restart in the background, stopped at the end whatever happens."""
    (tmp_path / "job").mkdir()
    running = Job(tmp_path / "job", "run.max_restarts=0")
    yield running
    running.stop()


@pytest.mark.timeout(300)
def test_a_rank_that_raises_mid_run_ends_the_job_with_the_cause_last(job):
    # Generous: starting two ranks takes seconds on an idle machine, a minute or more on a loaded one.
    job.wait_for("the first checkpoint", lambda: (job.checkpoint(INTERVAL) / "conveyor.json").is_file(),
                 timeout_s=150)
    checkpoints = job.run_dir / "checkpoints"
    checkpoints.rename(job.run_dir / "moved")  # at once, even while a save writes there
    checkpoints.write_text("not a directory")  # the next save fails in every rank
    status = job.finish(timeout_s=90)
    err = (job.where / "stderr").read_text()
    assert status == 1, job.output()
    last = err.rstrip().splitlines()[-3:]
    assert last[0].startswith("conveyor train: rank ") and " failed: CheckpointError: " in last[0], err[-4000:]
    log = job.run_dir / "launch.log"
    assert last[1].startswith(
        f"conveyor train: no restarts were allowed (run.max_restarts=0); every rank's traceback is in {log}, its "
        f"stderr (faulthandler's dump included) in {job.run_dir / 'logs'}/rank"
    )
    assert last[2] == "conveyor train: what to do: change what the error names, then run the same command again"
    assert "Traceback" not in err and "ProcessRaisedException" not in err
    assert "Traceback" in log.read_text() and "Root Cause" in log.read_text()
    assert not [pid for pid in job.seen if alive(pid)], "rank processes outlived the job"


@pytest.mark.timeout(300)
def test_a_rank_that_dies_of_sigabrt_leaves_its_python_frames_in_its_stderr_file_and_the_last_lines(job):
    job.wait_for("the first checkpoint", lambda: (job.checkpoint(INTERVAL) / "conveyor.json").is_file(),
                 timeout_s=150)
    victim = job.ranks()[0]
    os.kill(victim, signal.SIGABRT)  # as a C++ abort() in the rank would: faulthandler dumps, the rank dies
    status = job.finish(timeout_s=90)
    err = (job.where / "stderr").read_text()
    assert status == 1, job.output()
    dead = re.search(rf"^conveyor train: rank (\d) \(pid {victim}\) died of SIGABRT$", err, re.MULTILINE)
    assert dead, err[-4000:]
    stderr = job.run_dir / "logs" / f"rank{dead.group(1)}.stderr"
    dump = stderr.read_text()
    assert "Fatal Python error: Aborted" in dump and "most recent call first" in dump, dump[-3000:]
    lines = err[dead.start():].rstrip().splitlines()
    assert lines[1] == f"conveyor train: rank {dead.group(1)}'s last words (from {stderr}):"
    assert lines[2] == "conveyor train:     Fatal Python error: Aborted"
    frames = [line for line in lines[3:] if line.startswith('conveyor train:     File "')]
    assert frames and any("conveyor" in frame for frame in frames), lines  # the training code's own frames
    assert lines[-2].endswith(f"its stderr (faulthandler's dump included) in {stderr}")
    assert "Fatal Python error: Aborted" in err.split("conveyor train: rank")[0]  # also as it happened ([rank N])
    assert not [pid for pid in job.seen if alive(pid)], "rank processes outlived the job"
