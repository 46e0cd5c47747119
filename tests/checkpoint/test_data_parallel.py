"""Checkpoints of a pp=2 x dp=2 job: bitwise resume, and resharding to one replica and to one process.

Replicas write one checkpoint together (DCP writes a replicated tensor once, each shard of a
sharded one by its holder); it loads into any layout, as the pipeline-only ones do.
"""

from __future__ import annotations

import pytest
import torch

import conveyor
import conveyor.checkpoint as ckpt
from conveyor.testing import run_ranks

from .models import MICROBATCHES, SPLITS, ce_loss, lm_batch, tied_lm

pytestmark = pytest.mark.distributed

DP, PP = 2, 2


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().clone()


def _build(kind: str | None, name: str, virtual: int, seed: int, dp: int):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, PP), mesh_dim_names=("dp", "pp")) if dp > 1 else None
    model = tied_lm(seed, tie=False)  # fsdp shards each stage on its own: no parameter shared by two
    ids, _ = lm_batch(0)
    pipe = conveyor.pipeline(model, example_args=(ids[:2],), split_points=SPLITS[PP * virtual], schedule=name,
                             microbatches=MICROBATCHES, loss_fn=ce_loss, mesh=mesh, data_parallel=kind,
                             options=conveyor.PipelineOptions(virtual=virtual, transfer=conveyor.TransferOptions(timeout_s=60)))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    replica = mesh.get_local_rank("dp") if mesh is not None else 0
    return pipe, optimizer, replica


def _steps(pipe, optimizer, replica: int, dp: int, first: int, count: int) -> list[torch.Tensor]:
    losses = []
    for step in range(first, first + count):
        ids, targets = lm_batch(step, batch=16)  # 8 rows a replica, 2 a microbatch (the example)
        losses.append(pipe.step(ids.chunk(dp)[replica], target=targets.chunk(dp)[replica]))
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _resume(rank, world_size, kind, name, virtual, path):
    pipe, optimizer, replica = _build(kind, name, virtual, seed=1, dp=DP)
    _steps(pipe, optimizer, replica, DP, 0, 2)
    ckpt.save(path, pipe, optimizer, extra={"step": 2})
    saved = {n: _full(p) for n, p in pipe.named_parameters()}
    want = _steps(pipe, optimizer, replica, DP, 2, 2)
    want_params = {n: _full(p) for n, p in pipe.named_parameters()}
    pipe.close()

    fresh, fresh_optimizer, replica = _build(kind, name, virtual, seed=2, dp=DP)
    extra = ckpt.load(path, fresh, fresh_optimizer)
    got = _steps(fresh, fresh_optimizer, replica, DP, 2, 2)
    got_params = {n: _full(p) for n, p in fresh.named_parameters()}
    fresh.close()
    return extra, saved, want, got, want_params, got_params


def _one_replica(rank, world_size, path, again):
    pipe, optimizer, _ = _build(None, "1f1b", 1, seed=3, dp=1)
    ckpt.load(path, pipe, optimizer)
    params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    moments = {n: optimizer.state[p]["exp_avg"].clone() for n, p in pipe.named_parameters()}
    ckpt.save(again, pipe, optimizer)  # and back: one replica's checkpoint, for two replicas
    pipe.close()
    return params, moments


def _two_replicas(rank, world_size, kind, path):
    pipe, optimizer, _ = _build(kind, "zbv", 2, seed=4, dp=DP)
    ckpt.load(path, pipe, optimizer)
    params = {n: _full(p) for n, p in pipe.named_parameters()}
    moments = {n: _full(optimizer.state[p]["exp_avg"]) for n, p in pipe.named_parameters()}
    pipe.close()
    return params, moments


@pytest.mark.parametrize(("kind", "name", "virtual"), [("ddp", "1f1b", 1), ("ddp", "zbv", 2),
                                                       ("fsdp", "1f1b", 1), ("fsdp", "zbv", 2)])
def test_a_dp_job_resumes_bitwise_and_reshards(tmp_path, kind, name, virtual):
    path = str(tmp_path / "step_2")
    results = run_ranks(_resume, DP * PP, args=(kind, name, virtual, path), timeout_s=180)
    saved = {}
    for extra, saved_here, want, got, want_params, got_params in results:
        assert extra == {"step": 2}
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (got, want)
        for parameter_name, value in want_params.items():
            assert torch.equal(got_params[parameter_name], value), parameter_name
        saved.update(saved_here)
    # One process: the unsplit model's state dict holds exactly what the replicas held.
    state = ckpt.to_state_dict(path)
    assert all(torch.equal(state[n], value) for n, value in saved.items())
    assert set(saved) <= set(state)
    # One replica of the same pipeline (dp=2 -> dp=1), 1F1B whatever the job ran; and back
    # (dp=1 -> dp=2, under ZB-V), optimizer state included.
    again = str(tmp_path / "one_replica")
    moments = {}
    for params, moments_here in run_ranks(_one_replica, PP, args=(path, again), timeout_s=120):
        for parameter_name, value in params.items():
            assert torch.equal(value, saved[parameter_name]), parameter_name
        assert all(m.abs().sum() > 0 for m in moments_here.values())  # Adam's moments came back too
        moments.update(moments_here)
    for params, moments_here in run_ranks(_two_replicas, DP * PP, args=(kind, again), timeout_s=120):
        for parameter_name, value in params.items():
            assert torch.equal(value, saved[parameter_name]), parameter_name
            assert torch.equal(moments_here[parameter_name], moments[parameter_name]), parameter_name
