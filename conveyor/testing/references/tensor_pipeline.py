"""Rank functions of the pipeline-with-tensor-parallelism tests (pp=2 x tp=2 on 4 gloo ranks).

The pipeline against two references, each computed by every rank itself from the same seed:
TP alone (the same traced stages, parallelized by the same plan, run one after the other on this
rank's TP group, no pipeline) and one device (the unchanged model). Both run the pipeline's
microbatch loop: for each microbatch in order, ``(loss / M).backward()``; then AdamW.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import conveyor
from conveyor.microbatch import split_microbatches
from conveyor.options import PipelineOptions, SplitOptions, TransferOptions
from conveyor.parallel.mesh import layout_of
from conveyor.testing.compare import adamw_difference_bound, relative_difference, worst_absolute, worst_relative
from conveyor.testing.models import token_batch
from conveyor.testing.references.tensor_parallel import build, whole

MICROBATCHES = 4
STEPS = 3
LR = 1e-2
# Parameters after STEPS AdamW steps against one device, per element (absolute): where a gradient is at
# rounding level, the rounding picks its sign, and AdamW's division by the running RMS turns it into a
# step of up to lr. So no bound below the optimizer's own reach holds on every CPU (the largest difference
# relative to its parameter's largest element, once bounded by a measured 2e-3, came out 2.3e-3 on an
# Intel CPU). adamw_difference_bound: 2 lr (1 + 1.0014 + 1.0036) = 0.0601. It catches a NaN, a wrong learning rate
# or a diverging run; the losses of every step, compared within TP_ROUNDING, carry the trajectory.
ADAMW_AFTER_STEPS = adamw_difference_bound(LR, STEPS)
# One decoder layer per stage (2 or 4 stages), to keep the 4-rank test short; a stage of several
# layers is tested in test_tensor_parallel_traced.


def _loss_fn(output, target):
    return output.loss


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def _train_pipeline(pipe, batch, steps: int = STEPS) -> list:
    """``steps`` AdamW steps of ``pipe`` on ``batch`` (the same batch each step): the losses."""
    optimizer = _optimizer(pipe.parameters())
    losses = []
    for _ in range(steps):
        losses.append(pipe.step(**batch))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def _microbatches(batch):
    return [kwargs for _, kwargs in split_microbatches((), batch, MICROBATCHES)]


def _train(step_loss, params, batch, context=contextlib.nullcontext):
    """STEPS steps of the pipeline's microbatch loop (forward and backward under ``context``): the losses."""
    optimizer = _optimizer(params)
    losses = []
    for _ in range(STEPS):
        total = None
        for kwargs in _microbatches(batch):
            with context():
                loss = step_loss(kwargs)  # forward and backward of (loss / M)
            total = loss if total is None else total + loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


def _one_device(batch, layers: int):
    return _one_device_of(build("llama", layers), batch)


def _one_device_of(model, batch):
    """``model`` trained on one device with gradient accumulation: its losses and final parameters."""

    def step_loss(kwargs):
        loss = model(**kwargs).loss / MICROBATCHES
        loss.backward()
        return loss.detach()

    losses = _train(step_loss, list(model.parameters()), batch)
    return losses, dict(model.named_parameters())


def _tp_alone(num_stages: int, tp_mesh, batch):
    """The traced stages of the cut the pipeline makes, parallelized alike, run in order on one TP group."""
    from torch.distributed.tensor.experimental import implicit_replication

    import conveyor.frontend as frontend
    from conveyor.layout import DistributedLayout
    from conveyor.parallel.tensor.stages import model_placements
    from conveyor.parallel.tensor.traced import parallelize_traced_stage

    model = build("llama", num_stages)
    example = _microbatches(batch)[0]
    split = frontend.split_model(model, num_stages, example_kwargs=example, split_method="uniform")
    placements = model_placements(model, DistributedLayout(tp=tp_mesh.size()), tp_mesh.size(), split.tied_groups)
    stages = [parallelize_traced_stage(split.stage_module(s), tp_mesh, placements) for s in range(num_stages)]
    params = [p for stage in stages for p in stage.parameters()]

    def step_loss(kwargs):
        return frontend.run_sequential(stages, (), kwargs, loss_fn=lambda out: out.loss / MICROBATCHES
                                       ).loss.detach() / MICROBATCHES

    losses = _train(step_loss, params, batch, implicit_replication)
    named = {n: p for stage in stages for n, p in stage.named_parameters()}
    return losses, named


def every_schedule(rank: int, world_size: int, names: tuple[str, ...] | None = None) -> dict:
    """pp=2 x tp=2, each built-in schedule: losses and parameters against TP alone (torch.equal) and one device."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    tp_mesh = layout_of(mesh).tp_mesh
    batch = token_batch(batch=2 * MICROBATCHES, length=12, seed=1)  # microbatches of 2 rows
    alone: dict[int, tuple] = {}
    device: dict[int, tuple] = {}
    results = {}
    for name in names or conveyor.schedule.available():
        layers = 2 * conveyor.schedule.available()[name].default_virtual
        model = build("llama", layers)
        pipe = conveyor.pipeline(model, example_kwargs=_microbatches(batch)[0], schedule=name,
                                 microbatches=MICROBATCHES, loss_fn=_loss_fn,
                                 options=PipelineOptions(split=SplitOptions(method="uniform")),
                                 layout=conveyor.DistributedLayout(mesh=mesh, tensor_parallel="auto"))
        stages = pipe.schedule.num_stages
        if stages not in alone:
            alone[stages] = _tp_alone(stages, tp_mesh, batch)
            device[stages] = _one_device(batch, layers)
        (want_losses, want_params), (device_losses, device_params) = alone[stages], device[stages]
        losses = _train_pipeline(pipe, batch)
        mine = dict(pipe.named_parameters())
        # full_tensor is a collective over the TP group: every one in the same order, none skipped.
        full = {n: whole(p).detach() for n, p in mine.items()}
        want = {n: whole(want_params[n]).detach() for n in mine}
        results[name] = {
            "stages": stages,
            "sharded": sum(isinstance(p, DTensor) and any(not pl.is_replicate() for pl in p.placements)
                           for p in mine.values()),
            "losses_equal_tp": all(torch.equal(a, b) for a, b in zip(losses, want_losses)),
            "params_equal_tp": all(torch.equal(full[n], want[n]) for n in full),
            "loss_rel": worst_relative((a, b) for a, b in zip(losses, device_losses, strict=True)),
            "param_abs": worst_absolute((full[n], device_params[n].detach()) for n in full),
        }
        pipe.close()
    return results


class _Stage(torch.nn.Module):
    """A hand-built stage: a norm and a plain MLP of ``inner`` hidden units on hidden states."""

    def __init__(self, inner: int = 64, adapter: bool = False) -> None:
        super().__init__()
        # adapter: a projection no attention or MLP pattern explains, which "auto" cannot place
        self.pre = torch.nn.Sequential(torch.nn.Linear(32, 32)) if adapter else torch.nn.Identity()
        self.norm = torch.nn.LayerNorm(32)
        self.fc = torch.nn.Linear(32, inner)
        self.proj = torch.nn.Linear(inner, 32)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.pre(hidden)
        return hidden + self.proj(torch.nn.functional.gelu(self.fc(self.norm(hidden))))


def _square_loss(output, target):
    return (output - target).square().mean()


def _hand_built_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"fc": ColwiseParallel(), "proj": RowwiseParallel()}


def hand_built_refusals(rank: int, world_size: int) -> dict:
    """Bad tensor-parallel input to Pipeline on 4 ranks: each case's message on this rank (None: it was built)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel

    from conveyor.errors import PipelineConfigError
    from conveyor.layout import DistributedLayout

    torch.set_num_threads(1)
    pp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp_rank = layout_of(pp_tp).pp_rank

    def attempt(make_mesh, plan, inner_of_stage_1=64, sequence_parallel=False, adapter_on_stage_1=False, tp=1):
        torch.manual_seed(0)
        stage = _Stage(64 if pp_rank == 0 else inner_of_stage_1, adapter=adapter_on_stage_1 and pp_rank == 1)
        try:
            layout = DistributedLayout(mesh=make_mesh(), tensor_parallel=plan, sequence_parallel=sequence_parallel,
                                       tp=tp)
            pipe = conveyor.Pipeline([stage], "gpipe", _square_loss, microbatches=2, layout=layout)
        except PipelineConfigError as error:
            return str(error)
        pipe.close()
        return None

    return {
        "tp mesh, another tp size": attempt(lambda: pp_tp, "auto", tp=4),
        "tp mesh, no tensor_parallel: auto": attempt(lambda: pp_tp, None),
        "tensor_parallel, no tp dim": attempt(
            lambda: init_device_mesh("cpu", (4,), mesh_dim_names=("pp",)), "auto"),
        "pattern matching nothing": attempt(lambda: pp_tp, {**_hand_built_plan(), "mlp.up": ColwiseParallel()}),
        "size tp does not divide (stage 1)": attempt(lambda: pp_tp, _hand_built_plan(), inner_of_stage_1=33),
        "a plan that is not ParallelStyles": attempt(lambda: pp_tp, {"fc": "colwise"}),
        "sequence_parallel with hand-built stages": attempt(lambda: pp_tp, "auto", sequence_parallel=True),
        "auto cannot place a module (stage 1)": attempt(lambda: pp_tp, "auto", adapter_on_stage_1=True),
        "intermediate tp does not divide, auto (stage 1)": attempt(lambda: pp_tp, "auto", inner_of_stage_1=33),
        "unknown dim name": attempt(
            lambda: init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "ep", "tp")), "auto"),
        "mesh covering 2 of 4 ranks": attempt(
            lambda: DeviceMesh("cpu", torch.arange(2).reshape(1, 2), mesh_dim_names=("pp", "tp")), "auto"),
        "good plan": attempt(lambda: pp_tp, _hand_built_plan()),
        "sequence length tp does not divide (first step)": _odd_sequence(pp_tp, pp_rank),
    }


def _odd_sequence(mesh, pp_rank: int) -> str | None:
    """A step of sequence-parallel hand-built stages on sequences of 5 over tp=2: the message it fails with."""
    from conveyor.layout import DistributedLayout

    torch.manual_seed(0)
    pipe = conveyor.Pipeline([_Stage()], "gpipe", _square_loss, microbatches=2,
                             layout=DistributedLayout(mesh=mesh, tensor_parallel="auto", sequence_parallel=True))
    try:
        pipe.step(torch.randn(4, 5, 32), target=torch.randn(4, 5, 32) if pp_rank == 1 else None)
    except Exception as error:  # the stage-0 ranks' message; the others are told which peer failed
        return f"{type(error).__name__}: {error}"
    finally:
        pipe.close()
    return None


def hand_built_parity(rank: int, world_size: int) -> dict:
    """Two hand-built stages on pp=2 x tp=2 against one device: the user's plan (gpipe, zb-h1), "auto"
    with sequence parallelism (1f1b)."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp_rank = layout_of(mesh).pp_rank
    torch.manual_seed(0)
    whole_model = torch.nn.Sequential(_Stage(), _Stage())
    generator = torch.Generator().manual_seed(1)
    hidden, target = torch.randn(8, 6, 32, generator=generator), torch.randn(8, 6, 32, generator=generator)
    want_loss = sum(_square_loss(whole_model(h), t) / MICROBATCHES
                    for h, t in zip(hidden.chunk(MICROBATCHES), target.chunk(MICROBATCHES)))
    want_loss.backward()
    results = {}
    # The user's plan; and "auto" with sequence parallelism, whose stages are one MLP each (the
    # block is the stage itself: its fc gathers the sequence) fed whole hidden states on stage 0.
    for name, plan, sequence_parallel in (("gpipe", _hand_built_plan(), False), ("zb-h1", _hand_built_plan(), False),
                                          ("1f1b", "auto", True)):
        from conveyor.layout import DistributedLayout

        stage = copy.deepcopy(whole_model[pp_rank])
        stage.zero_grad(set_to_none=True)
        # With sequence parallelism the whole example output is given: each TP rank seeds its shard's shape.
        shapes = {0: torch.zeros(2, 6, 32, requires_grad=True)} if sequence_parallel else None
        pipe = conveyor.Pipeline([stage], name, _square_loss, microbatches=MICROBATCHES,
                                 layout=DistributedLayout(mesh=mesh, tensor_parallel=plan,
                                                          sequence_parallel=sequence_parallel),
                                 transfer=TransferOptions(shapes=shapes, fixed_shapes=sequence_parallel))
        loss = pipe.step(hidden, target=target)
        grads = {n: whole(p.grad) for n, p in pipe.named_parameters()}
        results[name] = {
            "loss": relative_difference(loss, want_loss.detach()),
            "grads": worst_relative((g, whole_model[pp_rank].get_parameter(n).grad) for n, g in grads.items()),
            "sharded": sorted(n for n, p in pipe.named_parameters()
                              if isinstance(p, DTensor) and not p.placements[0].is_replicate()),
        }
        pipe.close()
    return results


def clipping_and_ties(rank: int, world_size: int, name: str) -> dict:
    """One 1F1B step of traced ``name`` on pp=2 x tp=2, then clip_grad_norm_: the total norm and the
    clipped gradients against one device; for GPT-2 (wte on stage 0, its tied lm_head on stage 1),
    the tied copies after an AdamW step."""
    from conveyor.layout import DistributedLayout

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    batch = token_batch(batch=2 * MICROBATCHES, length=12, seed=1)
    reference = build(name, 2)
    for kwargs in _microbatches(batch):
        (reference(**kwargs).loss / MICROBATCHES).backward()
    want_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    layout = DistributedLayout(mesh=mesh, tensor_parallel="auto")
    pipe = conveyor.pipeline(build(name, 2), example_kwargs=_microbatches(batch)[0], schedule="1f1b",
                             microbatches=MICROBATCHES, loss_fn=_loss_fn,
                             layout=layout, options=PipelineOptions(split=SplitOptions(method="uniform")))
    loss = pipe.step(**batch)
    want_loss = sum(reference(**kwargs).loss.detach() / MICROBATCHES for kwargs in _microbatches(batch))
    # After a step every gradient has its parameter's placements (DTensor's backward leaves Partial ones).
    settled = all(p.grad.placements == p.placements for p in pipe.parameters() if isinstance(p.grad, DTensor))
    norm = pipe.clip_grad_norm_(0.05)
    grads = {n: whole(p.grad) for n, p in pipe.named_parameters()}
    result = {
        "loss": relative_difference(loss, want_loss),
        "norm": relative_difference(norm, want_norm),
        "grads": worst_relative((g, _reference_grad(reference, n)) for n, g in grads.items()),
        "tied": [list(t.names) for t in pipe.tied_parameters],
        "settled": settled,
    }
    optimizer = _optimizer(pipe.parameters())
    optimizer.step()
    if name == "gpt2":  # stage 0 holds wte, stage 1 lm_head: equal after the step (a gather over pp)
        mine = {n: whole(p).detach() for n, p in pipe.named_parameters() if n in ("transformer.wte.weight",
                                                                                    "lm_head.weight")}
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, mine)
        copies = [value for theirs in everyone for value in theirs.values()]
        result["tied_equal"] = len(copies) == 4 and all(torch.equal(copies[0], c) for c in copies[1:])
    pipe.close()
    return result


def _reference_grad(model: torch.nn.Module, name: str) -> torch.Tensor:
    param = dict(model.named_parameters(remove_duplicate=False))[name]
    return param.grad


def traced_refusals(rank: int, world_size: int) -> dict:
    """Bad tensor-parallel input to conveyor.pipeline (traced stages) on pp=2 x tp=2: each case's message
    on this rank (None: it was built). Each is refused from the unchanged model, before any step. (Each case
    traces the model: the other sizes, heads and intermediate, go through the same check, tested in
    test_tensor_parallel_errors without ranks.)"""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from conveyor.errors import PipelineConfigError
    from conveyor.testing.models import grouped_heads_lm

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    batch = token_batch(batch=2, length=8, seed=1)

    def attempt(plan="auto", **config):
        model_class, model_config = grouped_heads_lm("llama", 2, **config)
        torch.manual_seed(0)
        try:
            pipe = conveyor.pipeline(model_class(model_config), example_kwargs=batch, schedule="gpipe", microbatches=2,
                                     loss_fn=_loss_fn,
                                     options=PipelineOptions(split=SplitOptions(method="uniform")),
                                     layout=conveyor.DistributedLayout(mesh=mesh, tensor_parallel=plan))
        except PipelineConfigError as error:
            return str(error)
        pipe.close()
        return None

    return {
        "vocabulary 97": attempt(vocab_size=97),
        "key/value heads 1": attempt(num_key_value_heads=1),
        "pattern matching nothing": attempt({"model.layers.*.mlp.up": ColwiseParallel()}),
    }


def meta_model_shards(rank: int, world_size: int) -> dict:
    """conveyor.pipeline on a Llama built on the meta device, pp=2 x tp=2: what each rank materialized whole,
    the storage its sharded parameters hold, and one 1F1B step."""
    import conveyor.parallel.tensor.shards as shards
    from conveyor.testing.models import grouped_heads_lm

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    whole_names: list[str] = []
    owners_per_call: list[int] = []
    defer = shards.defer_materialization

    def recording(stage, source):  # what the shard path materializes whole, and how much at once
        def materialize(names):
            whole_names.extend(names)
            owners_per_call.append(len({name.rpartition(".")[0] for name in names}))
            return source.materialize(names)

        return defer(stage, dataclasses.replace(source, materialize=materialize))

    shards.defer_materialization = recording
    model_class, config = grouped_heads_lm("llama", 2)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = model_class(config)
    batch = token_batch(batch=2 * MICROBATCHES, length=12, seed=1)
    try:
        pipe = conveyor.pipeline(model, example_kwargs=_microbatches(batch)[0], schedule="1f1b",
                                 microbatches=MICROBATCHES, loss_fn=_loss_fn,
                                 options=PipelineOptions(split=SplitOptions(method="uniform")),
                                 layout=conveyor.DistributedLayout(mesh=mesh, tensor_parallel="auto"))
    finally:
        shards.defer_materialization = defer
    params = dict(pipe.named_parameters())
    sharded = {n: p for n, p in params.items() if isinstance(p, DTensor) and not p.placements[0].is_replicate()}
    local = {n: p.to_local() for n, p in sharded.items()}
    tp_group = layout_of(mesh).tp_mesh.get_group()
    mine = {n: p.to_local() for n, p in params.items()}
    theirs: list = [None] * 2
    dist.all_gather_object(theirs, mine, group=tp_group)
    result = {
        "sharded": sorted(sharded),
        "whole": sorted(set(whole_names)),
        "owners_per_call": max(owners_per_call),
        # each sharded parameter's storage is its local shard: nothing larger was kept behind it
        "storage_is_local": all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in local.values()),
        "local_is_half": all(t.numel() * 2 == sharded[n].numel() for n, t in local.items()),
        "finite": all(bool(torch.isfinite(t).all()) for t in mine.values()),
        "replicated_equal": all(torch.equal(theirs[0][n], theirs[1][n]) for n in mine if n not in sharded),
        "shards_differ": all(not torch.equal(theirs[0][n], theirs[1][n]) for n in sharded),
        "loss": float(pipe.step(**batch)),
    }
    pipe.close()
    return result
