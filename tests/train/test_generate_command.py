"""``conveyor generate RUN_OR_CHECKPOINT --prompt TEXT``: a run's model, its checkpoint, text through the pipeline.

A run directory is made by hand (its config.yaml and one checkpoint of a small GPT-2), cheaper than
training one; the text printed must be the prompt and the continuation the unsplit model's greedy
loop makes over the same windows. The command decodes through the stages' key/value caches (other
kernel calls than the window's full forward, logits within rounding: tests/frontend/test_decode.py
bounds them), so the tokens agree wherever no two logits of a step are within rounding of each other.
"""

from __future__ import annotations

import pytest
import torch

import conveyor
from conveyor.cli import main
from conveyor.pipe.generation import Sampling
from conveyor.testing.references.generation import reference_generate
from conveyor.train.config import load_config, save_config
from conveyor.train.data import load_tokenizer
from conveyor.train.generate_command import find_run
from conveyor.train.models import build_model

SEQ_LEN = 16


@pytest.fixture
def run_dir(tmp_path):
    cfg = load_config(None, ["model.layers=2", "model.width=32", f"model.seq_len={SEQ_LEN}", f"run.dir={tmp_path}"])
    save_config(cfg, tmp_path / "config.yaml")
    torch.manual_seed(0)
    model = build_model(cfg, load_tokenizer(cfg.data.tokenizer).vocab_size)
    conveyor.checkpoint.save(tmp_path / "checkpoints" / "step_000001", model)
    return tmp_path, model.eval()


def test_a_run_and_a_checkpoint_print_the_unsplit_models_greedy_text(run_dir, capsys):
    path, model = run_dir
    tokenizer = load_tokenizer("bytes")
    prompt = tokenizer.encode(b"def ").long()
    made = reference_generate(model, prompt[None], 8, Sampling(eos_token_id=tokenizer.eos_id), length=SEQ_LEN)[0]
    want = "def " + tokenizer.decode(made.tolist())
    checkpoint = path / "checkpoints" / "step_000001"
    # A checkpoint inside a run finds the run's config above it; the run directory, its latest checkpoint.
    assert find_run(checkpoint) == (path / "config.yaml", checkpoint)
    assert find_run(path) == (path / "config.yaml", checkpoint)
    assert main(["generate", str(checkpoint), "--prompt", "def ", "--tokens", "8"]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_sampling_options_and_bad_paths_are_refused_with_the_fix(run_dir, tmp_path, capsys):
    path, _ = run_dir
    assert main(["generate", str(path), "--prompt", "x", "--temperature", "0.5"]) == 2
    assert "pass do_sample=True" in capsys.readouterr().err
    assert main(["generate", str(path), "--prompt", "x", "--tokens", "16"]) == 2
    assert "pass --tokens 15 or fewer" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "nowhere"), "--prompt", "x"]) == 2
    assert "pass the run.dir of a `conveyor train` run" in capsys.readouterr().err
