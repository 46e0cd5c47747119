"""fp16 with dynamic loss scaling inside the pipeline: torch.equal to one device running torch's GradScaler.

CPU autocast computes matmuls in fp16 in torch 2.13 (checked here), so the pipeline under
``autocast="fp16"`` and the reference under ``torch.autocast("cpu", float16)`` run the same
operations in the same dtypes: losses, scales and parameters after every step are compared with
``torch.equal``. Step 3 of 6 overflows on the first stage only (conveyor.testing.references.loss_scaling):
GradScaler skips it and backs off; so must every rank of the pipeline: in one process under every
built-in schedule, on 2 ranks, and with dp=2 replicas (ddp, fsdp) against GradScaler over the replicas'
averaged gradients; with tp=2 against TP unscaled (the reason below).
"""

from __future__ import annotations

import pytest
import torch

import conveyor
import conveyor.schedule as cs
from conveyor.errors import NonFiniteError
from conveyor.layout import InProcessLayout
from conveyor.parallel.mesh import pipeline_mesh
from conveyor.pipe import Pipeline
from conveyor.testing import run_ranks
from conveyor.testing.compare import whole
from conveyor.testing.references.loss_scaling import (
    LR,
    ROWS,
    SCALING,
    Run,
    batches,
    grad_scaler_run,
    mlp_stages,
    mse_loss,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # the ranks' thread count: same reduction order

NUM_STEPS, OVERFLOW_STEP, NUM_MICROBATCHES = 6, 2, 2
FP16 = conveyor.StageOptions(autocast="fp16", loss_scaling=SCALING)


def train(pipe, minibatches, optimizer=None) -> Run:
    """The user's loop over ``pipe``: step, optimizer step, zero grads; what the reference records."""
    optimizer = optimizer or torch.optim.AdamW(pipe.parameters(), lr=LR)
    run = Run()
    for x, t in minibatches:
        before = pipe.skipped_steps
        run.losses.append(pipe.step(x if pipe.needs_inputs else None, target=t if pipe.needs_target else None))
        optimizer.step()
        optimizer.zero_grad()
        run.scales.append(pipe.loss_scale)
        run.skipped.append(pipe.skipped_steps > before)
        run.params.append({(s, n): whole(p).detach().clone() for s, runner in pipe.runners.items()  # replicas:
                           for n, p in runner.module.named_parameters()})  # DTensors, gathered on every rank
    return run


def assert_same_run(got: Run, want: Run, where: str) -> None:
    assert want.skipped[OVERFLOW_STEP] and sum(want.skipped) == 1, f"the forced overflow did not happen: {want}"
    assert got.scales == want.scales, f"{where}: scales {got.scales} vs GradScaler's {want.scales}"
    assert got.skipped == want.skipped, f"{where}: skipped {got.skipped} vs GradScaler's {want.skipped}"
    for step, (g, w) in enumerate(zip(got.losses, want.losses)):
        if step != OVERFLOW_STEP:
            assert torch.isfinite(w).all() and torch.equal(g, w), f"{where} step {step}: loss {g} vs {w}"
    for step, (g, w) in enumerate(zip(got.params, want.params)):
        assert g and all(torch.isfinite(p).all() for p in g.values()), f"{where} step {step}: a parameter is not finite"
        differ = sorted(key for key in g if not torch.equal(g[key], w[key]))  # this rank's stages
        assert not differ, f"{where} step {step}: parameters {differ} differ"


def test_cpu_autocast_computes_matmuls_in_fp16():
    # The premise of the parity below: the reference runs fp16 matmuls, the pipeline the same.
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.float16


def test_every_schedule_under_fp16_autocast_is_bitwise_gradscaler_with_the_overflow_skipped():
    minibatches = batches(NUM_STEPS, OVERFLOW_STEP)
    wants: dict[int, Run] = {}
    for name, info in sorted(cs.available().items()):
        schedule = cs.build(name, ranks=2, microbatches=NUM_MICROBATCHES, virtual=info.default_virtual)
        stages = schedule.num_stages
        if stages not in wants:
            wants[stages] = grad_scaler_run(mlp_stages(stages), minibatches, NUM_MICROBATCHES, SCALING,
                                            torch.device("cpu"))
        pipe = Pipeline(mlp_stages(stages), schedule, mse_loss, stage=FP16, layout=InProcessLayout())
        got = train(pipe, minibatches)
        assert pipe.skipped_steps == 1, name
        assert_same_run(got, wants[stages], name)


def test_fp16_weights_with_fp32_main_grad_are_bitwise_gradscaler_over_masters():
    minibatches = batches(NUM_STEPS, OVERFLOW_STEP, dtype=torch.float16)
    want = grad_scaler_run(mlp_stages(4), minibatches, NUM_MICROBATCHES, SCALING, torch.device("cpu"),
                           fp16_weights=True)
    pipe = Pipeline(mlp_stages(4), "zbv", mse_loss, microbatches=NUM_MICROBATCHES, virtual=2,
                    stage=conveyor.StageOptions(param_dtype="fp16", loss_scaling=SCALING), layout=InProcessLayout())
    optimizer = conveyor.MasterWeights(pipe, torch.optim.AdamW, lr=LR)
    got = train(pipe, minibatches, optimizer)
    assert all(p.dtype == torch.float16 and p.main_grad is None for p in pipe.parameters())
    assert_same_run(got, want, "fp16 weights")


def test_the_scale_resumes_from_a_checkpoint_bitwise(tmp_path):
    minibatches = batches(NUM_STEPS, OVERFLOW_STEP)

    def build():
        pipe = Pipeline(mlp_stages(2), "1f1b", mse_loss, microbatches=NUM_MICROBATCHES, stage=FP16,
                        layout=InProcessLayout())
        return pipe, torch.optim.AdamW(pipe.parameters(), lr=LR)

    pipe, optimizer = build()
    whole = train(pipe, minibatches, optimizer)
    pipe, optimizer = build()
    train(pipe, minibatches[:OVERFLOW_STEP + 2], optimizer)  # through the overflow and one step after it
    conveyor.checkpoint.save(tmp_path / "ckpt", pipe, optimizer)
    saved = pipe.gradient_checks.loss_scaling.state_dict()
    resumed, optimizer = build()
    conveyor.checkpoint.load(tmp_path / "ckpt", resumed, optimizer)
    assert resumed.gradient_checks.loss_scaling.state_dict() == saved
    assert saved["growth_tracker"] == 1 and saved["scale"] == 256.0  # one good step since the back-off
    rest = train(resumed, minibatches[OVERFLOW_STEP + 2:], optimizer)
    assert rest.scales == whole.scales[OVERFLOW_STEP + 2:]
    assert all(torch.equal(p, whole.params[-1][key]) for key, p in rest.params[-1].items())


def test_fp16_weights_with_replicas_are_refused_naming_fp16_autocast():
    from conveyor.errors import PipelineConfigError
    from conveyor.options import check_together

    with pytest.raises(PipelineConfigError, match=r"param_dtype='fp16'.*data_parallel='ddp'.*autocast='fp16' with "
                                                  r"fp32 parameters"):
        check_together(conveyor.StageOptions(param_dtype="fp16"), "ddp")


def test_a_loss_that_overflows_at_every_scale_stops_at_the_floor_naming_the_cause():
    scaling = conveyor.LossScaling(init_scale=4.0, min_scale=1.0)
    pipe = Pipeline(mlp_stages(2), "1f1b", mse_loss, microbatches=NUM_MICROBATCHES,
                    stage=conveyor.StageOptions(autocast="fp16", loss_scaling=scaling), layout=InProcessLayout())
    x, t = batches(1)[0]
    bad = t.clone()
    bad[0, 0] = float("inf")  # the loss, and every gradient, are not finite at any scale
    pipe.step(x, target=bad)
    pipe.step(x, target=bad)
    assert (pipe.skipped_steps, pipe.loss_scale) == (2, 1.0)
    with pytest.raises(NonFiniteError, match=r"loss scale fell to 0\.5, below its floor min_scale=1, after 3 steps "
                                             r"in a row.*overflows fp16 at every scale.*autocast='bf16'"):
        pipe.step(x, target=bad)
    assert pipe.skipped_steps == 3 and all(p.grad is None for p in pipe.parameters())
    loss = pipe.step(x, target=t)  # the pipeline stays usable; a finite step counts anew
    assert torch.isfinite(loss) and pipe.skipped_steps == 3 and pipe.gradient_checks.loss_scaling.consecutive_skips == 0


def test_a_nonfinite_loss_with_finite_gradients_is_left_to_on_nonfinite():
    pipe = Pipeline(mlp_stages(2), "1f1b", lambda y, t: mse_loss(y, t[:, :2]) + t[:, 2:].sum(),
                    microbatches=NUM_MICROBATCHES, stage=FP16, layout=InProcessLayout())
    x, t = batches(1)[0]
    t = torch.cat([t, torch.zeros(len(t), 1)], dim=1)
    t[-1, -1] = float("nan")  # in the loss by a term without gradient: parameters' gradients stay finite
    with pytest.raises(NonFiniteError, match=r"the loss of microbatch 1 .* are not finite"):
        pipe.step(x, target=t, on_nonfinite="raise")
    assert pipe.skipped_steps == 0 and pipe.loss_scale == SCALING.init_scale
    assert all(torch.isfinite(p.grad).all() for p in pipe.parameters())  # unscaled, and kept


def _two_ranks(rank, world_size):
    """pp=2: the first stage overflows alone; both ranks must skip that step with GradScaler."""
    torch.set_num_threads(1)
    minibatches = batches(NUM_STEPS, OVERFLOW_STEP)
    results = {}
    for name in ("1f1b", "zbv"):
        schedule = cs.build(name, ranks=2, microbatches=NUM_MICROBATCHES)
        everything = mlp_stages(schedule.num_stages)
        pipe = conveyor.Pipeline([everything[s] for s in schedule.stages_of(rank)], schedule, mse_loss, stage=FP16)
        got = train(pipe, minibatches)
        want = grad_scaler_run(mlp_stages(schedule.num_stages), minibatches, NUM_MICROBATCHES, SCALING,
                               torch.device("cpu"))
        assert_same_run(got, want, f"rank {rank} {name}")
        results[name] = (pipe.skipped_steps, got.scales)
        pipe.close()
    return results


@pytest.mark.distributed
def test_every_rank_skips_the_step_one_stage_overflowed():
    results = run_ranks(_two_ranks, 2, timeout_s=120)
    assert results[0] == results[1] and all(skipped == 1 for skipped, _ in results[0].values())


# Tensor parallelism: no one-device GradScaler run computes what TP does (its row-parallel sums round
# differently), so TP with loss scaling is held to TP without it, bitwise. Exact by construction: every
# backward op is linear in the incoming gradient, and multiplying by a power of two commutes with
# rounding while values stay normal, so gradients scaled by 2**k and unscaled are the unscaled ones.
# Step 0's loss carries a NaN term (0 x inf x the output): every rank's gradients are NaN, every rank must
# skip it (the unscaled run drops them by hand); the scale backs off to 2**9, then grows each good step.
TP_SCALING = conveyor.LossScaling(init_scale=2.0**10, growth_interval=1)


def _replicas_then_tensor_parallel(rank, world_size):
    """dp=2 x pp=2 against GradScaler over averaged replicas; then pp=2 x tp=2 against itself unscaled."""
    from torch.distributed.device_mesh import init_device_mesh

    from conveyor.layout import DistributedLayout
    from conveyor.testing.references.tensor_sequence import VOCAB, build_stages

    torch.set_num_threads(1)
    mesh = pipeline_mesh(2)
    dp_rank, pp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    minibatches = batches(NUM_STEPS, OVERFLOW_STEP)
    minibatches[OVERFLOW_STEP][0][:ROWS // 2, 0] = 0  # the overflow in replica 1's rows alone
    want = grad_scaler_run(mlp_stages(2), minibatches, NUM_MICROBATCHES, SCALING, torch.device("cpu"), num_replicas=2)
    for kind in ("ddp", "fsdp"):  # fsdp: sharded gradients, each replica unscales its shard
        pipe = conveyor.Pipeline([mlp_stages(2)[pp_rank]], "1f1b", mse_loss, microbatches=NUM_MICROBATCHES,
                                 layout=DistributedLayout(mesh=mesh, data_parallel=kind), stage=FP16)
        got = train(pipe, [(x.chunk(2)[dp_rank], t.chunk(2)[dp_rank]) for x, t in minibatches])
        pipe.close()
        assert_same_run(got, want, f"rank {rank} dp=2 {kind}")

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp_rank = mesh.get_local_rank("pp")
    tokens = torch.randint(0, VOCAB, (8, 13), generator=torch.Generator().manual_seed(1))
    runs = {}
    poison = [float("inf")]  # step 0's only

    def loss_fn(y, t):
        return torch.nn.functional.cross_entropy(y.flatten(0, 1), t.flatten()) + y.float().mean() * 0 * poison[0]

    for scaled in (True, False):
        stage = build_stages(2)[pp_rank]
        pipe = conveyor.Pipeline([stage], "1f1b", loss_fn, microbatches=2,
                                 layout=DistributedLayout(mesh=mesh, tensor_parallel="auto"),
                                 stage=conveyor.StageOptions(loss_scaling=TP_SCALING if scaled else None))
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
        losses = []
        for step in range(3):
            poison[0] = float("inf") if step == 0 else 1.0
            losses.append(pipe.step(tokens[:, :-1], target=tokens[:, 1:]))
            if step == 0 and not scaled:
                optimizer.zero_grad()  # the step the scaled run skips
            optimizer.step()
            optimizer.zero_grad()
        params = {n: whole(p).detach() for n, p in stage.named_parameters()}  # a collective over tp, in order
        runs[scaled] = (losses, params, pipe.skipped_steps, pipe.loss_scale)
        pipe.close()
    (losses, params, skipped, scale), (plain_losses, plain_params, _, _) = runs[True], runs[False]
    assert (skipped, scale) == (1, 2.0**11), f"rank {rank} tp=2: skipped {skipped}, scale {scale}"
    assert all(torch.isfinite(a) and torch.equal(a, b) for a, b in zip(losses[1:], plain_losses[1:])), rank
    assert all(torch.isfinite(p).all() and torch.equal(p, plain_params[n]) for n, p in params.items()), rank
    return got.scales, got.skipped, sum(p.numel() for p in params.values())


@pytest.mark.distributed
def test_replicas_and_tensor_parallel_ranks_skip_alike_and_stay_bitwise():
    results = run_ranks(_replicas_then_tensor_parallel, 4, timeout_s=180)
    assert all(r[:2] == results[0][:2] for r in results) and all(r[2] > 0 for r in results)
