"""Sequence parallelism on a traced stage: explicit redistributions placed in its graph.

A traced stage (:mod:`conveyor.parallel.tensor.traced`) is a graph of ATen operations run on
DTensors; it has no norm or block modules for torch's ``SequenceParallel`` and
``PrepareModuleInput`` to hook. What those styles do is still expressible, because every node
keeps the module path it ran in (``nn_module_stack``): torch's own sequence-parallel plan is
placed as ``DTensor.redistribute`` calls at the same module boundaries, and DTensor's sharding
propagation does the rest.

* The token (and position) embeddings' outputs are cut to ``Shard(1)``: each TP rank keeps its
  ``seq / tp`` rows (a local slice, no communication), as the "auto" plan's embedding with
  ``output_layouts=Shard(1)`` does.
* Before a column-parallel projection (q/k/v, gate/up, GPT-2's ``c_attn`` / ``c_fc``, the LM head)
  its input is gathered on the sequence (``Shard(1) -> Replicate``: one all-gather, shared by the
  projections reading the same norm output), as ``ColwiseParallel(input_layouts=Shard(1))``.
* After a row-parallel projection (o_proj, down_proj, ``c_proj``) its partial sums are
  reduce-scattered onto the sequence (``Partial -> Shard(1)``), as
  ``RowwiseParallel(output_layouts=Shard(1))``.
* A mixture of experts' block (the parent of an experts module: Mixtral's and Qwen3-MoE's ``mlp``)
  takes its input gathered on the sequence and gives its output back as this rank's rows (a local
  slice), as the "auto" plan's ``PrepareModuleInputOutput`` on it does: its router flattens batch and
  sequence into tokens, which a sequence shard cannot do alone. Within, the router and the experts
  run as without sequence parallelism (replicated, or the experts spread by expert parallelism, which
  takes each TP rank's rows of the tokens itself).

Between those points the residual adds, norms and dropout run on ``seq / tp`` rows (DTensor
propagates ``Shard(1)`` through them), and the weights never move: a projection's input is whole
before DTensor picks its strategy, so it has no reason to gather a weight instead. Per block that
is one all-gather and one reduce-scatter forward (torch's ``CommDebugMode`` counts them), and the
transposes of both backward.

Which activations are sequence-sharded is decided once, from the traced shapes: the *sequence
stream* is the shapes the points above produce or take (``[batch, seq, hidden]``). A stage's
floating input or output of such a shape crosses a stage boundary as each TP rank's ``seq / tp``
rows (the receiving stage takes it as a ``Shard(1)`` DTensor of the global shape); everything
else crosses whole. A graph that would do something else to a sequence-sharded activation than
work row by row (an operation that mixes sequence positions, a reshape that moves the sequence
dim) is refused when the pipeline is built, naming the node and its module, rather than left to
DTensor to gather silently in the middle of a block.

Example (on each of 2 ranks, a stage already parallelized by ``parallelize_traced_stage``)::

    shard_sequence(stage, tp_mesh)
    loss = stage(**batch).loss          # blocks on seq / tp rows between the projections
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from conveyor.errors import PipelineConfigError
from conveyor.expert_option import is_stacked_experts
from conveyor.parallel.tensor.traced import (
    colwise_linear,
    recompile,
    vocab_parallel_embedding,
    vocab_parallel_embedding_on_sequence,
)

aten = torch.ops.aten

# ATen operations that work on a [batch, seq, hidden] activation row by row (each sequence
# position on its own), besides the pointwise ones (torch.Tag.pointwise): a sequence shard of
# their input gives the same shard of their output.
_ROW_BY_ROW = frozenset({
    aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default, aten._fused_rms_norm.default,
    aten.dropout.default, aten.native_dropout.default, aten._to_copy.default, aten.clone.default,
    aten.contiguous.default, aten.alias.default, aten.detach.default,
})
_RESHAPES = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default})
_REDUCTIONS = frozenset({aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default,
                         aten.var.correction})
# A linear on a column-split weight may already be traced.colwise_linear (rewritten before this pass).
_LINEAR = frozenset({aten.linear.default, colwise_linear})
# The lookups of an embedding; a vocabulary-parallel one is rewritten to reduce onto the sequence.
_LOOKUPS = frozenset({aten.embedding.default, vocab_parallel_embedding, vocab_parallel_embedding_on_sequence})
_TRANSPOSED = frozenset({aten.addmm.default, aten.mm.default, aten.matmul.default})  # x @ w: a (in, out) weight


def whole_sequence(value: Any) -> Any:
    """A sequence-sharded DTensor gathered on the sequence (all-gather); anything else as it is.

    Example::

        whole_sequence(hidden)     # Shard(1) [2, 12, 32] -> Replicate [2, 12, 32]
    """
    if isinstance(value, DTensor) and any(p == Shard(1) for p in value.placements):
        return value.redistribute(placements=[Replicate() if p == Shard(1) else p for p in value.placements])
    return value


def sequence_shards(value: Any) -> Any:
    """A DTensor redistributed onto the sequence (``Shard(1)``): a slice of a replicated one, a
    reduce-scatter of a partial sum; anything else as it is.

    Example::

        sequence_shards(o_proj_output)     # Partial [2, 12, 32] -> Shard(1) [2, 12, 32]
    """
    if isinstance(value, DTensor):
        return value.redistribute(placements=[Shard(1)] * value.device_mesh.ndim)
    return value


def _paths(node: fx.Node) -> tuple[str, ...]:
    """The module paths ``node`` ran inside, outermost first (a module called twice, ``name@1``, once)."""
    paths: list[str] = []
    for path, _type in (node.meta.get("nn_module_stack") or {}).values():
        path = path.split("@")[0]
        if path and path not in paths:
            paths.append(path)
    return tuple(paths)


def _projections(graph: fx.Graph, stage: nn.Module) -> tuple[list[str], list[str], list[str]]:
    """The module paths of the stage's projections that take their input whole (column-parallel ones,
    and those left whole: a tied LM head), of its row-parallel projections, and of its embeddings;
    read from which operation takes each weight and on which dim it is sharded."""
    gathering, rowwise, embeddings = [], [], []
    for node, param in _parameters_read(graph, stage):
        shard = param.placements[0] if isinstance(param, DTensor) else Replicate()
        # Sharded on its input dim (1 of a Linear's (out, in), 0 of a Conv1D's (in, out)): row-parallel;
        # on its output dim, or whole: the projection takes its input whole.
        for user in node.users:
            path = (_paths(user) or ("",))[-1]
            if user.target in _LOOKUPS and user.args[0] is node:
                kind = embeddings
            elif param.dim() != 2:
                continue
            elif user.target in _LINEAR and user.args[1] is node:
                kind = rowwise if getattr(shard, "dim", 0) == 1 else gathering
            elif user.target in _TRANSPOSED and user.args[-1] is node:
                kind = rowwise if getattr(shard, "dim", 1) == 0 else gathering
            else:
                continue
            if path not in kind:
                kind.append(path)
    return gathering, rowwise, embeddings


def _region(graph: fx.Graph, path: str, modules: bool = False) -> list[fx.Node]:
    """The operations run inside the module at ``path`` (``modules``: the leaf modules called there too)."""
    kinds = ("call_function", "call_module") if modules else ("call_function",)
    return [node for node in graph.nodes if node.op in kinds and path in _paths(node)]


def _moe_blocks(graph: fx.Graph, stage: nn.Module) -> list[str]:
    """The module paths of the stage's mixture-of-experts blocks: the parents of its experts modules, found
    as leaves the trace kept whole (``call_module``) or by their 3-D weights (experts traced through)."""
    experts = {node.target for node in graph.nodes
               if node.op == "call_module" and is_stacked_experts(stage.get_submodule(node.target))}
    experts |= {node.target.rpartition(".")[0] for node, param in _parameters_read(graph, stage) if param.dim() == 3}
    return sorted({path.rpartition(".")[0] for path in experts if "." in path})


def _parameters_read(graph: fx.Graph, stage: nn.Module) -> Iterator[tuple[fx.Node, torch.Tensor]]:
    """Each ``get_attr`` node of ``graph`` that reads a parameter of ``stage``, with that parameter."""
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            param = stage.get_parameter(node.target)
        except AttributeError:  # a buffer or a constant
            continue
        yield node, param


def _insert_after(graph: fx.Graph, value: fx.Node, function, uses: list[fx.Node]) -> fx.Node:
    with graph.inserting_after(value):
        new = graph.call_function(function, (value,))
    new.meta = dict(value.meta)  # its shape, and the module path it belongs to (regions, messages)
    for user in uses:
        user.replace_input_with(value, new)
    return new


def _rewrite(graph: fx.Graph, stage: nn.Module) -> tuple[list[fx.Node], list[fx.Node]]:
    """Place the scatters and gathers in ``graph`` (in place): the nodes giving sequence-sharded
    activations, and the activations gathered."""
    gathering, rowwise, embeddings = _projections(graph, stage)
    shards: list[fx.Node] = []
    for path in (*embeddings, *rowwise):
        region = _region(graph, path)
        for node in region:  # the partial lookup reduce-scattered at once, not all-reduced then cut
            if node.target is vocab_parallel_embedding:
                node.target = vocab_parallel_embedding_on_sequence
        shards += _cut_outputs(graph, region)
    gathered: dict[fx.Node, fx.Node] = {}
    for path in _moe_blocks(graph, stage):  # the sequence gathered in, each rank's rows cut back out
        region = _region(graph, path, modules=True)
        _gather_inputs(graph, region, gathered)
        shards += _cut_outputs(graph, region)
    for path in gathering:
        _gather_inputs(graph, _region(graph, path), gathered)
    return shards, list(gathered)


def _cut_outputs(graph: fx.Graph, region: list[fx.Node]) -> list[fx.Node]:
    """Each activation ``region`` gives to an operation outside it, redistributed onto the sequence there."""
    inside, cut = set(region), []
    for node in region:
        outside = [user for user in node.users if user not in inside]
        if outside and _is_activation(node):
            cut.append(_insert_after(graph, node, sequence_shards, outside))
    return cut


def _gather_inputs(graph: fx.Graph, region: list[fx.Node], gathered: dict[fx.Node, fx.Node]) -> None:
    """Each activation ``region`` takes from outside it, gathered on the sequence first (once per value)."""
    inside = set(region)
    for node in region:
        for value in node.all_input_nodes:
            if value in inside or value.op == "get_attr" or not _is_activation(value):
                continue
            if value not in gathered:
                gathered[value] = _insert_after(graph, value, whole_sequence, [])
            node.replace_input_with(value, gathered[value])


def _is_activation(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() == 3


def _shape(node_or_value: Any) -> tuple:
    value = node_or_value.meta.get("val") if isinstance(node_or_value, fx.Node) else node_or_value
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def _check_rows(starts: list[fx.Node], stage: int) -> None:
    """Refuse an operation that takes a sequence-sharded activation and does not work row by row."""
    seen: set[fx.Node] = set()
    pending = list(starts)
    while pending:
        value = pending.pop()
        if value in seen:
            continue
        seen.add(value)
        for user in value.users:
            if user.op == "output" or user.target is whole_sequence:
                continue
            reason = _not_row_by_row(user, value)
            if reason is not None:
                module = (_paths(user) or ("the model's own code",))[-1]
                raise PipelineConfigError(
                    f"sequence_parallel=True cannot run stage {stage}'s operation {user.name} ({user.target}) in "
                    f"{module} on sequence shards: it takes {value.name} of shape {list(_shape(value))}, sharded on "
                    f"the sequence (dim 1) between the blocks, and {reason}. Use sequence_parallel=False (tensor "
                    "parallelism alone takes this model), or build the stages by hand with a plan of your own")
            pending.append(user)


def _not_row_by_row(user: fx.Node, value: fx.Node) -> str | None:
    """Why ``user`` cannot take ``value`` sharded on the sequence (None: it works row by row)."""
    target = user.target
    if target is operator.getitem:
        return None
    if not isinstance(target, torch._ops.OpOverload):
        return f"is {getattr(target, '__name__', target)}, not an ATen operation DTensor can propagate"
    if torch.Tag.pointwise in target.tags or target in _ROW_BY_ROW or target.overloadpacket is aten.to:
        return None
    if target in _RESHAPES:
        if _shape(user)[:2] == _shape(value)[:2]:
            return None
        return (f"reshapes it to {list(_shape(user))}, moving the sequence dim (a shape baked by the trace, "
                "which a sequence shard does not have)")
    if target in _REDUCTIONS:
        dims = user.args[1] if len(user.args) > 1 else None
        rank = len(_shape(value))
        if dims is not None and all(d % rank not in (0, 1) for d in ([dims] if isinstance(dims, int) else dims)):
            return None
        return "reduces over the batch or the sequence"
    return "mixes sequence positions (it is neither elementwise, a norm, dropout, nor a projection)"


def shard_sequence(stage: nn.Module, tp_mesh: Any, stream: frozenset | None = None) -> frozenset[tuple[int, ...]]:
    """Make the traced ``stage`` (parallelized by ``parallelize_traced_stage``) sequence-parallel, in place.

    Every mode's graph gets its redistributions (:func:`place_redistributions`); the stage then
    takes its inputs of a sequence-stream shape as this TP rank's ``seq / tp`` rows (a stage after
    the first) and gives its outputs of such a shape so (a stage before the last), everything else
    whole. ``stream``: the stream's shapes over every stage of the model (None: this stage's own),
    so that sender and receiver decide alike. Returns this stage's stream shapes. Raises
    PipelineConfigError, naming the node, where the graph cannot run on sequence shards.

    Example (on each of 2 ranks)::

        shard_sequence(parallelize_traced_stage(split.stage_module(0), tp_mesh, placements), tp_mesh)
        # frozenset({(2, 12, 32)}): stage 0 sends its [2, 6, 32] rows of the hidden states
    """
    own = place_redistributions(stage, tp_mesh.size())
    shard_boundaries(stage, tp_mesh, own if stream is None else stream)
    return own


def place_redistributions(stage: nn.Module, tp_size: int) -> frozenset[tuple[int, ...]]:
    """Place the scatters and gathers in every mode's graph of ``stage`` (not yet compiled): the
    shapes of the activations they give or take, the sequence stream. Refuses shapes that cannot be
    sharded (dynamic, or a length tp does not divide).

    Example::

        place_redistributions(stage, 2)     # frozenset({(2, 12, 32)})
    """
    graphs: Mapping[bool, fx.Graph] = stage._conveyor_graphs
    points = [node for graph in graphs.values() for found in _rewrite(graph, stage) for node in found]
    stream = frozenset(_shape(node) for node in points)
    _check_stream(stage.stage, stream, tp_size)
    return stream


def shard_boundaries(stage: nn.Module, tp_mesh: Any, stream: frozenset) -> None:
    """Check that ``stage``'s sequence-sharded activations only meet row-by-row operations, compile its
    rewritten graphs, and make its inputs and outputs of a ``stream`` shape cross as sequence rows.

    Example::

        shard_boundaries(stage, tp_mesh, place_redistributions(stage, tp_mesh.size()))
    """
    received, sent = {}, {}
    for training, graph in stage._conveyor_graphs.items():
        specs = stage._conveyor_runs[training][2] or ()
        received[training] = tuple(stage.stage > 0 and spec.is_tensor and spec.dtype.is_floating_point and
                                   tuple(spec.shape) in stream for spec in specs)
        placeholders = [node for node in graph.nodes if node.op == "placeholder"]
        shards = [node for node in graph.nodes if node.target is sequence_shards]
        _check_rows(shards + [node for node, flag in zip(placeholders, received[training]) if flag], stage.stage)
        sent[training] = tuple(isinstance(node, fx.Node) and _is_activation(node) and _shape(node) in stream
                               for node in graph.output_node().args[0])
    recompile(stage)
    stage._conveyor_sequence_received = received
    stage.register_forward_pre_hook(_received_rows(tp_mesh, received), with_kwargs=True, prepend=True)
    if stage.stage != stage.num_stages - 1:
        stage.register_forward_hook(_sent_rows(sent), prepend=True)


def _check_stream(stage: int, stream: frozenset, tp_size: int) -> None:
    for shape in stream:
        if not all(isinstance(size, int) for size in shape):
            raise PipelineConfigError(
                f"sequence_parallel=True on traced stages needs fixed shapes, but stage {stage}'s activations "
                f"between the blocks have the shape {list(shape)} (dims traced as dynamic): each TP rank's sequence "
                "shard is sized when the pipeline is built. Split without dynamic_shapes (pad the sequences), or "
                "drop sequence_parallel")
        if shape[1] % tp_size:
            raise PipelineConfigError(
                f"sequence_parallel=True shards stage {stage}'s activations of shape {list(shape)} on the sequence "
                f"(dim 1) over tp={tp_size}, which does not divide its length {shape[1]}: split with sequences "
                f"whose length is a multiple of {tp_size} (pad them), or drop sequence_parallel")


def _received_rows(tp_mesh: Any, received: Mapping[bool, tuple[bool, ...]]):
    """A pre-hook taking each sequence-stream input (this TP rank's rows) as a ``Shard(1)`` DTensor of
    the global shape; it runs before the traced stage's own, which takes the rest as replicated."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        flags = received[module.training]
        if len(flags) != len(args):
            return args, kwargs  # the stage's own check names the mismatch
        return tuple(DTensor.from_local(value, tp_mesh, [Shard(1)], run_check=False)
                     if flag and isinstance(value, torch.Tensor) and not isinstance(value, DTensor) else value
                     for flag, value in zip(flags, args)), kwargs

    return hook


def _sent_rows(sent: Mapping[bool, tuple[bool, ...]]):
    """A forward hook giving each sequence-stream output as this TP rank's rows (a plain tensor);
    the traced stage's own hook then gives the rest whole."""
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        flags = sent[module.training]
        return tuple(sequence_shards(value).to_local() if flag and isinstance(value, DTensor) else value
                     for flag, value in zip(flags, output, strict=True))

    return hook


def describe_received(stage: nn.Module, tp_size: int) -> list[str]:
    """Each tensor input of a traced ``stage`` as it crosses: placement and local shape (whole, unless
    sequence parallelism takes it as this TP rank's rows).

    Example::

        describe_received(stage_1, 2)   # ['add_6: [2, 12, 32] Shard(1) local [2, 6, 32]', 'to_2: ...']
    """
    received = getattr(stage, "_conveyor_sequence_received", None)
    flags = received[stage.training] if received else [False] * len(stage.input_specs)
    lines = []
    for spec, flag in zip(stage.input_specs, flags):
        if spec.is_tensor:
            local = list(spec.shape)
            if flag:
                local[1] //= tp_size
            lines.append(f"{spec.name}: {list(spec.shape)} {'Shard(1)' if flag else 'Replicate'} local {local}")
    return lines


def shard_stage_sequences(modules: Mapping[int, nn.Module], tp_mesh: Any) -> frozenset[tuple[int, ...]]:
    """:func:`shard_sequence` on each of this rank's traced stages, with the stream's shapes of every
    rank's stages, so that each boundary's sender and receiver decide alike. Checked on every rank of
    the job together: the first refusal any rank met is raised on every rank with the same message
    (two collectives). Returns the stream's shapes (what crosses as sequence rows).

    Example (on each rank of a pp=2 x tp=2 mesh)::

        shard_stage_sequences({0: stage}, layout_of(mesh).tp_mesh)    # frozenset({(2, 12, 32)})
    """
    stages = [module for _, module in sorted(modules.items())]
    stream = frozenset().union(*on_every_rank(stages, lambda module: place_redistributions(module, tp_mesh.size())))
    on_every_rank(stages, lambda module: shard_boundaries(module, tp_mesh, stream))
    return stream


def on_every_rank(items: list, step: Callable[[Any], Any], refusal: str = "{problem} (found on rank {rank})") -> list:
    """``step`` on each item; what every rank's items gave, or the first refusal any rank met, raised on every
    rank (its message ``refusal`` formatted with the ``problem`` and the ``rank``). A collective.

    Example::

        on_every_rank(stages, lambda module: place_redistributions(module, 2))    # [frozenset(...), ...]
    """
    problem, results = None, []
    for item in items:
        try:
            results.append(step(item))
        except PipelineConfigError as error:
            problem = str(error)
            break
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (problem, results))
    for rank, (theirs, _) in enumerate(everyone):
        if theirs is not None:
            raise PipelineConfigError(refusal.format(problem=theirs, rank=rank))
    return [result for _, theirs in everyone for result in theirs]
