"""Compare a split model, run stage after stage, with the unsplit model (bitwise)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

import conveyor.frontend as frontend


def check_parity(
    model: torch.nn.Module,
    split: frontend.ModelSplit,
    args: tuple = (),
    kwargs: dict | None = None,
    loss_fn: Callable[[Any], torch.Tensor] = lambda out: out.loss,
    seed: int = 0,
    reference_kwargs: dict | None = None,
) -> list[frontend.StageModule]:
    """Assert outputs, untied gradients and buffers are bitwise equal; tied gradients allclose.

    The reference is a deep copy of ``model`` run eagerly, given ``reference_kwargs`` on top
    of ``kwargs`` (``use_cache=False``, as a Hugging Face model is traced); the stages are
    built from ``split`` (they share the original model's untied tensors). Returns the stages.
    """
    kwargs = kwargs or {}
    model.zero_grad(set_to_none=True)  # stages share the model's untied parameters
    reference = copy.deepcopy(model)
    torch.manual_seed(seed)
    expected = reference(*args, **kwargs, **(reference_kwargs or {}))
    loss_fn(expected).backward()

    stages = split.stage_modules()
    torch.manual_seed(seed)
    got = frontend.run_sequential(stages, args, kwargs, loss_fn=loss_fn)

    assert type(got) is type(expected)
    expected_leaves, expected_spec = pytree.tree_flatten(expected)
    got_leaves, got_spec = pytree.tree_flatten(got)
    assert got_spec == expected_spec
    for want, have in zip(expected_leaves, got_leaves):
        if isinstance(want, torch.Tensor):
            assert torch.equal(want, have)
        else:
            assert want == have

    tied_names = {name for group in split.tied_groups for name in group.names}
    stage_grads: dict[str, torch.Tensor] = {}
    for stage in stages:
        for name, parameter in stage.named_parameters():
            if name not in tied_names:
                assert name not in stage_grads, f"{name} held by two stages but not reported tied"
                stage_grads[name] = parameter.grad
    for name, parameter in reference.named_parameters():
        if name in tied_names:
            continue
        assert parameter.grad is not None and stage_grads[name] is not None, name
        assert torch.equal(parameter.grad, stage_grads[name]), f"gradient of {name} differs"
    for group in split.tied_groups:
        total = sum(stages[stage].get_parameter(name).grad for stage, name in group.uses)
        want = reference.get_parameter(group.names[0]).grad
        # Sum of one gradient per copy: equal up to the order of additions.
        assert torch.allclose(total, want, rtol=1e-6, atol=1e-7), group

    reference_buffers = dict(reference.named_buffers())
    for stage in stages:
        for name, buffer in stage.named_buffers():
            if name in reference_buffers:
                assert torch.equal(buffer, reference_buffers[name]), f"buffer {name} differs"
    return stages


def check_names(
    model: torch.nn.Module, split: frontend.ModelSplit, stages: list[torch.nn.Module]
) -> None:
    """Stage state_dict keys are model keys with equal values; every model tensor is on a stage."""
    model_state = model.state_dict()
    held: set[str] = set()
    for index, stage in enumerate(stages):
        state = stage.state_dict()
        for name, value in state.items():
            assert name in model_state, f"stage {index} has {name}, not a model key"
            assert torch.equal(value, model_state[name]), name
        held |= set(state)
        names = {name for name, _ in stage.named_parameters(remove_duplicate=False)}
        assert names == set(split.stage_parameter_names(index))
    # Tied aliases count once: a key is covered if any name of the same tensor is held.
    alias_of = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        alias_of.setdefault(id(tensor), set()).add(name)
    for names in alias_of.values():
        persistent = names & set(model_state)
        if persistent:
            assert persistent & held, f"{sorted(names)} is on no stage"
