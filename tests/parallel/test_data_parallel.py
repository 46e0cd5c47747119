"""Pipeline x data parallelism on a ("pp", "dp") DeviceMesh, against one process on the whole batch.

Each replica trains on its own rows of every global minibatch. Two single-process references
train the unsplit model on the whole minibatch:

- ``per_replica``: each replica's microbatches accumulated on their own (loss / M), then the
  replicas' gradients and losses averaged (summed in replica order, divided by dp): the order
  in which the replicas' reduction adds. Halving is exact in floating point, so with
  ``data_parallel="ddp"`` and ``"fsdp"`` alike the pipeline must equal it bit for bit;
- ``accumulated``: replica 0's microbatches, then replica 1's, each loss divided by M x dp,
  all in one ``.grad``: equal to the pipeline to rounding only (1e-6 relative).

The model is a stack of MLP stages: every parameter has a gradient well above rounding. (An
attention block's key bias has a gradient that is exactly zero in exact arithmetic; AdamW
divides its rounding noise by its own tiny running magnitude and moves the bias by about
the learning rate either way, which no other summation order reproduces.)

Schedules compared under the same data-parallel kind train one after the other in one rank group
(``max_relative_differences``); each assertion names its schedule.
"""

from __future__ import annotations

import pytest
import torch

import conveyor
import conveyor.schedule as cs
from conveyor.errors import PipelineConfigError
from conveyor.parallel.mesh import pipeline_mesh
from conveyor.testing import RankFailure, run_ranks
from conveyor.testing.models import lm_loss, reference_step
from conveyor.testing.references.data_parallel import (
    BATCH_SIZE,
    NUM_MICROBATCHES,
    SEQ,
    TOLERANCE,
    VOCAB,
    MLPStack,
    MLPStage,
    full_tensor,
    make_batch,
    max_relative_difference,
    max_relative_differences,
    one_thread,
)

PARITY_CASES = [("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2)]


@pytest.mark.distributed
@pytest.mark.timeout(600)  # the rank group's own timeout grows with its cases
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_pp2_x_dp2_matches_one_process_on_the_whole_batch(kind):
    for (name, virtual), worst in max_relative_differences(PARITY_CASES, kind).items():
        assert worst["per_replica"] == 0.0, f"{name} V={virtual} {kind}: not bitwise ({worst['per_replica']:.3g})"
        assert worst["accumulated"] <= TOLERANCE, f"{name} V={virtual} {kind}: {worst['accumulated']:.3g}"


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_every_other_built_in_schedule_runs_data_parallel_bitwise():
    cases = [("gpipe", 1), ("looped-bfs", 2), ("zb-h1", 1), ("zb-h2", 1), ("dualpipev", 2)]
    for (name, virtual), worst in max_relative_differences(cases, "ddp", orders=("per_replica",)).items():
        assert worst["per_replica"] == 0.0, f"{name} V={virtual}: not bitwise ({worst['per_replica']:.3g})"


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_clip_grad_norm_spans_every_stage_and_replica(kind):
    # ddp: every replica holds whole gradients, so the norm is the one process's, bit for bit;
    # fsdp: each gradient's norm comes from its shards' norms, equal to rounding.
    worst = max_relative_difference("zbv", 2, kind, clip=True, orders=("per_replica",))
    if kind == "ddp":
        assert worst["per_replica"] == 0.0, worst
    else:
        assert worst["per_replica"] <= TOLERANCE, worst


def _one_replica(rank, world_size):
    mesh = pipeline_mesh(2)
    schedule = cs.build("1f1b", ranks=2, microbatches=NUM_MICROBATCHES)
    pipe = conveyor.Pipeline([MLPStage(rank, 2)], schedule=schedule, loss_fn=lm_loss,
                             layout=conveyor.DistributedLayout(mesh=mesh))
    ids, targets = make_batch(seed=0)
    loss = pipe.step(ids if rank == 0 else None, target=targets if rank == 1 else None)
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    pipe.close()
    return loss, grads, pipe.replicas is None


@pytest.mark.distributed
def test_one_replica_on_a_mesh_stays_bitwise_one_device():
    results = run_ranks(_one_replica, 2, timeout_s=60)
    model = MLPStack(2)
    ids, targets = make_batch(seed=0)
    with one_thread():  # the ranks' count: LayerNorm's backward sums in an order that depends on it
        want = reference_step(model, ids, targets, NUM_MICROBATCHES, lm_loss)
    for rank, (loss, grads, plain) in enumerate(results):
        assert plain  # dp=1: nothing wrapped, nothing reduced
        assert torch.equal(loss, want)
        for name, grad in grads.items():
            assert torch.equal(grad, model.stages[rank].get_parameter(name).grad), name


def _misbuilt(rank, world_size, case):
    from torch.distributed.device_mesh import init_device_mesh

    if case == "no pp dim":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    elif case == "group and mesh":
        mesh = pipeline_mesh(2)
    else:
        mesh = pipeline_mesh(2)
    pp_rank = mesh.get_local_rank("pp") if case != "no pp dim" else rank % 2
    replica = mesh.get_local_rank("dp")
    microbatches = NUM_MICROBATCHES * (2 if case == "replicas differ" and replica == 1 else 1)
    schedule = cs.build("1f1b", ranks=2, microbatches=microbatches)
    group = mesh["dp"].get_group() if case == "group and mesh" else None
    conveyor.Pipeline([MLPStage(pp_rank, 2)], schedule=schedule, loss_fn=lm_loss,
                      transfer=conveyor.TransferOptions(timeout_s=30),
                      layout=conveyor.DistributedLayout(group=group, mesh=mesh))


@pytest.mark.distributed
@pytest.mark.parametrize(("case", "message"), [
    ("no pp dim", "no 'pp' dim"),
    ("group and mesh", "mesh= or group=, not both"),
    ("replicas differ", "the replicas of this pipeline were not built alike"),
])
def test_a_mesh_that_cannot_work_is_refused_on_every_rank(case, message):
    with pytest.raises(RankFailure) as raised:
        run_ranks(_misbuilt, 4, args=(case,), timeout_s=60)
    assert message in str(raised.value)
    assert "PipelineConfigError" in str(raised.value) or PipelineConfigError.__name__ in str(raised.value)


def _loaders(rank, world_size):
    from torch.utils.data import TensorDataset

    from conveyor.parallel.data import data_loader

    mesh = pipeline_mesh(3)
    schedule = cs.build("1f1b", ranks=3, microbatches=NUM_MICROBATCHES)
    pipe = conveyor.Pipeline([MLPStage(mesh.get_local_rank("pp"), 3)], schedule=schedule, loss_fn=lm_loss,
                             transfer=conveyor.TransferOptions(timeout_s=60),
                             layout=conveyor.DistributedLayout(mesh=mesh))
    opened = []

    def dataset():
        opened.append(rank)
        rows = torch.arange(VOCAB).repeat_interleave(SEQ).reshape(VOCAB, SEQ)  # row r is all r
        return TensorDataset(rows, rows.roll(1, dims=1))

    loader = data_loader(pipe, dataset, batch_size=BATCH_SIZE // 2, seed=7)
    batches = [ids[:, 0].tolist() for ids, _ in loader] if loader is not None else None
    batch_iterator = iter(loader) if loader is not None else None
    for _ in range(2):
        ids, targets = next(batch_iterator) if batch_iterator is not None else (None, None)
        pipe.step(ids if pipe.needs_inputs else None, target=targets if pipe.needs_target else None)
    pipe.close()
    return pipe.dp_rank, pipe.needs_inputs, pipe.needs_target, opened, batches


@pytest.mark.distributed
def test_only_the_first_and_last_ranks_open_the_data_and_each_replica_reads_its_own_share():
    results = run_ranks(_loaders, 6, timeout_s=120)
    by_replica: dict[int, list] = {}
    for dp_rank, needs_inputs, needs_target, opened, batches in results:
        if needs_inputs or needs_target:
            assert opened and batches
            by_replica.setdefault(dp_rank, []).append(batches)
        else:
            assert opened == [] and batches is None  # a middle rank never builds the dataset
    first_rows = {}
    for dp_rank, (at_first, at_last) in by_replica.items():
        assert at_first == at_last  # inputs and targets of one replica come in the same order
        first_rows[dp_rank] = {row for batch in at_first for row in batch}
    assert not first_rows[0] & first_rows[1]  # the replicas read disjoint shares
    assert len(first_rows[0] | first_rows[1]) == VOCAB


def _tied(rank, world_size, kind):
    from conveyor.parallel.mesh import pipeline_mesh
    from conveyor.testing.rigs.checkpoint_models import SPLITS, ce_loss, lm_batch, tied_lm

    mesh = pipeline_mesh(2)
    ids, _ = lm_batch(0)
    pipe = conveyor.pipeline(tied_lm(0), example_args=(ids[:2],), split_points=SPLITS[2], schedule="1f1b",
                             microbatches=2, loss_fn=ce_loss,
                             options=conveyor.PipelineOptions(transfer=conveyor.TransferOptions(timeout_s=60)),
                             layout=conveyor.DistributedLayout(mesh=mesh, data_parallel=kind))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    copies = []
    for step in range(3):
        ids, targets = lm_batch(step, batch=8)
        pipe.step(ids.chunk(2)[pipe.dp_rank], target=targets.chunk(2)[pipe.dp_rank])
        optimizer.step()
        optimizer.zero_grad()
        named = dict(pipe.named_parameters())
        copies.append(full_tensor(named.get("embed.weight", named.get("head.weight"))))
    pipe.close()
    return copies


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_tied_copies_stay_equal_across_stages_and_replicas(kind):
    # fsdp: both copies have one shape, so they are sharded alike and summed shard by shard.
    results = run_ranks(_tied, 4, args=(kind,), timeout_s=120)
    for step in range(3):
        first = results[0][step]
        assert all(torch.equal(copies[step], first) for copies in results), f"step {step}"


@pytest.mark.distributed
def test_a_world_that_pp_does_not_divide_is_refused():
    with pytest.raises(RankFailure) as raised:
        run_ranks(_not_a_multiple, 3, timeout_s=60)
    assert "not a multiple of the pipeline size pp=2" in str(raised.value)


def _not_a_multiple(rank, world_size):
    pipeline_mesh(2)
