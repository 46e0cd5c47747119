"""The "auto" tensor-parallel plan, the checks every plan passes, and applying one to a stage.

A plan maps module names (or torch's ``fnmatch`` patterns, one per dotted atom, as
``parallelize_module`` reads them) to torch ``ParallelStyle``s. :func:`tensor_parallel_plan`
writes one from the module's structure (:mod:`conveyor.parallel.tensor.discover`);
:func:`parallelize_stage` checks a plan against the module and the TP size, then hands it to
torch's ``parallelize_module``.

The LM head's logits are gathered (``Replicate``) by default, so any loss (a Hugging Face
model's own, a user's ``loss_fn``) sees whole logits. ``loss_parallel=True`` keeps them sharded
on the vocabulary as a DTensor: the loss must then run under torch's
``torch.distributed.tensor.parallel.loss_parallel()``, and never gathers them.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatch

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from conveyor.errors import PipelineConfigError
from conveyor.expert_option import is_stacked_experts
from conveyor.parallel.tensor.discover import Block, Found, Projection, discover, parameterised_leaves
from conveyor.parallel.tensor.styles import (
    LocalBlock,
    PackedColwiseParallel,
    TransposedColwiseParallel,
    TransposedRowwiseParallel,
    is_transposed_projection,
)

PLAN_ADVICE = (
    "give parallelize_stage (or the pipeline's tensor_parallel=) a plan instead of 'auto': a dict from module "
    "names to torch ParallelStyles, e.g. {'layers.*.attn.q_proj': ColwiseParallel(), "
    "'layers.*.attn.o_proj': RowwiseParallel()}; modules the plan leaves out stay replicated"
)


def tensor_parallel_plan(
    module: nn.Module, tp_size: int, *, sequence_parallel: bool = False, loss_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """The "auto" plan for ``module`` at ``tp_size``, keyed by its own submodule names; checked first.

    Attention: q/k/v colwise, output rowwise, its head-count attributes made local; MLPs: the
    inputs colwise, the output rowwise; the token embedding vocab-parallel (rowwise); the LM
    head colwise (logits gathered, or sharded with ``loss_parallel``). Norms, routers and MoE
    experts stay replicated. ``sequence_parallel`` shards the activations between blocks on the
    sequence (dim 1): norms run ``SequenceParallel``, the blocks gather their input; a mixture of
    experts' block (the parent of an experts module: its router, experts and shared experts) takes the
    sequence gathered and gives its output back as this rank's rows (:func:`moe_blocks`).

    Under sequence parallelism the activations between blocks are DTensors of the global shape
    (the model's own code, positions and masks, reads the whole sequence length), and
    a module that is none of those above (an MoE router) is refused.

    Example::

        plan = tensor_parallel_plan(llama, 2)
        plan["model.layers.0.self_attn.q_proj"]    # ColwiseParallel(...)
    """
    found = discover(module)
    _refuse_unplaced(module, found)
    _check_divisible(module, found, tp_size)
    plan: dict[str, ParallelStyle] = {}
    if found.embedding is not None:
        plan[found.embedding[0]] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1) if sequence_parallel else Replicate(),
            use_local_output=not sequence_parallel,
        )
    moe = moe_blocks(module) if sequence_parallel else []
    for block in found.blocks:  # a block inside a MoE block (shared experts) meets the sequence already whole
        plan.update(_block_plan(block, sequence_parallel and not any(block.name.startswith(m + ".") for m in moe)))
    if sequence_parallel:
        plan.update(_sequence_parallel_plan(module, found, moe))
    if found.head is not None:
        plan[found.head.name] = _head_style(found.head, Shard(1) if sequence_parallel else Replicate(), loss_parallel)
    return plan


def _block_plan(block: Block, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {}
    # A block that is the module itself (a hand-built stage holding one MLP) has no name for a
    # style of its own: under sequence parallelism its input projections gather the sequence.
    at_root = block.name == ""
    if at_root and (block.local_attributes or block.head_inputs):
        raise PipelineConfigError(
            f"tensor_parallel='auto' cannot place the {block.kind} that is the module itself: its attributes "
            f"{list(block.local_attributes + block.head_inputs)} must be made local by a style on the block, and the "
            "module has no name to hang it on. Wrap it in a parent module, or " + PLAN_ADVICE)
    if (block.local_attributes or block.head_inputs or sequence_parallel) and not at_root:
        plan[block.name] = LocalBlock(block.local_attributes, block.head_inputs, gather_sequence=sequence_parallel)
    packed = 3 if block.kind == "fused_attention" else 1
    for projection in block.inputs:
        if projection.transposed:
            plan[projection.name] = TransposedColwiseParallel(packed=packed)
        elif packed > 1:
            plan[projection.name] = PackedColwiseParallel(packed=packed)
        else:
            plan[projection.name] = ColwiseParallel()
        if at_root and sequence_parallel:  # the activations arrive sequence-sharded: gathered here
            plan[projection.name].input_layouts = (Shard(1),)
    # Under sequence parallelism the block's output is reduce-scattered onto the sequence and
    # stays a DTensor, so that the model's own code between blocks sees the global shape.
    layout = dict(output_layouts=Shard(1), use_local_output=False) if sequence_parallel else {}
    rowwise = TransposedRowwiseParallel if block.output.transposed else RowwiseParallel
    plan[block.output.name] = rowwise(**layout)
    return plan


def _sequence_parallel_plan(module: nn.Module, found: Found, moe: list[str]) -> dict[str, ParallelStyle]:
    """Norms on the sequence shards; other embeddings (positions) made sequence-sharded to meet the tokens'."""
    norms = _norms(module, found)
    plan: dict[str, ParallelStyle] = {name: SequenceParallel() for name in norms}
    covered = set(norms) | {p.name for block in found.blocks for p in (*block.inputs, block.output)}
    covered |= {name for name in (found.head.name if found.head else None,
                                  found.embedding[0] if found.embedding else None) if name}
    for name in moe:  # the router and the experts run on the whole sequence, their output cut back to rows
        plan[name] = PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                              use_local_input=True, output_layouts=(Replicate(),),
                                              desired_output_layouts=(Shard(1),), use_local_output=False)
    for name, leaf in parameterised_leaves(module):
        if name in covered or any(name.startswith(block + ".") for block in moe):
            continue
        if isinstance(leaf, nn.Embedding):
            plan[name] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                             use_local_output=False)
            continue
        raise PipelineConfigError(
            f"sequence_parallel=True cannot place {name} ({type(leaf).__name__}): it is neither a norm, an "
            f"embedding, nor part of an attention or MLP block, and would meet sequence-sharded activations. "
            f"Use sequence_parallel=False, or {PLAN_ADVICE}"
        )
    return plan


def moe_blocks(module: nn.Module) -> list[str]:
    """The names of ``module``'s mixture-of-experts blocks: each parent of an experts module (transformers 5's
    stacked experts), which holds its router too. Under sequence parallelism such a block takes the whole
    sequence (its router and experts replicated, or its experts spread by expert parallelism, which splits
    the tokens itself) and gives its output back on the sequence.

    Example:
        >>> from conveyor.testing.models.moe import tiny_moe
        >>> moe_blocks(tiny_moe("mixtral", 2))
        ['model.layers.0.mlp', 'model.layers.1.mlp']
    """
    experts = [name for name, child in module.named_modules() if name and is_stacked_experts(child)]
    return sorted({name.rpartition(".")[0] for name in experts if "." in name})


def _head_style(head: Projection, input_layout, loss_parallel: bool) -> ParallelStyle:
    if head.transposed:
        raise PipelineConfigError(f"the LM head {head.name} stores its weight (in, out); {PLAN_ADVICE}")
    if loss_parallel:
        return ColwiseParallel(input_layouts=input_layout, use_local_output=False)
    return ColwiseParallel(input_layouts=input_layout, output_layouts=Replicate())


def _norms(module: nn.Module, found: Found) -> list[str]:
    """Leaves holding only 1-D parameters as wide as the blocks' output (LayerNorm, RMSNorm)."""
    widths = {block.output.out_features for block in found.blocks}
    return [name for name, leaf in parameterised_leaves(module) if not isinstance(leaf, nn.Embedding)
            and all(p.dim() == 1 and p.shape[0] in widths for p in leaf.parameters(recurse=False))]


def _refuse_unplaced(module: nn.Module, found: Found) -> None:
    if found.unplaced:
        lines = "; ".join(
            f"{name} ({type(module.get_submodule(name)).__name__}): {why}" for name, why in found.unplaced
        )
        raise PipelineConfigError(f"tensor_parallel='auto' cannot place {lines}. To parallelize it, {PLAN_ADVICE}")


def _check_divisible(module: nn.Module, found: Found, tp_size: int) -> None:
    def refuse(name: str, what: str, size: int) -> None:
        raise PipelineConfigError(
            f"tensor parallel size tp={tp_size} does not divide the {what} of {name or 'the module'} "
            f"({type(module.get_submodule(name)).__name__}): {size} is not a multiple of {tp_size}; choose a tp "
            f"that divides {size}"
        )

    if found.embedding is not None and found.embedding[1] % tp_size:
        refuse(found.embedding[0], "vocabulary (embedding rows)", found.embedding[1])
    if found.head is not None and found.head.out_features % tp_size:
        refuse(found.head.name, "vocabulary (LM head outputs)", found.head.out_features)
    for block in found.blocks:
        if block.kind.endswith("attention"):
            if block.heads % tp_size:
                refuse(block.name, "number of attention heads", block.heads)
            if block.kv_heads % tp_size:
                refuse(block.name, "number of key/value heads", block.kv_heads)
        elif block.output.in_features % tp_size:
            refuse(block.name, "intermediate (hidden) size", block.output.in_features)


def matching_modules(module: nn.Module, pattern: str) -> list[str]:
    """The submodule names ``pattern`` matches, atom by atom, as ``parallelize_module`` matches them."""
    atoms = pattern.split(".")
    return [name for name, _ in module.named_modules() if name and len(name.split(".")) == len(atoms)
            and all(fnmatch(part, atom) for part, atom in zip(name.split("."), atoms))]


def check_plan(module: nn.Module, plan: Mapping[str, ParallelStyle], tp_size: int) -> None:
    """Refuse a plan that names no module, holds a non-style, or splits a size tp does not divide.

    Example::

        check_plan(mlp, {"fc": ColwiseParallel(), "proj": RowwiseParallel()}, tp_size=2)
    """
    for pattern, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise PipelineConfigError(
                f"the plan maps {pattern!r} to {type(style).__name__}; it takes torch ParallelStyles "
                "(ColwiseParallel(), RowwiseParallel(), SequenceParallel(), PrepareModuleInput(...))"
            )
        names = matching_modules(module, pattern)
        if not names:
            raise PipelineConfigError(
                f"the tensor-parallel plan's pattern {pattern!r} matches no module of this "
                f"{type(module).__name__}; its modules are named e.g. "
                f"{[name for name, _ in module.named_modules() if name][:6]}"
            )
        for name in names:
            target = module.get_submodule(name)
            split = _split_size(target, style)
            if split is not None and split[1] % tp_size:
                raise PipelineConfigError(
                    f"tensor parallel size tp={tp_size} does not divide the {split[0]} of {name} "
                    f"({type(target).__name__}), {split[1]}, which {type(style).__name__} splits; choose a tp that "
                    f"divides {split[1]}, or leave {name} out of the plan"
                )


def _split_size(target: nn.Module, style: ParallelStyle) -> tuple[str, int] | None:
    colwise = isinstance(style, ColwiseParallel)
    if not colwise and not isinstance(style, RowwiseParallel):
        return None
    if isinstance(target, nn.Linear):
        return ("out_features", target.out_features) if colwise else ("in_features", target.in_features)
    if is_transposed_projection(target):
        return ("out_features", target.nf) if colwise else ("in_features", target.nx)
    if isinstance(target, nn.Embedding):
        return ("embedding_dim", target.embedding_dim) if colwise else ("num_embeddings", target.num_embeddings)
    return None


def parallelize_stage(
    module: nn.Module, tp_mesh, plan: str | Mapping[str, ParallelStyle] = "auto", *,
    sequence_parallel: bool = False, loss_parallel: bool = False,
) -> nn.Module:
    """Parallelize ``module`` (a whole model or one pipeline stage) over the 1-D ``tp_mesh``, in place.

    ``plan`` is "auto" (:func:`tensor_parallel_plan`) or a mapping from module names/patterns
    to ParallelStyles; either is checked before anything moves. Parameters tied inside the
    module (GPT-2's embedding and head) stay one parameter.

    Example (on each of 2 ranks)::

        tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        parallelize_stage(model, tp_mesh)          # or a plan: {"mlp.fc": ColwiseParallel(), ...}
        loss = model(**batch).loss                  # equal to one device's to rounding
    """
    if tp_mesh is None or tp_mesh.ndim != 1:
        raise PipelineConfigError(
            f"parallelize_stage takes the 1-D 'tp' sub-mesh (mesh['tp'], or layout_of(mesh).tp_mesh), got {tp_mesh}"
        )
    tp_size = tp_mesh.size()
    if isinstance(plan, str):
        if plan != "auto":
            raise PipelineConfigError(f"tensor_parallel takes 'auto' or a dict of ParallelStyles, got {plan!r}")
        plan = eager_plan(module, tp_size, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    elif not isinstance(plan, Mapping):
        raise PipelineConfigError(
            f"tensor_parallel takes 'auto' or a dict of ParallelStyles, got {type(plan).__name__}"
        )
    check_plan(module, plan, tp_size)
    tied = _tied_parameters(module)
    parallelize_module(module, tp_mesh, dict(plan))
    _retie(module, tied)
    return module


def eager_plan(module: nn.Module, tp_size: int, *, sequence_parallel: bool = False,
               loss_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The "auto" plan for a module torch's ``parallelize_module`` will take as it is (a whole model, or a stage
    built by hand), refusing what that path does not take yet: mixture-of-experts blocks under sequence parallelism
    (traced stages take them: :mod:`conveyor.parallel.tensor.traced_sequence`).

    Example::

        plan = eager_plan(stage, 2, sequence_parallel=True)
    """
    moe = moe_blocks(module) if sequence_parallel else []
    if moe:
        raise PipelineConfigError(
            f"sequence_parallel=True on a module parallelized eagerly (stages built by hand) does not take its "
            f"mixture-of-experts blocks ({', '.join(moe)}) yet: build the pipeline with "
            "conveyor.pipeline(model, ...), whose traced stages give each MoE block the sequence gathered, or "
            "drop sequence_parallel (tensor and expert parallelism take these stages)")
    return tensor_parallel_plan(module, tp_size, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


def _tied_parameters(module: nn.Module) -> list[list[str]]:
    by_id: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _retie(module: nn.Module, tied: list[list[str]]) -> None:
    """parallelize_module distributes each module's parameters anew: make tied names one parameter again."""
    for names in tied:
        first = module.get_parameter(names[0])
        for name in names[1:]:
            other = module.get_parameter(name)
            if getattr(other, "placements", None) != getattr(first, "placements", None):
                raise PipelineConfigError(
                    f"{names[0]} and {name} are one tied parameter, but the plan shards them differently "
                    f"({getattr(first, 'placements', 'whole')} and {getattr(other, 'placements', 'whole')}): give "
                    "both the same sharding (embedding RowwiseParallel and head ColwiseParallel both shard the "
                    "vocabulary)"
                )
            owner, _, attribute = name.rpartition(".")
            module.get_submodule(owner).register_parameter(attribute, first)
