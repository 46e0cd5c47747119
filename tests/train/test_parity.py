"""train.parity without a pipeline: the config rules it keeps, and how the reference reports a step."""

from __future__ import annotations

import pytest

from conveyor.errors import ConfigError
from conveyor.testing import run_ranks
from conveyor.train.config import load_config

TINY = ["model.name=llama", "model.layers=2", "model.width=32", "model.heads=2", "model.seq_len=16",
        "train.batch_size=4", "parallel.microbatches=2", "train.parity=true", "optim.warmup_steps=1"]


def test_parity_is_off_by_default_and_the_demo_recipe_turns_it_on():
    from conveyor.cli import demo_recipe

    assert load_config(None).train.parity is False
    assert load_config(demo_recipe()).train.parity is True


@pytest.mark.parametrize("override, rule", [
    ("parallel.dp=2", "parallel.dp=2 replicas have no single-device reference here; set parallel.dp=1"),
    ("stage.autocast=bf16", "stage.autocast='bf16': the reference trains in fp32"),
    ("stage.param_dtype=bf16", "stage.param_dtype='bf16': the reference trains fp32 parameters"),
    ("loss.normalize=tokens", "loss.normalize='tokens': the reference divides each microbatch's loss by M"),
    ("run.max_restarts=1", "run.max_restarts=1: a restarted round resumes, the reference cannot"),
    ("data.batching=by_length", "data.batching=by_length: the reference steps fixed windows"),
])
def test_what_parity_cannot_check_is_refused_with_the_key(override, rule):
    with pytest.raises(ConfigError, match="train.parity=true compares one pipeline with one device: "
                                          + rule.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [*TINY, override])


def _report_steps(rank: int, world_size: int) -> list:
    import torch

    from conveyor.train.parity import ParityReference

    cfg = load_config(None, TINY)
    reference, twin = ParityReference(cfg, 256, torch.device("cpu")), ParityReference(cfg, 256, torch.device("cpu"))
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    results = []
    for step in (1, 2):
        loss, norm = twin.train_step(x, y)  # the same model and steps: what a pipeline must equal
        results.append(reference.step(step, x, y, loss, norm))
    loss, norm = twin.train_step(x, y)
    results.append(reference.step(3, x, y, loss + 1e-6, norm))  # one pipeline step off by rounding
    return [*results, reference.finish(), reference.different]


def test_the_reference_reports_each_step_and_the_ones_that_differ(capfd):
    assert run_ranks(_report_steps, 1, timeout_s=120) == [[True, True, False, False, [3]]]
    lines = capfd.readouterr().out.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.rsplit("   ", 1)[1] for line in steps] == ["bitwise equal", "bitwise equal", "DIFFERENT"]
    assert all(" | one device " in line and " grad norm " in line for line in steps)
    assert "parity: MISMATCH with single-device training at 1 of 3 steps (steps 3)" in lines


def test_the_demo_flags_are_short_for_their_keys_and_overrides_win(monkeypatch, tmp_path):
    import conveyor.cli as cli
    from conveyor.train import launch

    seen = {}
    monkeypatch.setattr(cli, "_print_compare", lambda *args, **kwargs: 0)
    monkeypatch.setattr(launch, "run", lambda cfg: seen.setdefault("cfg", cfg) and 0)
    run_dir = tmp_path / "run"
    (run_dir).mkdir()
    (run_dir / "timeline.png").write_bytes(b"picture")
    png = tmp_path / "copy.png"
    status = cli.main(["demo", "--ranks", "4", "--steps", "3", "--schedule", "gpipe", "--png", str(png),
                       f"run.dir={run_dir}", "train.steps=5"])
    cfg = seen["cfg"]
    assert status == 0 and (cfg.parallel.pp, cfg.parallel.schedule, cfg.train.steps) == (4, "gpipe", 5)
    assert png.read_bytes() == b"picture"
