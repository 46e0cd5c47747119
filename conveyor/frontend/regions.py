"""A traced stage's blocks, and its graph with chosen blocks each run through a wrapper.

A traced stage is one flat graph of ATen operations, each carrying the module paths it ran
inside (``nn_module_stack``). Per-block activation checkpointing needs the block back as one
call: each maximal run of consecutive operations of a chosen block becomes a function of the
values it reads from outside (activations, the block's parameters and buffers), returning the
values used after it, and the stage graph calls ``wrap(function, block)`` in its place. The
operations, their order and their operands are unchanged, so the numbers are too.

A block is the outermost module whose path ends in an index (an item of a ``ModuleList`` or
``Sequential``: ``model.layers.3``), or, given a pattern, the outermost module whose path matches it
(see :func:`block_of`).

Example:
    >>> import torch, conveyor.frontend as frontend
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> stage = frontend.split_model(model, 1, example_args=(torch.randn(3, 4),)).stage_module(0)
    >>> stage.block_names()
    ['0', '1', '2']
"""

from __future__ import annotations

import itertools
import operator
import re
from collections.abc import Callable, Sequence

import torch.fx as fx

from conveyor.frontend.stage import _compile
from conveyor.frontend.trace import _module_paths

Wrap = Callable[[Callable, str], Callable]


def block_of(paths: Sequence[str], pattern: str | None = None) -> str | None:
    """The block of an operation run inside the modules ``paths`` (outermost first): the outermost
    path matching ``pattern``; without one, the outermost path up to its first index
    (``layers.3.up`` -> ``layers.3``, where ``layers.3`` is a ``ModuleDict`` never called itself)."""
    for path in paths:
        if pattern is not None:
            if re.fullmatch(pattern, path):
                return path
            continue
        parts = path.split(".")
        index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        if index is not None:
            return ".".join(parts[:index + 1])
    return None


def _node_block(node: fx.Node, pattern: str | None) -> str | None:
    if node.op != "call_function":
        return None
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and not _module_paths(node):
        return _node_block(node.args[0], pattern)  # a tuple output's item belongs where the tuple was made
    return block_of(_module_paths(node), pattern)


def graph_blocks(graph: fx.Graph, pattern: str | None = None) -> list[str]:
    """The blocks ``graph``'s operations run in, in order of their first operation."""
    blocks = (_node_block(node, pattern) for node in graph.nodes)
    return list(dict.fromkeys(block for block in blocks if block is not None))


def _runs(graph: fx.Graph, chosen: set[str], pattern: str | None) -> list[tuple[str, list[fx.Node]]]:
    """Maximal runs of consecutive operations of one chosen block."""
    grouped = itertools.groupby(graph.nodes, key=lambda node: _node_block(node, pattern))
    return [(block, list(nodes)) for block, nodes in grouped if block in chosen]


def wrap_blocks(graph: fx.Graph, chosen: set[str], wrap: Wrap, pattern: str | None = None) -> fx.Graph:
    """A copy of ``graph`` in which each run of a chosen block's operations is one call of
    ``wrap(function, block)(*values read)`` returning the tuple of values used after it."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = new.graph_copy(graph, env)
    new.output(out)
    for block, nodes in _runs(new, chosen, pattern):
        _replace_run(new, block, nodes, wrap)
    new.lint()
    return new


def _replace_run(graph: fx.Graph, block: str, nodes: list[fx.Node], wrap: Wrap) -> None:
    inside = set(nodes)
    reads = dict.fromkeys(used for node in nodes for used in node.all_input_nodes if used not in inside)
    results = [node for node in nodes if any(user not in inside for user in node.users)]
    function = _compile_run(list(reads), nodes, results, block)
    with graph.inserting_before(nodes[0]):
        call = graph.call_function(wrap(function, block), tuple(reads))
        items = [graph.call_function(operator.getitem, (call, i)) for i in range(len(results))]
    for result, item in zip(results, items):
        result.replace_all_uses_with(item, delete_user_cb=lambda user: user not in inside)
    for node in reversed(nodes):
        graph.erase_node(node)


def _compile_run(reads: list[fx.Node], nodes: list[fx.Node], results: list[fx.Node], block: str) -> Callable:
    """A Python function running ``nodes`` on values standing for ``reads``, returning ``results``."""
    sub = fx.Graph()
    env = {read: sub.placeholder(f"read_{i}") for i, read in enumerate(reads)}
    for node in nodes:
        env[node] = sub.node_copy(node, lambda source: env[source])
    sub.output(tuple(env[node] for node in results))
    forward, _ = _compile(sub, f"block {block}")

    def run_block(*values):
        return forward(None, *values)

    run_block.__name__ = "block_" + re.sub(r"\W", "_", block)
    return run_block
