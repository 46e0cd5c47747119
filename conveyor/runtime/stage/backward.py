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

A compiled region (``torch.compile``: AOTAutograd) is one autograd node whose one
backward graph computes its inputs' and its weights' gradients together. Where such a
node is a frontier node, W would have to run that whole graph again; instead I runs
the full backward of the microbatch (parameter gradients included, bitwise B) and W
has nothing left to do (``PendingWeightGrad.fused``).

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
from torch.autograd.function import BackwardCFunction
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
    pairs = _root_pairs(roots, root_grads)
    if pairs:
        _run_engine([e for e, _ in pairs], [g for _, g in pairs], (), accumulate=True, keep_graph=False)
    grads = [x.grad for x in inputs]
    for x in inputs:
        x.grad = None
    return grads


def _root_pairs(roots: Sequence[Root], root_grads: Sequence[torch.Tensor | None]
                ) -> list[tuple[GradientEdge, torch.Tensor]]:
    """Each root that gets a gradient, as an edge with that gradient: the loss (a 0-dim tensor) gets ones."""
    return [(_edge(r), torch.ones_like(r) if g is None else g) for r, g in zip(roots, root_grads)
            if g is not None or (isinstance(r, torch.Tensor) and r.dim() == 0)]


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
    fused: bool = False  # I ran the full backward (a compiled region): W has nothing to do

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


class GraphAnalysisCache:
    """The I/W analysis of each graph shape seen, so microbatches after the first skip it.

    Microbatches of a stage nearly always build the same autograd graph: the same edges
    and leaves. The analysis (which nodes are frontier nodes, which parameters each
    reaches, how they group) depends on nothing else, so it is computed once per shape and
    found again by the shape's signature, which the graph walk produces anyway. A graph of
    another shape (another sequence length through a data-dependent branch, say) gets its own
    entry; past ``max_entries`` shapes the least recently used is forgotten.

    Example:
        >>> import torch
        >>> lin, analyses = torch.nn.Linear(3, 3), GraphAnalysisCache()
        >>> for _ in range(2):
        ...     x = torch.randn(2, 3, requires_grad=True)
        ...     backward_input([lin(x)], [torch.ones(2, 3)], [x], list(lin.parameters()), analyses).backward_weight()
        >>> analyses.misses, analyses.hits
        (1, 1)
    """

    def __init__(self, max_entries: int = 64) -> None:
        if max_entries < 1:
            raise ValueError(f"GraphAnalysisCache needs room for at least one analysis; got max_entries={max_entries}")
        self.max_entries = max_entries
        self.analyses: dict[tuple, _GraphAnalysis] = {}
        self.hits = 0
        self.misses = 0

    def get(self, signature: tuple) -> _GraphAnalysis | None:
        analysis = self.analyses.pop(signature, None)
        if analysis is not None:
            self.analyses[signature] = analysis  # most recently used last: a rare shape cannot evict the usual one
            self.hits += 1
        return analysis

    def put(self, signature: tuple, analysis: _GraphAnalysis) -> None:
        self.misses += 1
        if len(self.analyses) >= self.max_entries:
            del self.analyses[next(iter(self.analyses))]  # the least recently used
        self.analyses[signature] = analysis


@dataclass
class _GraphAnalysis:
    """The analysis of one graph shape, in node indices (discovery order) and parameter positions."""

    runs_input_path: bool  # some stage input is reachable: I has an engine run to do
    frontier: list[int]  # input-path nodes with an edge into the weight region
    frontier_reach: list[frozenset[int]]  # per frontier node: parameter positions below its weight edges
    weight_roots: list[tuple[int, frozenset[int]]]  # (root pair, parameters below) for roots off the input path
    fused: bool = False  # a frontier node is a compiled region: input and weight gradients in one graph
    groupings: dict[tuple, list[tuple[list[int], list[int]]]] = field(default_factory=dict)


_MAX_GROUPINGS = 16
_ACCUMULATE_GRAD = type(get_gradient_edge(torch.zeros(1, requires_grad=True)).node)
_FUSED = ("fused", 0)


def _is_fused(node: Node) -> bool:
    """Whether ``node`` is the backward of a compiled region (AOTAutograd makes a Function class per graph)."""
    if not isinstance(node, BackwardCFunction):  # a C++ node: an eager op
        return False
    forward = node._forward_cls
    return forward.__name__ == "CompiledFunction" and forward.__module__.startswith("torch._functorch")


def _walk(root_nodes: list[Node], leaf_kinds: dict[int, tuple[str, int]], input_grad_fns: dict[Node, int]):
    """Nodes in discovery order, their successor indices, each node's kind, each root's index.

    Kinds say what a leaf is (a stage input or parameter by position, or something else).
    Successors, kinds and root indices are all the analysis reads (node types do not
    matter, only how nodes connect), so together they are the graph's signature.
    """
    nodes: list[Node] = list(dict.fromkeys(root_nodes))  # each root node once, in order
    index = {node: i for i, node in enumerate(nodes)}
    successors: list[tuple[int, ...]] = [()] * len(nodes)
    kinds: list = [None] * len(nodes)
    stack = list(range(len(nodes)))
    while stack:
        i = stack.pop()
        node = nodes[i]
        if type(node) is _ACCUMULATE_GRAD:
            kinds[i] = leaf_kinds.get(id(node.variable), ("leaf", 0))
            continue
        if node in input_grad_fns:
            kinds[i] = ("input", input_grad_fns[node])
        elif _is_fused(node):
            kinds[i] = _FUSED
        nexts = []
        for f, _ in node.next_functions:
            if f is None:
                continue
            j = index.get(f)
            if j is None:
                j = index[f] = len(nodes)
                nodes.append(f)
                successors.append(())
                kinds.append(None)
                stack.append(j)
            nexts.append(j)
        successors[i] = tuple(nexts)
    return nodes, successors, kinds, [index[node] for node in root_nodes]


def _analyse(successors: list[tuple[int, ...]], kinds: list, root_indices: list[int]) -> _GraphAnalysis:
    count = len(successors)
    predecessors: list[list[int]] = [[] for _ in range(count)]
    for i, nexts in enumerate(successors):
        for j in nexts:
            predecessors[j].append(i)
    param_position = {i: kind[1] for i, kind in enumerate(kinds) if kind is not None and kind[0] == "param"}
    inputs = [i for i, kind in enumerate(kinds) if kind is not None and kind[0] == "input"]
    on_input_path = _reaching(inputs, predecessors)
    in_weight_region = _reaching(list(param_position), predecessors) - on_input_path

    def params_below(starts: list[int]) -> frozenset[int]:
        # Starting in the weight region, every path down to a parameter stays in it (no node
        # below reaches a stage input), so the plain walk down finds the same parameters.
        return frozenset(param_position[i] for i in _reaching(starts, successors) if i in param_position)

    frontier = [i for i in range(count) if i in on_input_path and any(j in in_weight_region for j in successors[i])]
    frontier_reach = [params_below([j for j in successors[i] if j in in_weight_region]) for i in frontier]
    weight_roots = [(pair, params_below([i])) for pair, i in enumerate(root_indices) if i in in_weight_region]
    fused = any(kinds[i] == _FUSED for i in frontier)
    return _GraphAnalysis(bool(on_input_path), frontier, frontier_reach, weight_roots, fused=fused)


def backward_input(
    roots: Sequence[Root],
    root_grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    analyses: GraphAnalysisCache | None = None,
) -> PendingWeightGrad:
    """I: the inputs' gradients now, and what W needs later (parameters untouched until then).

    ``analyses`` remembers the graph analysis per graph shape (pass the same one for every
    microbatch of a stage); without it every call analyses its graph afresh.
    """
    pairs = _root_pairs(roots, root_grads)
    if not pairs:
        return PendingWeightGrad([None] * len(inputs), [])
    root_edges = [e for e, _ in pairs]
    leaf_kinds = {id(p): ("param", position) for position, p in enumerate(params) if p.requires_grad}
    input_grad_fns: dict[Node, int] = {}
    for position, x in enumerate(inputs):
        if x.grad_fn is not None:
            input_grad_fns.setdefault(x.grad_fn, position)
        elif x.requires_grad:
            leaf_kinds[id(x)] = ("input", position)  # an input is a stage input first, even if also a parameter
    nodes, successors, kinds, root_indices = _walk([e.node for e in root_edges], leaf_kinds, input_grad_fns)
    signature = (tuple(successors), tuple(kinds), tuple(root_indices))
    analysis = analyses.get(signature) if analyses is not None else None
    if analysis is None:
        analysis = _analyse(successors, kinds, root_indices)
        if analyses is not None:
            analyses.put(signature, analysis)
    if analysis.fused:
        return PendingWeightGrad(backward_full(roots, root_grads, inputs), [], fused=True)

    frontier_nodes = [nodes[i] for i in analysis.frontier]
    kept: dict[Node, tuple] = {}
    handles = [n.register_prehook(_keep(kept, n)) for n in frontier_nodes]
    try:
        live_inputs = [x for x in inputs if x.requires_grad]
        if live_inputs and analysis.runs_input_path:
            grads = _run_engine(root_edges, [g for _, g in pairs], live_inputs, accumulate=False)
        else:
            grads = [None] * len(live_inputs)
    finally:
        for handle in handles:
            handle.remove()
    by_input = dict(zip(map(id, live_inputs), grads))
    input_grads = [by_input.get(id(x)) for x in inputs]

    groups = _weight_groups(analysis, pairs, frontier_nodes, kept, params)
    return PendingWeightGrad(input_grads, groups)


def _weight_groups(
    analysis: _GraphAnalysis,
    pairs: list[tuple[GradientEdge, torch.Tensor]],
    frontier_nodes: list[Node],
    kept: dict[Node, tuple],
    params: Sequence[torch.Tensor],
) -> list[_Group]:
    """What W runs, as groups of gradient edges that reach common parameters.

    ``pairs``: the roots' edges and gradients; ``kept``: the gradients the input pass saw
    arrive at each frontier node.
    """
    # Entries for W: roots in the weight region, then each kept gradient at a frontier node.
    # Which of those exist depends on which gradients arrived (a branch may get none), so the
    # grouping is remembered per pattern of arrivals.
    entries: list[tuple[GradientEdge, torch.Tensor, Node | None]] = [
        (*pairs[pair], None) for pair, _ in analysis.weight_roots]
    reaches = [reach for _, reach in analysis.weight_roots]
    arrived = []
    for node, reach in zip(frontier_nodes, analysis.frontier_reach):
        grads_in = kept.get(node) or ()
        arrived.append(tuple(g is not None for g in grads_in))
        for i, g in enumerate(grads_in):
            if g is not None:
                entries.append((GradientEdge(node, i), g, node))
                reaches.append(reach)
    pattern = tuple(arrived)
    grouping = analysis.groupings.get(pattern)
    if grouping is None:
        if len(analysis.groupings) >= _MAX_GROUPINGS:
            analysis.groupings.clear()  # arrival patterns that never repeat must not pile up
        grouping = analysis.groupings[pattern] = _group(reaches)
    groups = []
    for members, param_positions in grouping:
        group = _Group(params=[params[k] for k in param_positions])
        for k in members:
            edge, grad, node = entries[k]
            group.edges.append(edge)
            group.grads.append(grad)
            if node is not None and node not in group.frontier:
                group.frontier.append(node)
        groups.append(group)
    return groups


def _keep(kept: dict, node: Node):
    def hook(grad_outputs):
        kept[node] = grad_outputs

    return hook


def _reaching(starts: list[int], links: Sequence[Sequence[int]]) -> set[int]:
    """Every node reached from ``starts`` along ``links`` (starts included): along predecessors,
    the nodes from which one of ``starts`` can be reached; along successors, those below them."""
    found = set(starts)
    stack = list(starts)
    while stack:
        for p in links[stack.pop()]:
            if p not in found:
                found.add(p)
                stack.append(p)
    return found


def _group(reaches: list[frozenset[int]]) -> list[tuple[list[int], list[int]]]:
    """Entries that reach a common parameter share one engine run: ``(entries, parameter positions)``."""
    parent = list(range(len(reaches)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for i, reach in enumerate(reaches):
        for position in reach:
            if position in owner:
                parent[find(i)] = find(owner[position])
            else:
                owner[position] = i
    groups: dict[int, tuple[list[int], set[int]]] = {}
    for i, reach in enumerate(reaches):
        members, positions = groups.setdefault(find(i), ([], set()))
        members.append(i)
        positions |= reach
    # Groups keep a stable order: by first appearance, which follows the frontier order.
    return [(members, sorted(positions)) for members, positions in groups.values() if positions]
