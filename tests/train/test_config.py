"""conveyor.train.config: defaults, YAML + overrides, every refusal, and the save/load round trip."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from conveyor.errors import ConfigError
from conveyor.train.config import (
    TrainConfig,
    config_reference,
    config_yaml,
    field_help,
    load_config,
    save_config,
)


def _refusal(overrides, **kwargs) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides, **kwargs)
    assert isinstance(caught.value, ValueError)
    return str(caught.value)


def test_defaults_are_a_small_byte_level_gpt_on_two_ranks():
    cfg = load_config()
    assert cfg == TrainConfig()
    assert (cfg.model.name, cfg.data.source, cfg.data.tokenizer) == ("gpt", "stdlib", "bytes")
    assert (cfg.parallel.pp, cfg.parallel.dp, cfg.world_size) == (2, 1, 2)
    assert cfg.replica_batch_size % cfg.parallel.microbatches == 0
    assert cfg.checkpoint.dir is None and cfg.checkpoint_dir == "runs/train/checkpoints"
    assert cfg.optim.betas == (0.9, 0.95) and cfg.checkpoint.resume is False


def test_every_field_has_help():
    for section in dataclasses.fields(TrainConfig):
        for key in dataclasses.fields(type(getattr(TrainConfig(), section.name))):
            assert field_help(section.name, key.name), f"{section.name}.{key.name}"


def test_yaml_then_overrides_later_wins(tmp_path):
    path = tmp_path / "gpt.yaml"
    path.write_text("parallel:\n  pp: 4\n  microbatches: 8\noptim:\n  lr: 1.0e-2\nrun:\n  dir: out/a\n")
    cfg = load_config(path, ["parallel.pp=2", "optim.lr=3e-4", "optim.betas=[0.8,0.9]",
                             "checkpoint.resume=true", "parallel.virtual=null"])
    assert (cfg.parallel.pp, cfg.parallel.microbatches, cfg.optim.lr) == (2, 8, 3e-4)
    assert cfg.optim.betas == (0.8, 0.9) and cfg.checkpoint.resume is True
    assert cfg.checkpoint_dir == "out/a/checkpoints"


def test_a_world_size_that_fits_is_accepted():
    assert load_config(None, ["parallel.pp=2", "parallel.dp=2"], world_size=4).world_size == 4


def test_save_then_load_gives_an_equal_config(tmp_path):
    cfg = load_config(None, ["optim.lr=3e-4", "parallel.schedule=interleaved-1f1b", "parallel.virtual=2",
                             "data.max_bytes=1000", "run.dir=elsewhere", "checkpoint.dir=${run.dir}/ckpt"])
    path = save_config(cfg, tmp_path / "sub" / "config.yaml")
    again = load_config(path)
    assert again == cfg and again.checkpoint_dir == "elsewhere/ckpt"
    assert "${" not in config_yaml(cfg)  # resolved: what ran is what the file says


def test_unknown_key_names_its_section_keys_and_a_close_match():
    message = _refusal(["optim.lrr=1"])
    assert "unknown key 'optim.lrr'" in message and "did you mean 'optim.lr'" in message
    assert "lr, betas, weight_decay, warmup_steps, lr_schedule, min_lr_ratio" in message
    assert "command-line override 'optim.lrr=1'" in message


def test_unknown_section_and_unknown_key_in_yaml(tmp_path):
    assert "did you mean 'optim'" in _refusal(["optimizer.lr=1"])
    path = tmp_path / "c.yaml"
    path.write_text("parallel:\n  microbatch: 2\n")
    with pytest.raises(ConfigError, match=r"parallel.microbatch.*c.yaml.*did you mean 'parallel.microbatches'"):
        load_config(path)


def test_sections_and_values_are_not_confused():
    assert "is a section, not a value" in _refusal(["optim=3"])
    assert "is a value, not a section" in _refusal(["optim.lr.x=3"])


@pytest.mark.parametrize("override, expected", [
    ("optim.lr=abc", "optim.lr='abc': expected float"),
    ("train.steps=1.5", "train.steps=1.5: expected int"),
    ("optim.betas=[0.9]", "expected 2 values"),
    ("optim.betas=[0.9,1.2]", "expected two numbers in [0, 1)"),
    ("optim.lr=-1", "optim.lr=-1.0: expected a value > 0.0"),
    ("data.val_fraction=1.0", "data.val_fraction=1.0: expected 0.0 <= value < 1.0"),
    ("stage.autocast=fp8", "stage.autocast='fp8' is not a mixed precision conveyor knows; use 'bf16'"),
    ("transfer.transport=pigeon", "transfer.transport must be one of 'auto'"),
    ("parallel.data_parallel=zero", "expected one of ddp, fsdp"),
    ("loss.normalize=token", "did you mean 'tokens'"),
    ("loss.on_nonfinite=raise", "expected one of skip, stop"),
    ("optim.lr_schedule=linear", "expected one of cosine, constant"),
    ("parallel.schedule=1f1c", "did you mean '1f1b'"),
    ("model.name=gtp", "did you mean 'gpt'"),
    ("model.name=hf:not a class", "transformers class name"),
    ("model.heads=3", "model.heads=3: must divide model.width=128"),
    ("model.layers=1", "give at least 2 layers"),
    ("data.format=csv", "expected one of text, jsonl, parquet"),
    ("data.source=no/such/*.txt", "'no/such/*.txt' matches no file"),
    ("data.source=[stdlib,a.txt]", "'stdlib' stands alone"),
    ("data.tokenizer=gpt2", "expected 'bytes' or a local tokenizer directory"),
    ("checkpoint.resume=/no/such/ckpt", "no such checkpoint"),
    ("checkpoint.dir=${nope}", "cannot resolve an interpolation"),
])
def test_a_bad_value_names_key_value_and_what_is_allowed(override, expected):
    assert expected in _refusal([override])


def test_sizes_that_do_not_divide():
    message = _refusal(["parallel.microbatches=3"])
    assert "parallel.microbatches=3: must divide the per-replica batch" in message and "1, 2, 4, 8, 16" in message
    assert "must split evenly over parallel.dp=3" in _refusal(["parallel.dp=3"])
    assert "but the job has 3 ranks" in _refusal([], world_size=3)
    assert "zbv" in _refusal(["parallel.schedule=zbv", "parallel.virtual=3"])
    assert "nothing to validate on" in _refusal(["data.val_fraction=0"])


def test_every_problem_is_reported_at_once():
    message = _refusal(["stage.autocast=int8", "optim.lr=-1", "loss.normalize=token"])
    assert message.startswith("3 problems in the config:")
    both = _refusal(["stage.autocast=int8", "parallel.microbatches=3"])  # a size rule is not hidden
    assert both.startswith("2 problems") and "parallel.microbatches=3" in both


def test_malformed_input():
    assert "is not of the form section.key=value" in _refusal(["noequals"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/no/such/config.yaml")


def test_yaml_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping of sections"):
        load_config(path)


def test_fp16_trains_with_loss_scaling_and_is_refused_without_it():
    # The stage: section IS the pipeline's StageOptions: the default and the refusal are the record's own.
    from conveyor import LossScaling

    assert load_config(None, ["stage.autocast=fp16"]).stage.loss_scaling == LossScaling()
    cfg = load_config(None, ["stage.autocast=fp16", "stage.loss_scaling={growth_interval: 100}"])
    assert cfg.stage.loss_scaling == LossScaling(growth_interval=100)
    with pytest.raises(ConfigError, match=r"stage.loss_scaling=False: fp16 needs loss scaling.*'bf16'"):
        load_config(None, ["stage.autocast=fp16", "stage.loss_scaling=false"])
    # fp16 weights keep their gradients in fp32 main_grad, for conveyor.MasterWeights, which the trainer's
    # AdamW does not read (it would step nothing): refused, naming autocast (bf16 weights alike).
    with pytest.raises(ConfigError, match=r"stage.param_dtype='fp16': its gradients accumulate in fp32 main_grad.*"
                                          r"use stage.autocast=fp16 with fp32 parameters instead$"):
        load_config(None, ["stage.param_dtype=fp16"])
    with pytest.raises(ConfigError, match=r"stage.param_dtype='bf16'.*stage.autocast=bf16.*grad_accum_dtype=none"):
        load_config(None, ["stage.param_dtype=bf16"])


def test_the_stage_and_transfer_sections_are_the_pipelines_records():
    from conveyor.options import StageOptions, TransferOptions

    cfg = load_config(None, ["stage.autocast=bfloat16", "stage.param_dtype=bf16", "stage.grad_accum_dtype=none",
                             "transfer.timeout_s=30"])
    assert cfg.stage == StageOptions(autocast="bf16", param_dtype="bf16", grad_accum_dtype="none")
    assert cfg.transfer == TransferOptions(timeout_s=30.0)
    assert "stage.recompute (None): recompute activations in backward" in config_reference()


@pytest.mark.parametrize("old, new", [
    ("stage.checkpoint_activations=true", "use stage.recompute=true"),
    ("stage.checkpoint={every: 2}", "use stage.recompute (the same policy"),
])
def test_a_renamed_stage_key_says_its_new_name(old, new):
    with pytest.raises(ConfigError, match=re.escape(f"{old.split('=')[0]} was renamed: {new}")):
        load_config(None, [old])


def test_in_process_runs_one_process_and_one_replica():
    assert load_config(None, ["parallel.in_process=true"]).world_size == 1
    assert "set parallel.dp=1" in _refusal(["parallel.in_process=true", "parallel.dp=2"])


def test_the_plan_file_is_read_once_and_the_pipeline_is_given_that_plan(tmp_path, monkeypatch):
    # Before: load_config, the checks, --dry-run and every rank's pipeline each read parallel.plan again
    # (a file changed or removed meanwhile gave them another plan, or none), and the pipeline was given a
    # schedule and split points rather than the plan.
    import pickle

    import conveyor
    from conveyor.plan.result import Plan
    from conveyor.train import loop
    from conveyor.train.dry_run import run_layout

    path = Plan("gpipe", 2, 1, 8, 16, ("transformer.h.3",), 1.0, 0.1, (1e6, 1e6), (0.5, 0.5),
                float("inf")).save(tmp_path / "plan.json")
    reads = []
    load = Plan.load
    monkeypatch.setattr(Plan, "load", staticmethod(lambda p: reads.append(p) or load(p)))
    cfg = load_config(None, [f"parallel.plan={path}"])
    assert (cfg.parallel.schedule, cfg.parallel.microbatches) == ("gpipe", 8)
    path.unlink()
    rank_cfg = pickle.loads(pickle.dumps(cfg))  # what the launcher hands each rank
    assert [row.first for row in run_layout(rank_cfg).stages] == ["transformer.wte", "transformer.h.3"]
    monkeypatch.setattr(conveyor, "pipeline", lambda model, **kwargs: kwargs)
    given = loop.build_pipeline(rank_cfg, torch.nn.Linear(1, 1))
    assert given["plan"] is rank_cfg.plan and given["plan"].split_points == ("transformer.h.3",)
    assert len(reads) == 1
