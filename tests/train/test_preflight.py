"""What `conveyor train` refuses before any rank starts: a resume checkpoint the ranks' load would refuse.

The checkpoints are written in this process from the unsplit model the config builds (no ranks);
each test spoils one in a way a user meets (a copy cut short, a hand-edited or foreign metadata
file, another model size) and expects one ConfigError naming ``checkpoint.resume`` and the cause.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

import conveyor.checkpoint as ckpt
from conveyor.cli import main
from conveyor.errors import CheckpointIncompleteError, ConfigError
from conveyor.train import launch
from conveyor.train.config import load_config
from conveyor.train.loop import lr_lambda
from conveyor.train.models import build_model
from conveyor.train.preflight import check_resume

SIZES = ["model.layers=2", "model.width=32", "model.heads=2", "model.seq_len=16", "data.max_bytes=100000",
         "train.batch_size=4", "parallel.microbatches=2", "train.eval_interval=0"]


def saved_checkpoint(where: Path, overrides: list[str] = SIZES) -> Path:
    """A checkpoint of the model, AdamW and schedule `conveyor train` builds for ``overrides``, one step in."""
    cfg = load_config(None, overrides)
    torch.manual_seed(0)
    model = build_model(cfg, 256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    model(torch.randint(0, 256, (2, 16))).logits.sum().backward()
    optimizer.step()
    scheduler.step()
    path = where / "checkpoints" / "step_000001"
    ckpt.save(path, model, optimizer, scheduler, extra={"step": 1})
    return path


def resuming(path: Path | str, *more: str):
    return load_config(None, [*SIZES, f"checkpoint.resume={path}", *more])


def test_a_whole_checkpoint_of_the_configs_model_passes(tmp_path):
    path = saved_checkpoint(tmp_path)
    assert check_resume(resuming(path)) == path
    assert check_resume(resuming("true", f"checkpoint.dir={path.parent}")) == path  # the latest
    assert check_resume(resuming("true", f"checkpoint.dir={tmp_path / 'none yet'}")) is None
    assert check_resume(load_config(None, SIZES)) is None  # not resuming


def test_a_checkpoint_cut_short_is_refused_naming_the_file(tmp_path):
    path = saved_checkpoint(tmp_path)
    (data,) = [p for p in path.iterdir() if p.suffix == ".distcp"]
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(ConfigError, match=rf"^checkpoint.resume='{path}' cannot be resumed from: checkpoint "
                                          rf"{path} is incomplete: .* stored in {data.name}, which has 1000 bytes"):
        check_resume(resuming(path))
    with pytest.raises(CheckpointIncompleteError):  # the library's own check, as load would raise it
        ckpt.check(path)


def test_tampered_metadata_is_refused(tmp_path):
    path = saved_checkpoint(tmp_path)
    meta = path / "conveyor.json"
    text = meta.read_text()
    meta.write_text(text[: len(text) // 2])  # cut mid-JSON
    with pytest.raises(ConfigError, match="its conveyor.json is not the JSON a save writes"):
        check_resume(resuming(path))
    meta.write_text(text.replace('"model"', '"modle"'))  # a checkpoint's, but edited
    with pytest.raises(ConfigError, match="has metadata conveyor cannot read"):
        check_resume(resuming(path))
    meta.write_text(text)
    (path / ".metadata").write_bytes(pickle.dumps(print))  # an index that would call a function
    with pytest.raises(ConfigError, match="cannot be resumed from"):
        check_resume(resuming(path))


def test_a_checkpoint_of_another_model_size_is_refused_naming_the_tensor(tmp_path):
    path = saved_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match=r"'transformer.wte.weight' has shape \[256, 64\] here but \[256, 32\]"):
        check_resume(resuming(path, "model.width=64"))
    with pytest.raises(ConfigError, match=r"holds 'transformer.h.1.ln_1.weight'.*which this model does not have"):
        check_resume(resuming(path, "model.layers=1", "parallel.pp=1"))


def test_the_command_refuses_it_before_starting_any_rank(tmp_path, monkeypatch, capsys):
    path = saved_checkpoint(tmp_path)
    (path / ".metadata").unlink()

    def no_launch(cfg):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launch, "launch", no_launch)
    assert main(["train", *SIZES, f"checkpoint.resume={path}", f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.rstrip().splitlines()[-1].startswith(f"conveyor: error: checkpoint.resume='{path}' cannot be "
                                                    f"resumed from: ")
    assert "no .metadata" in err and "Traceback" not in err
