"""A stage part of the test's own plugs into the distributed pipeline without any edit of the core.

The part below is defined here alone: it counts every hook the backend calls and doubles every
gradient of its rank's stages at the end of each step. Under every built-in schedule on 2 ranks,
its gradients must equal, bit for bit, twice those of the same pipeline without it (doubling a
float is exact), its losses must equal those without it, and each hook must run as often as the
contract says.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import conveyor
import conveyor.schedule as cs
from conveyor.errors import PipelineConfigError
from conveyor.parallel.part import PartSite, StagePart
from conveyor.testing import run_ranks
from conveyor.testing.models import TinyConfig, build_stage, lm_loss, make_batch

NUM_STEPS, NUM_MICROBATCHES, BATCH_SIZE = 2, 4, 8


class CountingDoubler(StagePart):
    """Counts the hooks it is called at; doubles this rank's gradients when a step finishes."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.done: Counter[int] = Counter()  # stage_done calls, by stage
        self.runners: dict = {}

    def wrap_stages(self, modules, schedule, model) -> None:
        self.calls["wrap_stages"] += 1
        self.stages = sorted(modules)

    def runner_context(self, stage: int):
        self.calls["runner_context"] += 1
        return None  # the stage's passes run as they would without this part

    def agree(self, site: PartSite) -> None:
        self.calls["agree"] += 1
        self.runners = dict(site.runners)

    def wrap(self) -> None:
        self.calls["wrap"] += 1

    def start_step(self) -> None:
        self.calls["start_step"] += 1

    def stage_done(self, stage: int) -> None:
        self.done[stage] += 1

    def finish_step(self) -> None:
        self.calls["finish_step"] += 1
        for runner in self.runners.values():
            for param in runner.module.parameters():
                if param.grad is not None:
                    param.grad.mul_(2)

    def step_loss(self, loss: torch.Tensor) -> torch.Tensor:
        self.calls["step_loss"] += 1
        return loss

    def whole_norms(self, grads, norms, norm_type):
        self.calls["whole_norms"] += 1
        return norms

    def flags(self, flags: torch.Tensor) -> torch.Tensor:
        self.calls["flags"] += 1
        return flags

    def spans(self):
        self.calls["spans"] += 1
        return [("doubled", 0.0, 0.0)]

    def describe_spans(self, by_rank):
        return "doubler", {"ranks": len(by_rank)}


def _train(rank: int, name: str, part: CountingDoubler | None):
    schedule = cs.build(name, ranks=2, microbatches=NUM_MICROBATCHES)
    cfg = TinyConfig(num_stages=schedule.num_stages)
    mine = schedule.stages_of(rank)
    torch.manual_seed(0)
    stages = {s: build_stage(s, cfg) for s in mine}
    layout = conveyor.DistributedLayout(parts=(part,) if part is not None else ())
    pipe = conveyor.Pipeline([stages[s] for s in mine], schedule, lm_loss, layout=layout,
                             transfer=conveyor.TransferOptions(timeout_s=60))
    first, last = schedule.placement.rank_of(0), schedule.placement.rank_of(schedule.num_stages - 1)
    losses, grads, norms = [], [], []
    for step in range(NUM_STEPS):
        for param in pipe.parameters():
            param.grad = None
        ids, targets = make_batch(cfg, BATCH_SIZE, seed=step)
        losses.append(pipe.step(ids if rank == first else None, target=targets if rank == last else None,
                                on_nonfinite="raise"))
        grads.append({n: p.grad.clone() for n, p in pipe.named_parameters()})
        norms.append(pipe.clip_grad_norm_(1e9))  # nothing clipped: the norm of the (doubled) gradients
    metadata = pipe.timeline().metadata.get("doubler")
    pipe.close()
    return losses, grads, norms, metadata, mine


def _every_schedule(rank: int, world_size: int, names: list[str]) -> list:
    results = []
    for name in names:
        part = CountingDoubler()
        with_part = _train(rank, name, part)
        without = _train(rank, name, None)
        results.append((name, with_part, without, dict(part.calls), dict(part.done)))
    return results


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_a_part_of_the_tests_own_runs_at_every_hook_under_every_schedule():
    names = sorted(cs.available())
    by_rank = run_ranks(_every_schedule, 2, args=(names,), timeout_s=360)
    for rank, results in enumerate(by_rank):
        assert [name for name, *_ in results] == names
        for name, with_part, without, calls, done in results:
            (losses, grads, norms, metadata, mine), (want_losses, want_grads, want_norms, _, _) = with_part, without
            where = f"{name} rank {rank}"
            assert all(torch.equal(a, b) for a, b in zip(losses, want_losses, strict=True)), where
            for got, want in zip(grads, want_grads, strict=True):
                assert sorted(got) == sorted(want) and got, where
                assert all(torch.equal(got[n], want[n] * 2) for n in want), where  # doubling is exact
                assert all(torch.isfinite(g).all() for g in got.values()), where
            # The total norm of gradients doubled is twice the norm: exact, as every term is scaled by 2.
            assert all(torch.equal(a, b * 2) for a, b in zip(norms, want_norms, strict=True)), where
            assert calls == {"wrap_stages": 1, "runner_context": len(mine), "agree": 1, "wrap": 1,
                             "start_step": NUM_STEPS, "finish_step": NUM_STEPS, "step_loss": NUM_STEPS,
                             "flags": NUM_STEPS, "whole_norms": NUM_STEPS, "spans": 1}, where
            assert done == {stage: NUM_STEPS for stage in mine}, where  # each stage's gradients final once a step
            assert metadata == {"ranks": 2}, where


def test_an_in_process_layout_has_no_parts_and_a_part_must_be_a_stage_part():
    with pytest.raises(TypeError, match="parts"):  # parts wrap a distributed pipeline's stages: no such field here
        conveyor.InProcessLayout(parts=(CountingDoubler(),))
    from conveyor.parallel.parts import parts_for

    with pytest.raises(PipelineConfigError, match="takes conveyor.parallel.part.StagePart objects; got object"):
        parts_for(conveyor.DistributedLayout(parts=(object(),)), None)
