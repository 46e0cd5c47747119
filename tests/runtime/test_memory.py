"""pipe.memory(): the activation bytes autograd held, measured, against the simulator's memory model.

The stages are alike: BLOCKS blocks of Linear(WIDTH, WIDTH) + GELU, so every stage saves the
same tensors per microbatch: each Linear its input and each GELU its input, 2 x BLOCKS tensors of
MB x WIDTH floats (the first stage's input is a slice of the minibatch that needs no gradient,
but its Linear saves it for the weight gradient all the same). The last stage also runs the loss,
which saves one more, MB floats: (y.sum(-1) - t).pow(2) keeps only the base of pow. The
comparison with the simulator weighs each stage by its own measured bytes, so that difference is
counted, not hidden; it is also checked against the plain product (peak stage-microbatches x the
largest stage-microbatch's bytes), which it must stay within 10% of.

A split backward (I, then W) frees at I what only the input gradient needed: the saved tensors
of the operations above the stage's last weight use (here the last GELU's input, and the loss's
base). What W keeps is measured per stage and handed to the simulator as the zero-bubble paper's
M_W (``StageCosts.weight_activation_bytes``); counting the whole stage until W would overstate
zb-h2's last rank at P=4 by 28%.
"""

from __future__ import annotations

import pytest
import torch

import conveyor
import conveyor.schedule as cs
from conveyor.errors import PipelineConfigError, StageExecutionError
from conveyor.schedule.passes import executable
from conveyor.testing import run_ranks

WIDTH, BLOCKS, MB = 32, 2, 4  # MB: rows per microbatch
FLOAT = 4
BLOCK_TENSOR = MB * WIDTH * FLOAT  # one saved (MB, WIDTH) float tensor
LOSS_SAVED = MB * FLOAT


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny kernels: a second thread only waits (seconds on a busy machine)
    yield
    torch.set_num_threads(previous)


def uniform_stage(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(BLOCKS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def loss_fn(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (y.sum(-1) - t).pow(2).mean()


def batch(num_microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(MB * num_microbatches, WIDTH, generator=generator),
            torch.randn(MB * num_microbatches, generator=generator))


def cases() -> list[tuple[str, int, int]]:
    return [(name, ranks, info.default_virtual) for name, info in sorted(cs.available().items()) for ranks in (2, 4)]


def local_reports(schedule: cs.Schedule, recompute: bool = False) -> list:
    stages = [uniform_stage(s) for s in range(schedule.num_stages)]
    pipe = conveyor.Pipeline(stages, schedule, loss_fn,
                                  stage=conveyor.StageOptions(measure_memory=True,
                                                              recompute=recompute),
                                                              layout=conveyor.InProcessLayout())
    x, t = batch(schedule.num_microbatches)
    for _ in range(2):  # the second step's figures stand alone: nothing of the first is left held
        pipe.step(x, target=t)
    return pipe.memory(all_ranks=True)


def simulated(schedule: cs.Schedule, reports: list) -> tuple[list[float], list[float]]:
    """Per rank: the simulator's peak with each stage's measured bytes, and peak units x one stage-microbatch."""
    full = {s: b for r in reports for s, b in r.stage_bytes.items()}
    kept = {s: r.weight_bytes.get(s, b) for r in reports for s, b in r.stage_bytes.items()}
    split = {s for r in reports for s in r.weight_bytes}
    compute = executable(schedule).compute  # what the ranks run: an I right before its W is one B
    per_stage = cs.CostModel.per_stage([(1, 1, 1, full[s], kept[s]) for s in range(schedule.num_stages)])
    one = max(full.values())
    share = max((kept[s] / full[s] for s in split), default=1.0)  # what W keeps of a split stage
    units = cs.simulate(compute, cs.CostModel.uniform(schedule.num_stages, activation_bytes=1.0,
                                                      weight_activation_bytes=share)).peak_activation_bytes()
    return cs.simulate(compute, per_stage).peak_activation_bytes(), [u * one for u in units]


def check_against_simulator(schedule: cs.Schedule, reports: list) -> None:
    weighted, product = simulated(schedule, reports)
    for rank, report in enumerate(reports):
        for what, want in (("per-stage bytes", weighted[rank]), ("units x one stage-microbatch", product[rank])):
            assert abs(report.peak_bytes - want) <= 0.10 * want, (
                f"{schedule.name} P={schedule.num_ranks} rank {rank}: measured peak {report.peak_bytes} B, "
                f"simulated ({what}) {want:.0f} B"
            )


@pytest.mark.parametrize(("name", "num_ranks", "virtual"), cases())
def test_measured_peak_matches_the_simulator_for_every_schedule(name, num_ranks, virtual):
    schedule = cs.build(name, ranks=num_ranks, microbatches=2 * num_ranks, virtual=virtual)
    reports = local_reports(schedule)
    last = schedule.num_stages - 1
    split = {a.stage for program in executable(schedule).compute.programs for a in program
             if a.kind is cs.ActionKind.I}
    for rank, report in enumerate(reports):
        assert report.rank == rank and report.device_peak_bytes is None
        for stage, got in report.stage_bytes.items():
            assert got == 2 * BLOCKS * BLOCK_TENSOR + (LOSS_SAVED if stage == last else 0)
        # I frees the last GELU's input (and the loss's tensor): W keeps the rest.
        assert report.weight_bytes == {s: (2 * BLOCKS - 1) * BLOCK_TENSOR for s in report.stage_bytes if s in split}
    check_against_simulator(schedule, reports)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zbv"])
def test_checkpointing_keeps_only_the_stage_inputs(name):
    schedule = cs.build(name, ranks=2, microbatches=4)
    reports = local_reports(schedule, recompute=True)
    last = schedule.num_stages - 1
    for report in reports:
        # Each stage keeps its input; the loss runs outside the checkpoint and keeps its own.
        assert report.stage_bytes == {s: BLOCK_TENSOR + (LOSS_SAVED if s == last else 0)
                                      for s in schedule.stages_of(report.rank)}
    check_against_simulator(schedule, reports)
    plain = local_reports(schedule)
    assert all(c.peak_bytes * 3 < p.peak_bytes for c, p in zip(reports, plain))


def test_measuring_changes_no_result_and_memory_needs_the_flag():
    schedule = cs.build("zb-h2", ranks=2, microbatches=4)
    x, t = batch(4)
    results = []
    for measure in (False, True):
        stages = [uniform_stage(s) for s in range(2)]
        pipe = conveyor.Pipeline(stages, schedule, loss_fn,
                                 stage=conveyor.StageOptions(measure_memory=measure),
                                 layout=conveyor.InProcessLayout())
        results.append((pipe.step(x, target=t), [p.grad for p in pipe.parameters()]))
        if not measure:
            with pytest.raises(PipelineConfigError, match="measure_memory=True"):
                pipe.memory()
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def test_an_inplace_write_to_a_saved_tensor_is_still_caught():
    class Writes(torch.nn.Module):
        def forward(self, x):
            y = x * 2
            z = y.sin()  # saves y
            y.add_(1)
            return z

    pipe = conveyor.Pipeline([Writes(), uniform_stage(1)], "1f1b", loss_fn, microbatches=2,
                             stage=conveyor.StageOptions(measure_memory=True), layout=conveyor.InProcessLayout())
    with pytest.raises(StageExecutionError, match="modified by an inplace operation"):
        pipe.step(torch.randn(2 * MB, WIDTH, requires_grad=True), target=torch.zeros(2 * MB))


def _measure_across_processes(rank, world_size, name, transport):
    schedule = cs.build(name, ranks=world_size, microbatches=2 * world_size)
    stages = [uniform_stage(s) for s in schedule.stages_of(rank)]
    with conveyor.Pipeline(stages, schedule, loss_fn, stage=conveyor.StageOptions(measure_memory=True),
                           transfer=conveyor.TransferOptions(timeout_s=60, transport=transport)) as pipe:
        x, t = batch(schedule.num_microbatches)
        pipe.step(x if pipe.needs_inputs else None, target=t if pipe.needs_target else None)
        return pipe.memory(), pipe.memory(all_ranks=True)


@pytest.mark.parametrize(("name", "transport"), [("zb-h1", "shared_memory"), ("interleaved-1f1b", "process_group")])
def test_a_distributed_pipeline_measures_what_the_local_one_does(name, transport):
    schedule = cs.build(name, ranks=2, microbatches=4)
    results = run_ranks(_measure_across_processes, 2, args=(name, transport), timeout_s=120)
    local = local_reports(schedule)
    for rank, (mine, everyone) in enumerate(results):
        assert mine == everyone[rank] == local[rank]
    check_against_simulator(schedule, [mine for mine, _ in results])
