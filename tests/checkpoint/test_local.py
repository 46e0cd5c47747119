"""Checkpoints in one process: unsplit modules and in-process pipelines, keep_last, refusals, safe reading."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import conveyor
import conveyor.checkpoint as ckpt
import conveyor.frontend as frontend
from conveyor.errors import CheckpointError, CheckpointIncompleteError, CheckpointMismatchError
from conveyor.testing.models import reference_step
from conveyor.testing.rigs.checkpoint_models import (
    MICROBATCHES,
    SPLITS,
    assert_same_tensors,
    ce_loss,
    lm_batch,
    named_optimizer_state,
    tied_lm,
)


def _trained_module(seed=0, steps=2, **kwargs):
    model = tied_lm(seed, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for step in range(steps):
        ids, targets = lm_batch(step)
        reference_step(model, ids, targets, MICROBATCHES, ce_loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, scheduler


def _names(module):
    return {id(p): n for n, p in module.named_parameters()}


def test_module_round_trip_is_bitwise_and_training_continues_alike(tmp_path):
    model, optimizer, scheduler = _trained_module()
    ckpt.save(tmp_path / "step_2", model, optimizer, scheduler, extra={"step": 2, "betas": (1, 2)})
    fresh, fresh_opt, fresh_sched = _trained_module(seed=7, steps=1)
    extra = ckpt.load(tmp_path / "step_2", fresh, fresh_opt, fresh_sched)
    assert extra == {"step": 2, "betas": (1, 2)}
    assert_same_tensors(fresh.state_dict(), model.state_dict(), "model")
    assert_same_tensors(named_optimizer_state(fresh_opt, _names(fresh)),
                        named_optimizer_state(optimizer, _names(model)), "optimizer")
    assert fresh_opt.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert fresh_opt.param_groups[0]["betas"] == (0.9, 0.999)  # a tuple again
    assert fresh_sched.state_dict() == scheduler.state_dict()
    for step in (2, 3):
        for m, o in ((model, optimizer), (fresh, fresh_opt)):
            reference_step(m, *lm_batch(step), MICROBATCHES, ce_loss)
            o.step()
            o.zero_grad()
    assert_same_tensors(fresh.state_dict(), model.state_dict(), "model after 2 more steps")


def test_saving_before_the_first_step_leaves_the_optimizer_alone(tmp_path):
    model = tied_lm(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt.save(tmp_path / "c", model, optimizer)
    assert not optimizer.state  # no step was run to create state
    other, other_opt = _trained_module(seed=3)[:2]
    ckpt.load(tmp_path / "c", other, other_opt)
    assert not other_opt.state and other_opt.param_groups[0]["lr"] == 1e-2
    assert_same_tensors(other.state_dict(), model.state_dict(), "model")


def test_to_state_dict_equals_the_unsplit_model_trained_alike(tmp_path):
    """An in-process Pipeline of traced stages, trained with AdamW, against the unsplit model (untied: bitwise)."""
    model, optimizer, _ = _trained_module(tie=False)
    start = tied_lm(0, tie=False)
    split = frontend.split_model(start, 4, split_points=SPLITS[4], example_args=(lm_batch(0)[0][:2],))
    pipe = conveyor.Pipeline(split.stage_modules(), schedule="1f1b", microbatches=MICROBATCHES,
                             loss_fn=ce_loss, layout=conveyor.InProcessLayout())
    pipe_opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    pipe_sched = torch.optim.lr_scheduler.StepLR(pipe_opt, step_size=1, gamma=0.5)
    for step in range(2):
        ids, targets = lm_batch(step)
        pipe.step(ids, target=targets)
        pipe_opt.step()
        pipe_opt.zero_grad()
        pipe_sched.step()
    ckpt.save(tmp_path / "local", pipe, pipe_opt, pipe_sched)
    state = ckpt.to_state_dict(tmp_path / "local")
    assert sorted(state) == sorted(model.state_dict())  # an in-process Pipeline knows no model order: stage order
    assert_same_tensors(dict(state), model.state_dict(), "to_state_dict")
    # ... and the unsplit module loads the in-process pipeline's checkpoint, optimizer included.
    other, other_opt, other_sched = _trained_module(seed=5, steps=1, tie=False)
    ckpt.load(tmp_path / "local", other, other_opt, other_sched)
    assert_same_tensors(named_optimizer_state(other_opt, _names(other)),
                        named_optimizer_state(optimizer, _names(model)), "optimizer")


def test_tied_names_both_come_back_and_load_strictly(tmp_path):
    model, optimizer, _ = _trained_module()
    ckpt.save(tmp_path / "c", model, optimizer)
    state = ckpt.to_state_dict(tmp_path / "c")
    assert "head.weight" in state and state["head.weight"] is state["embed.weight"]
    tied_lm(9).load_state_dict(state, strict=True)


def test_keep_last_removes_only_older_conveyor_checkpoints(tmp_path):
    model, optimizer, _ = _trained_module(steps=1)
    (tmp_path / "notes").mkdir()  # not conveyor's: never touched
    (tmp_path / ".step_0.partial-deadbeef").mkdir()  # what an interrupted save leaves
    for step in range(1, 5):
        ckpt.save(tmp_path / f"step_{step}", model, optimizer, extra={"step": step}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "notes", "step_3", "step_4"]
    assert ckpt.latest(tmp_path) == tmp_path / "step_4"
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step_3", "step_4"]
    assert ckpt.load(tmp_path, model, optimizer) == {"step": 4}  # a parent directory: its latest
    ckpt.save(tmp_path / "step_4", model, optimizer, extra={"step": 44})  # the same name again: replaced
    assert ckpt.load(tmp_path / "step_4", model) == {"step": 44}
    with pytest.raises(CheckpointError, match="keep_last"):
        ckpt.save(tmp_path / "step_5", model, keep_last=0)
    with pytest.raises(CheckpointError, match="is not a conveyor checkpoint"):
        (tmp_path / "notes" / "mine.txt").write_text("keep me")
        ckpt.save(tmp_path / "notes", model)


def test_a_checkpoint_of_another_model_is_refused_with_the_key_and_shapes(tmp_path):
    model, optimizer, _ = _trained_module()
    ckpt.save(tmp_path / "c", model, optimizer)
    narrow = tied_lm(0, dim=8)
    before = {k: v.clone() for k, v in narrow.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as caught:
        ckpt.load(tmp_path / "c", narrow)
    message = str(caught.value)
    assert "'scale'" in message and "[8]" in message and "[16]" in message and "configuration" in message
    assert_same_tensors(narrow.state_dict(), before, "a refused load changes nothing")
    with pytest.raises(CheckpointMismatchError, match=r"'blocks\.4\.0\.weight' \(shape \[16\]\) is not in"):
        ckpt.load(tmp_path / "c", tied_lm(0, layers=5))
    with pytest.raises(CheckpointMismatchError, match=r"holds 'blocks\.3\.0\.weight'.*does not have"):
        ckpt.load(tmp_path / "c", tied_lm(0, layers=3))
    sgd_model = tied_lm(1)
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointMismatchError, match="AdamW, not of a SGD"):
        ckpt.load(tmp_path / "c", sgd_model, sgd)


def test_a_truncated_checkpoint_is_refused_naming_the_file(tmp_path):
    model, optimizer, _ = _trained_module()
    ckpt.save(tmp_path / "c", model, optimizer)
    (data,) = [p for p in (tmp_path / "c").iterdir() if p.suffix == ".distcp"]
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(
        CheckpointIncompleteError, match=rf"'model\.[a-z.0-9]+' is stored in {data.name}, which has 1000"
    ):
        ckpt.load(tmp_path / "c", tied_lm(3))
    data.unlink()
    with pytest.raises(CheckpointIncompleteError, match=f"{data.name}, which is missing"):
        ckpt.to_state_dict(tmp_path / "c")
    (tmp_path / "c" / ".metadata").unlink()
    with pytest.raises(CheckpointIncompleteError, match="no .metadata"):
        ckpt.load(tmp_path / "c", tied_lm(3))
    os.remove(tmp_path / "c" / "conveyor.json")
    with pytest.raises(CheckpointIncompleteError, match="not a complete conveyor checkpoint"):
        ckpt.load(tmp_path / "c", tied_lm(3))


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo owned",))


def test_metadata_that_would_run_code_is_refused(tmp_path):
    model, optimizer, _ = _trained_module(steps=1)
    ckpt.save(tmp_path / "c", model, optimizer)
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        ckpt.load(tmp_path / "c", model)


def test_extra_must_be_json(tmp_path):
    model = tied_lm(0)
    with pytest.raises(CheckpointError, match=r"extra\.t is a tensor"):
        ckpt.save(tmp_path / "c", model, extra={"t": torch.ones(1)})
    with pytest.raises(
        CheckpointError, match=r"extra\.f is a builtin_function_or_method, which a checkpoint cannot hold"
    ):
        ckpt.save(tmp_path / "c", model, extra={"f": print})
    assert not (tmp_path / "c").exists()


def test_a_refused_optimizer_load_leaves_its_state_as_it_was(tmp_path):
    model, optimizer, _ = _trained_module()
    ckpt.save(tmp_path / "c", model, optimizer)
    other = tied_lm(4)
    amsgrad = torch.optim.AdamW(other.parameters(), lr=1e-2, amsgrad=True)
    reference_step(other, *lm_batch(0), MICROBATCHES, ce_loss)
    amsgrad.step()
    before = named_optimizer_state(amsgrad, _names(other))
    with pytest.raises(CheckpointMismatchError, match="max_exp_avg_sq"):
        ckpt.load(tmp_path / "c", other, amsgrad)  # the checkpoint has no max_exp_avg_sq
    assert_same_tensors(named_optimizer_state(amsgrad, _names(other)), before, "optimizer after a refusal")


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_the_exported_weights_get_the_mode_of_every_other_file_written(tmp_path, umask):
    # safetensors creates its file 0600: a user's other accounts (a serving job) could not read it.
    model, optimizer, _ = _trained_module(steps=1)
    ckpt.save(tmp_path / "step_1", model, optimizer)
    previous = os.umask(umask)
    try:
        names = ckpt.export(tmp_path / "step_1", tmp_path / "out")
    finally:
        os.umask(previous)
    assert names == ["model.safetensors"]
    assert (tmp_path / "out" / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
