"""What `conveyor train` tells a new user: the recipes its help lists, what data.source takes, the run's banner."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.cli import main
from conveyor.errors import ConfigError
from conveyor.train import launch, sources
from conveyor.train.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_train_help_lists_every_recipe_of_configs(capsys):
    # The list once missed moe, llama-tp and demo; it is read from the folder now, so compare with the folder.
    assert main(["train", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # the description is wrapped at 100 columns
    recipes = sorted(path.name for path in (ROOT / "configs").glob("*.yaml"))
    assert {"moe.yaml", "llama-tp.yaml", "demo.yaml", "gpt.yaml"} <= set(recipes)
    missing = [name for name in recipes if f"configs/{name}" not in text]
    assert not missing, (missing, text[:600])


@pytest.mark.parametrize("source", [None, "no/such/*.txt"])
def test_a_missing_data_source_names_every_built_in_corpus(source):
    with pytest.raises(ConfigError) as refused:
        sources.source_files(source)
    for name in sources.BUILT_IN:  # the registry the readers dispatch on
        assert repr(name) in str(refused.value), (name, str(refused.value))
    assert "stdlib-definitions" in sources.BUILT_IN


def test_the_banner_says_sequence_parallel(monkeypatch, capsys):
    import torch.distributed.launcher.api as api

    monkeypatch.setattr(api, "elastic_launch", lambda config, fn: lambda *args: {rank: {} for rank in range(4)})
    cfg = load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true"])
    assert launch.launch(cfg) == 0
    assert "4 local ranks (pp=2 x dp=1 x tp=2, sequence parallel) on " in capsys.readouterr().out
    assert launch.launch(load_config(None, ["parallel.tp=2"])) == 0
    assert "4 local ranks (pp=2 x dp=1 x tp=2) on " in capsys.readouterr().out
