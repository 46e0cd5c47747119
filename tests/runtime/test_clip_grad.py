"""pipe.clip_grad_norm_: the unsplit model's clipping, bit for bit, on every rank at once."""

from __future__ import annotations

import math

import pytest
import torch

import conveyor
import conveyor.schedule as cs
from conveyor.layout import InProcessLayout
from conveyor.pipe import Pipeline
from conveyor.testing import run_ranks
from conveyor.testing.models import (
    build_stage,
    lm_loss,
    make_batch,
    reference_model,
    reference_step,
)
from conveyor.testing.references.schedule_parity import (
    BATCH_SIZE,
    NUM_MICROBATCHES,
    NUM_STEPS,
    assert_same,
    config_for,
    schedule_grid,
)

from ..frontend.test_pipeline_models import _batch, _gpt2


def _one_device(cfg, max_norm: float, norm_type: float):
    """Norms, gradients after the first clip, and parameters after NUM_STEPS clipped AdamW steps."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' count: some CPU reductions depend on it
    try:
        model = reference_model(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        norms, first_grads = [], None
        for step in range(NUM_STEPS):
            ids, targets = make_batch(cfg, BATCH_SIZE, seed=step)
            reference_step(model, ids, targets, NUM_MICROBATCHES, lm_loss)
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type))
            if step == 0:
                first_grads = [{n: p.grad.clone() for n, p in s.named_parameters()} for s in model.stages]
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(previous)
    params = [{n: p.detach().clone() for n, p in s.named_parameters()} for s in model.stages]
    return norms, first_grads, params


def _unclipped_norm(cfg, norm_type: float) -> float:
    model = reference_model(cfg)
    ids, targets = make_batch(cfg, BATCH_SIZE, seed=0)
    reference_step(model, ids, targets, NUM_MICROBATCHES, lm_loss)
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], norm_type).item()


def _train_clipped(rank, world_size, name, virtual, max_norm, norm_type):
    schedule = cs.build(name, ranks=world_size, microbatches=NUM_MICROBATCHES, virtual=virtual)
    cfg = config_for(schedule)
    mine = schedule.stages_of(rank)
    stages = {s: build_stage(s, cfg) for s in mine}
    pipe = conveyor.Pipeline([stages[s] for s in mine], schedule=schedule, loss_fn=lm_loss,
                             transfer=conveyor.TransferOptions(timeout_s=60))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    norms, grads = [], None
    for step in range(NUM_STEPS):
        ids, targets = make_batch(cfg, BATCH_SIZE, seed=step)
        pipe.step(ids if 0 in mine else None, target=targets if schedule.num_stages - 1 in mine else None)
        norms.append(pipe.clip_grad_norm_(max_norm, norm_type))
        if step == 0:
            grads = {s: {n: p.grad.clone() for n, p in stages[s].named_parameters()} for s in mine}
        optimizer.step()
        optimizer.zero_grad()
    return norms, grads, {s: {n: p.detach().clone() for n, p in stages[s].named_parameters()} for s in mine}


@pytest.mark.parametrize(("name", "num_ranks", "virtual", "norm_type"), [
    ("1f1b", 2, 1, 2.0),
    ("zbv", 2, 2, 2.0),
    ("interleaved-1f1b", 4, 2, math.inf),
])
def test_clipping_across_ranks_is_bitwise_the_unsplit_models(name, num_ranks, virtual, norm_type):
    schedule = cs.build(name, ranks=num_ranks, microbatches=NUM_MICROBATCHES, virtual=virtual)
    cfg = config_for(schedule)
    max_norm = 0.5 * _unclipped_norm(cfg, norm_type)  # so that clipping scales the gradients
    want_norms, want_grads, want_params = _one_device(cfg, max_norm, norm_type)
    results = run_ranks(_train_clipped, num_ranks, args=(name, virtual, max_norm, norm_type), timeout_s=120)
    for rank, (norms, grads, params) in enumerate(results):
        for step, (got, want) in enumerate(zip(norms, want_norms, strict=True)):
            assert torch.equal(got, want), f"rank {rank} step {step}: norm {got.item()} vs {want.item()}"
        for stage in schedule.stages_of(rank):
            assert_same(f"stage {stage} clipped grads", grads[stage], want_grads[stage])
            assert_same(f"stage {stage} params after clipped steps", params[stage], want_params[stage])


@pytest.mark.parametrize(("name", "num_ranks", "virtual"), schedule_grid((2,)))
def test_clipping_in_one_process_is_bitwise_the_unsplit_models(name, num_ranks, virtual):
    schedule = cs.build(name, ranks=num_ranks, microbatches=NUM_MICROBATCHES, virtual=virtual)
    cfg = config_for(schedule)
    max_norm = 0.5 * _unclipped_norm(cfg, 2.0)
    want_norms, _, want_params = _one_device(cfg, max_norm, 2.0)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        stages = [build_stage(s, cfg) for s in range(schedule.num_stages)]
        pipe = Pipeline(stages, schedule, loss_fn=lm_loss, layout=InProcessLayout())
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        for step in range(NUM_STEPS):
            ids, targets = make_batch(cfg, BATCH_SIZE, seed=step)
            pipe.step(ids, target=targets)
            assert torch.equal(pipe.clip_grad_norm_(max_norm), want_norms[step])
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(previous)
    for stage, module in enumerate(stages):
        assert_same(f"stage {stage}", {n: p.detach() for n, p in module.named_parameters()}, want_params[stage])


def test_a_large_max_norm_leaves_the_gradients_alone_and_reports_the_norm():
    schedule = cs.build("1f1b", ranks=2, microbatches=NUM_MICROBATCHES)
    cfg = config_for(schedule)
    stages = [build_stage(s, cfg) for s in range(2)]
    pipe = Pipeline(stages, schedule, loss_fn=lm_loss, layout=InProcessLayout())
    ids, targets = make_batch(cfg, BATCH_SIZE, seed=0)
    pipe.step(ids, target=targets)
    before = [p.grad.clone() for p in pipe.parameters()]
    norm = pipe.clip_grad_norm_(1e9)
    assert torch.equal(norm, torch.nn.utils.get_total_norm(before))
    assert all(torch.equal(p.grad, b) for p, b in zip(pipe.parameters(), before, strict=True))


@pytest.mark.parametrize("foreach", [None, True, False])
def test_foreach_means_what_it_means_to_torch(foreach):
    schedule = cs.build("1f1b", ranks=2, microbatches=NUM_MICROBATCHES)
    cfg = config_for(schedule)
    ids, targets = make_batch(cfg, BATCH_SIZE, seed=0)
    model = reference_model(cfg)
    reference_step(model, ids, targets, NUM_MICROBATCHES, lm_loss)
    stages = [build_stage(s, cfg) for s in range(2)]
    pipe = Pipeline(stages, schedule, loss_fn=lm_loss, layout=InProcessLayout())
    pipe.step(ids, target=targets)
    max_norm = 0.5 * torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    want = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=foreach)
    assert torch.equal(pipe.clip_grad_norm_(max_norm, foreach=foreach), want)
    for stage, module in enumerate(stages):
        assert_same(f"stage {stage}", {n: p.grad for n, p in module.named_parameters()},
                    {n: p.grad for n, p in model.stages[stage].named_parameters()})


def _nonfinite(rank, world_size):
    schedule = cs.build("1f1b", ranks=world_size, microbatches=NUM_MICROBATCHES)
    cfg = config_for(schedule)
    stage = build_stage(rank, cfg)
    pipe = conveyor.Pipeline([stage], schedule=schedule, loss_fn=lm_loss,
                             transfer=conveyor.TransferOptions(timeout_s=60))
    ids, targets = make_batch(cfg, BATCH_SIZE, seed=0)
    pipe.step(ids if rank == 0 else None, target=targets if rank == world_size - 1 else None)
    if rank == 1:
        next(iter(stage.parameters())).grad[0] = float("inf")
    try:
        pipe.clip_grad_norm_(1.0, error_if_nonfinite=True)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_non_finite_norm_is_an_error_on_every_rank_not_only_where_it_is():
    messages = run_ranks(_nonfinite, 2, timeout_s=60)
    for message in messages:
        assert "total norm of order 2.0" in message and "non-finite (inf)" in message, message


def _gpt2_clipped(rank, world_size, max_norm):
    model = _gpt2()
    ids, labels = _batch()
    pipe = conveyor.pipeline(model, example_args=(ids[:2],), example_kwargs={"labels": labels[:2]},
                             schedule="1f1b", microbatches=NUM_MICROBATCHES, loss_fn=lambda out, _t: out.loss,
                             options=conveyor.PipelineOptions(transfer=conveyor.TransferOptions(timeout_s=60)))
    pipe.step(ids, labels=labels)
    return pipe.clip_grad_norm_(max_norm).item()


def test_a_tied_parameter_counts_once_as_in_the_unsplit_model():
    model = _gpt2()
    ids, labels = _batch()
    for x, y in zip(torch.tensor_split(ids, NUM_MICROBATCHES), torch.tensor_split(labels, NUM_MICROBATCHES)):
        (model(x, labels=y).loss / NUM_MICROBATCHES).backward()
    want = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
    wte = model.transformer.wte.weight.grad
    counted_twice = math.sqrt(want**2 + wte.norm().item() ** 2)
    norms = run_ranks(_gpt2_clipped, 2, args=(1.0,), timeout_s=120)
    # The tied gradient is summed across ranks in another order than one device sums it:
    # equal to rounding, as the tied parameter itself.
    for norm in norms:
        assert norm == pytest.approx(want, rel=1e-5) and norm != pytest.approx(counted_twice, rel=1e-3)
    assert norms[0] == norms[1]


def _peer_gives_up_before_clipping(rank, world_size):
    schedule = cs.build("1f1b", ranks=world_size, microbatches=2)
    pipe = conveyor.Pipeline([torch.nn.Linear(2, 2)], schedule=schedule, loss_fn=lambda y, t: y.sum(),
                             transfer=conveyor.TransferOptions(timeout_s=60))
    pipe.step(torch.ones(2, 2) if rank == 0 else None)
    if rank == 1:
        # As a rank that failed inside the pipeline does: say why, then go.
        pipe.ranks.transport.publish_failure("ValueError: rank 1 gave up")
        return "left"
    try:
        pipe.clip_grad_norm_(1.0)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_peer_that_never_joins_the_clipping_is_named_not_waited_for():
    messages = run_ranks(_peer_gives_up_before_clipping, 2, timeout_s=60)
    assert messages[1] == "left"
    assert messages[0] == "PeerFailure: rank 1 failed: ValueError: rank 1 gave up", messages[0]


def test_mixed_dtypes_stack_as_torch_stacks_them():
    # torch stacks the norms group by group of gradient dtype, in its own grouping's order (not
    # the order of first appearance): a pipeline must find the same order from its stages.
    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.float16]
    generator = torch.Generator().manual_seed(0)
    for trial in range(100):
        stages = []
        for _ in range(3):
            module = torch.nn.Module()
            for i in range(int(torch.randint(1, 5, (), generator=generator))):
                dtype = dtypes[int(torch.randint(len(dtypes), (), generator=generator))]
                size = int(torch.randint(1, 40, (), generator=generator))
                param = torch.nn.Parameter(torch.zeros(size, dtype=dtype))
                scale = 10.0 ** int(torch.randint(-3, 4, (), generator=generator))
                param.grad = (torch.randn(size, dtype=torch.float64, generator=generator) * scale).to(dtype)
                module.register_parameter(f"p{i}", param)
            stages.append(module)
        want = torch.nn.utils.get_total_norm([p.grad for m in stages for p in m.parameters()])
        got = Pipeline(stages, "1f1b", microbatches=2, layout=InProcessLayout()).clip_grad_norm_(1e30)
        assert torch.equal(got, want), f"trial {trial}: {got.item()} vs {want.item()}"


def _assert_every_rank_got(per_rank: list[list[torch.Tensor]], want: list[torch.Tensor]) -> None:
    for got in per_rank:
        for trial, (g, w) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(g, w), f"trial {trial}: {g.item()} vs {w.item()}"


def _random_grads(model: torch.nn.Module, trial: int) -> dict[int, torch.Tensor]:
    generator = torch.Generator().manual_seed(trial)
    return {
        id(p): torch.randn(p.shape, generator=generator) * 10.0 ** int(torch.randint(-3, 4, (), generator=generator))
        for p in model.parameters()
    }


def _clip_norms_of_random_grads(model: torch.nn.Module, pipe, trials: int) -> list[torch.Tensor]:
    """Every rank draws every gradient and keeps those of its own stages, under any of their names."""
    mine = dict(pipe.named_parameters())
    got = []
    for trial in range(trials):
        grads = _random_grads(model, trial)
        for name, param in model.named_parameters(remove_duplicate=False):
            if name in mine:
                mine[name].grad = grads[id(param)].clone()
        got.append(pipe.clip_grad_norm_(1e30))
    return got


def _unsplit_norms(model: torch.nn.Module, trials: int) -> list[torch.Tensor]:
    return [torch.nn.utils.get_total_norm(list(_random_grads(model, trial).values())) for trial in range(trials)]


def _clip_norms_rank(rank, world_size, model_class, example, split_point, trials):
    """This rank's parameter names, and the pipeline's total norm of each trial's random gradients."""
    torch.manual_seed(0)
    model = model_class()
    pipe = conveyor.pipeline(model, example_args=(example,), split_points=[split_point], schedule="1f1b",
                             microbatches=2, loss_fn=lambda y, t: y.sum(),
                             options=conveyor.PipelineOptions(transfer=conveyor.TransferOptions(timeout_s=60)))
    return sorted(dict(pipe.named_parameters())), _clip_norms_of_random_grads(model, pipe, trials)


class _HeadFirst(torch.nn.Module):
    """Registers its head first and runs it last: parameters() is not the stages' order."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(8, 3)
        self.body1 = torch.nn.Linear(8, 8)
        self.body2 = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.head(torch.relu(self.body2(torch.relu(self.body1(x)))))


def test_the_models_own_parameter_order_decides_the_rounding_not_the_stages():
    trials = 60
    torch.manual_seed(0)
    want = _unsplit_norms(_HeadFirst(), trials)
    results = run_ranks(_clip_norms_rank, 2, args=(_HeadFirst, torch.randn(2, 8), "body2", trials), timeout_s=120)
    _assert_every_rank_got([norms for _, norms in results], want)


class _FrozenLookupTiedHead(torch.nn.Module):
    """The model's own code reads the tied weight (a frozen lookup): torch.export names it by
    its other name, ``head.weight``, on the first stage."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        with torch.no_grad():
            x = torch.nn.functional.embedding(ids, self.embed.weight)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def test_a_tied_parameter_held_under_its_other_name_keeps_the_models_order():
    trials = 60
    torch.manual_seed(0)
    want = _unsplit_norms(_FrozenLookupTiedHead(), trials)
    ids = torch.zeros(2, 5, dtype=torch.long)
    results = run_ranks(_clip_norms_rank, 2, args=(_FrozenLookupTiedHead, ids, "layers.2", trials), timeout_s=120)
    assert "head.weight" in results[0][0], results[0][0]  # the alias this test is about, on the first stage
    _assert_every_rank_got([norms for _, norms in results], want)


def _norm_fails_on_rank_1(rank, world_size):
    schedule = cs.build("1f1b", ranks=world_size, microbatches=2)
    pipe = conveyor.Pipeline([torch.nn.Linear(2, 2)], schedule=schedule, loss_fn=lambda y, t: y.sum(),
                             transfer=conveyor.TransferOptions(timeout_s=60))
    pipe.step(torch.ones(2, 2) if rank == 0 else None)
    if rank == 1:
        def broken(norm_type, foreach):
            raise RuntimeError("rank 1 could not take its norms")

        pipe.gradient_checks._total_norm = broken  # a failure on the way to the exchange, as an odd gradient gives
    try:
        pipe.clip_grad_norm_(1.0)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_rank_that_fails_before_the_exchange_stops_its_peers_with_its_message():
    # Rank 0's PeerFailure carries rank 1's message: it stopped on rank 1's failure, not at a timeout.
    first, second = run_ranks(_norm_fails_on_rank_1, 2, timeout_s=60)
    assert second == "RuntimeError: rank 1 could not take its norms"
    assert first == "PeerFailure: rank 1 failed: RuntimeError: rank 1 could not take its norms", first
