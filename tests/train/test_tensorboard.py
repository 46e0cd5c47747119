"""conveyor.train.report's TensorBoard log: metrics.jsonl's records as scalars, and nothing when it is off or absent."""

from __future__ import annotations

import sys

import numpy as np

from conveyor.train.report import open_tensorboard


def scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_records_become_scalars_at_their_steps(tmp_path):
    board = open_tensorboard(tmp_path, enabled=True)
    board.log({"step": 0, "val_loss": 5.5, "elapsed": 0.1})
    board.log({"step": 1, "loss": 5.25, "lr": 1e-3, "tokens_per_s": 1234.5, "elapsed": 0.2})
    board.log({"step": 1, "measured_bubble": 0.4, "simulated_bubble": 0.3, "timeline_png": "t.png"})
    board.close()
    f32 = lambda x: float(np.float32(x))  # noqa: E731 - TensorBoard keeps float32
    assert scalars(tmp_path / "tensorboard") == {
        "val/loss": [(0, 5.5)], "train/loss": [(1, 5.25)], "train/lr": [(1, f32(1e-3))],
        "train/tokens_per_s": [(1, 1234.5)], "bubble/measured": [(1, f32(0.4))],
        "bubble/simulated": [(1, f32(0.3))]}


def test_off_or_not_installed_gives_no_log_and_no_error(tmp_path, monkeypatch):
    assert open_tensorboard(tmp_path, enabled=False) is None
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # what an absent package looks like
    assert open_tensorboard(tmp_path, enabled=True) is None
    assert not (tmp_path / "tensorboard").exists()


def _next_second() -> None:
    """Sleep into the next second of the clock: a file opened now is named by a later second than any before."""
    import time

    time.sleep(1.01 - time.time() % 1)


def test_a_resumed_run_keeps_the_steps_up_to_its_checkpoint_and_a_fresh_one_starts_over(tmp_path):
    first = open_tensorboard(tmp_path, enabled=True)
    for step in range(1, 7):
        first.log({"step": step, "loss": float(step), "elapsed": 0.0})
    first.close()
    _next_second()  # event files are named by the second they were opened in
    resumed = open_tensorboard(tmp_path, enabled=True, step=3)  # resumed from step 3's checkpoint
    for step in range(4, 6):
        resumed.log({"step": step, "loss": 10.0 * step, "elapsed": 0.0})
    resumed.close()
    assert scalars(tmp_path / "tensorboard")["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
    _next_second()
    fresh = open_tensorboard(tmp_path, enabled=True, step=0)
    fresh.log({"step": 1, "loss": 7.0, "elapsed": 0.0})
    fresh.close()
    assert scalars(tmp_path / "tensorboard")["train/loss"] == [(1, 7.0)]
