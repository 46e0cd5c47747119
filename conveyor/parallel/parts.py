"""Which stage parts a distributed pipeline gets: the one place that reads the layout's parallelisms.

The order of the list is the order of every hook, and so the order of a step's reductions, which
bitwise parity with one device depends on: the replicas' reduction first (the gradients then hold
the replicas' mean), then the tensor-parallel gradients settled to their placements, then the expert
shards' gradients (summed over their expert-data-parallel group, divided by dp), then the tied
copies' sums, and after the loss broadcast the replicas' mean of the loss. A new parallelism is
one more entry here, read from its one option field.

Example:
    >>> from conveyor.layout import DistributedLayout
    >>> [type(part).__name__ for part in parts_for(DistributedLayout(), None)]
    ['TiedGradients']
"""

from __future__ import annotations

from conveyor.errors import PipelineConfigError
from conveyor.layout import DistributedLayout
from conveyor.parallel.mesh import MeshLayout
from conveyor.parallel.part import StagePart
from conveyor.parallel.replicas import Replicas
from conveyor.parallel.tied import TiedGradients


def parts_for(layout: DistributedLayout, mesh_layout: MeshLayout | None) -> list[StagePart]:
    """The parts a pipeline over ``layout`` runs with, in hook order, then ``layout.parts`` (the user's own).

    ``mesh_layout``: the layout's mesh read as pipeline, replica and TP positions (None: a plain group).
    Tied copies are summed across ranks always (nothing to do for a model without tied parameters).
    """
    dp_size = mesh_layout.dp_size if mesh_layout is not None else 1
    parts: list[StagePart] = []
    if dp_size > 1:  # the record checked the kind; "ddp" by default
        assert mesh_layout is not None
        # With TP the stages' parameters are DTensors on the mesh's "tp" sub-mesh: torch's 2-D
        # composition (FSDP2 on TP-sharded parameters) needs the "dp" sub-mesh of that same mesh.
        dp_mesh = layout.mesh["dp"] if layout.tensor_parallel is not None else None
        parts.append(Replicas(layout.data_parallel or "ddp", dp_size, mesh=dp_mesh))
    if layout.tensor_parallel is not None:
        # DTensor is loaded for tensor parallelism only.
        from conveyor.parallel.tensor.stages import TensorParallelStages

        assert mesh_layout is not None  # with_mesh built the mesh of tp > 1
        parts.append(TensorParallelStages(layout, mesh_layout.tp_mesh))
    if layout.expert_parallel is not None:
        from conveyor.parallel.experts import ExpertParallel

        assert mesh_layout is not None  # Layout refuses expert_parallel without a mesh's "dp" or "tp" dim
        ep = layout.ep or mesh_layout.dp_size
        if ep > 1:  # ep=1: every rank keeps every expert, nothing to move
            parts.append(ExpertParallel(layout.expert_parallel, ep, mesh_layout, layout.expert_capacity,
                                        layout.expert_overlap))
    parts.append(TiedGradients())
    for part in layout.parts:
        if not isinstance(part, StagePart):
            raise PipelineConfigError(f"DistributedLayout(parts=...) takes conveyor.parallel.part.StagePart objects; "
                                      f"got {type(part).__name__}: subclass StagePart and override its hooks")
        parts.append(part)
    return parts


def part_classes(layout: DistributedLayout) -> list[type[StagePart]]:
    """The classes of the parts :func:`parts_for` builds for ``layout`` that the trace and the cut ask before any
    part exists (:meth:`StagePart.trace_leaves`, :meth:`StagePart.materialize_stages`,
    :meth:`StagePart.parameter_placements`), in hook order.

    Example:
        >>> part_classes(DistributedLayout())
        []
    """
    classes: list[type[StagePart]] = []
    if layout.tensor_parallel is not None:
        from conveyor.parallel.tensor.stages import TensorParallelStages

        classes.append(TensorParallelStages)
    if layout.expert_parallel is not None:
        from conveyor.parallel.experts import ExpertParallel

        classes.append(ExpertParallel)
    return classes + [type(part) for part in layout.parts if isinstance(part, StagePart)]

