"""Reshard: saved with pp=4 under 1f1b, loaded with pp=2 (zbv V=2, interleaved-1f1b V=2), pp=1 and unsplit.

Values must be identical (torch.equal), optimizer state included; a tied parameter is saved
once, by its first name, and every copy loads it. A checkpoint of another model is refused on
every rank alike, and the pipeline goes on working.
"""

from __future__ import annotations

import pytest
import torch

import conveyor
import conveyor.checkpoint as ckpt
import conveyor.frontend as frontend
from conveyor.errors import CheckpointMismatchError
from conveyor.testing import run_ranks
from conveyor.testing.rigs.checkpoint_models import (
    MICROBATCHES,
    SPLITS,
    assert_same_tensors,
    ce_loss,
    lm_batch,
    named_optimizer_state,
    tied_lm,
)

pytestmark = pytest.mark.distributed

TIED = {"head.weight": "embed.weight"}  # the name a stage may hold -> the tensor's first name


@pytest.fixture(scope="module", autouse=True)
def _traced_once_here():
    """Trace once in the test process, so that forked ranks find torch.export warmed up (~2 s each)."""
    frontend.split_model(tied_lm(0), 2, split_points=SPLITS[2], example_args=(lm_batch(0)[0][:2],))


def _pipeline(world_size, schedule, virtual, seed):
    stages = world_size * (virtual or 1)
    return conveyor.pipeline(tied_lm(seed), example_args=(lm_batch(0)[0][:2],), split_points=SPLITS[stages],
                             schedule=schedule, microbatches=MICROBATCHES, loss_fn=ce_loss,
                             options=conveyor.PipelineOptions(virtual=virtual,
                                                              transfer=conveyor.TransferOptions(timeout_s=60)))


def _by_first_name(pipe, optimizer):
    """This rank's parameters and optimizer state, keyed by each tensor's first name."""
    names = {id(p): TIED.get(n, n) for n, p in pipe.named_parameters()}
    params = {names[id(p)]: p.detach().clone() for _, p in pipe.named_parameters()}
    return params, named_optimizer_state(optimizer, names)


def _save(rank, world_size, path):
    pipe = _pipeline(world_size, "1f1b", None, seed=0)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    for step in range(2):
        ids, targets = lm_batch(step)
        pipe.step(ids, target=targets)
        optimizer.step()
        optimizer.zero_grad()
    ckpt.save(path, pipe, optimizer, extra={"step": 2})
    return _by_first_name(pipe, optimizer)


def _load(rank, world_size, schedule, virtual, path, save_to, wrong):
    pipe = _pipeline(world_size, schedule, virtual, seed=world_size + 10)  # other values until loaded
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=5e-2)
    assert ckpt.load(path, pipe, optimizer) == {"step": 2}
    loaded = _by_first_name(pipe, optimizer)
    if save_to:
        ckpt.save(save_to, pipe, optimizer, extra={"step": 2})
    refusal = None
    if wrong:
        try:
            ckpt.load(wrong, pipe, optimizer)
        except CheckpointMismatchError as exc:
            refusal = str(exc)
        ids, targets = lm_batch(5)
        pipe.step(ids, target=targets)  # still usable after a refused load
    return loaded, refusal


def _merge(results):
    params, states = {}, {}
    for rank_params, rank_states in results:
        for name, value in rank_params.items():
            assert name not in params or torch.equal(params[name], value), f"copies of {name} differ"
            params[name] = value
        states.update(rank_states)
    return params, states


def test_pp4_loads_into_pp2_pp1_other_schedules_and_the_unsplit_model(tmp_path):
    pp4 = tmp_path / "pp4"
    want_params, want_states = _merge(run_ranks(_save, 4, args=(str(pp4),), timeout_s=120))
    assert set(want_params) == {n for n, _ in tied_lm(0).named_parameters()}

    wrong = tmp_path / "narrow"
    ckpt.save(wrong, tied_lm(0, dim=8))  # another configuration, saved from one process
    zbv = run_ranks(_load, 2, args=("zbv", 2, str(pp4), str(tmp_path / "pp2"), str(wrong)), timeout_s=120)
    refusals = {refusal for _, refusal in zbv}  # every rank raises the same error: the first problem
    assert len(refusals) == 1 and "'embed.weight' has shape [32, 16] here but [32, 8]" in refusals.pop()
    merged = _merge([loaded for loaded, _ in zbv])  # each rank holds stages (0, 3) or (1, 2)
    assert_same_tensors(merged[0], want_params, "zbv V=2 parameters")
    assert_same_tensors(merged[1], want_states, "zbv V=2 optimizer state")

    interleaved = run_ranks(_load, 2, args=("interleaved-1f1b", 2, str(pp4), None, None), timeout_s=120)
    merged = _merge([loaded for loaded, _ in interleaved])
    assert_same_tensors(merged[0], want_params, "interleaved parameters")
    assert_same_tensors(merged[1], want_states, "interleaved optimizer state")

    # pp=4 -> pp=2 (saved again under zbv) -> pp=1 (one process, world 1).
    (pp1,) = run_ranks(_load, 1, args=("1f1b", None, str(tmp_path / "pp2"), None, None), timeout_s=120)
    merged = _merge([pp1[0]])
    assert_same_tensors(merged[0], want_params, "pp=1 parameters")
    assert_same_tensors(merged[1], want_states, "pp=1 optimizer state")

    # The unsplit model, in this process: to_state_dict, and load() with its optimizer.
    state = ckpt.to_state_dict(pp4)
    assert list(state) == list(tied_lm(0).state_dict())  # the model's own order, tied name included
    assert state["head.weight"] is state["embed.weight"]
    model = tied_lm(99)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-2)
    ckpt.load(pp4, model, optimizer)
    assert_same_tensors(dict(model.named_parameters()), want_params, "unsplit parameters")
    assert_same_tensors(named_optimizer_state(optimizer, {id(p): n for n, p in model.named_parameters()}),
                        want_states, "unsplit optimizer state")
    assert_same_tensors({k: v for k, v in state.items() if k in want_params}, want_params, "to_state_dict")
