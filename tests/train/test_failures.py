"""What a user reads last when a launched run fails (no ranks here: the launcher's failure records are faked)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from conveyor.train.failures import failure_report, launcher_log, raised


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
