"""Across gloo processes: resume bitwise (RNG included), and a rank killed in the middle of a save."""

from __future__ import annotations

import os
import random

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

import conveyor
import conveyor.checkpoint as ckpt
import conveyor.schedule as cs
from conveyor.errors import CheckpointIncompleteError
from conveyor.testing import RankFailure, run_ranks
from conveyor.testing.rigs.checkpoint_models import (
    assert_same_tensors,
    drop_stage,
    mse,
    named_optimizer_state,
    random_batch,
)

pytestmark = pytest.mark.distributed


def _build(rank, world_size, name, virtual, seed):
    schedule = cs.build(name, ranks=world_size, microbatches=2, virtual=virtual)
    stages = [drop_stage(s, schedule.num_stages, seed) for s in schedule.stages_of(rank)]
    pipe = conveyor.Pipeline(stages, schedule=schedule, loss_fn=mse, transfer=conveyor.TransferOptions(timeout_s=60))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    return pipe, optimizer, scheduler


def _train(pipe, optimizer, scheduler, steps):
    losses = []
    for _ in range(steps):
        x, t = random_batch()
        losses.append(pipe.step(x, target=t))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return losses


def _resume(rank, world_size, name, virtual, path):
    torch.manual_seed(0)
    random.seed(0)
    pipe, optimizer, scheduler = _build(rank, world_size, name, virtual, seed=1)
    _train(pipe, optimizer, scheduler, 2)
    ckpt.save(path, pipe, optimizer, scheduler, extra={"step": 2, "rank": rank})
    names = {id(p): n for n, p in pipe.named_parameters()}
    saved_optimizer = named_optimizer_state(optimizer, names)
    want = _train(pipe, optimizer, scheduler, 2)
    want_params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    pipe.close()

    torch.manual_seed(123)  # elsewhere in its streams: the checkpoint must put them back
    random.seed(5)
    fresh, fresh_optimizer, fresh_scheduler = _build(rank, world_size, name, virtual, seed=2)
    extra = ckpt.load(path, fresh, fresh_optimizer, fresh_scheduler)
    fresh_names = {id(p): n for n, p in fresh.named_parameters()}
    assert_same_tensors(named_optimizer_state(fresh_optimizer, fresh_names), saved_optimizer, "optimizer")
    got = _train(fresh, fresh_optimizer, fresh_scheduler, 2)
    got_params = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    fresh.close()
    return extra, want, got, want_params, got_params


@pytest.mark.parametrize(("name", "virtual"), [("1f1b", 1), ("zbv", 2)])
def test_resume_gives_the_same_losses_and_parameters_bitwise(tmp_path, name, virtual):
    results = run_ranks(_resume, 2, args=(name, virtual, str(tmp_path / "step_2")), timeout_s=120)
    for rank, (extra, want, got, want_params, got_params) in enumerate(results):
        assert extra == {"step": 2, "rank": rank}  # each rank's own extra: the layout is the same
        assert [loss.item() for loss in got] == [loss.item() for loss in want]
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert_same_tensors(got_params, want_params, f"rank {rank} parameters")
    assert not torch.equal(results[0][1][0], results[0][1][1])  # dropout and data really differ per step


def _save_then_die(rank, world_size, path, die):
    pipe, optimizer, scheduler = _build(rank, world_size, "1f1b", 1, seed=1)
    torch.manual_seed(0)
    random.seed(0)
    _train(pipe, optimizer, scheduler, 1)
    if not die:
        ckpt.save(path, pipe, optimizer, extra={"saved": "first"})
        return {n: p.detach().clone() for n, p in pipe.named_parameters()}
    _train(pipe, optimizer, scheduler, 1)
    if rank == 1:
        write_data = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            write_data(self, plan, planner).wait()  # this rank's tensors are on disk ...
            os._exit(17)  # ... and the process is gone before the checkpoint is finished

        FileSystemWriter.write_data = write_then_die
    ckpt.save(path, pipe, optimizer, extra={"saved": "second"})
    raise AssertionError("unreachable: rank 1 dies inside the save")


def _load_latest(rank, world_size, parent):
    pipe, optimizer, scheduler = _build(rank, world_size, "1f1b", 1, seed=3)
    extra = ckpt.load(parent, pipe, optimizer)
    params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    ckpt.save(os.path.join(parent, "step_2"), pipe, optimizer)  # the same name again, now complete
    return extra, params


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    first = run_ranks(_save_then_die, 2, args=(str(tmp_path / "step_1"), False), timeout_s=60)
    with pytest.raises(RankFailure) as caught:
        run_ranks(_save_then_die, 2, args=(str(tmp_path / "step_2"), True), timeout_s=60)
    assert 1 in caught.value.failed and "exit code 17" in str(caught.value)
    (partial,) = [p for p in tmp_path.iterdir() if p.name.startswith(".step_2.partial-")]
    assert any(p.suffix == ".distcp" for p in partial.iterdir())  # some of it was written
    assert not (tmp_path / "step_2").exists()
    assert ckpt.latest(tmp_path) == tmp_path / "step_1"
    assert ckpt.checkpoints(tmp_path) == [tmp_path / "step_1"]  # the partial directory is not one
    with pytest.raises(CheckpointIncompleteError, match="unfinished save"):
        ckpt.to_state_dict(partial)
    state = ckpt.to_state_dict(tmp_path)
    assert set(state) == {f"stages.{s}.{n}" for s, ps in enumerate(first) for n in ps}
    results = run_ranks(_load_latest, 2, args=(str(tmp_path),), timeout_s=60)
    for rank, (extra, params) in enumerate(results):
        assert extra == {"saved": "first"}
        assert_same_tensors(params, first[rank], f"rank {rank} parameters from step_1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_1", "step_2"]  # leftovers gone
