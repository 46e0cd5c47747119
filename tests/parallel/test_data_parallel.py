"""Pipeline x data parallelism on a ("dp", "pp") DeviceMesh, against one process on the whole batch.

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
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import conveyor
import conveyor.schedule as cs
from conveyor.errors import PipelineConfigError
from conveyor.testing import RankFailure, run_ranks
from conveyor.testing.models import lm_loss, reference_step

NUM_MICROBATCHES = 2
BATCH_SIZE = 8  # the global minibatch: BATCH_SIZE / dp rows per replica
NUM_STEPS = 3
TOLERANCE = 1e-6


VOCAB, DIM, SEQ = 32, 16, 8


class MLPStage(torch.nn.Module):
    """Stage ``stage`` of ``num_stages``: embedding first, a residual MLP, the head last."""

    def __init__(self, stage: int, num_stages: int) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(100 + stage)
            self.embed = torch.nn.Embedding(VOCAB, DIM) if stage == 0 else None
            self.norm = torch.nn.LayerNorm(DIM)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 2 * DIM), torch.nn.GELU(), torch.nn.Linear(2 * DIM, DIM))
            self.head = torch.nn.Linear(DIM, VOCAB) if stage == num_stages - 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        x = x + self.mlp(self.norm(x))
        return self.head(x) if self.head is not None else x


class Whole(torch.nn.Module):
    def __init__(self, num_stages: int) -> None:
        super().__init__()
        self.stages = torch.nn.ModuleList(MLPStage(s, num_stages) for s in range(num_stages))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        return x


def make_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH_SIZE, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _mesh(dp: int, pp: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().clone()


def _train(rank, world_size, name, virtual, kind, dp, clip):
    mesh = _mesh(dp, world_size // dp)
    schedule = cs.build(name, ranks=world_size // dp, microbatches=NUM_MICROBATCHES, virtual=virtual)
    dp_rank, pp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    mine = schedule.stages_of(pp_rank)
    modules = [MLPStage(s, schedule.num_stages) for s in mine]
    pipe = conveyor.Pipeline(modules, schedule=schedule, loss_fn=lm_loss, mesh=mesh, data_parallel=kind,
                             timeout_s=60)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses, norms = [], []
    first, last = schedule.placement.rank_of(0), schedule.placement.rank_of(schedule.num_stages - 1)
    for step in range(NUM_STEPS):
        ids, targets = make_batch(seed=step)
        ids, targets = ids.chunk(dp)[dp_rank], targets.chunk(dp)[dp_rank]  # this replica's shard
        losses.append(pipe.step(ids if pp_rank == first else None, target=targets if pp_rank == last else None))
        if clip:
            norms.append(pipe.clip_grad_norm_(0.5))
        optimizer.step()
        optimizer.zero_grad()
    params = {s: {n: _full(p) for n, p in module.named_parameters()} for s, module in zip(mine, modules)}
    timeline = pipe.timeline()
    pipe.close()
    return losses, norms, params, timeline.metadata.get("data_parallel")


@contextlib.contextmanager
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _reference(num_stages: int, dp: int, clip: bool, order: str = "per_replica"):
    model = Whole(num_stages)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for step in range(NUM_STEPS):
        ids, targets = make_batch(seed=step)
        if order == "accumulated":
            losses.append(reference_step(model, ids, targets, NUM_MICROBATCHES * dp, lm_loss))
        else:
            replica_losses, replica_grads = [], []
            for x, y in zip(ids.chunk(dp), targets.chunk(dp)):
                replica_losses.append(reference_step(model, x, y, NUM_MICROBATCHES, lm_loss))
                replica_grads.append([p.grad for p in model.parameters()])
                optimizer.zero_grad()
            for param, grads in zip(model.parameters(), zip(*replica_grads)):
                param.grad = _average(list(grads))
            losses.append(_average(replica_losses))
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
        optimizer.step()
        optimizer.zero_grad()
    params = {s: {n: p.detach().clone() for n, p in stage.named_parameters()} for s, stage in enumerate(model.stages)}
    return losses, norms, params


def _average(values: list[torch.Tensor]) -> torch.Tensor:
    total = values[0]
    for value in values[1:]:
        total = total + value
    return total / len(values)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def max_relative_difference(name: str, virtual: int, kind: str, dp: int = 2, pp: int = 2, clip: bool = False,
                            orders: tuple[str, ...] = ("per_replica", "accumulated")) -> dict[str, float]:
    """Run the pipeline replicas once; the worst relative difference to each reference (0.0: bitwise)."""
    results = run_ranks(_train, dp * pp, args=(name, virtual, kind, dp, clip), timeout_s=180)
    # Every replica and every rank of a replica agree on the loss, bit for bit.
    assert all(torch.equal(r[0][-1], results[0][0][-1]) for r in results)
    worst = {}
    for order in orders:
        with _one_thread():
            worst[order] = _worst(results, *_reference(pp * virtual, dp, clip, order))
    return worst


def _worst(results, want_losses, want_norms, want_params) -> float:
    worst = 0.0
    for losses, norms, params, _ in results:
        for got, want in zip(losses, want_losses, strict=True):
            worst = max(worst, _relative(got, want))
        for got, want in zip(norms, want_norms, strict=True):
            worst = max(worst, _relative(got, want))
        for stage, named in params.items():
            for parameter_name, value in named.items():
                worst = max(worst, _relative(value, want_params[stage][parameter_name]))
    return worst


PARITY_CASES = [("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2)]


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize(("name", "virtual"), PARITY_CASES)
def test_pp2_x_dp2_matches_one_process_on_the_whole_batch(name, virtual, kind):
    worst = max_relative_difference(name, virtual, kind)
    assert worst["per_replica"] == 0.0, f"{name} V={virtual} {kind}: not bitwise ({worst['per_replica']:.3g})"
    assert worst["accumulated"] <= TOLERANCE, f"{name} V={virtual} {kind}: {worst['accumulated']:.3g}"


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
    mesh = _mesh(1, 2)
    schedule = cs.build("1f1b", ranks=2, microbatches=NUM_MICROBATCHES)
    pipe = conveyor.Pipeline([MLPStage(rank, 2)], schedule=schedule, loss_fn=lm_loss, mesh=mesh)
    ids, targets = make_batch(seed=0)
    loss = pipe.step(ids if rank == 0 else None, target=targets if rank == 1 else None)
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    pipe.close()
    return loss, grads, pipe.replicas is None


@pytest.mark.distributed
def test_one_replica_on_a_mesh_stays_bitwise_one_device():
    results = run_ranks(_one_replica, 2, timeout_s=60)
    model = Whole(2)
    ids, targets = make_batch(seed=0)
    with _one_thread():  # the ranks' count: LayerNorm's backward sums in an order that depends on it
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
        mesh = _mesh(2, 2)
    else:
        mesh = _mesh(2, 2)
    pp_rank = rank % 2
    microbatches = NUM_MICROBATCHES * (2 if case == "replicas differ" and rank >= 2 else 1)
    schedule = cs.build("1f1b", ranks=2, microbatches=microbatches)
    group = mesh["dp"].get_group() if case == "group and mesh" else None
    conveyor.Pipeline([MLPStage(pp_rank, 2)], schedule=schedule, loss_fn=lm_loss, mesh=mesh,
                      group=group, timeout_s=30)


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
