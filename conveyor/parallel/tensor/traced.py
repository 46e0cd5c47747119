"""Tensor parallelism on a traced stage: its parameters sharded by the plan, its graph run on DTensors.

What tracing leaves to work with. ``conveyor.frontend`` traces the unchanged model with
``torch.export`` into ATen operations and cuts that graph into stages. A stage module keeps
every parameter under its original name (``model.layers.1.self_attn.q_proj.weight``), but in
plain containers: there is no ``nn.Linear`` or ``nn.Embedding`` left to hang
``parallelize_module``'s hooks on; a projection is ``aten.linear(x, <get_attr weight>)``. Shapes
are baked into the graph as the trace saw them: a Hugging Face ``view(*shape, -1, head_dim)``
keeps its ``-1``, but MPT's ``reshape(b, s, self.n_heads, head_dim)`` records ``n_heads`` (4) as a
constant, and ALiBi's per-head bias is a whole-model tensor.

So a traced stage is not parallelized module by module. The plan is still the one "auto" (or
the user) writes for the unchanged model, by the same names; :func:`parameter_placements`
reads from each style where its module's parameters go (ColwiseParallel on a Linear: rows
sharded, ...), and :func:`parallelize_traced_stage` distributes the stage's parameters so and
runs its graph on DTensors: the inputs enter as replicated DTensors, DTensor's sharding
propagation decides every collective, the outputs leave replicated and local. Every baked
shape stays right because a DTensor keeps the global shape (the graph's 4 heads are the whole
tensor's 4 heads, 2 of them on each rank). The communication matches the module-wise styles:
a row-parallel projection's partial sums are all-reduced where the next operation needs them
whole (the residual add), as ``RowwiseParallel``'s output does. Sequence parallelism (whose styles
act on module inputs and outputs, which a traced stage does not have) is placed in the stage's
graph as explicit redistributions by :mod:`conveyor.parallel.tensor.traced_sequence`.

What the prototype needs and leaves open:

* The stage's forward and backward (F, B, I and W) run under torch's
  ``implicit_replication()``: tensors the graph makes itself (``arange`` positions) meet
  DTensors, in the forward and in the backward formulas that saved them. Wiring this into the
  pipeline means the runner enters it around a TP stage's actions.
* The token embedding is vocab-parallel (``Shard(0)``: each TP rank its rows of the vocabulary),
  as the LM head is colwise (``Shard(0)`` too), so tied copies (GPT-2's ``wte`` and ``lm_head``)
  are sharded alike at both ends. DTensor's lookup on such a weight gives a masked partial sum
  whose mask lives on that one output; the traced graph would cast it first (``aten.to``) and
  lose the mask, so the stage's graph looks it up through :func:`vocab_parallel_embedding`,
  which reduces it at once (as ``RowwiseParallel`` does on an ``nn.Embedding``'s output).
* A linear on a ``Shard(0)`` weight takes its input whole (:func:`colwise_linear`), as
  ``ColwiseParallel`` does: left to itself, DTensor carries a row-parallel sum Partial through the
  residual add and an RMSNorm's scaling, then gathers the next projection's whole weight rather
  than reduce the activation (Llama's gate/up projections and its LM head did, giving Partial
  logits). So the logits leave the head sharded on the vocabulary, and with ``loss_parallel`` the
  last stage gives them so (``outputs_whole=False``) to a loss run under torch's
  ``loss_parallel()``: a Hugging Face model's own loss inside the traced graph, or the user's.
* CPU's fused attention kernel has no DTensor sharding rule in torch; one is registered here
  (by heads or batch, as torch's CUDA kernels have), and its local outputs are kept in the
  memory layout DTensor describes (else a stage's second attention layer fails in a reshape).
  On CUDA torch's own rules apply.
* Mixtral's experts run ``transformers.grouped_mm_fallback``, a custom op DTensor has no
  sharding rule for. Any such opaque custom op in a stage's graph (and its companions, such as
  the ``_backward`` op its autograd formula calls) is given one rule here: every input and
  output replicated (:func:`_replicate_opaque_custom_ops`). So for Mixtral, TP shards the
  attention (and the LM head) while the router and the experts stay whole on every TP rank,
  each computing every expert on the whole tokens, as one device does (no expert parallelism).
* Against eager TP the loss is bitwise equal and gradients agree to rounding: DTensor sums a
  replicated activation's partial gradients from its users (q, k, v) before one all-reduce.
  Between themselves, pipelined traced TP stages equal traced TP alone bit for bit.

Example (on each of 2 ranks)::

    split = conveyor.frontend.split_model(model, 2, example_kwargs=batch)
    placements = parameter_placements(model, tensor_parallel_plan(model, 2))
    stage = parallelize_traced_stage(split.stage_module(1), tp_mesh, placements)
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from types import MappingProxyType
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import register_sharding
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from conveyor.errors import PipelineConfigError
from conveyor.parallel.tensor.shards import materialize_stage_shards, shard_source
from conveyor.parallel.tensor.style_map import matching_modules
from conveyor.parallel.tensor.styles import column_placement, is_transposed_projection


def parameter_placements(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> dict[str, object]:
    """Where each planned parameter of ``model`` goes (by its original name), as the plan's styles put it.

    Example::

        parameter_placements(llama, {"model.layers.0.mlp.up_proj": ColwiseParallel()})
        # {'model.layers.0.mlp.up_proj.weight': Shard(dim=0)}
    """
    return {f"{name}.{param_name}": placement for pattern, style in plan.items()
            for name in matching_modules(model, pattern)
            for param_name, placement in _module_placements(model.get_submodule(name), style).items()}


def _module_placements(module: nn.Module, style: ParallelStyle) -> dict[str, object]:
    if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return {}  # LocalHeads, SequenceParallel, PrepareModule*: no parameter of theirs moves
    colwise = isinstance(style, ColwiseParallel)
    column = partial(column_placement, packed=getattr(style, "packed", 1))
    if isinstance(module, nn.Embedding):
        # Row-wise: vocab-parallel (each rank its rows of the vocabulary); the traced lookup is
        # reduced at once (_rewrite_row_split_weight_calls), as RowwiseParallel's output does.
        return {"weight": Shard(1) if colwise else Shard(0)}
    if isinstance(module, nn.Linear):
        found = {"weight": column(0) if colwise else Shard(1), "bias": column(0) if colwise else Replicate()}
    elif is_transposed_projection(module):
        found = {"weight": column(1) if colwise else Shard(0), "bias": column(0) if colwise else Replicate()}
    else:
        raise PipelineConfigError(
            f"{type(style).__name__} takes a Linear, Embedding or Conv1D, got {type(module).__name__}"
        )
    return {name: placement for name, placement in found.items() if getattr(module, name, None) is not None}


def parallelize_traced_stage(stage: nn.Module, tp_mesh, placements: Mapping[str, object], *,
                             outputs_whole: bool = True) -> nn.Module:
    """Distribute ``stage``'s parameters (placements by original name, the rest replicated) and run it on DTensors.

    In place; the stage keeps its names. Its inputs are taken as this TP rank's whole (replicated)
    tensors, its outputs are given back whole and local, as the neighbouring stages exchange them;
    ``outputs_whole=False`` (the last stage under ``loss_parallel``) gives them as DTensors as
    propagation left them: the logits sharded on the vocabulary, for a loss under torch's
    ``loss_parallel()``.

    Example (on each of 2 ranks)::

        parallelize_traced_stage(split.stage_module(0), tp_mesh, parameter_placements(model, plan))
    """
    _register_cpu_attention_sharding()
    _replicate_opaque_custom_ops(stage)
    distributed: dict[int, nn.Parameter] = {}
    for name, param in list(stage.named_parameters(remove_duplicate=False)):
        owner_name, _, attribute = name.rpartition(".")
        if id(param) not in distributed:  # a parameter tied within the stage stays one Parameter
            placement = placements.get(name, Replicate())
            # A meta tensor is described, not sent: each rank takes its own (meta) shard.
            src = None if param.is_meta else 0
            distributed[id(param)] = nn.Parameter(
                distribute_tensor(param.detach(), tp_mesh, [placement], src_data_rank=src),
                requires_grad=param.requires_grad)
        stage.get_submodule(owner_name).register_parameter(attribute, distributed[id(param)])
    source = shard_source(stage)
    if source is not None:  # a meta-device model's stage: each rank allocates its own shards only
        materialize_stage_shards(stage, tp_mesh, source)
    _rewrite_row_split_weight_calls(stage, placements)
    stage.register_forward_pre_hook(_inputs_as_dtensors(tp_mesh), with_kwargs=True)
    if outputs_whole:
        stage.register_forward_hook(whole_outputs)
    return stage


def vocab_parallel_embedding(weight: DTensor, indices: DTensor, *options) -> DTensor:
    """``aten.embedding`` on a vocabulary-sharded (``Shard(0)``) weight, its partial sums reduced at once.

    DTensor looks each index up in the rank holding its row: the other ranks give zeros, and
    the output is a ``_MaskPartial`` whose mask (which indices this rank held) lives on that
    output alone. Redistributing it to ``Replicate`` here, in the same call, is the all-reduce
    ``RowwiseParallel`` does on an ``nn.Embedding``'s output (the same values as eager TP);
    left in the graph, the next operation (a cast, ``aten.to``) would make a new DTensor
    without the mask. The backward is DTensor's own: each rank's rows of the weight gradient.

    Example (on each of 2 ranks)::

        weight = distribute_tensor(torch.randn(96, 32), tp_mesh, [Shard(0)])
        ids = DTensor.from_local(torch.tensor([[1, 95]]), tp_mesh, [Replicate()])
        vocab_parallel_embedding(weight, ids).placements    # (Replicate(),)
    """
    return _reduced_lookup(weight, indices, options, Replicate())


def vocab_parallel_embedding_on_sequence(weight: DTensor, indices: DTensor, *options) -> DTensor:
    """:func:`vocab_parallel_embedding` reduced onto the sequence (``Shard(1)``): a reduce-scatter
    in place of the all-reduce, as ``RowwiseParallel(output_layouts=Shard(1))`` gives a
    sequence-parallel model's embedding (each TP rank keeps its ``seq / tp`` rows).

    Example (on each of 2 ranks)::

        vocab_parallel_embedding_on_sequence(weight, ids).placements    # (Shard(dim=1),)
    """
    return _reduced_lookup(weight, indices, options, Shard(1))


def _reduced_lookup(weight: DTensor, indices: DTensor, options: tuple, placement) -> DTensor:
    looked_up = torch.ops.aten.embedding.default(weight, indices, *options)
    if not (isinstance(looked_up, DTensor) and any(p.is_partial() for p in looked_up.placements)):
        return looked_up
    placements = [placement] * looked_up.device_mesh.ndim
    reduced = looked_up.redistribute(placements=placements)
    # Through a local tensor and back: the gradient arriving here is often Partial (the graph's
    # row-parallel users), and torch cannot turn a Partial gradient into the lookup's masked
    # one; from_local's backward reduces it to these placements first, as RowwiseParallel's
    # local output has it reduced before the lookup's backward.
    return DTensor.from_local(reduced.to_local(), looked_up.device_mesh, placements, run_check=False,
                              shape=reduced.shape, stride=reduced.stride())


def colwise_linear(input: torch.Tensor, weight: DTensor, *bias) -> DTensor:
    """``aten.linear`` on a column-split (``Shard(0)``) weight, taking its input whole, as ``ColwiseParallel`` does.

    DTensor's propagation may carry an activation as a partial sum (a row-parallel projection's
    output, through the residual add and an RMSNorm's scaling, both linear in it). A linear on
    a ``Shard(0)`` weight then finds gathering the weight cheaper than reducing the activation:
    every rank multiplies by the whole weight and the output is Partial (Llama's logits would be).
    Reduced here first, the output is sharded on its last dim (the LM head's logits on the
    vocabulary, as torch's ``loss_parallel()`` needs them) and the weight never gathered.

    Example (on each of 2 ranks)::

        weight = distribute_tensor(torch.randn(96, 32), tp_mesh, [Shard(0)])
        hidden = DTensor.from_local(torch.randn(2, 4, 32), tp_mesh, [Partial()])
        colwise_linear(hidden, weight).placements    # (Shard(dim=2),)
    """
    if isinstance(input, DTensor) and any(p.is_partial() for p in input.placements):
        input = input.redistribute(placements=[Replicate()] * input.device_mesh.ndim)
    return torch.ops.aten.linear.default(input, weight, *bias)


def _rewrite_row_split_weight_calls(stage: nn.Module, placements: Mapping[str, object]) -> None:
    """Make every lookup of a ``Shard(0)`` embedding weight in ``stage``'s graphs (each mode's) a
    :func:`vocab_parallel_embedding`, every linear on a ``Shard(0)`` weight (colwise, packed or not)
    a :func:`colwise_linear`; recompile the graphs changed.

    The calls are found by their weight: a ``get_attr`` of a parameter the plan puts at
    ``Shard(0)`` (by its original name). A stage that is not a traced stage module (no graphs) is
    left as it is; so are calls in a nested graph (a ``cond`` branch), which take their weights
    as inputs.
    """
    graphs = getattr(stage, "_conveyor_graphs", None)  # a StageModule's graph per mode, edited in place
    if not graphs:
        return
    rewritten = False
    for graph in graphs.values():
        for node in graph.nodes:
            if node.op != "call_function" or node.target not in _ROW_SPLIT_WEIGHT_CALLS:
                continue
            weight = node.args[0 if node.target is torch.ops.aten.embedding.default else 1]
            placement = placements.get(weight.target) if getattr(weight, "op", None) == "get_attr" else None
            if isinstance(placement, Shard) and placement.dim == 0:
                node.target = _ROW_SPLIT_WEIGHT_CALLS[node.target]
                rewritten = True
    if rewritten:
        recompile(stage)


def recompile(stage: nn.Module) -> None:
    """The traced stage's forward compiled anew from its edited graphs, in every mode: ``wrap_blocks``
    with no block chosen does exactly that (activation checkpointing, which wraps blocks later,
    starts from the edited graphs)."""
    stage.wrap_blocks(set(), lambda function, block: function)


def _inputs_as_dtensors(tp_mesh):
    def hook(module, args, kwargs):
        def wrap(value):
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                return DTensor.from_local(value, tp_mesh, [Replicate()], run_check=False)
            return value

        return pytree.tree_map(wrap, args), pytree.tree_map(wrap, kwargs)

    return hook


def whole_outputs(module: nn.Module, args: Any, output: Any) -> Any:
    """A stage's DTensor outputs as whole local tensors: what the matching TP rank of the next stage receives."""
    return pytree.tree_map_only(DTensor, DTensor.full_tensor, output)


_ROW_SPLIT_WEIGHT_CALLS = MappingProxyType({torch.ops.aten.embedding.default: vocab_parallel_embedding,
                                            torch.ops.aten.linear.default: colwise_linear})


def _keep_layouts_as_described(op) -> None:
    """Make ``op``'s local outputs keep the memory layout their DTensor says they have.

    DTensor describes an output's strides from the op's meta kernel, and decides from them
    whether a later ``reshape`` is a view. The CPU flash-attention kernel lays its local output
    out one way on its first call and another way later (contiguous by heads): the next
    reshape's view then fails on the second attention layer of a stage. Here the local result
    is copied into the described layout (the same values: only their order in memory changes).
    """
    handlers = DTensor._op_dispatcher._custom_op_handlers

    def handler(op_call, args, kwargs):
        del handlers[op]  # the default dispatch, then the layouts
        try:
            outputs = op_call(*args, **kwargs)
        finally:
            handlers[op] = handler
        return type(outputs)(_as_described(value) for value in outputs)

    handlers[op] = handler


def _as_described(value):
    if not isinstance(value, DTensor) or value.dim() == 0:
        return value
    local = value._local_tensor
    order = sorted(range(value.dim()), key=lambda dim: -value.stride()[dim])
    inverse = [order.index(dim) for dim in range(value.dim())]
    wanted = local.permute(order).contiguous().permute(inverse)
    if wanted.stride() == local.stride():
        return value
    return DTensor(wanted, value._spec, requires_grad=value.requires_grad)


def _register_cpu_attention_sharding() -> None:
    """Tell DTensor that CPU's fused attention splits by heads (dim 1) or batch (dim 0), as the CUDA kernels do.

    torch registers sharding strategies for the CUDA flash/efficient kernels but not for the
    CPU flash kernel a traced ``scaled_dot_product_attention`` dispatches to on CPU; eager TP
    never meets it as a DTensor (each rank attends over its local heads as plain tensors).
    Torch's registries are process-wide: the forward's layout handler in place says this ran before.
    """
    aten = torch.ops.aten
    if aten._scaled_dot_product_flash_attention_for_cpu.default in DTensor._op_dispatcher._custom_op_handlers:
        return

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def _forward(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
        return [([p, p], [p, p, p, None, None]) for p in (Replicate(), Shard(1), Shard(0))]

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def _backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None, scale=None):
        return [([p, p, p], [p, p, p, p, p, p, None, None]) for p in (Replicate(), Shard(1), Shard(0))]

    for op in (aten._scaled_dot_product_flash_attention_for_cpu.default,
               aten._scaled_dot_product_flash_attention_for_cpu_backward.default):
        _keep_layouts_as_described(op)


# Namespaces whose operators DTensor either knows or must not be taught blindly.
_TORCH_NAMESPACES = frozenset({"aten", "prims", "prim", "_c10d_functional", "c10d", "c10d_functional", "higher_order"})


def _replicate_opaque_custom_ops(stage: nn.Module) -> None:
    """Give each custom op of ``stage``'s graphs that DTensor has no rule for a replicated one.

    A custom op (``torch.library.custom_op``, such as transformers' ``grouped_mm_fallback`` that
    Mixtral's experts run) is opaque to DTensor, which refuses it. Replicating every input and
    output is right for any op that computes from its inputs alone: each TP rank runs it on whole
    tensors, exactly as one device does (a sharded or partial input is gathered or reduced
    first). Its companions (ops of the same namespace whose names extend its own, such as the
    ``grouped_mm_fallback_backward`` its autograd formula calls) never appear in the forward
    graph, so they are taken too. A rule torch or the user registered is left alone.
    """
    propagator = DTensor._op_dispatcher.sharding_propagator
    known = (set(propagator.op_strategy_funcs) | set(propagator.op_single_dim_strategy_funcs)
             | set(propagator.op_to_rules))
    graphs = list(getattr(stage, "_conveyor_graphs", {}).values())
    graphs += [module.graph for module in stage.modules() if isinstance(module, torch.fx.GraphModule)]
    found = {node.target for graph in graphs for node in graph.nodes
             if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
             and node.target.namespace not in _TORCH_NAMESPACES}
    all_names = torch._C._dispatch_get_all_op_names()
    for op in sorted(found, key=str):
        namespace, _, name = op._schema.name.partition("::")
        for qualified in sorted(n for n in all_names if n == op._schema.name or n.startswith(f"{namespace}::{name}_")):
            packet = getattr(getattr(torch.ops, namespace), qualified.partition("::")[2])
            for overload in packet.overloads():
                companion = getattr(packet, overload)
                if companion not in known:
                    register_sharding(companion)(_replicated(len(companion._schema.returns)))
                    known.add(companion)


def _replicated(returns: int):
    def strategy(*args, **kwargs):
        inputs = [Replicate() if hasattr(arg, "placements") else None for arg in args]
        return [([Replicate()] * returns, inputs)]

    return strategy
