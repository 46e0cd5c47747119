"""Pipelines x tensor parallelism x data parallelism on one ("pp", "dp", "tp") mesh: the parity harness.

The pipeline against the same model under TP x DP without a pipeline, on the same ranks: the
traced stages of the cut the pipeline makes, parallelized over the mesh's "tp" sub-mesh by the
same placements, each wrapped with torch's own ``fully_shard`` (``"fsdp"``) or ``replicate``
(``"ddp"``) over the "dp" sub-mesh (torch's 2-D composition), then run one after the other on
this replica's rows: for each microbatch in order ``(loss / M).backward()``, the replicas'
reduction only after the last one (``set_requires_gradient_sync``), as the pipeline reduces once
per step. The loss is the replicas' mean. Both sides clip with torch's formula by a norm no
gradient reaches (so the scale is exactly 1): the pipeline's total norm is compared with the
norm of the gathered gradients.

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
from conveyor.microbatch import split_microbatches
from conveyor.options import PipelineOptions, SplitOptions, TransferOptions
from conveyor.parallel.mesh import layout_of
from conveyor.testing.models import gpt2, grouped_heads_lm, token_batch

MICROBATCHES = 4
STEPS = 3
ROWS_PER_REPLICA = 2 * MICROBATCHES  # microbatches of 2 rows
NO_CLIPPING = 1e9  # a max_norm above every total norm here: the clip scale is exactly 1


def build(name: str, num_layers: int) -> torch.nn.Module:
    """A tiny Hugging Face causal LM: ``"gpt2"`` (tied embedding and head) or a grouped-heads family (``"llama"``)."""
    model_class, config = gpt2(num_layers=num_layers) if name == "gpt2" else grouped_heads_lm(name, num_layers)
    torch.manual_seed(0)
    return model_class(config).train()


def _loss_fn(output, target):
    return output.loss


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _microbatches(batch: dict) -> list[dict]:
    return [kwargs for _, kwargs in split_microbatches((), batch, MICROBATCHES)]


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


class _NoPipelineMesh:
    """What Layout's check reads of a mesh (its dim names): the reference has no pipeline mesh."""

    mesh_dim_names = ("pp", "tp")


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
    """The total 2-norm of the gradients as torch computes it on DTensors (torchtitan's way, no pipeline)."""
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return total.full_tensor() if isinstance(total, DTensor) else total


def tp_dp_alone(name: str, num_stages: int, mesh, kind: str) -> tuple[list, list, dict]:
    """The traced stages of the pipeline's cut under TP x DP, no pipeline: losses, norms, parameters."""
    from torch.distributed.tensor.experimental import implicit_replication

    import conveyor.frontend as frontend
    from conveyor.options import Layout
    from conveyor.parallel.tensor.stages import model_placements
    from conveyor.parallel.tensor.traced import parallelize_traced_stage

    layout = layout_of(mesh)
    model = build(name, _layers(name, num_stages))
    example = _microbatches(_batches(0, layout.dp_size, layout.dp_rank))[0]
    split = frontend.split_model(model, num_stages, example_kwargs=example, split_method="uniform")
    placements = model_placements(model, Layout(tensor_parallel="auto", mesh=_NoPipelineMesh()), layout.tp_size,
                                  split.tied_groups)
    stages = [_wrapped_over_dp(parallelize_traced_stage(split.stage_module(s), layout.tp_mesh, placements),
                               mesh["dp"], kind) for s in range(num_stages)]
    params = [p for stage in stages for p in stage.parameters()]
    optimizer = _optimizer(params)
    losses, norms = [], []
    for step in range(STEPS):
        total = None
        for number, kwargs in enumerate(_microbatches(_batches(step, layout.dp_size, layout.dp_rank))):
            for stage in stages:  # reduce over the replicas once, after the last microbatch
                stage.set_requires_gradient_sync(number == MICROBATCHES - 1)
            with implicit_replication():
                output = frontend.run_sequential(stages, (), kwargs, loss_fn=lambda out: out.loss / MICROBATCHES)
            loss = output.loss.detach() / MICROBATCHES
            total = loss if total is None else total + loss
        dist.all_reduce(total, group=mesh["dp"].get_group())
        losses.append(total / layout.dp_size)
        norms.append(torch_total_norm(params))
        torch.nn.utils.clip_grads_with_norm_(params, NO_CLIPPING, torch.tensor(1.0))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, norms, {n: p for stage in stages for n, p in stage.named_parameters()}


def _layers(name: str, num_stages: int) -> int:
    return max(2, num_stages)  # one decoder layer per stage, two in a one-stage pipeline


def pipeline_run(name: str, schedule: str, mesh, kind: str) -> tuple[list, list, dict, conveyor.Pipeline]:
    """The pipeline on ``mesh`` under TP x DP: losses, total norms, parameters, and the pipeline (open)."""
    layout = layout_of(mesh)
    num_stages = layout.pp_size * conveyor.schedule.available()[schedule].default_virtual
    first = _batches(0, layout.dp_size, layout.dp_rank)
    pipe = conveyor.pipeline(build(name, _layers(name, num_stages)), example_kwargs=_microbatches(first)[0],
                             schedule=schedule, microbatches=MICROBATCHES, loss_fn=_loss_fn, mesh=mesh,
                             tensor_parallel="auto", data_parallel=kind,
                             options=PipelineOptions(split=SplitOptions(method="uniform"),
                                                     transfer=TransferOptions(timeout_s=120)))
    optimizer = _optimizer(pipe.parameters())
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(pipe.step(**_batches(step, layout.dp_size, layout.dp_rank)))
        norms.append(pipe.clip_grad_norm_(NO_CLIPPING))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    params = dict(pipe.named_parameters())
    return losses, norms, params, pipe


def compare(name: str, schedule: str, mesh, kind: str) -> dict:
    """One case: the pipeline against TP x DP alone (torch.equal), norms to rounding."""
    losses, norms, params, pipe = pipeline_run(name, schedule, mesh, kind)
    want_losses, want_norms, want_params = tp_dp_alone(name, pipe.schedule.num_stages, mesh, kind)
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
        "norm_rel": max(relative(a, b) for a, b in zip(norms, want_norms, strict=True)),
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
                                     microbatches=MICROBATCHES, loss_fn=_loss_fn, mesh=make_mesh(),
                                     tensor_parallel="auto", data_parallel=kind,
                                     options=PipelineOptions(split=SplitOptions(method="uniform")))
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
