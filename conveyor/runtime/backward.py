"""Backward of one stage on one microbatch: full (B), or input-gradient (I) then weight-gradient (W).

The I/W split works on any autograd graph, with no change to the model:

1. Walk the graph from the stage outputs. Nodes from which a stage input can
   be reached form the *input path*; the rest that reach a parameter form the
   *weight region*.
2. I runs ``autograd.grad`` towards the stage inputs only. Nodes on the input
   path whose other edges lead into the weight region (an ``addmm`` whose
   ``mat2`` is a weight) are *frontier* nodes: a pre-hook keeps the gradient
   they receive.
3. W re-enters the graph at the frontier nodes with the kept gradients and
   asks only for the parameters of that frontier group, so the engine computes
   the weight edges and nothing on the input path again.

Each parameter then receives exactly the gradient a full backward would give
it, through the same kernels on the same operands: bit-for-bit equal.
Frontier nodes that reach a common parameter (a weight used twice) form one
group and one ``autograd.grad`` call, so the engine sums their contributions
as a full backward does.

Example:
    >>> import torch
    >>> lin = torch.nn.Linear(3, 3)
    >>> x = torch.randn(2, 3, requires_grad=True)
    >>> y = lin(x)
    >>> pending = backward_input([y], [torch.ones(2, 3)], [x], list(lin.parameters()))
    >>> x_grad = pending.input_grads[0]; lin.weight.grad is None
    True
    >>> pending.backward_weight(); lin.weight.grad is not None
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

Root = torch.Tensor | GradientEdge


def _edge(root: Root) -> GradientEdge:
    return root if isinstance(root, GradientEdge) else get_gradient_edge(root)


try:  # torch 2.13 (pinned): the engine entry autograd.grad/backward use, without their Python checks
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # pragma: no cover - another torch
    _engine_run_backward = None


def _run_engine(edges, grads, inputs, *, accumulate: bool, keep_graph: bool = True):
    """One engine run from ``edges`` to ``inputs``; grads were built here, so they need no checks.

    ``accumulate``: add into ``.grad`` through the AccumulateGrad nodes (of ``inputs``, or of
    every leaf when ``inputs`` is empty: a plain ``backward``); else return the gradients (as
    ``autograd.grad``). Skipping autograd's Python checks matters beyond their cost: for
    GradientEdge roots they import sympy, about a second on each rank's first backward.
    """
    if _engine_run_backward is None:  # pragma: no cover - another torch
        if accumulate:
            torch.autograd.backward(edges, grads, retain_graph=keep_graph, inputs=inputs or None)
            return None
        return torch.autograd.grad(edges, inputs, grads, retain_graph=keep_graph, allow_unused=True)
    return _engine_run_backward(
        tuple(edges), tuple(grads), keep_graph, False, tuple(inputs), True, accumulate_grad=accumulate
    )


def backward_full(
    roots: Sequence[Root], root_grads: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """Full backward (B): parameter grads accumulate in ``.grad``; returns each input's gradient."""
    pairs = [(r, g) for r, g in zip(roots, root_grads) if g is not None or _is_scalar_loss(r)]
    if pairs:
        _run_engine([_edge(r) for r, _ in pairs], [_grad_or_one(r, g) for r, g in pairs], (),
                    accumulate=True, keep_graph=False)
    grads = [x.grad for x in inputs]
    for x in inputs:
        x.grad = None
    return grads


def _is_scalar_loss(root: Root) -> bool:
    return isinstance(root, torch.Tensor) and root.dim() == 0


def _grad_or_one(root: Root, grad: torch.Tensor | None) -> torch.Tensor:
    if grad is not None:
        return grad
    assert isinstance(root, torch.Tensor), "only the loss may have an implicit gradient"
    return torch.ones_like(root)


@dataclass
class _Group:
    edges: list[GradientEdge] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    frontier: list[Node] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)


@dataclass
class PendingWeightGrad:
    """What I leaves for W: the gradients kept at the frontier, grouped by shared parameters."""

    input_grads: list[torch.Tensor | None]
    groups: list[_Group]

    def backward_weight(self) -> None:
        """W: accumulate every parameter's gradient into ``.grad``."""
        for group in self.groups:
            handles = []
            if len(group.frontier) > 1:
                # Within a group one frontier node may feed another; pin each to the gradient
                # it received in I so nothing is counted twice.
                kept = {}
                for edge, grad in zip(group.edges, group.grads):
                    kept.setdefault(edge.node, {})[edge.output_nr] = grad
                for node, by_index in kept.items():
                    handles.append(node.register_prehook(_pin(by_index)))
            try:
                # Accumulating through the parameters' own AccumulateGrad nodes gives .grad
                # exactly what a full backward would have added.
                _run_engine(group.edges, group.grads, group.params, accumulate=True)
            finally:
                for handle in handles:
                    handle.remove()
        self.groups = []


def _pin(by_index: dict[int, torch.Tensor]):
    def hook(grad_outputs):
        return tuple(by_index.get(i, g) for i, g in enumerate(grad_outputs))

    return hook


def backward_input(
    roots: Sequence[Root],
    root_grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> PendingWeightGrad:
    """I: the inputs' gradients now, and what W needs later (parameters untouched until then)."""
    pairs = [(_edge(r), _grad_or_one(r, g)) for r, g in zip(roots, root_grads) if g is not None or _is_scalar_loss(r)]
    if not pairs:
        return PendingWeightGrad([None] * len(inputs), [])
    root_edges = [e for e, _ in pairs]
    input_nodes = {get_gradient_edge(x).node for x in inputs}
    param_of = {}
    for p in params:
        if p.requires_grad:
            param_of[get_gradient_edge(p).node] = p

    successors: dict[Node, list[Node]] = {}
    predecessors: dict[Node, list[Node]] = {}
    stack = [e.node for e in root_edges]
    seen = set(stack)
    order = list(stack)  # discovery order, so grouping and hooks are deterministic
    while stack:
        node = stack.pop()
        nexts = [f for f, _ in node.next_functions if f is not None]
        successors[node] = nexts
        for f in nexts:
            predecessors.setdefault(f, []).append(node)
            if f not in seen:
                seen.add(f)
                order.append(f)
                stack.append(f)

    on_input_path = _reaching(input_nodes & seen, predecessors)
    in_weight_region = _reaching(set(param_of) & seen, predecessors) - on_input_path

    # Frontier items: (edge into the weight region's side, gradient source) per group.
    frontier_nodes = [
        n for n in order
        if n in on_input_path and any(f in in_weight_region for f in successors.get(n, ()))
    ]
    kept: dict[Node, tuple] = {}
    handles = [n.register_prehook(_keep(kept, n)) for n in frontier_nodes]
    try:
        live_inputs = [x for x in inputs if x.requires_grad]
        if live_inputs and on_input_path:
            grads = _run_engine(root_edges, [g for _, g in pairs], live_inputs, accumulate=False)
        else:
            grads = [None] * len(live_inputs)
    finally:
        for handle in handles:
            handle.remove()
    by_input = dict(zip(map(id, live_inputs), grads))
    input_grads = [by_input.get(id(x)) for x in inputs]

    # Group frontier entries (and roots that lie in the weight region) by the parameters they reach.
    entries: list[tuple[GradientEdge, torch.Tensor, Node | None, set]] = []
    for edge, grad in pairs:
        if edge.node in in_weight_region or edge.node in param_of:
            entries.append((edge, grad, None, _params_below(edge.node, successors, in_weight_region, param_of)))
    for node in frontier_nodes:
        grads_in = kept.get(node)
        if grads_in is None:
            continue
        reach = set()
        for f in successors[node]:
            if f in in_weight_region or f in param_of:
                reach |= _params_below(f, successors, in_weight_region, param_of)
        for i, g in enumerate(grads_in):
            if g is not None:
                entries.append((GradientEdge(node, i), g, node, reach))
    return PendingWeightGrad(input_grads, _group(entries, param_of))


def _keep(kept: dict, node: Node):
    def hook(grad_outputs):
        kept[node] = grad_outputs

    return hook


def _reaching(targets: set[Node], predecessors: dict[Node, list[Node]]) -> set[Node]:
    """Every node from which one of ``targets`` can be reached (targets included)."""
    found = set(targets)
    stack = list(targets)
    while stack:
        for p in predecessors.get(stack.pop(), ()):
            if p not in found:
                found.add(p)
                stack.append(p)
    return found


def _params_below(start: Node, successors, region: set[Node], param_of: dict) -> set[Node]:
    found, stack, seen = set(), [start], {start}
    while stack:
        node = stack.pop()
        if node in param_of:
            found.add(node)
            continue
        for f in successors.get(node, ()):
            if f not in seen and (f in region or f in param_of):
                seen.add(f)
                stack.append(f)
    return found


def _group(entries, param_of: dict) -> list[_Group]:
    parent = list(range(len(entries)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    param_rank = {node: i for i, node in enumerate(param_of)}
    owner: dict[Node, int] = {}
    for i, (_, _, _, reach) in enumerate(entries):
        for pnode in reach:
            if pnode in owner:
                parent[find(i)] = find(owner[pnode])
            else:
                owner[pnode] = i
    groups: dict[int, _Group] = {}
    for i, (edge, grad, node, reach) in enumerate(entries):
        group = groups.setdefault(find(i), _Group())
        group.edges.append(edge)
        group.grads.append(grad)
        if node is not None and node not in group.frontier:
            group.frontier.append(node)
        for pnode in sorted(reach, key=lambda n: param_rank[n]):
            if all(param_of[pnode] is not p for p in group.params):
                group.params.append(param_of[pnode])
    # Groups keep a stable order: by first appearance, which follows the frontier order.
    return [g for g in groups.values() if g.params]
