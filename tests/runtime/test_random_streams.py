"""Dropout in a pipeline: one random stream per (stage, microbatch), not one per rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import conveyor
import conveyor.schedule as cs
from conveyor.layout import InProcessLayout
from conveyor.options import StageOptions
from conveyor.pipe import Pipeline
from conveyor.testing import run_ranks

WIDTH, BATCH, MICROBATCHES = 16, 8, 4


def _stage(index: int) -> nn.Module:
    torch.manual_seed(100 + index)  # weights independent of how the stages were built
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.5))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def _local_step(name: str, virtual: int, options: StageOptions = StageOptions()) -> tuple[torch.Tensor, dict]:
    schedule = cs.build(name, ranks=2, microbatches=MICROBATCHES, virtual=virtual)
    stages = [_stage(s) for s in range(schedule.num_stages)]
    pipe = Pipeline(stages, schedule, loss_fn=_loss, stage=options, layout=InProcessLayout())
    torch.manual_seed(0)
    x, y = _batch()
    loss = pipe.step(x, target=y)
    return loss, {(s, n): p.grad for s, m in enumerate(stages) for n, p in m.named_parameters()}


@pytest.mark.parametrize(("name", "virtual"), [("gpipe", 1), ("zb-h1", 1), ("zbv", 2), ("interleaved-1f1b", 2)])
def test_masks_depend_on_stage_and_microbatch_not_on_the_schedule(name, virtual):
    # Same stages (4 of them), different schedules and placements: the same numbers.
    want_loss, want_grads = _local_step("1f1b" if virtual == 1 else "looped-bfs", virtual)
    loss, grads = _local_step(name, virtual)
    assert torch.equal(loss, want_loss)
    assert all(torch.equal(grads[k], want_grads[k]) for k in want_grads)


def test_recomputed_forwards_draw_the_same_masks():
    want_loss, want_grads = _local_step("1f1b", 1)
    loss, grads = _local_step("1f1b", 1, StageOptions(recompute=True))
    assert torch.equal(loss, want_loss)
    assert all(torch.equal(grads[k], want_grads[k]) for k in want_grads)


def test_a_step_takes_one_number_from_the_users_stream_and_is_reproducible():
    first, _ = _local_step("1f1b", 1)
    after_step = torch.rand(3)
    again, _ = _local_step("1f1b", 1)
    assert torch.equal(first, again)
    torch.manual_seed(0)
    _batch()  # draws from its own generator, not the global one
    torch.randint(0, 2**62, (1,))
    assert torch.equal(after_step, torch.rand(3))


def test_random_streams_false_leaves_the_generators_to_the_user():
    _, grads = _local_step("1f1b", 1, StageOptions(random_streams=False))
    _, streamed = _local_step("1f1b", 1)
    assert not all(torch.equal(grads[k], streamed[k]) for k in grads)


class _MaskOfOnes(nn.Module):
    """Returns its input and, stacked below, the dropout mask it drew for a tensor of ones."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, nn.functional.dropout(torch.ones_like(x[:1]), 0.5, training=True)])


def _masks_on_two_ranks(rank, world_size):
    torch.manual_seed(0)  # every rank seeded alike, as most training scripts do
    schedule = cs.build("1f1b", ranks=2, microbatches=2)
    pipe = conveyor.Pipeline([_MaskOfOnes()], schedule=schedule, transfer=conveyor.TransferOptions(timeout_s=60))
    out = pipe.forward(torch.zeros(2, 1, 64) if rank == 0 else None)
    return out


def test_stages_on_ranks_seeded_alike_draw_different_masks():
    _, out = run_ranks(_masks_on_two_ranks, 2, timeout_s=60)
    # Each microbatch (1 row of zeros) gains one mask row per stage.
    per_microbatch = out.reshape(2, 3, 64)
    for m in range(2):
        stage0, stage1 = per_microbatch[m, 1], per_microbatch[m, 2]
        assert not torch.equal(stage0, stage1), f"microbatch {m}: both stages drew the same mask"
    assert not torch.equal(per_microbatch[0, 1], per_microbatch[1, 1])
