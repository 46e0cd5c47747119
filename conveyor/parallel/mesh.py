"""Where a rank stands in a job of ``dp`` pipeline replicas of ``pp`` stages of ``tp`` ranks each.

A :class:`~torch.distributed.device_mesh.DeviceMesh` with named dims "pp", "dp" and "tp" lays the
job out: ranks along "pp" form one pipeline, ranks along "dp" hold the same stages in different
replicas, ranks along "tp" share one stage's tensors. Every mesh conveyor builds (:func:`pipeline_mesh`,
for a DistributedLayout's sizes and ``conveyor train`` alike) is ("pp", "dp", "tp"): pp outermost, tp
innermost, so that TP's frequent collectives stay inside a node; a mesh of your own may order "pp" and
"dp" either way, "tp" last. :func:`layout_of` reads what a pipeline needs from it and refuses a mesh it
cannot use, before any communication.

Example (4 ranks: 2 replicas of a 2-rank pipeline)::

    mesh = pipeline_mesh(2)                 # ("pp", "dp") = (2, 2)
    layout = layout_of(mesh)
    layout.pp_ranks        # global ranks of this rank's pipeline, e.g. [0, 2]
    layout.dp_ranks        # global ranks holding the same stages, e.g. [0, 1]

With tensor parallelism (4 ranks: 2 stages of 2 TP ranks; rank 1 is stage 0's second TP rank)::

    layout = layout_of(init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp")))
    layout.pp_ranks        # on rank 1: [1, 3], the matching TP rank of every stage
    layout.tp_ranks        # on rank 1: [0, 1]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from conveyor.errors import PipelineConfigError, positive_int

if TYPE_CHECKING:
    from conveyor.layout import DistributedLayout

MESH_DIMS = ("pp", "dp", "tp")  # the order of the meshes conveyor builds: pp outermost, tp innermost
GRID_ORDER = ("dp", "pp", "tp")  # how layout_of indexes its grid: a replica's pipelines, then their stages


@dataclass(frozen=True)
class MeshLayout:
    """This rank's pipeline, its replicas and its tensor-parallel peers, as global ranks.

    ``pipelines[r]`` lists the global ranks of replica ``r``'s pipeline, in pipeline-rank
    order, among the ranks at this rank's TP position (each TP rank talks to the matching TP
    rank of the neighbouring stage); this rank is ``pipelines[dp_rank][pp_rank]``. ``pp_group``
    is the mesh's group along "pp" (the one a pipeline is given as ``group=``). ``tp_ranks``
    holds this stage's TP ranks (this rank is ``tp_ranks[tp_rank]``) and ``tp_mesh`` the 1-D
    "tp" sub-mesh that :func:`conveyor.parallel.tensor.parallelize_stage` takes (None without a "tp" dim).
    """

    pipelines: tuple[tuple[int, ...], ...]
    dp_rank: int
    pp_rank: int
    pp_group: object
    tp_ranks: tuple[int, ...] = ()
    tp_rank: int = 0
    tp_mesh: object = None
    # Every pipeline of the job, one per (replica, TP position), in that order: the pipelines'
    # own groups are built by every rank, for each of them, in this one order.
    every_pipeline: tuple[tuple[int, ...], ...] = ()

    @property
    def dp_size(self) -> int:
        return len(self.pipelines)

    @property
    def pp_size(self) -> int:
        return len(self.pipelines[0])

    @property
    def tp_size(self) -> int:
        return max(1, len(self.tp_ranks))

    @property
    def pp_ranks(self) -> list[int]:
        return list(self.pipelines[self.dp_rank])

    @property
    def dp_ranks(self) -> list[int]:
        return [pipeline[self.pp_rank] for pipeline in self.pipelines]

    @property
    def group_pipelines(self) -> list[list[int]]:
        """Every pipeline of the job (each replica's, at each TP position): whose groups every rank builds."""
        return [list(p) for p in (self.every_pipeline or self.pipelines)]

    def replica_ranks(self, pipeline_ranks: list[int]) -> list[list[int]]:
        """For each pipeline of the job (each replica, each TP position), the global ranks at the
        pipeline positions ``pipeline_ranks``."""
        return [[pipeline[r] for r in pipeline_ranks] for pipeline in self.group_pipelines]


def mesh_dims(pp: int, dp: int, tp: int = 1) -> tuple[tuple[str, int], ...]:
    """The (name, size) dims of every mesh conveyor builds: pp outermost, then dp, then tp (when above 1).

    Example:
        >>> mesh_dims(2, 2, 2), mesh_dims(4, 1)
        ((('pp', 2), ('dp', 2), ('tp', 2)), (('pp', 4), ('dp', 1)))
    """
    return tuple(zip(MESH_DIMS, (pp, dp, tp)))[:3 if tp > 1 else 2]


def pipeline_mesh(pp: int | None = None, device_type: str = "cpu", tp: int = 1, dp: int | None = None):
    """The job's DeviceMesh of :func:`mesh_dims` (("pp", "dp"), "tp" innermost when above 1): give ``pp``
    (dp is what the job's ranks leave) or ``dp`` (pp is). Consecutive global ranks share a stage (its
    TP ranks: one node when ``--nproc-per-node`` is a multiple of tp), then a stage's replicas; a
    pipeline's ranks lie farthest apart.

    Example (on each of 4 ranks)::

        mesh = pipeline_mesh(2)          # 2 replicas of a 2-rank pipeline: pipelines [0, 2] and [1, 3]
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    what, given = ("the pipeline size pp", pp) if pp is not None else ("the replica count dp", dp)
    if not positive_int(given) or world % (given * tp):
        raise PipelineConfigError(
            f"the job has {world} ranks, which is not a multiple of {what}={given} x tp={tp}: launch a multiple "
            f"of {given} x {tp} processes, or choose sizes whose product divides {world}")
    rest = world // (given * tp)
    dims = mesh_dims(*((given, rest) if pp is not None else (rest, given)), tp)
    return init_device_mesh(device_type, tuple(size for _, size in dims), mesh_dim_names=tuple(n for n, _ in dims))


def with_mesh(layout: DistributedLayout) -> DistributedLayout:
    """``layout`` with its mesh: the one given, or for sizes dp or tp above 1 :func:`pipeline_mesh`'s over
    the job's ranks (a collective); a layout of one pipeline (dp = tp = 1, no mesh) as it is.

    Example (on each of 4 ranks)::

        with_mesh(DistributedLayout(dp=2)).mesh     # ("pp", "dp") = (2, 2)
    """
    import torch.distributed as dist

    sizes = {name: getattr(layout, name) for name in layout.mesh_dims()}  # every size field: a new dim's too
    if layout.mesh is not None or set(sizes.values()) == {1} or not dist.is_initialized():
        return layout  # (not initialised: the pipeline's own check says how to start torch.distributed)
    from conveyor.runtime.stage.device import resolve_device

    mesh = pipeline_mesh(None, resolve_device(layout.device).type, **sizes)
    return dataclasses.replace(layout, mesh=mesh)


def pipeline_ranks(layout: DistributedLayout, fix: str) -> tuple[Any, int, int]:
    """(group, size, this process's rank) of ``layout``'s pipeline: its mesh's "pp" dim, else its group (None: the
    default one); a PipelineConfigError ending with ``fix`` when torch.distributed is not initialised."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise PipelineConfigError("torch.distributed is not initialised: launch with torchrun and call "
                                  f"torch.distributed.init_process_group() first, or {fix}")
    group = layout.group if layout.mesh is None else layout_of(layout.mesh).pp_group
    return group, dist.get_world_size(group), dist.get_rank(group)


def layout_of(mesh) -> MeshLayout:
    """Read a mesh with a "pp" dim and any of "dp" and "tp" ("tp" last); raise PipelineConfigError on any other.

    Example::

        layout = layout_of(init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp")))
        layout = layout_of(init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp")))
    """
    import torch.distributed as dist

    names = _checked_dim_names(mesh)
    world = dist.get_world_size()
    if mesh.size() != world:
        sizes = " x ".join(f"{name}={size}" for name, size in zip(names, mesh.mesh.shape))
        raise PipelineConfigError(
            f"the mesh {sizes} covers {mesh.size()} ranks but the job has {world}: a mesh must cover every "
            f"rank (world size = {' x '.join(names)}); choose sizes whose product is {world}"
        )
    # One grid indexed (dp, pp, tp), a missing dim of size 1.
    grid = mesh.mesh
    for name in GRID_ORDER:
        if name not in names:
            grid = grid.unsqueeze(-1)
            names = (*names, name)
    grid = grid.permute(*(names.index(name) for name in GRID_ORDER))
    me = dist.get_rank()
    dp_rank, pp_rank, tp_rank = (int(i) for i in (grid == me).nonzero()[0])
    pipelines = tuple(tuple(row) for row in grid[:, :, tp_rank].tolist())
    has_tp = "tp" in tuple(mesh.mesh_dim_names)
    return MeshLayout(
        pipelines, dp_rank, pp_rank, mesh["pp"].get_group(),
        tp_ranks=tuple(grid[dp_rank, pp_rank, :].tolist()) if has_tp else (),
        tp_rank=tp_rank, tp_mesh=mesh["tp"] if has_tp else None,
        every_pipeline=tuple(tuple(grid[d, :, t].tolist()) for d in range(grid.shape[0]) for t in range(grid.shape[2])),
    )


def _checked_dim_names(mesh) -> tuple[str, ...]:
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise PipelineConfigError(
            f"mesh= takes a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}; build one "
            "with conveyor.parallel.pipeline_mesh(pp) or init_device_mesh(device, (pp, dp), mesh_dim_names=('pp', "
            "'dp'))"
        )
    names = tuple(mesh.mesh_dim_names or ())
    unknown = [n for n in names if n not in MESH_DIMS]
    if unknown:
        raise PipelineConfigError(
            f"the mesh has dims {names}; conveyor knows 'pp', 'dp' and 'tp' only (got {unknown}). Name the "
            "dims, e.g. init_device_mesh('cpu', (pp, dp, tp), mesh_dim_names=('pp', 'dp', 'tp'))"
        )
    if len(set(names)) != len(names):
        raise PipelineConfigError(f"the mesh names a dim twice: {names}; name each of 'pp', 'dp', 'tp' once")
    if "pp" not in names:
        raise PipelineConfigError(
            f"the mesh has dims {names or '(unnamed)'} but no 'pp' dim: name its dims, e.g. "
            "init_device_mesh('cpu', (pp, dp), mesh_dim_names=('pp', 'dp'))"
        )
    if "tp" in names and names[-1] != "tp":
        wanted = tuple(n for n in names if n != "tp") + ("tp",)
        raise PipelineConfigError(
            f"the mesh has dims {names}: 'tp' must be the innermost (last) dim, so that a stage's "
            f"tensor-parallel ranks are neighbours (one node); build it with mesh_dim_names={wanted}"
        )
    return names
