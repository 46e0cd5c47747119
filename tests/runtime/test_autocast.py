"""``autocast="bf16"``: every stage under the autocast region of a single-device run, bitwise equal to it."""

from __future__ import annotations

import pytest
import torch

import conveyor
import conveyor.schedule as cs
from conveyor.errors import PipelineConfigError
from conveyor.layout import InProcessLayout
from conveyor.pipe import Pipeline
from conveyor.testing import run_ranks
from conveyor.testing.models import build_stage, lm_loss, make_batch, reference_model
from conveyor.testing.references.schedule_parity import BATCH_SIZE, NUM_MICROBATCHES, NUM_STEPS, assert_same, config_for

BF16 = torch.bfloat16


def reference_autocast_run(schedule):
    """One device, gradient accumulation, each microbatch's forward and loss under autocast bf16."""
    cfg = config_for(schedule)
    model = reference_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    m = schedule.num_microbatches
    for step in range(NUM_STEPS):
        ids, targets = make_batch(cfg, BATCH_SIZE, seed=step)
        total = None
        for x, y in zip(torch.tensor_split(ids, m), torch.tensor_split(targets, m)):
            with torch.autocast("cpu", dtype=BF16):
                loss = lm_loss(model(x), y) / m
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        losses.append(total)
        optimizer.step()
        optimizer.zero_grad()
    return losses, [{n: p.detach().clone() for n, p in stage.named_parameters()} for stage in model.stages]


def local_autocast_run(schedule, recompute=False):
    cfg = config_for(schedule)
    stages = [build_stage(s, cfg) for s in range(schedule.num_stages)]
    pipe = Pipeline(stages, schedule, lm_loss, stage=conveyor.StageOptions(autocast="bf16", recompute=recompute),
                    layout=InProcessLayout())
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses = []
    for step in range(NUM_STEPS):
        ids, targets = make_batch(cfg, BATCH_SIZE, seed=step)
        losses.append(pipe.step(ids, target=targets))
        optimizer.step()
        optimizer.zero_grad()
    return losses, [{n: p.detach().clone() for n, p in st.named_parameters()} for st in stages]


def assert_runs_equal(got, want):
    (got_losses, got_params), (want_losses, want_params) = got, want
    for step, (g, w) in enumerate(zip(got_losses, want_losses)):
        assert torch.equal(g, w), f"loss of step {step}: {g.item()} vs {w.item()}"
    for stage, (g, w) in enumerate(zip(got_params, want_params)):
        assert_same(f"stage {stage} params after {NUM_STEPS} AdamW steps", g, w)


pytestmark = pytest.mark.usefixtures("one_thread")  # the ranks' thread count: same reduction order


@pytest.mark.parametrize("name", sorted(cs.available()))
def test_every_schedule_under_bf16_autocast_is_bitwise_equal_to_one_device(name):
    info = cs.available()[name]
    schedule = cs.build(name, ranks=2, microbatches=NUM_MICROBATCHES, virtual=info.default_virtual)
    want = reference_autocast_run(schedule)
    assert_runs_equal(local_autocast_run(schedule), want)
    # and the run really is in bf16: it differs from the full-precision one
    assert not torch.equal(want[0][0], reference_fp32_loss(schedule))


def reference_fp32_loss(schedule):
    cfg = config_for(schedule)
    model = reference_model(cfg)
    ids, targets = make_batch(cfg, BATCH_SIZE, seed=0)
    with torch.no_grad():
        m = schedule.num_microbatches
        return sum(lm_loss(model(x), y) / m
                   for x, y in zip(torch.tensor_split(ids, m), torch.tensor_split(targets, m)))


def test_recomputed_activations_run_under_the_same_autocast():
    schedule = cs.build("zbv", ranks=2, microbatches=NUM_MICROBATCHES, virtual=2)
    assert_runs_equal(local_autocast_run(schedule, recompute=True), reference_autocast_run(schedule))


def test_an_unknown_precision_is_refused_naming_the_choices():
    cfg = TinyConfigFor2()
    with pytest.raises(PipelineConfigError, match="autocast='int8'.*'bf16'"):
        Pipeline([build_stage(s, cfg) for s in range(2)], "1f1b", lm_loss, microbatches=2,
                 stage=conveyor.StageOptions(autocast="int8"), layout=InProcessLayout())


@pytest.mark.parametrize("kwargs", [{"autocast": "fp16"}, {"autocast": torch.float16}, {"autocast": "half"},
                                    {"param_dtype": "fp16"}, {"param_dtype": torch.float16}])
def test_fp16_without_loss_scaling_is_refused_with_the_reason_and_the_fix(kwargs):
    # fp16 trains with loss scaling (on by default: tests/runtime/test_loss_scaling.py); turned off, its
    # gradients would underflow, so the record refuses it, naming what to do.
    assert conveyor.StageOptions(**kwargs).loss_scaling == conveyor.LossScaling()
    with pytest.raises(PipelineConfigError, match=r"loss_scaling=False: fp16 needs loss scaling.*leave "
                                                  r"loss_scaling unset or True.*'bf16'"):
        conveyor.StageOptions(**kwargs, loss_scaling=False)  # refused when the record is made, before any stage


def TinyConfigFor2():  # noqa: N802 - reads as a constant
    return config_for(cs.build("1f1b", ranks=2, microbatches=2))


def mlp_stages(seed: int = 0) -> list[torch.nn.Module]:
    """Two stages whose boundary is a Linear's output: under autocast it crosses as bf16."""
    torch.manual_seed(seed)
    first = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32))
    return [first, torch.nn.Sequential(torch.nn.GELU(), torch.nn.Linear(32, 4))]


def mse(output, target):
    return torch.nn.functional.mse_loss(output.float(), target)


def mlp_batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(NUM_STEPS)]


def mlp_reference():
    model = torch.nn.Sequential(*mlp_stages())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in mlp_batches():
        total = 0
        for xm, ym in zip(torch.tensor_split(x, NUM_MICROBATCHES), torch.tensor_split(y, NUM_MICROBATCHES)):
            with torch.autocast("cpu", dtype=BF16):
                loss = mse(model(xm), ym) / NUM_MICROBATCHES
            loss.backward()
            total = total + loss.detach()
        losses.append(total)
        optimizer.step()
        optimizer.zero_grad()
    return losses, [dict(stage.named_parameters()) for stage in model]


def _train_bf16(rank, world_size, transport):
    torch.set_num_threads(1)
    stage = mlp_stages()[rank]
    crossing = []
    if rank == 1:  # what arrives from stage 0, as stage 1 sees it
        stage.register_forward_pre_hook(lambda module, args: crossing.append(args[0].dtype))
    pipe = conveyor.Pipeline([stage], schedule="1f1b", microbatches=NUM_MICROBATCHES, loss_fn=mse,
                             stage=conveyor.StageOptions(autocast="bf16"),
                             transfer=conveyor.TransferOptions(timeout_s=60, transport=transport))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses = []
    for x, y in mlp_batches():
        losses.append(pipe.step(x if rank == 0 else None, target=y if rank == 1 else None))
        optimizer.step()
        optimizer.zero_grad()
    pipe.close()
    return losses, {n: p.detach().clone() for n, p in stage.named_parameters()}, sorted(set(crossing), key=str)


@pytest.mark.parametrize("transport", ["shared_memory", "process_group"])
def test_bf16_across_processes_is_bitwise_equal_and_sends_bf16_activations(transport):
    want_losses, want_params = mlp_reference()
    results = run_ranks(_train_bf16, 2, args=(transport,), timeout_s=120)
    for rank, (losses, params, _) in enumerate(results):
        assert all(torch.equal(g, w) for g, w in zip(losses, want_losses)), f"rank {rank} losses differ"
        assert_same(f"rank {rank} params", params, {n: p.detach() for n, p in want_params[rank].items()})
    assert results[1][2] == [BF16], f"stage 1 received {results[1][2]}: the Linear's bf16 output should cross"
