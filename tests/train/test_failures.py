"""What a user reads last when a launched run fails (no ranks here: the launcher's failure records are faked)."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from conveyor.train.failures import failure_report, launcher_log, raised
from conveyor.train.rank_logs import RankLogs, last_frames, stderr_path


def failure(pid: int, exitcode: int, timestamp: int, message=None, signal: str = "<N/A>") -> SimpleNamespace:
    return SimpleNamespace(pid=pid, exitcode=exitcode, timestamp=timestamp, message=message,
                           signal_name=lambda: signal)


def error_file(text: str) -> dict:
    return {"message": text, "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "0"}}


def test_the_report_names_the_rank_its_error_and_what_to_do_in_three_lines():
    first = failure(21, 1, 100, error_file("CheckpointError: writing runs/x/step_000010 failed on some rank"))
    peer = failure(22, 1, 101, error_file("PeerFailure: rank 0 failed while this rank waited for it"))
    lines = failure_report(SimpleNamespace(failures={1: peer, 0: first}), 0, "runs/x/launch.log").splitlines()
    assert lines == [
        "conveyor train: rank 0 (pid 21) failed: CheckpointError: writing runs/x/step_000010 failed on some rank",
        "conveyor train: no restarts were allowed (run.max_restarts=0); every rank's traceback is in runs/x/launch.log",
        "conveyor train: what to do: change what the error names, then run the same command again",
    ]


def test_a_rank_killed_by_a_signal_is_the_cause_even_after_its_peers_errors():
    peer = failure(31, 1, 50, error_file("RuntimeError: Connection closed by peer"))
    dead = failure(32, -9, 60, signal="SIGKILL")
    lines = failure_report(SimpleNamespace(failures={0: peer, 1: dead}), 2, "log").splitlines()
    assert lines[0] == "conveyor train: rank 1 (pid 32) died of SIGKILL"
    assert lines[1].startswith("conveyor train: after 2 restart(s), none left (run.max_restarts=2)")
    assert "out-of-memory" in lines[2] and "run.max_restarts" not in lines[2]  # restarts were already allowed


def test_a_message_carrying_tracebacks_is_cut_to_the_error_and_the_one_under_it():
    text = ("CheckpointError: writing c/step_10 failed on some rank: CheckpointException ranks:dict_keys([0, 1])\n"
            "Traceback (most recent call last): (RANK 0)\n  File \"x.py\", line 1, in f\n    g()\n"
            "NotADirectoryError: [Errno 20] Not a directory: 'c/.step_10.partial'")
    assert raised(failure(1, 1, 0, error_file(text))) == (
        "CheckpointError: writing c/step_10 failed on some rank: CheckpointException ranks:dict_keys([0, 1]) "
        "(under it: NotADirectoryError: [Errno 20] Not a directory: 'c/.step_10.partial')")
    assert raised(failure(1, 1, 0, "Signal 9 (SIGKILL) received by PID 1")) is None
    exited = failure_report(SimpleNamespace(failures={0: failure(5, 3, 0)}), 0, "log").splitlines()
    assert exited[0] == ("conveyor train: rank 0 (pid 5) exited with status 3 without a Python exception "
                         "(os._exit, or a crash in native code)")


def test_the_launchers_log_lines_go_to_the_file_and_not_to_the_terminal(tmp_path, capsys):
    where = tmp_path / "run" / "launch.log"
    with launcher_log(where):
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").error("failed (exitcode: 1) local_rank: 0")
        logging.getLogger("torch.multiprocessing.spawn").warning("Terminating process 7 via signal SIGTERM")
    captured = capsys.readouterr()
    assert "exitcode" not in captured.err + captured.out and "SIGTERM" not in captured.err + captured.out
    assert "failed (exitcode: 1)" in where.read_text() and "SIGTERM" in where.read_text()
    assert logging.getLogger("torch.distributed.elastic").propagate  # as it was, after the block


def dying_rank(tmp_path) -> Path:
    """The stderr file of a real Python process that enabled faulthandler and called abort() two calls deep."""
    stderr = tmp_path / "logs" / "rank1.stderr"
    stderr.parent.mkdir(parents=True)
    script = ("import faulthandler, os\nfaulthandler.enable(all_threads=True)\n"
              "def validate_now():\n    os.abort()\ndef loop():\n    validate_now()\nloop()\n")
    with open(stderr, "w") as err:
        done = subprocess.run([sys.executable, "-c", script], stderr=err, timeout=60)
    assert done.returncode == -signal.SIGABRT
    return stderr


def test_the_last_frames_of_a_rank_that_died_of_sigabrt_are_read_back_from_its_stderr(tmp_path):
    frames = last_frames(dying_rank(tmp_path))
    assert frames[0] == "Fatal Python error: Aborted"
    assert frames[1].startswith('File "<string>", line 4 in validate_now'), frames  # innermost first
    assert frames[2].startswith('File "<string>", line 6 in loop') and frames[3].endswith("in <module>")
    assert last_frames(tmp_path / "missing") == [] and last_frames(__file__) == []  # no dump: nothing quoted


def test_the_report_of_a_signal_names_the_ranks_stderr_file_and_quotes_its_last_frames(tmp_path):
    stderr = dying_rank(tmp_path)
    dead = failure(41, -6, 10, "Signal 6 (SIGABRT) received by PID 41", signal="SIGABRT")
    peer = failure(40, 1, 11, error_file("RuntimeError: Connection closed by peer"))
    report = failure_report(SimpleNamespace(failures={0: peer, 1: dead}), 0, tmp_path / "launch.log", tmp_path)
    lines = report.splitlines()
    assert lines[0] == "conveyor train: rank 1 (pid 41) died of SIGABRT"
    assert lines[1] == f"conveyor train: rank 1's last words (from {stderr}):"
    assert lines[2:4] == ["conveyor train:     Fatal Python error: Aborted",
                          'conveyor train:     File "<string>", line 4 in validate_now']
    assert lines[-2] == (f"conveyor train: no restarts were allowed (run.max_restarts=0); every rank's traceback is "
                         f"in {tmp_path / 'launch.log'}, its stderr (faulthandler's dump included) in {stderr}")
    assert lines[-1].startswith("conveyor train: what to do: find out what stopped the rank")


def test_each_ranks_stderr_and_error_file_go_to_the_run_directory_by_global_rank_and_round(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank3.stderr").write_text("an older run's")
    envs = {0: {"RANK": "2", "TORCHELASTIC_RESTART_COUNT": "0"}, 1: {"RANK": "3", "TORCHELASTIC_RESTART_COUNT": "0"}}
    started = []
    dest = RankLogs(tmp_path, starting=lambda: started.append(True)).reify(envs)
    assert started == [True]  # the launcher's "starting N ranks" phase ends as the ranks start
    assert dest.stderrs == dest.tee_stderrs == {0: str(tmp_path / "logs" / "rank2.stderr"),
                                                 1: str(tmp_path / "logs" / "rank3.stderr")}
    assert dest.stdouts == {0: "", 1: ""}  # stdout stays the terminal's (the progress bar)
    assert envs[1]["TORCHELASTIC_ERROR_FILE"] == dest.error_files[1] == str(tmp_path / "logs" / "rank3.error.json")
    assert not (tmp_path / "logs" / "rank3.stderr").exists()  # an older run's file is not mistaken for this one's
    again = RankLogs(tmp_path).reify({0: {"RANK": "0", "TORCHELASTIC_RESTART_COUNT": "2"}})
    assert again.stderrs[0] == str(stderr_path(tmp_path, 0, restart=2)) == str(tmp_path / "logs/rank0.restart2.stderr")


def test_a_signal_death_is_reported_after_the_other_ranks_own_errors_but_not_after_their_echoes():
    dead = failure(51, -6, 10, "Signal 6 (SIGABRT) received by PID 51", signal="SIGABRT")
    own = failure(52, 1, 9, error_file("CommTimeout: rank 2 waited 300 s for stage 1's activations of microbatch 0"))
    echo = failure(53, 1, 11, error_file("PeerFailure: rank 2 failed while this rank waited for it"))
    lines = failure_report(SimpleNamespace(failures={0: dead, 2: own, 3: echo}), 0, "log").splitlines()
    assert lines[0] == ("conveyor train: rank 2 (pid 52) also failed: CommTimeout: rank 2 waited 300 s for stage 1's "
                        "activations of microbatch 0")
    assert lines[1] == "conveyor train: rank 0 (pid 51) died of SIGABRT" and len(lines) == 4  # the echo is left out
