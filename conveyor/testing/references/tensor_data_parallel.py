"""Pipelines x tensor parallelism x data parallelism on one ("pp", "dp", "tp") mesh: the parity harness.

The pipeline against the same model under TP x DP without a pipeline, on the same ranks: the
traced stages of the cut the pipeline makes, parallelized over the mesh's "tp" sub-mesh by the
same placements, each wrapped with torch's own ``fully_shard`` (``"fsdp"``) or ``replicate``
(``"ddp"``) over the "dp" sub-mesh (torch's 2-D composition), then run one after the other on
this replica's rows: for each microbatch in order ``(loss / M).backward()``, the replicas'
reduction only after the last one (``set_requires_gradient_sync``), as the pipeline reduces once
per step. The loss is the replicas' mean. The pipeline clips by a norm no gradient reaches (its
scale is exactly 1, so the reference need not clip): its total norm is compared with torch's own
norm of the reference's DTensor gradients. Hand-built stages (:class:`MLPBlock` under the user's
plan) are compared the same way against ``parallelize_module`` then ``fully_shard`` / ``replicate``.

Used by tests/parallel/test_tensor_data_parallel.py (pp=1 x dp=2 x tp=2, 4 ranks) and by
``python -m benchmarks --tp-parity`` (pp=2 x dp=2 x tp=2, 8 ranks).

Example (8 processes; every case on one launch of ranks)::

    results = run_ranks(cases_on_one_launch, 8, args=((2, 2, 2), [("llama", "zbv", "fsdp")]))
    results[0][("llama", "zbv", "fsdp")]["params_equal"]      # True: bitwise
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

import conveyor
from conveyor.errors import PipelineConfigError
from conveyor.options import PipelineOptions, SplitOptions, TransferOptions
from conveyor.parallel.mesh import layout_of
from conveyor.testing.compare import whole, worst_relative
from conveyor.testing.models import token_batch
from conveyor.testing.references.tensor_parallel import build
from conveyor.testing.references.tensor_pipeline import MICROBATCHES, _loss_fn, _microbatches, _optimizer, _square_loss

STEPS = 3
ROWS_PER_REPLICA = 2 * MICROBATCHES  # microbatches of 2 rows
HIDDEN = 32  # the hand-built stages' width
NO_CLIPPING = 1e9  # a max_norm above every total norm here: the clip scale is exactly 1


def _batches(step: int, dp_size: int, dp_rank: int) -> dict:
    """This replica's rows of step ``step``'s global minibatch."""
    batch = token_batch(batch=ROWS_PER_REPLICA * dp_size, length=12, seed=1 + step)
    return {key: value.chunk(dp_size)[dp_rank] for key, value in batch.items()}


def _wrapped_over_dp(stage: torch.nn.Module, dp_mesh, kind: str) -> torch.nn.Module:
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard

    return fully_shard(stage, mesh=dp_mesh) if kind == "fsdp" else replicate(stage, mesh=dp_mesh)


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (dp, tp) DTensor: gathered over "dp", then over "tp" (collectives).

    In one call, torch 2.13's ``full_tensor()`` gets a (_StridedShard, _StridedShard) tensor wrong
    (FSDP2 over GPT-2's fused c_attn, already strided over "tp"): it duplicates some rows and drops
    others. Gathering one dim at a time is right.
    """
    if isinstance(tensor, DTensor) and tensor.device_mesh.ndim == 2:
        tensor = tensor.redistribute(placements=[Replicate(), tensor.placements[-1]])
    return whole(tensor)


def torch_total_norm(params) -> torch.Tensor:
    """The total 2-norm of the gradients as torch computes it on DTensors (torchtitan's way, no pipeline):
    per mesh (torch stacks DTensors of one mesh only: a parameter TP left whole is over "dp" alone),
    then over those totals."""
    by_mesh: dict = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(id(getattr(p.grad, "device_mesh", None)), []).append(p.grad)
    totals = [torch.nn.utils.get_total_norm(grads) for grads in by_mesh.values()]
    return torch.linalg.vector_norm(torch.stack([whole(total) for total in totals]))


def tp_dp_alone(name: str, num_stages: int, mesh, kind: str, pipeline_stages: int = 1) -> tuple[list, list, dict]:
    """The model cut in ``num_stages`` traced stages (the pipeline's cut), under TP x DP, no pipeline:
    losses, norms, parameters. ``pipeline_stages``: the model's layers as for that many stages."""
    from torch.distributed.tensor.experimental import implicit_replication

    import conveyor.frontend as frontend
    from conveyor.layout import DistributedLayout
    from conveyor.parallel.tensor.stages import model_placements
    from conveyor.parallel.tensor.traced import parallelize_traced_stage

    layout = layout_of(mesh)
    model = build(name, _layers(name, max(num_stages, pipeline_stages)))
    example = _microbatches(_batches(0, layout.dp_size, layout.dp_rank))[0]
    split = frontend.split_model(model, num_stages, example_kwargs=example, split_method="uniform")
    placements = model_placements(model, DistributedLayout(tp=layout.tp_size), layout.tp_size, split.tied_groups)
    stages = [_wrapped_over_dp(parallelize_traced_stage(split.stage_module(s), layout.tp_mesh, placements),
                               mesh["dp"], kind) for s in range(num_stages)]

    def microbatch_loss(kwargs):
        with implicit_replication():
            output = frontend.run_sequential(stages, (), kwargs, loss_fn=lambda out: out.loss / MICROBATCHES)
        return output.loss.detach() / MICROBATCHES

    losses, norms = _train_alone(stages, mesh, lambda step: _microbatches(_batches(step, layout.dp_size,
                                                                                  layout.dp_rank)), microbatch_loss)
    # A tied parameter under each of its names: the pipeline's stages hold it under either.
    return losses, norms, {n: p for stage in stages for n, p in stage.named_parameters(remove_duplicate=False)}


def _layers(name: str, num_stages: int) -> int:
    return max(2, num_stages)  # one decoder layer per stage, two in a one-stage pipeline


def pipeline_run(name: str, schedule: str, mesh, kind: str) -> tuple[list, list, dict, conveyor.Pipeline]:
    """The pipeline on ``mesh`` under TP x DP: losses, total norms, parameters, and the pipeline (open)."""
    layout = layout_of(mesh)
    num_stages = layout.pp_size * conveyor.schedule.available()[schedule].default_virtual
    first = _batches(0, layout.dp_size, layout.dp_rank)
    pipe = conveyor.pipeline(build(name, _layers(name, num_stages)), example_kwargs=_microbatches(first)[0],
                             schedule=schedule, microbatches=MICROBATCHES, loss_fn=_loss_fn,
                             options=PipelineOptions(split=SplitOptions(method="uniform"),
                                                     transfer=TransferOptions(timeout_s=120)),
                             layout=conveyor.DistributedLayout(mesh=mesh, data_parallel=kind, tensor_parallel="auto"))
    optimizer = _optimizer(pipe.parameters())
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(pipe.step(**_batches(step, layout.dp_size, layout.dp_rank)))
        norms.append(pipe.clip_grad_norm_(NO_CLIPPING))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    params = dict(pipe.named_parameters())
    return losses, norms, params, pipe


class MLPBlock(torch.nn.Module):
    """A hand-built stage: a norm and a plain MLP on hidden states, with a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.fc = torch.nn.Linear(HIDDEN, 2 * HIDDEN)
        self.proj = torch.nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.proj(torch.nn.functional.gelu(self.fc(self.norm(hidden))))


def _block_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"fc": ColwiseParallel(), "proj": RowwiseParallel()}


def _blocks(num_stages: int) -> list[MLPBlock]:
    torch.manual_seed(0)
    return [MLPBlock() for _ in range(num_stages)]


def _hidden_batch(step: int, dp_size: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This replica's rows of step ``step``'s hidden states and targets."""
    generator = torch.Generator().manual_seed(100 + step)
    rows = ROWS_PER_REPLICA * dp_size
    hidden, target = (torch.randn(rows, 6, HIDDEN, generator=generator) for _ in range(2))
    return hidden.chunk(dp_size)[dp_rank], target.chunk(dp_size)[dp_rank]


def _by_stage(modules) -> dict:
    return {f"{stage}.{name}": p for stage, module in modules for name, p in module.named_parameters()}


def hand_built_run(schedule: str, mesh, kind: str) -> tuple[list, list, dict, conveyor.Pipeline]:
    """:func:`pipeline_run` for hand-built stages (:class:`MLPBlock`) under the user's plan; parameters by
    "stage.name"."""
    import conveyor.schedule as cs

    layout = layout_of(mesh)
    plan = cs.build(schedule, ranks=layout.pp_size, microbatches=MICROBATCHES)
    blocks = _blocks(plan.num_stages)
    pipe = conveyor.Pipeline([blocks[s] for s in plan.stages_of(layout.pp_rank)], plan, _square_loss,
                             transfer=TransferOptions(timeout_s=120),
                             layout=conveyor.DistributedLayout(mesh=mesh, data_parallel=kind,
                                                               tensor_parallel=_block_plan()))
    optimizer = _optimizer(pipe.parameters())
    losses, norms = [], []
    for step in range(STEPS):
        hidden, target = _hidden_batch(step, layout.dp_size, layout.dp_rank)
        losses.append(pipe.step(hidden, target=target))
        norms.append(pipe.clip_grad_norm_(NO_CLIPPING))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, norms, _by_stage((s, r.module) for s, r in sorted(pipe.runners.items())), pipe


def hand_built_alone(num_stages: int, mesh, kind: str) -> tuple[list, list, dict]:
    """:func:`tp_dp_alone` for the hand-built stages: parallelize_module, then fully_shard / replicate."""
    from conveyor.parallel.tensor import parallelize_stage

    layout = layout_of(mesh)
    stages = [_wrapped_over_dp(parallelize_stage(block, layout.tp_mesh, _block_plan()), mesh["dp"], kind)
              for block in _blocks(num_stages)]

    def microbatch_loss(inputs):
        output = inputs[0]
        for stage in stages:
            output = stage(output)
        loss = _square_loss(output, inputs[1])
        (loss / MICROBATCHES).backward()
        return loss.detach() / MICROBATCHES

    def batches(step):
        return zip(*(t.chunk(MICROBATCHES) for t in _hidden_batch(step, layout.dp_size, layout.dp_rank)))

    losses, norms = _train_alone(stages, mesh, batches, microbatch_loss)
    return losses, norms, _by_stage(enumerate(stages))


def _train_alone(stages, mesh, batches, microbatch_loss) -> tuple[list, list]:
    """STEPS steps of the microbatch loop over ``stages`` wrapped over "dp": the replicas' mean losses and
    torch's total norms. The replicas reduce once per step, after the last microbatch, as the pipeline does."""
    params = [p for stage in stages for p in stage.parameters()]
    optimizer = _optimizer(params)
    losses, norms = [], []
    for step in range(STEPS):
        total = None
        for number, inputs in enumerate(batches(step)):
            for stage in stages:
                stage.set_requires_gradient_sync(number == MICROBATCHES - 1)
            loss = microbatch_loss(inputs)
            total = loss if total is None else total + loss
        dist.all_reduce(total, group=mesh["dp"].get_group())
        losses.append(total / mesh["dp"].size())
        norms.append(torch_total_norm(params))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, norms


def compare(name: str, schedule: str, mesh, kind: str) -> dict:
    """One case: the pipeline against TP x DP alone (torch.equal), norms to rounding. ``name``: a
    model for :func:`build` (traced stages, tensor_parallel="auto"), or "hand-built"."""
    if name == "hand-built":
        losses, norms, params, pipe = hand_built_run(schedule, mesh, kind)
        want_losses, want_norms, want_params = hand_built_alone(pipe.schedule.num_stages, mesh, kind)
    else:
        losses, norms, params, pipe = pipeline_run(name, schedule, mesh, kind)
        # Copies of a tied parameter on several stages: the reference keeps it one Parameter in one
        # stage (FSDP2 cannot share one between two roots), so the summation order differs.
        reference_stages = 1 if pipe.tied_parameters else pipe.schedule.num_stages
        want_losses, want_norms, want_params = tp_dp_alone(name, reference_stages, mesh, kind,
                                                           pipeline_stages=pipe.schedule.num_stages)
    # Gathers are collectives over the (dp, tp) mesh: every rank, the same order, none skipped.
    full = {n: gathered(p).detach() for n, p in params.items()}
    want = {n: gathered(want_params[n]).detach() for n in params}
    result = {
        "stages": pipe.schedule.num_stages,
        "wrapped": sum(isinstance(p, DTensor) and p.device_mesh.ndim == 2 for p in params.values()),
        "tp_sharded": sum(isinstance(p, DTensor) and p.device_mesh.ndim == 2 and not p.placements[-1].is_replicate()
                          for p in params.values()),
        "whole_tied": _tied_within_stages(pipe),
        "losses_equal": all(torch.equal(a, b) for a, b in zip(losses, want_losses, strict=True)),
        "params_equal": all(torch.equal(full[n], want[n]) for n in full),
        "shards_equal": all(_local(p).equal(_local(want_params[n])) and _placed(p) == _placed(want_params[n])
                            for n, p in params.items()),
        "norm_rel": worst_relative((a, b) for a, b in zip(norms, want_norms, strict=True)),
        "loss_rel": worst_relative((a, b) for a, b in zip(losses, want_losses, strict=True)),
        "param_rel": worst_relative((full[n], want[n]) for n in full),
        "tied": [list(t.names) for t in pipe.tied_parameters],
    }
    if pipe.tied_parameters:
        result["tied_equal"] = _tied_copies_equal(pipe, params)
    pipe.close()
    return result


def _tied_within_stages(pipe) -> bool:
    """Whether every stage holding both GPT-2's embedding and head holds them as one Parameter."""
    for runner in pipe.runners.values():
        named = dict(runner.module.named_parameters(remove_duplicate=False))
        pair = [named.get("transformer.wte.weight"), named.get("lm_head.weight")]
        if None not in pair and pair[0] is not pair[1]:
            return False
    return True


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _placed(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.placements) if isinstance(tensor, DTensor) else ()


def _tied_copies_equal(pipe, params: dict) -> bool:
    """Whether every rank's copy of each tied parameter is equal to the first (a gather over the job)."""
    names = [n for tied in pipe.tied_parameters for n in tied.names]
    mine = {n: gathered(params[n]).detach() for n in names if n in params}  # collectives, in one order
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [mine[n] for n in sorted(mine)])
    copies = [value for theirs in everyone for value in theirs]
    return len(copies) > 1 and all(torch.equal(copies[0], c) for c in copies[1:])


def cases_on_one_launch(rank: int, world_size: int, shape: tuple[int, int, int], cases: list) -> dict:
    """Every (model, schedule, kind) of ``cases`` on one ("pp", "dp", "tp") mesh of ``shape``, in turn."""
    import warnings

    torch.set_num_threads(1)
    # The gathers for the comparison (not the pipeline) redistribute 2-D shards in two steps, on purpose.
    warnings.filterwarnings("ignore", message="While redistributing from")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp", "tp"))
    return {case: compare(*case[:2], mesh, case[2]) for case in cases}


def cases_and_refusals(rank: int, world_size: int, shape: tuple[int, int, int], cases: list) -> tuple[dict, dict]:
    """:func:`cases_on_one_launch`, then :func:`refusals` on the same launch of ranks (4 ranks)."""
    return cases_on_one_launch(rank, world_size, shape, cases), refusals(rank, world_size)


def refusals(rank: int, world_size: int) -> dict:
    """Bad TP x DP input on 4 ranks, each built on every rank: its message here (None: it was built)."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    batch = _batches(0, 2, layout_of(mesh).dp_rank)

    def attempt(make_mesh, name="llama", schedule="1f1b", kind="fsdp"):
        try:
            pipe = conveyor.pipeline(build(name, 2), example_kwargs=_microbatches(batch)[0], schedule=schedule,
                                     microbatches=MICROBATCHES, loss_fn=_loss_fn,
                                     options=PipelineOptions(split=SplitOptions(method="uniform")),
                                     layout=conveyor.DistributedLayout(mesh=make_mesh(), data_parallel=kind,
                                                                       tensor_parallel="auto"))
        except PipelineConfigError as error:
            return str(error)
        pipe.close()
        return None

    from torch.distributed.device_mesh import DeviceMesh

    return {
        "sizes do not multiply to the world": attempt(
            lambda: DeviceMesh("cpu", torch.arange(2).reshape(1, 1, 2), mesh_dim_names=("pp", "dp", "tp"))),
        "tp not innermost": attempt(
            lambda: init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "tp", "dp"))),
        "no pp dim": attempt(lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))),
        "unknown data_parallel": attempt(lambda: mesh, kind="zero3"),
        "tied uses on one rank (zbv), fsdp": attempt(lambda: mesh, name="gpt2", schedule="zbv"),
        "tied uses on one rank (zbv), ddp": attempt(lambda: mesh, name="gpt2", schedule="zbv", kind="ddp"),
        "good": attempt(lambda: mesh),
    }
