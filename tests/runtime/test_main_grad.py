"""``param_dtype="bf16"``: bf16 stages, fp32 main_grad across microbatches, fp32 masters, bitwise one device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import conveyor
import conveyor.schedule as cs
from conveyor.errors import NonFiniteError, PipelineConfigError
from conveyor.frontend import split_model
from conveyor.layout import InProcessLayout
from conveyor.pipe import Pipeline
from conveyor.runtime.stage.main_grad import param_precision
from conveyor.testing import run_ranks
from conveyor.testing.models import build_stage, lm_loss, make_batch, reference_model
from conveyor.testing.references.main_grad import MainGradReference
from conveyor.testing.references.schedule_parity import BATCH_SIZE, NUM_MICROBATCHES, NUM_STEPS, config_for

BF16 = torch.bfloat16
LR = 1e-2

pytestmark = pytest.mark.usefixtures("one_thread")  # the ranks' thread count: same reduction order


def reference_run(schedule, max_norm=None):
    """Per step: loss, main grads (after clipping) by (stage, name); then bf16 parameters and masters."""
    cfg = config_for(schedule)
    ref = MainGradReference(reference_model(cfg), torch.optim.AdamW, lr=LR)
    place = {id(p): (s, n) for s, stage in enumerate(ref.model.stages) for n, p in stage.named_parameters()}
    steps = []
    for step in range(NUM_STEPS):
        ids, targets = make_batch(cfg, BATCH_SIZE, seed=step)
        loss = ref.accumulate(ids, targets, schedule.num_microbatches, lm_loss)
        norm = ref.clip_grad_norm_(max_norm) if max_norm is not None else None
        steps.append((loss, norm, {place[id(p)]: g.clone() for p, g in zip(ref.params, ref.main_grads)}))
        ref.optimizer_step()
    params = {place[id(p)]: p.detach().clone() for p in ref.params}
    masters = {place[id(p)]: m.detach().clone() for p, m in zip(ref.params, ref.masters)}
    return steps, params, masters


def pipeline_run(pipe, stages, cfg, max_norm=None, ranks=None):
    """The same loop through a pipeline whose stage ``s`` is ``stages[s]`` (None where not on this rank)."""
    optimizer = conveyor.MasterWeights(pipe, torch.optim.AdamW, lr=LR)
    place = {id(p): (s, n) for s, stage in enumerate(stages) if stage is not None
             for n, p in stage.named_parameters()}
    steps = []
    for step in range(NUM_STEPS):
        ids, targets = make_batch(cfg, BATCH_SIZE, seed=step)
        loss = pipe.step(ids, target=targets)
        norm = pipe.clip_grad_norm_(max_norm) if max_norm is not None else None
        steps.append((loss, norm, {place[id(p)]: p.main_grad.clone() for p in optimizer.params}))
        optimizer.step()
        optimizer.zero_grad()
    params = {place[id(p)]: p.detach().clone() for p in optimizer.params}
    masters = {place[id(p)]: m.detach().clone() for p, m in zip(optimizer.params, optimizer.masters)}
    return steps, params, masters


def assert_equal_runs(got, want, where=""):
    (got_steps, got_params, got_masters), (want_steps, want_params, want_masters) = got, want
    for step, ((g_loss, g_norm, g_grads), (w_loss, w_norm, w_grads)) in enumerate(zip(got_steps, want_steps)):
        assert torch.equal(g_loss, w_loss), f"{where}step {step} loss {g_loss.item()} vs {w_loss.item()}"
        if w_norm is not None:
            assert torch.equal(g_norm, w_norm), f"{where}step {step} norm {g_norm.item()} vs {w_norm.item()}"
        assert_same(f"{where}step {step} main_grad", g_grads, {k: w_grads[k] for k in g_grads})
    assert_same(f"{where}bf16 params", got_params, {k: want_params[k] for k in got_params})
    assert_same(f"{where}fp32 masters", got_masters, {k: want_masters[k] for k in got_masters})


def assert_same(what, got, want):
    assert got.keys() == want.keys(), f"{what}: {sorted(got)} vs {sorted(want)}"
    for key in want:
        assert got[key].dtype == want[key].dtype, f"{what} {key}: {got[key].dtype} vs {want[key].dtype}"
        assert torch.equal(got[key], want[key]), \
            f"{what} {key} differs by {(got[key].float() - want[key].float()).abs().max().item():.3g}"


def local_run(schedule, max_norm=None):
    cfg = config_for(schedule)
    stages = [build_stage(s, cfg) for s in range(schedule.num_stages)]
    pipe = Pipeline(stages, schedule, lm_loss, stage=conveyor.StageOptions(param_dtype="bf16"),
                    layout=InProcessLayout())
    return pipeline_run(pipe, stages, cfg, max_norm)


@pytest.mark.parametrize("name", sorted(cs.available()))
def test_every_schedule_with_bf16_params_and_fp32_main_grad_is_bitwise_one_device(name):
    schedule = cs.build(name, ranks=2, microbatches=NUM_MICROBATCHES, virtual=cs.available()[name].default_virtual)
    got = local_run(schedule)
    assert all(p.dtype == BF16 for p in got[1].values()) and all(
        g.dtype == torch.float32 for _, _, grads in got[0] for g in grads.values())
    assert_equal_runs(got, reference_run(schedule))


def test_fp32_accumulation_is_not_what_bf16_gradients_sum_to():
    """The parity above would not notice main_grad if bf16 .grad sums were the same: they are not."""
    schedule = cs.build("1f1b", ranks=2, microbatches=NUM_MICROBATCHES)
    cfg = config_for(schedule)
    ids, targets = make_batch(cfg, BATCH_SIZE, seed=0)
    ref = MainGradReference(reference_model(cfg), torch.optim.AdamW, lr=LR)
    ref.accumulate(ids, targets, NUM_MICROBATCHES, lm_loss)
    plain = reference_model(cfg).to(BF16)
    for x, y in zip(torch.tensor_split(ids, NUM_MICROBATCHES), torch.tensor_split(targets, NUM_MICROBATCHES)):
        (lm_loss(plain(x), y) / NUM_MICROBATCHES).backward()
    bf16_sums = [p.grad.float() for p in plain.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(ref.main_grads, bf16_sums))


def test_clipping_reads_main_grad_bitwise_as_one_device():
    schedule = cs.build("zbv", ranks=2, microbatches=NUM_MICROBATCHES, virtual=2)
    want = reference_run(schedule, max_norm=0.05)
    assert want[0][0][1] > 0.05, "the norm must exceed max_norm for clipping to do something"
    assert_equal_runs(local_run(schedule, max_norm=0.05), want)


def mlp_pipe(grad_accum_dtype=None):
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(8, 16), nn.GELU()), nn.Linear(16, 2)]
    return Pipeline(stages, "zb-h1", microbatches=2,
                    loss_fn=lambda out, t: nn.functional.mse_loss(out.float(), t),
                    stage=conveyor.StageOptions(param_dtype="bf16", grad_accum_dtype=grad_accum_dtype),
                    layout=InProcessLayout())


def test_the_nonfinite_check_reads_main_grad_and_skip_leaves_the_masters_alone():
    pipe = mlp_pipe()
    optimizer = conveyor.MasterWeights(pipe, torch.optim.AdamW, lr=LR)
    x, y = torch.ones(4, 8, dtype=BF16), torch.zeros(4, 2)
    pipe.step(x, target=y)
    optimizer.step()
    optimizer.zero_grad()
    masters = [m.detach().clone() for m in optimizer.masters]
    huge = torch.full((4, 8), 3e38, dtype=BF16)  # finite inputs, non-finite gradients
    with pytest.raises(NonFiniteError, match=r"gradients of stage\(s\) \[0, 1\]"):
        pipe.step(huge, target=y, on_nonfinite="raise")
    optimizer.zero_grad()
    pipe.step(huge, target=y, on_nonfinite="skip")
    assert pipe.skipped_steps == 1 and all(p.main_grad is None and p.grad is None for p in optimizer.params)
    optimizer.step()
    assert all(torch.equal(a, m) for a, m in zip(masters, optimizer.masters))
    assert all(torch.equal(p, m.to(BF16)) for p, m in zip(optimizer.params, optimizer.masters))


def test_memory_per_rank_counts_params_main_grad_masters_and_optimizer_state():
    pipe = mlp_pipe()
    optimizer = conveyor.MasterWeights(pipe, torch.optim.AdamW, lr=LR)
    sizes = {0: 8 * 16 + 16, 1: 16 * 2 + 2}
    before = optimizer.memory()
    assert {r: (m.param_bytes, m.main_grad_bytes, m.master_bytes, m.optimizer_bytes) for r, m in before.items()} \
        == {r: (2 * n, 4 * n, 4 * n, 0) for r, n in sizes.items()}
    pipe.step(torch.ones(4, 8, dtype=BF16), target=torch.zeros(4, 2))
    optimizer.step()
    after = optimizer.memory()  # AdamW: exp_avg and exp_avg_sq in fp32, a step count per parameter
    assert {r: m.optimizer_bytes for r, m in after.items()} == {0: 8 * sizes[0] + 2 * 4, 1: 8 * sizes[1] + 2 * 4}
    assert after[0].total_bytes == 2 * 144 + 4 * 144 + 4 * 144 + 8 * 144 + 8


def test_bf16_parameters_without_main_grad_accumulate_in_bf16_grad():
    pipe = mlp_pipe(grad_accum_dtype="none")
    pipe.step(torch.ones(4, 8, dtype=BF16), target=torch.zeros(4, 2))
    assert all(p.grad.dtype == BF16 and not hasattr(p, "main_grad") for p in pipe.parameters())


def test_data_parallel_and_odd_dtypes_are_refused_saying_what_to_do():
    with pytest.raises(PipelineConfigError, match="param_dtype='bf16'.*data_parallel='ddp'.*drop data_parallel="):
        param_precision("bf16", None, "ddp")
    with pytest.raises(PipelineConfigError, match="grad_accum_dtype='bf16'.*'fp32'"):
        param_precision("bf16", "bf16")
    with pytest.raises(PipelineConfigError, match="grad_accum_dtype='fp32' needs param_dtype="):
        param_precision(None, "fp32")
    with pytest.raises(PipelineConfigError, match="param_dtype='int8'"):
        param_precision("int8")
    with pytest.raises(PipelineConfigError, match="MasterWeights needs parameters that accumulate in main_grad"):
        conveyor.MasterWeights(Pipeline([nn.Linear(2, 2)], "gpipe", microbatches=1,
                                        layout=InProcessLayout()), torch.optim.SGD, lr=1)


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 16, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def tied_model() -> TiedLM:
    torch.manual_seed(0)
    return TiedLM()


def tied_loss(out, target):
    return nn.functional.cross_entropy(out.flatten(0, 1).float(), target.flatten())


TIED_IDS = torch.randint(0, 16, (8, 6), generator=torch.Generator().manual_seed(1))


def tied_reference():
    ref = MainGradReference(tied_model(), torch.optim.AdamW, lr=LR)
    for _ in range(2):
        ref.accumulate(TIED_IDS, TIED_IDS, 4, tied_loss)
        grads = dict(zip(ref.names, (g.clone() for g in ref.main_grads)))
        ref.optimizer_step()
    return grads, {n: p.detach().clone() for n, p in zip(ref.names, ref.params)}


def train_tied(pipe):
    optimizer = conveyor.MasterWeights(pipe, torch.optim.AdamW, lr=LR)
    for _ in range(2):
        local = pipe.ranks.in_process
        pipe.step(TIED_IDS if local or pipe.needs_inputs else None,
                  target=TIED_IDS if local or pipe.needs_target else None)
        grads = {n: p.main_grad.clone() for n, p in zip(optimizer.names, optimizer.params)}
        optimizer.step()
        optimizer.zero_grad()
    return grads, {n: p.detach().clone() for n, p in zip(optimizer.names, optimizer.params)}


def assert_close_to(got, want, what):
    for name, value in got.items():
        key = "embed.weight" if name == "head.weight" else name
        torch.testing.assert_close(value.float(), want[key].float(), rtol=2e-2, atol=2e-3, msg=f"{what} {name}")


def test_a_tied_parameter_on_one_rank_accumulates_both_uses_in_main_grad():
    # Traced stages check what they receive against the trace: trace the model in bf16.
    split = split_model(tied_model().to(BF16), 2, split_points=["layers.1"], example_args=(TIED_IDS[:2],))
    pipe = Pipeline([split.stage_module(s) for s in range(2)], "1f1b", tied_loss, microbatches=4,
                    stage=conveyor.StageOptions(param_dtype="bf16"),
                    model=conveyor.WholeModel(tied_parameters=split.tied_groups), layout=InProcessLayout())
    grads, params = train_tied(pipe)
    want_grads, want_params = tied_reference()
    # The two uses' bf16 gradients reach main_grad one by one, not summed in bf16 first: close, not bitwise.
    assert_close_to(grads, want_grads, "main_grad")
    assert_close_to(params, want_params, "param")


def _train_across_ranks(rank, world_size):
    results = {}
    for name in ("1f1b", "zb-h1"):
        schedule = cs.build(name, ranks=2, microbatches=NUM_MICROBATCHES)
        cfg = config_for(schedule)
        stage = build_stage(rank, cfg)
        with conveyor.Pipeline([stage], schedule, lm_loss, stage=conveyor.StageOptions(param_dtype="bf16"),
                               transfer=conveyor.TransferOptions(timeout_s=60)) as pipe:
            results[name] = pipeline_run(pipe, [stage if s == rank else None for s in range(2)], cfg, max_norm=0.05)
    tied = conveyor.pipeline(tied_model(), example_args=(TIED_IDS[:2],), split_points=["layers.1"],
                             schedule="1f1b", microbatches=4, loss_fn=tied_loss,
                             options=conveyor.PipelineOptions(stage=conveyor.StageOptions(param_dtype="bf16"),
                                                              transfer=conveyor.TransferOptions(timeout_s=60)))
    results["tied"] = train_tied(tied)
    tied.close()
    return results


@pytest.mark.distributed
def test_two_processes_are_bitwise_one_device_and_tied_copies_sum_main_grad():
    got = run_ranks(_train_across_ranks, 2, timeout_s=120)
    for name in ("1f1b", "zb-h1"):
        want = reference_run(cs.build(name, ranks=2, microbatches=NUM_MICROBATCHES), max_norm=0.05)
        for rank in range(2):
            assert_equal_runs(got[rank][name], want, where=f"{name} rank {rank}: ")
    (grads0, params0), (grads1, params1) = got[0]["tied"], got[1]["tied"]
    assert torch.equal(grads0["embed.weight"], grads1["head.weight"]), "tied copies' main_grad were not summed"
    assert torch.equal(params0["embed.weight"], params1["head.weight"]), "tied copies drifted apart"
    want_grads, want_params = tied_reference()
    assert_close_to({**grads0, **grads1}, want_grads, "main_grad")
    assert_close_to({**params0, **params1}, want_params, "param")


def test_a_checkpoint_holds_the_fp32_masters_and_resumes_bitwise(tmp_path):
    from conveyor.checkpoint import load, save

    def build():
        pipe = mlp_pipe()
        return pipe, conveyor.MasterWeights(pipe, torch.optim.AdamW, lr=LR)

    x, y = torch.randn(4, 8).to(BF16), torch.randn(4, 2)

    def train(pipe, optimizer, steps):
        for _ in range(steps):
            pipe.step(x, target=y)
            optimizer.step()
            optimizer.zero_grad()

    pipe, optimizer = build()
    train(pipe, optimizer, 2)
    save(tmp_path / "ckpt", pipe, optimizer)
    train(pipe, optimizer, 1)
    again, again_optimizer = build()
    load(tmp_path / "ckpt", again, again_optimizer)
    train(again, again_optimizer, 1)
    for a, b in [*zip(optimizer.masters, again_optimizer.masters), *zip(optimizer.params, again_optimizer.params)]:
        assert a.dtype == b.dtype and torch.equal(a, b)
    plain = mlp_pipe()  # no MasterWeights: the bf16 parameters get the masters rounded
    load(tmp_path / "ckpt", plain)
    saved = conveyor.MasterWeights(build()[0], torch.optim.AdamW, lr=LR)
    load(tmp_path / "ckpt", saved.pipe, saved)
    assert all(torch.equal(p, m.to(BF16)) for p, m in zip(plain.parameters(), saved.masters))
    assert not all(torch.equal(m, p.float()) for p, m in zip(saved.params, saved.masters)), "masters were rounded"
