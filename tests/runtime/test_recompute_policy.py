"""Selective recomputation (per stage, per block, per operator) stays bitwise equal to one device.

One launch of 2 gloo ranks runs every built-in schedule (the zero-bubble I/W splits included) on
hand-built stages, each stage with another policy, rotating so that every policy runs under several
schedules and under every zero-bubble family; the in-process pipeline (the numerics of the
distributed one, bit for bit, and cheaper) runs every policy under every schedule, and traced
stages, whose blocks are regrouped out of the flat graph.
"""

from __future__ import annotations

import pytest
import torch

import conveyor
import conveyor.schedule as cs
from conveyor.errors import PipelineConfigError
from conveyor.options import PipelineOptions, RecomputePolicy, StageOptions
from conveyor.runtime.stage.recompute import StageRecompute
from conveyor.testing import run_ranks
from conveyor.testing.models import TinyConfig, build_stage, lm_loss, make_batch, reference_model, reference_step
from conveyor.testing.references.schedule_parity import assert_same

MICROBATCHES, BATCH = 4, 8
MLP = r"blocks\.\d+\.mlp"
# Each kind of policy: the whole stage, every other block, each block with matmul outputs kept,
# blocks by name with one operator kept.
POLICIES = ({}, {"every": 2}, {"every": 1, "save": ["matmul"]}, {"blocks": MLP, "save": ["addmm"]})


def _config(schedule: cs.Schedule) -> TinyConfig:
    return TinyConfig(num_stages=schedule.num_stages, blocks_per_stage=2)


def _schedules() -> list[cs.Schedule]:
    return [cs.build(name, ranks=2, microbatches=MICROBATCHES, virtual=info.default_virtual)
            for name, info in sorted(cs.available().items())]


def _rotated(index: int, schedule: cs.Schedule) -> list:
    """``recompute=`` for the ``index``-th schedule: stage s takes policy index + s (mod their number)."""
    return [POLICIES[(index + stage) % len(POLICIES)] for stage in range(schedule.num_stages)]


def _reference(schedule: cs.Schedule):
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' thread count: CPU reductions depend on it
    try:
        model = reference_model(_config(schedule))
        ids, targets = make_batch(_config(schedule), BATCH, seed=0)
        loss = reference_step(model, ids, targets, MICROBATCHES, lm_loss)
        return loss, [{n: p.grad.clone() for n, p in stage.named_parameters()} for stage in model.stages]
    finally:
        torch.set_num_threads(previous)


def _step_each(rank: int, world_size: int) -> list:
    torch.set_num_threads(1)
    results = []
    for index, schedule in enumerate(_schedules()):
        cfg, mine = _config(schedule), schedule.stages_of(rank)
        first, last = schedule.placement.rank_of(0), schedule.placement.rank_of(schedule.num_stages - 1)
        for policy in [_rotated(index, schedule)]:
            stages = {s: build_stage(s, cfg) for s in mine}
            try:
                pipe = conveyor.Pipeline([stages[s] for s in mine], schedule=schedule, loss_fn=lm_loss,
                                         stage=StageOptions(recompute=policy),
                                         transfer=conveyor.TransferOptions(timeout_s=60))
                ids, targets = make_batch(cfg, BATCH, seed=0)
                loss = pipe.step(ids if rank == first else None, target=targets if rank == last else None)
                pipe.close()
            except Exception as exc:
                exc.add_note(f"while rank {rank} ran {schedule.name} with recompute={policy}")
                raise
            grads = {s: {n: p.grad.clone() for n, p in stages[s].named_parameters()} for s in mine}
            results.append((schedule.name, str(policy), loss, grads))
    return results


def test_policies_per_stage_under_every_schedule_are_bitwise_equal_to_one_device_on_two_ranks():
    ranks = run_ranks(_step_each, 2, timeout_s=240)
    references = {schedule.name: _reference(schedule) for schedule in _schedules()}
    count = 0
    for results in ranks:
        for name, policy, loss, grads in results:
            want_loss, want_grads = references[name]
            if loss is not None:
                assert torch.equal(loss, want_loss), f"{name} recompute={policy}: loss {loss} vs {want_loss}"
            for stage, got in grads.items():
                assert_same(f"{name} recompute={policy} stage {stage}", got, want_grads[stage])
                count += 1
    assert count == sum(s.num_stages for s in _schedules())
    zero_bubble = [(i, s) for i, s in enumerate(_schedules()) if s.name.startswith("zb") or s.name == "dualpipev"]
    assert {str(p) for i, s in zero_bubble for p in _rotated(i, s)} == {str(p) for p in POLICIES}


@pytest.mark.parametrize("schedule", [s for s in _schedules() if s.name in ("1f1b", "zb-1p", "zbv")],
                         ids=lambda s: s.name)
def test_every_policy_under_one_two_and_v_shaped_schedules_in_process(schedule):
    torch.set_num_threads(1)
    want_loss, want_grads = _reference(schedule)
    cfg = _config(schedule)
    for policy in [*POLICIES, True]:
        stages = [build_stage(s, cfg) for s in range(schedule.num_stages)]
        options = StageOptions(recompute=policy)
        pipe = conveyor.Pipeline(stages, schedule, lm_loss, stage=options, layout=conveyor.InProcessLayout())
        ids, targets = make_batch(cfg, BATCH, seed=0)
        assert torch.equal(pipe.step(ids, target=targets), want_loss), policy
        for stage, module in enumerate(stages):
            assert_same(f"recompute={policy} stage {stage}", {n: p.grad for n, p in module.named_parameters()},
                        want_grads[stage])


class _Llama(torch.nn.Module):
    """A small Llama-like stack (embedding, four residual blocks, head) to trace."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed = torch.nn.Embedding(32, 16)
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict({"norm": torch.nn.LayerNorm(16), "up": torch.nn.Linear(16, 32),
                                 "down": torch.nn.Linear(32, 16)}) for _ in range(4))
        self.head = torch.nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer["down"](torch.nn.functional.gelu(layer["up"](layer["norm"](x))))
        return self.head(x)


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_traced_stages_recompute_blocks_bitwise(name):
    torch.set_num_threads(1)
    ids = torch.randint(0, 32, (8, 6), generator=torch.Generator().manual_seed(0))
    reference = _Llama()
    want = reference_step(reference, ids, ids, MICROBATCHES, lm_loss)
    wanted = dict(reference.named_parameters())
    for policy in [{"every": 2}, {"every": 1, "save": ["matmul"]}, {"blocks": r"layers\.\d+\.up", "save": ["mm"]}]:
        options = PipelineOptions(stage=StageOptions(recompute=policy))
        pipe = conveyor.pipeline(_Llama(), example_args=(ids[:2],), schedule=name, microbatches=MICROBATCHES,
                                 loss_fn=lm_loss, layout=conveyor.InProcessLayout(ranks=2), options=options)
        loss = pipe.step(ids, target=ids)
        assert torch.equal(loss, want), (policy, loss, want)
        assert any(runner.recompute.blocks for runner in pipe.runners.values()), policy
        for parameter_name, parameter in pipe.named_parameters():
            assert torch.equal(parameter.grad, wanted[parameter_name].grad), (policy, parameter_name)


def test_blocks_are_list_items_or_named_and_a_policy_that_finds_none_says_so():
    stage = build_stage(0, TinyConfig(blocks_per_stage=3))
    assert StageRecompute(stage, RecomputePolicy(every=2)).blocks == ["blocks.0", "blocks.2"]
    assert StageRecompute(build_stage(0, TinyConfig(blocks_per_stage=3)),
                          RecomputePolicy(blocks=r"blocks\.\d+\.attn")).blocks == [
        "blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]
    with pytest.raises(PipelineConfigError, match=r"no module of this stage matches blocks='decoder.*' \(it has no "
                       r"blocks; its top modules: none\)"):
        StageRecompute(torch.nn.Linear(2, 2), RecomputePolicy(blocks="decoder.*"))
    # A pattern that matches none of a stage's blocks names the stage and the blocks it has.
    with pytest.raises(PipelineConfigError, match=r"no module of stage 1 matches blocks='layers' \(its blocks: "
                                                  r"blocks.0, blocks.1, blocks.2\)"):
        StageRecompute(build_stage(0, TinyConfig(blocks_per_stage=3)), RecomputePolicy(blocks="layers"), stage=1)
    with pytest.raises(PipelineConfigError, match="'mmm' is no aten operator"):
        RecomputePolicy(save=("mmm",))
    with pytest.raises(PipelineConfigError, match="lists 2 policies for a pipeline of 3 stages"):
        StageOptions(recompute=[{"every": 1}, None]).recompute_policy(0, 3)
    assert StageOptions(recompute=True).recompute == RecomputePolicy()
    assert StageOptions(recompute=[True, None]).recompute_policy(0, 2) == RecomputePolicy()
    assert "recompute=[every=1, None]" in StageOptions(recompute=[{"every": 1}, False]).describe()
