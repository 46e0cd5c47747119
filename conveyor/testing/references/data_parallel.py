"""Pipeline x data parallelism against one process: the parity harness tests and benchmarks share.

Each replica trains on its own rows of every global minibatch of a stack of MLP stages
(:class:`MLPStage`: every parameter has a gradient well above rounding). Two single-process
references train the unsplit model (:class:`MLPStack`) on the whole minibatch:

- ``per_replica``: each replica's microbatches accumulated on their own (loss / M), then the
  replicas' gradients and losses averaged (summed in replica order, divided by dp): the order
  in which the replicas' reduction adds. Halving is exact in floating point, so with
  ``data_parallel="ddp"`` and ``"fsdp"`` alike a pipeline equals it bit for bit;
- ``accumulated``: replica 0's microbatches, then replica 1's, each loss divided by M x dp,
  all in one ``.grad``: equal to rounding only.

(An attention block's key bias has a gradient that is exactly zero in exact arithmetic; AdamW
divides its rounding noise by its own tiny running magnitude and moves the bias by about the
learning rate either way, which no other summation order reproduces: hence MLP stages.)

Example:
    >>> worst = max_relative_difference("zbv", 2, "fsdp")   # doctest: +SKIP
    >>> worst["per_replica"], worst["accumulated"] < 1e-6     # doctest: +SKIP
    (0.0, True)
"""

from __future__ import annotations

import torch

import conveyor
import conveyor.schedule as cs
from conveyor.parallel.mesh import pipeline_mesh
from conveyor.runtime.stage.device import torch_threads
from conveyor.testing.compare import worst_relative
from conveyor.testing.models import lm_loss, reference_step
from conveyor.testing.multiprocess import run_ranks

NUM_MICROBATCHES = 2
BATCH_SIZE = 8  # the global minibatch: BATCH_SIZE / dp rows per replica
NUM_STEPS = 3
# ``accumulated`` against the pipeline: the same microbatch gradients (the same kernels on the same rows),
# added in another order (dp x M = 4 terms per element: at most 2 (4 - 1) u = 3.6e-7 of their magnitudes,
# deterministic), then 3 AdamW steps, which move an element by about lr times its gradient's relative error
# per step, large where its microbatch terms cancel. That last factor is the data's, not derived: measured
# 6.9e-7 (this machine's AVX-512 kernels and ATen's default), 6.2e-7 (SSE4.2 MKL), 3.1e-7 (AVX2), so 1e-6
# is a measured bound with a 1.45x margin. The FSDP clipping norm (shard norms combined) is held to it too.
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
            self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 2 * DIM), torch.nn.GELU(),
                                           torch.nn.Linear(2 * DIM, DIM))
            self.head = torch.nn.Linear(DIM, VOCAB) if stage == num_stages - 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        x = x + self.mlp(self.norm(x))
        return self.head(x) if self.head is not None else x


class MLPStack(torch.nn.Module):
    """Every MLPStage in one module: the one-process reference."""

    def __init__(self, num_stages: int) -> None:
        super().__init__()
        self.stages = torch.nn.ModuleList(MLPStage(s, num_stages) for s in range(num_stages))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        return x


def make_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global minibatch of step ``seed``: token ids and next-token targets."""
    tokens = torch.randint(0, VOCAB, (BATCH_SIZE, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of the whole tensor: gathered from the replicas when it is a sharded DTensor."""
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().clone()


def train_replicas(rank, world_size, name, virtual, kind, dp, clip):
    """A rank of a dp x (world / dp) job: NUM_STEPS AdamW steps on its replica's rows of each minibatch.

    Returns the losses, the clipped norms (``clip``), the full parameters per stage and the
    last step's data-parallel timing (see :meth:`conveyor.Pipeline.timeline`).
    """
    mesh = pipeline_mesh(world_size // dp)
    schedule = cs.build(name, ranks=world_size // dp, microbatches=NUM_MICROBATCHES, virtual=virtual)
    dp_rank, pp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    mine = schedule.stages_of(pp_rank)
    modules = [MLPStage(s, schedule.num_stages) for s in mine]
    pipe = conveyor.Pipeline(modules, schedule=schedule, loss_fn=lm_loss,
                             transfer=conveyor.TransferOptions(timeout_s=60),
                             layout=conveyor.DistributedLayout(mesh=mesh, data_parallel=kind))
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
    params = {s: {n: full_tensor(p) for n, p in module.named_parameters()} for s, module in zip(mine, modules)}
    timeline = pipe.timeline()
    pipe.close()
    return losses, norms, params, timeline.metadata.get("data_parallel")


def one_thread():
    """Run the reference with the ranks' one thread: some CPU kernels sum in a thread-dependent order."""
    return torch_threads(1)


def reference(num_stages: int, dp: int, clip: bool, order: str = "per_replica"):
    """One process on the whole minibatch (``order``: see the module docstring): losses, norms, parameters."""
    model = MLPStack(num_stages)
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
                param.grad = average(list(grads))
            losses.append(average(replica_losses))
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
        optimizer.step()
        optimizer.zero_grad()
    params = {s: {n: p.detach().clone() for n, p in stage.named_parameters()} for s, stage in enumerate(model.stages)}
    return losses, norms, params


def average(values: list[torch.Tensor]) -> torch.Tensor:
    total = values[0]
    for value in values[1:]:
        total = total + value
    return total / len(values)


def max_relative_difference(name: str, virtual: int, kind: str, dp: int = 2, pp: int = 2, clip: bool = False,
                            orders: tuple[str, ...] = ("per_replica", "accumulated")) -> dict[str, float]:
    """Run the pipeline replicas once; the worst relative difference to each reference (0.0: bitwise)."""
    return max_relative_differences([(name, virtual)], kind, dp, pp, clip, orders)[(name, virtual)]


def _train_replicas_each(rank, world_size, cases, kind, dp, clip):
    results = []
    for name, virtual in cases:
        try:
            results.append(train_replicas(rank, world_size, name, virtual, kind, dp, clip))
        except Exception as exc:
            exc.add_note(f"while rank {rank} trained {name} (virtual={virtual}, {kind})")
            raise
    return results


def max_relative_differences(cases: list[tuple[str, int]], kind: str, dp: int = 2, pp: int = 2, clip: bool = False,
                             orders: tuple[str, ...] = ("per_replica", "accumulated"),
                             ) -> dict[tuple[str, int], dict[str, float]]:
    """:func:`max_relative_difference` for each ``(schedule, virtual)`` case, all trained in one rank group.

    The cases run one after the other in the same ranks (each with its own pipeline), which
    spares a rank group's start per case; the result is keyed by case.

    Example:
        >>> worst = max_relative_differences([("1f1b", 1), ("zbv", 2)], "ddp")  # doctest: +SKIP
        >>> worst[("zbv", 2)]["per_replica"]  # doctest: +SKIP
        0.0
    """
    by_rank = run_ranks(_train_replicas_each, dp * pp, args=(list(cases), kind, dp, clip),
                        timeout_s=120 + 60 * len(cases))
    worst: dict[tuple[str, int], dict[str, float]] = {}
    for index, (name, virtual) in enumerate(cases):
        results = [per_case[index] for per_case in by_rank]
        # Every replica and every rank of a replica agree on the loss, bit for bit.
        assert all(torch.equal(r[0][-1], results[0][0][-1]) for r in results), f"{name} V={virtual} {kind}"
        worst[(name, virtual)] = {}
        for order in orders:
            with one_thread():
                worst[(name, virtual)][order] = _worst(results, *reference(pp * virtual, dp, clip, order))
    return worst


def _worst(results, want_losses, want_norms, want_params) -> float:
    """The largest relative difference of every rank's losses, norms and parameters; NaN if any is NaN."""
    pairs = []
    for losses, norms, params, _ in results:
        pairs += zip(losses, want_losses, strict=True)
        pairs += zip(norms, want_norms, strict=True)
        pairs += [(value, want_params[stage][name]) for stage, named in params.items() for name, value in named.items()]
    return worst_relative(pairs)
