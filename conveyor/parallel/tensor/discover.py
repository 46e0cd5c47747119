"""Find, from a module's structure alone, what tensor parallelism can split in it.

The unit is a parent module and its direct projection children (``nn.Linear``, or a layer
storing its weight ``(in, out)`` as GPT-2's ``Conv1D``). One child is the output projection:
the last whose ``out_features`` equals every other child's ``in_features``. The others are
its inputs, and their shapes say what the parent is:

===========================================  ==============================  ====================
inputs (all reading the output's width)      the parent is                   styles
===========================================  ==============================  ====================
3, one as wide as the output reads (q, k, v)  attention                       q/k/v colwise, o rowwise
2 of equal width, as the output reads         gated MLP (gate, up)            colwise, down rowwise
1, as wide as the output reads                plain MLP (fc)                  colwise, proj rowwise
1, three times what the output reads          attention with fused q|k|v      packed colwise, rowwise
===========================================  ==============================  ====================

Attention heads come from the parent's own ``head_dim``, or a head count attribute
(``num_heads``, ``num_attention_heads``, ``n_head``, ``n_heads``). An ``nn.Embedding`` whose rows
are the vocabulary (tied to the head, or as many as the head has outputs, or the largest) is the
token embedding; a projection outside every block that is the module's last parameterised leaf
is the LM head. Any other projection is one "auto" cannot place.

Example::

    found = discover(model)
    [block.kind for block in found.blocks]    # ['attention', 'gated_mlp', ...]
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from torch import nn

from conveyor.parallel.tensor.styles import is_transposed_projection

HEAD_COUNT_ATTRIBUTES = ("num_heads", "num_attention_heads", "n_head", "n_heads")
KV_HEAD_COUNT_ATTRIBUTES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
# Width attributes an attention module may use in its forward, besides head counts (GPT-2's split).
WIDTH_ATTRIBUTES = ("split_size", "embed_dim", "all_head_size", "inner_dim")
# Keyword inputs of an attention's forward that carry one bias per head (ALiBi), built for all heads.
PER_HEAD_INPUTS = ("position_bias", "alibi")


@dataclass(frozen=True)
class Projection:
    """A Linear-like leaf: its name in the module, its widths, and whether it stores its weight (in, out)."""

    name: str
    in_features: int
    out_features: int
    transposed: bool


@dataclass(frozen=True)
class Block:
    """A parent and the roles of its projections: ``inputs`` split by columns, ``output`` by rows."""

    name: str
    kind: str  # "attention", "fused_attention", "gated_mlp", "mlp"
    inputs: tuple[Projection, ...]
    output: Projection
    heads: int = 0
    kv_heads: int = 0
    local_attributes: tuple[str, ...] = ()
    head_inputs: tuple[str, ...] = ()


@dataclass
class Found:
    """What :func:`discover` found, and what it could not place (name, reason)."""

    blocks: list[Block] = field(default_factory=list)
    embedding: tuple[str, int] | None = None  # (name, vocabulary rows)
    head: Projection | None = None
    unplaced: list[tuple[str, str]] = field(default_factory=list)


def projection_of(name: str, module: nn.Module) -> Projection | None:
    if isinstance(module, nn.Linear):
        return Projection(name, module.in_features, module.out_features, transposed=False)
    if is_transposed_projection(module):
        return Projection(name, module.nx, module.nf, transposed=True)
    return None


def _joined(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def discover(module: nn.Module) -> Found:
    """Classify ``module``'s projections and embeddings by structure (see the module docstring).

    Example::

        discover(llama).blocks[0]   # Block(name='model.layers.0.self_attn', kind='attention', ...)
    """
    found = Found()
    placed: set[str] = set()
    for parent_name, parent in module.named_modules():
        children = [p for n, child in parent.named_children() if (p := projection_of(_joined(parent_name, n), child))]
        if len(children) < 2:
            continue
        block = _block_of(parent_name, parent, children, found)
        if block is not None:
            found.blocks.append(block)
            placed.update(p.name for p in (*block.inputs, block.output))
    leftovers = [p for n, m in module.named_modules() if n not in placed and (p := projection_of(n, m)) is not None]
    found.head = _head_of(module, leftovers)
    for projection in leftovers:
        if projection is not found.head:
            found.unplaced.append((projection.name, f"a projection ({projection.in_features} -> "
                                   f"{projection.out_features}) that belongs to no attention or MLP pattern and is "
                                   "not the model's last layer (the LM head)"))
    found.embedding = _token_embedding(module, found.head)
    return found


def _output_of(children: list[Projection]) -> Projection | None:
    for candidate in reversed(children):
        others = [c for c in children if c is not candidate]
        if all(c.in_features == candidate.out_features for c in others):
            return candidate
    return None


def _block_of(name: str, parent: nn.Module, children: list[Projection], found: Found) -> Block | None:
    output = _output_of(children)
    if output is None:
        found.unplaced.append((name, f"its projections {[c.name for c in children]} have no common input width"))
        return None
    inputs = tuple(c for c in children if c is not output)
    widths = [c.out_features for c in inputs]
    if len(inputs) == 3 and widths[0] == output.in_features and widths[1] == widths[2]:
        return _attention(name, parent, inputs, output, found)
    if len(inputs) == 2 and widths[0] == widths[1] == output.in_features:
        return Block(name, "gated_mlp", inputs, output)
    if len(inputs) == 1 and widths[0] == output.in_features:
        return Block(name, "mlp", inputs, output)
    if len(inputs) == 1 and widths[0] == 3 * output.in_features:
        return _attention(name, parent, inputs, output, found, fused=True)
    found.unplaced.append((name, f"projections {[c.name for c in children]} of widths "
                                 f"{[(c.in_features, c.out_features) for c in children]} match no attention or MLP"))
    return None


def _attention(name, parent, inputs, output, found, fused: bool = False) -> Block | None:
    query_width = output.in_features
    head_dim = getattr(parent, "head_dim", None)
    if not isinstance(head_dim, int):
        counts = [getattr(parent, a) for a in HEAD_COUNT_ATTRIBUTES if isinstance(getattr(parent, a, None), int)]
        head_dim = query_width // counts[0] if counts and counts[0] and query_width % counts[0] == 0 else None
    if not head_dim or query_width % head_dim:
        found.unplaced.append((name, "an attention whose head size is unknown (no head_dim or num_heads attribute)"))
        return None
    heads = query_width // head_dim
    kv_heads = heads if fused else inputs[1].out_features // head_dim
    local = []
    for attribute in (*HEAD_COUNT_ATTRIBUTES, *KV_HEAD_COUNT_ATTRIBUTES, *WIDTH_ATTRIBUTES):
        value = getattr(parent, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool) and value in (heads, kv_heads, query_width):
            local.append(attribute)
    kind = "fused_attention" if fused else "attention"
    parameters = inspect.signature(parent.forward).parameters
    head_inputs = tuple(name for name in PER_HEAD_INPUTS if name in parameters)
    return Block(name, kind, inputs, output, heads=heads, kv_heads=kv_heads, local_attributes=tuple(local),
                 head_inputs=head_inputs)


def parameterised_leaves(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``module``'s leaves that hold parameters of their own, (name, leaf) in module order."""
    return [(n, m) for n, m in module.named_modules() if not list(m.children()) and list(m.parameters(recurse=False))]


def _head_of(module: nn.Module, leftovers: list[Projection]) -> Projection | None:
    leaves = parameterised_leaves(module)
    if not leaves:
        return None
    return next((p for p in leftovers if p.name == leaves[-1][0]), None)


def _token_embedding(module: nn.Module, head: Projection | None) -> tuple[str, int] | None:
    embeddings = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        return None
    head_weight, vocabulary = (module.get_submodule(head.name).weight, head.out_features) if head else (None, None)
    # Tied to the head, else as many rows as the head has outputs, else the largest: the first such.
    tied = [item for item in embeddings if item[1].weight is head_weight]
    as_wide = [item for item in embeddings if item[1].num_embeddings == vocabulary]
    name, embedding = (tied or as_wide or [max(embeddings, key=lambda item: item[1].num_embeddings)])[0]
    return name, embedding.num_embeddings
