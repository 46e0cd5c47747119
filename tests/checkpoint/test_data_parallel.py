"""Checkpoints of a pp=2 x dp=2 job: bitwise resume, and resharding to one replica and to one process.

Replicas write one checkpoint together (DCP writes a replicated tensor once, each shard of a
sharded one by its holder); it loads into any layout, as the pipeline-only ones do. One test per
data-parallel kind runs both schedules (1F1B, and ZB-V with V=2) inside the same rank groups, one
after the other (three rank groups a kind instead of three per schedule); each assertion names
the schedule it checks.
"""

from __future__ import annotations

import pytest
import torch

import conveyor
import conveyor.checkpoint as ckpt
from conveyor.testing import run_ranks
from conveyor.testing.rigs.checkpoint_models import MICROBATCHES, SPLITS, ce_loss, lm_batch, tied_lm

pytestmark = pytest.mark.distributed

DP, PP = 2, 2


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().clone()


def _build(kind: str | None, name: str, virtual: int, seed: int, dp: int):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (PP, dp), mesh_dim_names=("pp", "dp")) if dp > 1 else None
    model = tied_lm(seed, tie=False)  # fsdp shards each stage on its own: no parameter shared by two
    ids, _ = lm_batch(0)
    pipe = conveyor.pipeline(model, example_args=(ids[:2],), split_points=SPLITS[PP * virtual], schedule=name,
                             microbatches=MICROBATCHES, loss_fn=ce_loss,
                             options=conveyor.PipelineOptions(virtual=virtual,
                                                              transfer=conveyor.TransferOptions(timeout_s=60)),
                             layout=conveyor.DistributedLayout(mesh=mesh, data_parallel=kind))
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


SCHEDULES = (("1f1b", 1), ("zbv", 2))


def _resume_each(rank, world_size, kind, paths):
    return [_resume(rank, world_size, kind, name, virtual, path) for (name, virtual), path in zip(SCHEDULES, paths)]


def _one_replica_each(rank, world_size, paths, agains):
    return [_one_replica(rank, world_size, path, again) for path, again in zip(paths, agains)]


def _two_replicas_each(rank, world_size, kind, agains):
    return [_two_replicas(rank, world_size, kind, again) for again in agains]


# ddp is the extended tier here: the README example resumes a ddp job bitwise in CI (tests/e2e/test_examples.py).
@pytest.mark.parametrize("kind", [pytest.param("ddp", marks=pytest.mark.extended), "fsdp"])
def test_a_dp_job_resumes_bitwise_and_reshards(tmp_path, kind):
    """CI twin of ``[ddp]``: ``[fsdp]`` (the same assertions)."""
    paths = [str(tmp_path / f"{name}_step_2") for name, _ in SCHEDULES]
    by_rank = run_ranks(_resume_each, DP * PP, args=(kind, paths), timeout_s=240)
    saved = {name: {} for name, _ in SCHEDULES}
    for results in by_rank:
        for (name, _), (extra, saved_here, want, got, want_params, got_params) in zip(SCHEDULES, results):
            assert extra == {"step": 2}, name
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (name, got, want)
            for parameter_name, value in want_params.items():
                assert torch.equal(got_params[parameter_name], value), (name, parameter_name)
            saved[name].update(saved_here)
    for (name, _), path in zip(SCHEDULES, paths):
        # One process: the unsplit model's state dict holds exactly what the replicas held.
        state = ckpt.to_state_dict(path)
        assert all(torch.equal(state[n], value) for n, value in saved[name].items()), name
        assert set(saved[name]) <= set(state), name
    # One replica of the same pipeline (dp=2 -> dp=1), 1F1B whatever the job ran; and back
    # (dp=1 -> dp=2, under ZB-V), optimizer state included.
    agains = [str(tmp_path / f"{name}_one_replica") for name, _ in SCHEDULES]
    moments = {name: {} for name, _ in SCHEDULES}
    for results in run_ranks(_one_replica_each, PP, args=(paths, agains), timeout_s=120):
        for (name, _), (params, moments_here) in zip(SCHEDULES, results):
            for parameter_name, value in params.items():
                assert torch.equal(value, saved[name][parameter_name]), (name, parameter_name)
            assert all(m.abs().sum() > 0 for m in moments_here.values()), name  # Adam's moments came back too
            moments[name].update(moments_here)
    for results in run_ranks(_two_replicas_each, DP * PP, args=(kind, agains), timeout_s=120):
        for (name, _), (params, moments_here) in zip(SCHEDULES, results):
            for parameter_name, value in params.items():
                assert torch.equal(value, saved[name][parameter_name]), (name, parameter_name)
                assert torch.equal(moments_here[parameter_name], moments[name][parameter_name]), (name, parameter_name)
