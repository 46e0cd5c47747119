"""A model that is not a chain, split by the frontend and trained through the pipeline runtime.

All ranks run in one process (InProcessLayout: the numerics of Pipeline over gloo). Two encoders
whose outputs meet late land on different stages; the image features cross the text stages
untouched, and the mask and labels are inputs the last stage uses. Bitwise equal to one device.
"""

from __future__ import annotations

import pytest
import torch

import conveyor.schedule as cs
from conveyor import frontend
from conveyor.layout import InProcessLayout
from conveyor.options import WholeModel
from conveyor.pipe import Pipeline
from conveyor.testing.models import TwoEncoders, two_encoder_batch

NUM_MICROBATCHES = 2
NUM_STEPS = 3


def _batches():
    return [two_encoder_batch(batch=4, seed=step) for step in range(NUM_STEPS)]


def _reference():
    torch.manual_seed(0)
    model = TwoEncoders()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in _batches():
        total = None
        for part in zip(*(torch.tensor_split(t, NUM_MICROBATCHES) for t in batch)):
            loss = model(*part)["loss"] / NUM_MICROBATCHES
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        losses.append(total)
        optimizer.step()
        optimizer.zero_grad()
    return losses, dict(model.named_parameters())


@pytest.mark.parametrize(("schedule", "num_ranks", "virtual", "split_points"), [
    ("1f1b", 3, None, ["embed", "text.2"]),
    ("zbv", 2, 2, ["embed", "text.1", "text.2"]),
])
def test_two_encoders_train_through_the_pipeline_bitwise(schedule, num_ranks, virtual, split_points):
    torch.manual_seed(0)
    model = TwoEncoders()
    example = tuple(t[: 4 // NUM_MICROBATCHES] for t in _batches()[0])
    sched = cs.build(schedule, ranks=num_ranks, microbatches=NUM_MICROBATCHES, virtual=virtual)
    split = frontend.split_model(model, sched.num_stages, example_args=example, split_points=split_points)
    assert split.stage_parameter_names(0)[0].startswith("image.")
    assert split.stage_parameter_names(1)[0].startswith("embed.")
    pipe = Pipeline(split.stage_modules(), sched, loss_fn=lambda out, _target: out["loss"],
                    model=WholeModel(tied_parameters=split.tied_groups), layout=InProcessLayout())
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses = []
    for batch in _batches():
        losses.append(pipe.step(*batch))
        optimizer.step()
        optimizer.zero_grad()
    want_losses, want_params = _reference()
    assert all(torch.equal(g, w) for g, w in zip(losses, want_losses))
    got = {n: p for runner in pipe.runners.values() for n, p in runner.module.named_parameters()}
    assert got.keys() == want_params.keys()
    for name, value in got.items():
        assert torch.equal(value, want_params[name]), name
