"""Traced stages with a dynamic sequence (and batch) dimension: microbatches of their own lengths, bitwise.

``SplitOptions(dynamic_shapes=...)`` traces once with torch.export's dynamic shapes; every stage
then runs each microbatch at its own size, the same operations eager runs. One launch of 2 ranks
runs an unchanged grouped-head Llama under 1f1b over the ordered (NCCL-style) transport against
one device looping over the same microbatches (the schedule x transport table of traced runs:
``python -m benchmarks --varlen-parity``; tracing a dynamic model costs seconds, so CI runs one).
"""

from __future__ import annotations

import pytest
import torch

import conveyor
from conveyor.errors import SpecMismatchError, TracingError
from conveyor.frontend import split_model
from conveyor.options import PipelineOptions, SplitOptions
from conveyor.testing import run_ranks
from conveyor.testing.models.hf import llama, token_batch

DYNAMIC = {"input_ids": {0: "batch", 1: "seq"}, "labels": {0: "batch", 1: "seq"}}
# (batch size, length) of each microbatch; the second step reverses them.
SHAPES = [(2, 5), (1, 12), (3, 3), (2, 9)]


def _model():
    torch.manual_seed(0)
    model_class, config = llama(num_layers=2)
    return model_class(config)


def _microbatches(step):
    shapes = SHAPES if step % 2 == 0 else SHAPES[::-1]
    return [token_batch(batch, length, seed=10 * step + index) for index, (batch, length) in enumerate(shapes)]


def _example():
    batch = token_batch(2, 8)
    return {"input_ids": batch["input_ids"], "labels": batch["labels"].clone()}


def test_one_dynamic_trace_runs_every_length_bitwise_and_checks_the_other_dims():
    torch.set_num_threads(1)
    model = _model()
    split = split_model(model, 2, example_kwargs=_example(), dynamic_shapes=DYNAMIC)
    stages = split.stage_modules()
    for batch in _microbatches(0):
        assert torch.equal(stages[1](*stages[0](**batch)).loss, model(**batch).loss)
    wrong_dtype = {"input_ids": torch.ones(2, 4), "labels": torch.ones(2, 4, dtype=torch.long)}
    with pytest.raises(SpecMismatchError, match=r"split for tensor\[\*, \*\] int64"):
        stages[0](**wrong_dtype)


class _GuardsOnLength(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x) * 2 if x.shape[1] == 5 else self.linear(x)


def test_a_dim_that_tracing_fixes_anyway_is_named():
    with pytest.raises(TracingError, match=r"x dim 1 \(= 5\)"):
        split_model(_GuardsOnLength(), 1, example_args=(torch.ones(2, 5, 4),), dynamic_shapes={"x": {1: "seq"}})


def _train(rank, world_size, cases):
    results = []
    for schedule, virtual, transport in cases:
        pipe = conveyor.pipeline(
            _model(), example_kwargs=_example(), schedule=schedule, microbatches=len(SHAPES),
            loss_fn=lambda output, _target: output.loss,
            options=PipelineOptions(virtual=virtual, split=SplitOptions(dynamic_shapes=DYNAMIC),
                                    transfer=conveyor.TransferOptions(timeout_s=60, transport=transport,
                                                                      variable_shapes=transport == "ordered")))
        losses = [pipe.step(conveyor.Microbatches(inputs=_microbatches(step) if pipe.needs_inputs else None))
                  for step in range(2)]
        results.append((losses, {name: p.grad.clone() for name, p in pipe.named_parameters()}))
        pipe.close()
    return results


def _reference():
    model = _model()
    losses = []
    for step in range(2):
        total = None
        for batch in _microbatches(step):
            loss = model(**batch).loss / len(SHAPES)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        losses.append(total)
    return losses, {name: p.grad for name, p in model.named_parameters()}


# Every schedule (each traces the model again) is the extended tier; the hand-built table covers every
# schedule and transport in CI (tests/runtime/test_varlen.py).
EVERY_SCHEDULE = [(name, None, "shared_memory") for name in sorted(conveyor.schedule.available())]


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("cases", [[("1f1b", None, "ordered")],
                                   pytest.param(EVERY_SCHEDULE, marks=pytest.mark.extended)],
                         ids=["1f1b-ordered", "every-schedule"])
def test_traced_llama_with_variable_lengths_is_bitwise_across_ranks(cases):
    """CI twin of ``[every-schedule]``: ``[1f1b-ordered]`` (the same assertions, one schedule)."""
    by_rank = run_ranks(_train, 2, args=(cases,), timeout_s=60 + 60 * len(cases))
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want_losses, want_grads = _reference()
    finally:
        torch.set_num_threads(previous)
    for index, (schedule, _, transport) in enumerate(cases):
        for rank, results in enumerate(by_rank):
            losses, grads = results[index]
            where = f"{schedule} over {transport}, rank {rank}"
            assert all(torch.equal(got, want) for got, want in zip(losses, want_losses)), (where, losses, want_losses)
            assert grads, where
            for name, grad in grads.items():
                assert torch.equal(grad, want_grads[name]), f"{where}: {name}"
