"""Grouped-query models through the pipeline, traced and unchanged, bitwise equal to one device.

Llama, Qwen2, Mistral and Mixtral with 4 query heads over 2 key/value heads, 4 microbatches, 2
AdamW steps, in fp32 and under bf16 autocast: losses, first-step gradients and trained parameters
are ``torch.equal`` to the unsplit model accumulating the same microbatches. The stages call
``scaled_dot_product_attention`` as eager does (``conveyor.frontend.attention``); before, the trace
repeated the key/value heads under a materialised mask, and gradients differed by rounding
(fp32 ~1e-8, bf16 ~3e-4 in the embedding's). All ranks run in one process (InProcessLayout: the
numerics of Pipeline over gloo; tests/frontend/test_pipeline_models.py runs Llama over gloo).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import conveyor.schedule as cs
from conveyor import frontend
from conveyor.layout import InProcessLayout
from conveyor.options import StageOptions
from conveyor.pipe import Pipeline
from conveyor.testing.models import GROUPED_FAMILIES, grouped_heads_lm

NUM_MICROBATCHES = 4
NUM_STEPS = 2


def _model(family):
    model_class, config = grouped_heads_lm(family)
    torch.manual_seed(0)
    return model_class(config)


def _ids(step):
    return torch.randint(0, 96, (8, 12), generator=torch.Generator().manual_seed(step))


def _autocast(bf16):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)


@functools.cache
def _reference(family, bf16):
    model = _model(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], None
    for step in range(NUM_STEPS):
        total = None
        for ids in torch.tensor_split(_ids(step), NUM_MICROBATCHES):
            with _autocast(bf16):
                loss = model(ids, labels=ids).loss / NUM_MICROBATCHES
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        losses.append(total)
        grads = grads or {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, {name: p.detach().clone() for name, p in model.named_parameters()}


@functools.cache
def _split(family, num_stages):
    example = _ids(0)[: 8 // NUM_MICROBATCHES]
    return frontend.split_model(_model(family), num_stages, example_args=(example,),
                                example_kwargs={"labels": example}, split_method="uniform")


def _pipelined(family, schedule, bf16):
    sched = cs.build(schedule, ranks=2, microbatches=NUM_MICROBATCHES)
    stages = copy.deepcopy(_split(family, sched.num_stages).stage_modules())  # fresh weights, one trace
    pipe = Pipeline(stages, sched, loss_fn=lambda out, _target: out.loss,
                    stage=StageOptions(autocast=torch.bfloat16 if bf16 else None), layout=InProcessLayout())
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses, grads = [], None
    for step in range(NUM_STEPS):
        losses.append(pipe.step(_ids(step), labels=_ids(step)))
        grads = grads or {name: p.grad.clone() for name, p in pipe.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, {name: p.detach().clone() for name, p in pipe.named_parameters()}


CASES = [
    # Every built-in schedule (zero-bubble I/W splits included) runs grouped-head Mixtral in
    # tests/frontend/test_moe_losses.py; here each family under one schedule of each kind.
    *[(family, schedule, False) for family in GROUPED_FAMILIES for schedule in ("1f1b", "zbv")],
    *[(family, "zbv", True) for family in ("llama", "mixtral")],
    ("qwen2", "zb-h1", True),
]
# The whole family x schedule x precision grid is the extended tier (80 cases, about 3 minutes).
EXTENDED_CASES = [pytest.param(family, schedule, bf16, marks=pytest.mark.extended)
                  for family in GROUPED_FAMILIES for schedule in sorted(cs.available()) for bf16 in (False, True)
                  if (family, schedule, bf16) not in CASES]


@pytest.mark.parametrize(("family", "schedule", "bf16"), CASES + EXTENDED_CASES)
def test_grouped_query_model_trains_bitwise_equal_to_one_device(family, schedule, bf16):
    """CI twin of the extended grid (EXTENDED_CASES): this test's CASES, the same assertions on fewer cases."""
    losses, grads, params = _pipelined(family, schedule, bf16)
    want_losses, want_grads, want_params = _reference(family, bf16)
    assert grads.keys() == want_grads.keys()
    differ = {name: (grad - want_grads[name]).abs().max().item()
              for name, grad in grads.items() if not torch.equal(grad, want_grads[name])}
    assert not differ, f"first-step gradients differ (max abs): {differ}"
    assert all(torch.equal(got, want) for got, want in zip(losses, want_losses)), (losses, want_losses)
    for name, value in params.items():
        assert torch.equal(value, want_params[name]), f"{name} after {NUM_STEPS} steps differs"
