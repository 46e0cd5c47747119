"""conveyor.pipeline(..., schedule="auto") and (..., plan=PATH) on 2 ranks."""

from __future__ import annotations

import torch
from torch import nn

import conveyor
from conveyor.testing import run_ranks


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)], nn.Linear(16, 2))


def _auto_then_from_file(rank, world_size, path):
    torch.set_num_threads(1)
    x, y = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)), torch.zeros(8, 2)
    pipe = conveyor.pipeline(_model(), example_args=(x[:1],), schedule="auto", loss_fn=nn.functional.mse_loss,
                             options=conveyor.PipelineOptions(
                                 plan_options=conveyor.plan.PlanOptions(global_batch=8, memory_per_rank="1GiB",
                                                                        schedules=["1f1b", "zb-h1"],
                                                                        measure=conveyor.plan.Measurement(repeats=1)),
                                 transfer=conveyor.TransferOptions(timeout_s=60)))
    auto = (pipe.schedule.name, pipe.schedule.num_microbatches)
    loss = pipe.step(x, target=y)
    plan = conveyor.plan.plan(_model(), x[:2], ranks=2, global_batch=8, schedules=["gpipe"], microbatches=[2],
                              measure=conveyor.plan.Measurement(repeats=1))
    if rank == 0:
        plan.save(path)
    torch.distributed.barrier()
    again = conveyor.pipeline(_model(), example_args=(x[:1],), plan=path, loss_fn=nn.functional.mse_loss,
                              options=conveyor.PipelineOptions(transfer=conveyor.TransferOptions(timeout_s=60)))
    again.step(x, target=y)
    return auto, loss, (again.schedule.name, again.schedule.num_microbatches)


def test_auto_plans_on_rank_0_and_a_plan_file_sets_schedule_and_microbatches(tmp_path):
    results = run_ranks(_auto_then_from_file, 2, args=(str(tmp_path / "plan.json"),), timeout_s=120)
    (auto0, _, again0), (auto1, _, again1) = results
    assert auto0 == auto1 and auto0[0] in ("1f1b", "zb-h1")
    assert again0 == again1 == ("gpipe", 2)


def test_a_plan_for_tensor_parallel_ranks_is_refused_without_a_tp_mesh():
    import dataclasses

    import pytest

    from conveyor.errors import PipelineConfigError
    from conveyor.plan.result import Plan

    plan = dataclasses.replace(Plan("gpipe", 2, 1, 2, 8, ("2",), 1.0, 0.1, (1e6, 1e6), (0.5, 0.5), 4e9),
                               tensor_parallel=2)
    layout = conveyor.InProcessLayout(ranks=2)
    with pytest.raises(PipelineConfigError, match='pipeline ranks of 2 tensor-parallel ranks but the mesh\'s "tp" '
                                                  'size is 1; build the pipeline on a mesh with tp=2'):
        conveyor.pipeline(_model(), example_args=(torch.zeros(4, 16),), plan=plan, loss_fn=nn.functional.mse_loss,
                          layout=layout)
