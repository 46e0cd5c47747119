"""What a pipeline does after a step raised, and with stages that hold nothing to train."""

from __future__ import annotations

import copy
import os
import time

import torch
from torch import nn

import conveyor
import conveyor.schedule as cs
from conveyor.layout import InProcessLayout
from conveyor.pipe import Pipeline
from conveyor.runtime.lifecycle.peers import process_alive
from conveyor.testing import run_ranks


class _Checked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.isnan(x).any():
            raise ValueError("NaN in the batch")  # a user's own check
        return self.linear(x)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def test_a_step_after_a_caught_error_is_exact_in_one_process():
    torch.manual_seed(0)
    reference = [nn.Linear(6, 6), _Checked(), nn.Linear(6, 6), nn.Linear(6, 6)]
    stages = copy.deepcopy(reference)
    pipe = Pipeline(stages, schedule="1f1b", microbatches=4, loss_fn=_mse, layout=InProcessLayout())
    bad = torch.randn(8, 6)
    bad[6:] = float("nan")  # the last microbatch fails on stage 1, after the others sent
    try:
        pipe.step(bad, target=torch.randn(8, 6))
    except Exception as exc:
        assert "NaN in the batch" in str(exc)
    for module in stages:
        module.zero_grad(set_to_none=True)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    loss = pipe.step(x, target=y)
    want = torch.zeros(())
    for xi, yi in zip(x.tensor_split(4), y.tensor_split(4)):
        out = xi
        for module in reference:
            out = module(out)
        microbatch_loss = _mse(out, yi) / 4
        microbatch_loss.backward()
        want = want + microbatch_loss.detach()
    assert torch.equal(loss, want)
    for got, expected in zip(stages, reference):
        for (name, p), q in zip(got.named_parameters(), expected.parameters()):
            assert torch.equal(p.grad, q.grad), name


def test_clipping_with_a_stage_that_has_nothing_to_train_in_one_process():
    torch.manual_seed(0)
    stages = [nn.Linear(4, 4), nn.Tanh()]
    pipe = Pipeline(stages, schedule="1f1b", microbatches=2, loss_fn=_mse, layout=InProcessLayout())
    pipe.step(torch.randn(4, 4), target=torch.randn(4, 4))
    want = torch.nn.utils.get_total_norm([p.grad for p in stages[0].parameters()])
    assert torch.equal(pipe.clip_grad_norm_(1e9), want)


def _clip_with_an_empty_rank(rank, world_size):
    torch.manual_seed(0)
    module = nn.Linear(4, 4) if rank == 0 else nn.Tanh()
    pipe = conveyor.Pipeline([module], schedule=cs.build("1f1b", ranks=2, microbatches=2), loss_fn=_mse,
                             transfer=conveyor.TransferOptions(timeout_s=60))
    pipe.step(torch.randn(4, 4) if rank == 0 else None, target=torch.randn(4, 4) if rank == 1 else None)
    return pipe.clip_grad_norm_(1e9)


def test_clipping_with_a_rank_that_has_nothing_to_train():
    norms = run_ranks(_clip_with_an_empty_rank, 2, timeout_s=60)
    assert torch.equal(norms[0], norms[1]) and norms[0] > 0


def test_an_exited_peer_not_yet_reaped_counts_as_gone():
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    try:
        deadline = time.monotonic() + 10
        while process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not process_alive(pid)  # a zombie: signal 0 still reaches it
    finally:
        os.waitpid(pid, 0)
    assert process_alive(os.getpid())


def test_the_in_process_pipeline_answers_what_the_distributed_one_does():
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)), nn.Linear(4, 1)]
    pipe = Pipeline(stages, schedule="1f1b", microbatches=2, loss_fn=_mse, layout=InProcessLayout())
    assert [name for name, _ in pipe.named_parameters()] == ["0.weight", "0.bias", "weight", "bias"]
    assert pipe.eval() is pipe and not stages[0].training
    assert pipe.train() is pipe and stages[0].training
    assert set(pipe.state_dict()) == {"0.weight", "0.bias", "weight", "bias"}
