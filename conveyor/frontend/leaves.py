"""Leaves of the trace: the experts modules of a mixture of experts, kept whole and placed by their name.

A transformers 5 experts module (3-D ``gate_up_proj`` / ``down_proj`` sharing dim 0, ``forward(hidden_states,
top_k_index, top_k_weights)``: :func:`conveyor.expert_option.is_stacked_experts`) routes its tokens by their
values, so tracing into it either fails (the eager loop over the experts hit) or bakes the expert and token
counts into ~30 operations that nothing can reroute. While tracing, its forward is one opaque operation
(``conveyor::experts_leaf``, a ``torch.library.custom_op`` whose fake gives an output shaped like
``hidden_states``, as every such module returns), reading the module's own tensors, so the splitter places
the operation, and its tensors, in one stage by the module's name. Each stage graph then calls the module
itself (:func:`restore_leaves`): the stage holds a copy of it at its original path, holding the stage's
tensors under their original names; it runs the model's own code eagerly, and expert parallelism finds and
reroutes it as it does on hand-built stages.

The trace takes leaves only where a stage part asks for them (``StagePart.trace_leaves``: expert parallelism's,
``conveyor.pipeline`` with ``DistributedLayout(expert_parallel=...)``):
transformers' experts code takes another path when traced (its ``grouped_mm_fallback`` custom op) than
eagerly (``torch._grouped_mm``), so a leaf changes the kernels, and without expert parallelism the traced
path keeps what one device compares to and what tensor parallelism has rules for.

Example:
    >>> import torch
    >>> with experts_as_leaves(torch.nn.Linear(2, 2)) as paths:
    ...     paths
    []
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from conveyor.errors import PipelineConfigError
from conveyor.expert_option import is_stacked_experts


@torch.library.custom_op("conveyor::experts_leaf", mutates_args=())
def experts_leaf(inputs: list[torch.Tensor], state: list[torch.Tensor], path: str) -> torch.Tensor:
    """The experts module at ``path`` as one operation of a trace; only its fake runs (while tracing)."""
    raise RuntimeError(f"the experts leaf {path!r} of a trace ran outside it: stage graphs call the module itself "
                       "(conveyor.frontend.leaves.restore_leaves)")


@experts_leaf.register_fake
def _experts_leaf_shape(inputs: list[torch.Tensor], state: list[torch.Tensor], path: str) -> torch.Tensor:
    return torch.empty_like(inputs[0])  # an experts module returns its tokens' new hidden states


@contextmanager
def experts_as_leaves(model: nn.Module, names: Sequence[str] | None = None) -> Iterator[list[str]]:
    """Within, each experts module of ``model`` (those ``names`` name; None: every one found by structure) runs as
    one ``conveyor::experts_leaf`` operation; yields their names. Their forwards are put back however it ends."""
    modules = dict(model.named_modules())
    wanted = [name for name in modules if is_stacked_experts(modules[name])] if names is None else list(names)
    misfits = [name for name in wanted if name not in modules or not is_stacked_experts(modules[name])]
    if misfits:
        raise PipelineConfigError(f"trace leaves {misfits} are not experts modules of the model (3-D weights, "
                                  "forward(hidden_states, top_k_index, top_k_weights)): name only such modules")
    found = [(name, modules[name]) for name in wanted]
    own_forwards = [module.__dict__.get("forward") for _, module in found]
    try:
        for name, module in found:
            module.forward = functools.partial(_leaf_forward, module, name)
        yield [name for name, _ in found]
    finally:
        for (_, module), own in zip(found, own_forwards):
            if own is None:
                del module.forward
            else:
                module.forward = own


def _leaf_forward(module: nn.Module, path: str, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
    """An experts module's forward while tracing: its inputs and tensors into one opaque operation."""
    state = [*module.parameters(), *module.buffers()]
    return experts_leaf([hidden_states, top_k_index, top_k_weights], state, path)


def restore_leaves(graph: fx.Graph) -> list[str]:
    """Turn each experts leaf of a stage graph into a call of the module at its path; return the paths.

    The tensors the leaf read stay in the stage (the module copy holds them), no longer read by the graph.
    """
    paths = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.conveyor.experts_leaf.default:
            continue
        inputs, state, path = node.args
        with graph.inserting_before(node):
            call = graph.call_module(path, tuple(inputs))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        for tensor in state:
            if tensor.op == "get_attr" and not tensor.users:
                graph.erase_node(tensor)
        paths.append(path)
    return paths


def held_in_order(tensors: Mapping[str, tuple[torch.Tensor, bool]],
                  submodules: Mapping[str, nn.Module]) -> list[tuple[str, tuple[Any, bool]]]:
    """What a stage module registers, by name, in order: its tensors, each leaf module (a dotted path) just
    before its first tensor, which it then holds (the parameters keep the model's order), then its nested
    graphs and any leaf that holds no tensor.

    Example:
        >>> held_in_order({"a.w": (1, True), "b.e.w": (2, True)}, {"b.e": "E", "g": "G"})
        [('a.w', (1, True)), ('b.e', ('E', True)), ('b.e.w', (2, True)), ('g', ('G', True))]
    """
    leaves = {name: module for name, module in submodules.items() if "." in name}
    held: list[tuple[str, tuple[Any, bool]]] = []
    for name, tensor in tensors.items():
        held += [(path, (leaves.pop(path), True)) for path in list(leaves) if name.startswith(path + ".")]
        held.append((name, tensor))
    held += [(name, (module, True)) for name, module in submodules.items() if "." not in name or name in leaves]
    return held


def hollow_copy(module: nn.Module) -> nn.Module:
    """``module`` without its tensors (its submodules' too): the stage registers its own under their names.

    Example:
        >>> sorted(dict(hollow_copy(torch.nn.Linear(2, 2)).named_parameters()))
        []
    """
    hollow = copy.copy(module)
    hollow._parameters = {}
    hollow._buffers = {}
    hollow._non_persistent_buffers_set = set()
    hollow._modules = {name: hollow_copy(child) for name, child in module._modules.items() if child is not None}
    hollow.__dict__.pop("forward", None)
    return hollow


def leaves_as_shapes(stage: nn.Module) -> None:
    """Let each experts module of ``stage`` give only its output's shape (what a check on meta tensors needs:
    the model's expert code may have no meta kernel, as ``torch._grouped_mm`` in float32)."""
    for module in stage.modules():
        if is_stacked_experts(module):
            module.forward = _experts_leaf_shape_only


def _experts_leaf_shape_only(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    return _experts_leaf_shape([hidden_states, top_k_index, top_k_weights], [], "")
