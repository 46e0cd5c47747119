"""pipe.step(Microbatches(inputs=..., targets=...)): microbatches of their own lengths, bitwise equal to one device.

Kept cheap for CI: one launch of 2 ranks runs every built-in schedule over shared memory (and
checks that a fixed-shape pipeline refuses a microbatch of another shape), one launch per other
transport runs one or two schedules, one launch of 4 ranks runs data parallel x pipeline. The
whole schedule x transport table: ``python -m benchmarks --varlen-parity``.
"""

from __future__ import annotations

import pytest
import torch

import conveyor
from conveyor import Microbatches
from conveyor.errors import PipelineConfigError
from conveyor.testing import run_ranks
from conveyor.testing.models import TinyConfig, build_stage, lm_loss
from conveyor.testing.references.schedule_parity import schedule_grid
from conveyor.testing.references.varlen import (
    differences,
    reference_replicas_varlen,
    reference_varlen,
    refusal,
    train_each,
    train_replicas_varlen,
    varlen_batches,
)


def _every_schedule_then_refusals(rank, world_size, cases, transport):
    return train_each(rank, world_size, cases, transport), [refusal(rank, world_size, how)
                                                            for how in ("process_group", "ordered")]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_every_schedule_with_variable_lengths_over_shared_memory_is_bitwise_and_fixed_shapes_refuse():
    cases = [(name, virtual) for name, _, virtual in schedule_grid((2,))]
    by_rank = run_ranks(_every_schedule_then_refusals, 2, args=(cases, "shared_memory"), timeout_s=240)
    found = []
    for index, (name, virtual) in enumerate(cases):
        found += differences(f"{name} V={virtual} shared_memory", [results[index] for results, _ in by_rank],
                             reference_varlen(name, virtual, 2))
    assert not found, "\n".join(found)
    sender_process_group, sender_ordered = by_rank[0][1]
    # Step 1 rotates the shapes: its microbatch 0 is (1, 8); the channel froze on step 0's last, (2, 7).
    assert "rank 0, stage 0, microbatch 0" in sender_process_group, sender_process_group
    assert "tensor [0] is (1, 8, 16) float32" in sender_process_group
    assert "the receiver was told (2, 7, 16) float32" in sender_process_group
    assert "fixed_shapes=True froze" in sender_process_group
    assert "rank 0, stage 0, microbatch 0" in sender_ordered and "variable_shapes=True" in sender_ordered


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("transport", "cases"), [
    ("process_group", [("1f1b", 1), ("zbv", 2)]),
    ("hybrid", [("interleaved-1f1b", 2)]),
    ("ordered", [("1f1b", 1), ("dualpipev", 2)]),
])
def test_other_transports_carry_each_microbatch_shape(transport, cases):
    by_rank = run_ranks(train_each, 2, args=(cases, transport), timeout_s=120)
    found = []
    for index, (name, virtual) in enumerate(cases):
        found += differences(f"{name} V={virtual} {transport}", [results[index] for results in by_rank],
                             reference_varlen(name, virtual, 2))
    assert not found, "\n".join(found)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_data_parallel_replicas_with_their_own_lengths_normalized_by_tokens_are_bitwise():
    by_rank = run_ranks(train_replicas_varlen, 4, args=("1f1b",), timeout_s=120)
    want_losses, want_grads = reference_replicas_varlen(num_stages=2)
    for rank, (losses, grads) in enumerate(by_rank):
        assert all(torch.equal(got, want) for got, want in zip(losses, want_losses)), (rank, losses, want_losses)
        for stage, named in grads.items():
            for param, grad in named.items():
                assert torch.equal(grad, want_grads[stage][param]), (rank, stage, param)


def _in_process(num_microbatches=4):
    cfg = TinyConfig(num_stages=2)
    return cfg, conveyor.Pipeline([build_stage(s, cfg) for s in range(2)], "1f1b", lm_loss,
                                  microbatches=num_microbatches, layout=conveyor.InProcessLayout())


def test_in_process_variable_lengths_return_one_output_per_microbatch():
    cfg, pipe = _in_process()
    inputs, targets = varlen_batches(cfg, step=0)
    loss, outputs = pipe.step(Microbatches(inputs=inputs, targets=targets), return_outputs=True)
    assert [tuple(o.shape) for o in outputs] == [(x.shape[0], x.shape[1], cfg.vocab_size) for (x,) in inputs]
    assert torch.equal(loss, reference_varlen("1f1b", 1, 2)[0][0])
    merged = pipe.forward(torch.cat([x for (x,) in inputs[:1]] * 2))  # a minibatch again: merged outputs
    assert isinstance(merged, torch.Tensor) and merged.shape[0] == 2 * inputs[0][0].shape[0]


@pytest.mark.parametrize(("given", "message"), [
    (Microbatches(inputs=[(torch.ones(1, 3, dtype=torch.long),)] * 3), "holds 3 microbatches, but the schedule runs 4"),
    (Microbatches(inputs=[{"ids": torch.ones(1, 3)}] * 3 + ["ids"]), "microbatch 3 is a str"),
    (Microbatches(inputs=[(torch.ones(1, 3, dtype=torch.long),)] * 4, targets=[None]),
     "targets=...\\) holds 1 targets"),
])
def test_given_microbatches_are_checked_before_anything_runs(given, message):
    _, pipe = _in_process()
    with pytest.raises(PipelineConfigError, match=message):
        pipe.step(given)


@pytest.mark.parametrize("beside", [dict(args=(torch.ones(4, 3),)), dict(kwargs={"mask": None}),
                                    dict(kwargs={"target": torch.ones(4)})])
def test_given_microbatches_refuse_a_minibatch_beside_them(beside):
    _, pipe = _in_process()
    with pytest.raises(PipelineConfigError, match="takes the microbatches already split"):
        pipe.step(Microbatches(inputs=[(torch.ones(1, 3),)] * 4), *beside.get("args", ()), **beside.get("kwargs", {}))


class _TakesTargetsAndMicrobatches(torch.nn.Module):
    """A first stage whose own forward has keyword inputs named ``targets`` and ``microbatches``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, x, *, targets, microbatches):
        return self.linear(x) * targets + microbatches


def _model_with_colliding_names():
    torch.manual_seed(0)
    return torch.nn.ModuleList([_TakesTargetsAndMicrobatches(), torch.nn.Linear(3, 1)])


def _reference(batches, labels):
    """One device: (loss_i / M).backward() for each microbatch i in order; the losses summed."""
    model = _model_with_colliding_names()
    total = None
    for (x, keywords), label in zip(batches, labels, strict=True):
        loss = torch.nn.functional.mse_loss(model[1](model[0](x, **keywords)), label) / len(batches)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total, [p.grad for p in model.parameters()]


def test_model_inputs_named_targets_and_microbatches_reach_the_model_on_both_paths():
    x, scale, shift, y = (torch.randn(8, 3, generator=torch.Generator().manual_seed(i)) for i in range(4))
    y = y[:, :1]
    split = [(x[2 * i:2 * i + 2], {"targets": scale[2 * i:2 * i + 2], "microbatches": shift[2 * i:2 * i + 2]})
             for i in range(4)]
    want_loss, want_grads = _reference(split, [y[2 * i:2 * i + 2] for i in range(4)])
    for how in ("minibatch", "given"):
        pipe = conveyor.Pipeline(list(_model_with_colliding_names()), "1f1b", torch.nn.functional.mse_loss,
                                 microbatches=4, layout=conveyor.InProcessLayout())
        if how == "minibatch":  # the model's keywords, split by rows as one device's loop splits them
            loss = pipe.step(x, targets=scale, microbatches=shift, target=y)
        else:
            loss = pipe.step(Microbatches(inputs=[{"x": a, **k} for a, k in split],
                                          targets=[y[2 * i:2 * i + 2] for i in range(4)]))
        assert torch.equal(loss, want_loss), how
        grads = [p.grad for p in pipe.parameters()]
        assert len(grads) == len(want_grads) and all(torch.equal(g, w) for g, w in zip(grads, want_grads)), how
