"""Per-token loss normalization: ``pipe.step(..., normalize_by=N)`` with a summing ``loss_fn``.

Targets are padded (``ignore_index``) differently per row, so the microbatches hold different
token counts: the per-token loss (every token's loss summed, divided by the global count N)
then differs from the mean of per-microbatch means (torchtitan's issue 2972). The pipeline is
checked against one process: bitwise against ``(loss_sum(mb) / N).backward()`` per microbatch
with one replica; with 2 replicas bitwise against each replica's microbatches so accumulated,
then added, and to 1e-6 against the whole batch in one go (see :mod:`conveyor.parallel.loss`).
"""

from __future__ import annotations

import pytest
import torch

import conveyor
import conveyor.schedule as cs
from conveyor.errors import PipelineConfigError
from conveyor.parallel import count_tokens
from conveyor.parallel.mesh import pipeline_mesh
from conveyor.testing import RankFailure, run_ranks
from conveyor.testing.compare import relative_difference
from conveyor.testing.references.data_parallel import (
    NUM_MICROBATCHES,
    TOLERANCE,
    MLPStack,
    MLPStage,
    full_tensor,
    make_batch,
    one_thread,
)

IGNORE = -100


def sum_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each microbatch's SUM of token losses; padded positions count for nothing."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             reduction="sum", ignore_index=IGNORE)


def mean_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each microbatch's MEAN over its own tokens: the per-microbatch normalization."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             ignore_index=IGNORE)


def padded_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """make_batch's minibatch with row r's last r targets ignored: later rows hold fewer tokens."""
    ids, targets = make_batch(seed)
    targets = targets.clone()
    for row in range(targets.shape[0]):
        if row:
            targets[row, -row:] = IGNORE
    return ids, targets


def tokens(targets: torch.Tensor) -> int:
    return int((targets != IGNORE).sum())


def accumulate(model: torch.nn.Module, ids, targets, count: int, microbatches: int = NUM_MICROBATCHES):
    """One process: ``(sum_loss(mb) / count).backward()`` per microbatch in order; the summed loss."""
    total = None
    for x, y in zip(torch.tensor_split(ids, microbatches), torch.tensor_split(targets, microbatches)):
        loss = sum_loss(model(x), y) / count
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def grads_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(("name", "ranks", "virtual"), [("1f1b", 2, 1), ("zbv", 2, 2)])
def test_local_pipeline_per_token_loss_is_bitwise_one_device(name, ranks, virtual):
    schedule = cs.build(name, ranks=ranks, microbatches=NUM_MICROBATCHES, virtual=virtual)
    ids, targets = padded_batch()
    counts = [tokens(t) for t in torch.tensor_split(targets, NUM_MICROBATCHES)]
    assert counts[0] != counts[1]  # the microbatches differ, or the test would prove nothing
    model = MLPStack(schedule.num_stages)
    pipe = conveyor.Pipeline(list(MLPStack(schedule.num_stages).stages), schedule, sum_loss,
                             layout=conveyor.InProcessLayout())
    with one_thread():
        want = accumulate(model, ids, targets, tokens(targets))
        got = pipe.step(ids, target=targets, normalize_by=count_tokens(pipe, targets, ignore_index=IGNORE))
    assert count_tokens(pipe, targets) == tokens(targets) == sum(counts)
    assert torch.equal(got, want), (got.item(), want.item())
    for stage, runner in pipe.runners.items():
        for (n, p), q in zip(runner.module.named_parameters(), model.stages[stage].parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), (stage, n)
    # The next step without normalize_by is the mean over microbatches again.
    assert pipe.runners[schedule.num_stages - 1].loss_divisor == tokens(targets)
    pipe.step(ids, target=targets)
    assert pipe.runners[schedule.num_stages - 1].loss_divisor == NUM_MICROBATCHES


def test_the_mean_per_microbatch_is_not_the_per_token_loss():
    """torchtitan 2972: dividing each microbatch by its own count weighs the short one's tokens more."""
    ids, targets = padded_batch()
    schedule = cs.build("1f1b", ranks=2, microbatches=NUM_MICROBATCHES)
    per_token = conveyor.Pipeline(list(MLPStack(2).stages), schedule, sum_loss, layout=conveyor.InProcessLayout())
    per_microbatch = conveyor.Pipeline(list(MLPStack(2).stages), schedule, mean_loss, layout=conveyor.InProcessLayout())
    got = per_token.step(ids, target=targets, normalize_by=count_tokens(per_token, targets))
    mistaken = per_microbatch.step(ids, target=targets)
    model = MLPStack(2)
    whole = sum_loss(model(ids), targets) / tokens(targets)  # every token weighs 1 / N
    whole.backward()
    assert torch.allclose(got, whole, rtol=TOLERANCE, atol=0)
    assert abs(mistaken.item() - whole.item()) > 1e-3 * whole.item()
    first = next(per_microbatch.parameters()).grad
    assert not torch.allclose(first, next(model.parameters()).grad, rtol=1e-3, atol=0)


@pytest.mark.parametrize("bad", [0, -3, float("nan"), float("inf"), True, "12", torch.tensor([4, 5])])
def test_normalize_by_that_cannot_be_a_token_count_names_rank_and_value(bad):
    ids, targets = padded_batch()
    pipe = conveyor.Pipeline(list(MLPStack(2).stages), "1f1b", sum_loss, microbatches=2,
                             layout=conveyor.InProcessLayout())
    with pytest.raises(PipelineConfigError, match=r"normalize_by must be a positive finite number.* on rank 1"):
        pipe.step(ids, target=targets, normalize_by=bad)
    with pytest.raises(PipelineConfigError, match="got NoneType"):
        count_tokens(pipe, None)


def _two_ranks(rank, world_size, bad):
    schedule = cs.build("1f1b", ranks=2, microbatches=NUM_MICROBATCHES)
    pipe = conveyor.Pipeline([MLPStage(rank, 2)], schedule=schedule, loss_fn=sum_loss,
                             transfer=conveyor.TransferOptions(timeout_s=60))
    ids, targets = padded_batch()
    target = targets if pipe.needs_target else None
    count = count_tokens(pipe, target)
    loss = pipe.step(ids if pipe.needs_inputs else None, target=target, normalize_by=0 if bad else count)
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    pipe.close()
    return count, loss, grads


@pytest.mark.distributed
def test_two_ranks_per_token_loss_is_bitwise_one_device():
    results = run_ranks(_two_ranks, 2, args=(False,), timeout_s=60)
    ids, targets = padded_batch()
    model = MLPStack(2)
    with one_thread():
        want = accumulate(model, ids, targets, tokens(targets))
    assert [count for count, _, _ in results] == [None, tokens(targets)]  # counted where the targets are
    for rank, (_, loss, grads) in enumerate(results):
        assert torch.equal(loss, want), (rank, loss.item(), want.item())
        for name, grad in grads.items():
            assert torch.equal(grad, model.stages[rank].get_parameter(name).grad), name


@pytest.mark.distributed
def test_a_bad_token_count_on_the_last_rank_stops_every_rank_naming_it():
    with pytest.raises(RankFailure, match=r"got 0 on rank 1"):
        run_ranks(_two_ranks, 2, args=(True,), timeout_s=60)


def _replicas(rank, world_size, dp, kind):
    mesh = pipeline_mesh(2)
    schedule = cs.build("1f1b", ranks=2, microbatches=NUM_MICROBATCHES)
    pipe = conveyor.Pipeline([MLPStage(mesh.get_local_rank("pp"), 2)], schedule=schedule, loss_fn=sum_loss,
                             transfer=conveyor.TransferOptions(timeout_s=60),
                             layout=conveyor.DistributedLayout(mesh=mesh, data_parallel=kind))
    ids, targets = padded_batch()
    ids, targets = ids.chunk(dp)[pipe.dp_rank], targets.chunk(dp)[pipe.dp_rank]  # this replica's rows
    target = targets if pipe.needs_target else None
    count = count_tokens(pipe, target)
    loss = pipe.step(ids if pipe.needs_inputs else None, target=target, normalize_by=count)
    grads = {n: full_tensor(p.grad) for n, p in pipe.named_parameters()}
    stage = pipe.schedule.stages_of(pipe.ranks.rank)[0]
    pipe.close()
    return count, loss, stage, grads


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_pp2_x_dp2_per_token_loss_matches_one_process_on_the_whole_batch(kind):
    dp = 2
    results = run_ranks(_replicas, 2 * dp, args=(dp, kind), timeout_s=120)
    ids, targets = padded_batch()
    n = tokens(targets)
    # The replicas' shares hold different counts: each divides by N / dp, not by its own count.
    assert tokens(targets.chunk(dp)[0]) != tokens(targets.chunk(dp)[1])
    whole = MLPStack(2)
    per_replica = MLPStack(2)
    with one_thread():
        want = sum_loss(whole(ids), targets) / n  # one process, the whole batch: sum over tokens / N
        want.backward()
        losses, grads = [], []
        for x, y in zip(ids.chunk(dp), targets.chunk(dp)):
            losses.append(accumulate(per_replica, x, y, n))
            grads.append({name: p.grad.clone() for name, p in per_replica.named_parameters()})
            per_replica.zero_grad()
    for count, loss, stage, got in results:
        assert count in (None, n)  # N on every last-stage rank, None on the others
        assert relative_difference(loss, want) <= TOLERANCE
        assert torch.equal(loss, losses[0] + losses[1])  # dp = 2: N / 2 and the halving are exact
        for name, grad in got.items():
            full_name = f"stages.{stage}.{name}"
            assert relative_difference(grad, whole.get_parameter(full_name).grad) <= TOLERANCE, name
            assert torch.equal(grad, grads[0][full_name] + grads[1][full_name]), name
    assert sum(count == n for count, *_ in results) == dp
