"""Where a rank stands in a job of ``dp`` pipeline replicas of ``pp`` stages of ``tp`` ranks each.

A :class:`~torch.distributed.device_mesh.DeviceMesh` with named dims "pp", "dp" and "tp" lays the
job out: ranks along "pp" form one pipeline, ranks along "dp" hold the same stages in
different replicas, ranks along "tp" share one stage's tensors (tensor parallel, innermost, so
that its frequent collectives stay inside a node). :func:`layout_of` reads what a pipeline needs
from it and refuses a mesh it cannot use, before any communication.

Any order of "pp" and "dp" is read, "tp" last; the examples use pp outermost: ("pp", "dp", "tp").

Example (4 ranks: 2 replicas of a 2-rank pipeline)::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    layout = layout_of(mesh)
    layout.pp_ranks        # global ranks of this rank's pipeline, e.g. [0, 2]
    layout.dp_ranks        # global ranks holding the same stages, e.g. [0, 1]

With tensor parallelism (4 ranks: 2 stages of 2 TP ranks; rank 1 is stage 0's second TP rank)::

    layout = layout_of(init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp")))
    layout.pp_ranks        # on rank 1: [1, 3], the matching TP rank of every stage
    layout.tp_ranks        # on rank 1: [0, 1]
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.errors import PipelineConfigError

DIM_NAMES = ("dp", "pp")
KNOWN_DIMS = ("dp", "pp", "tp")


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
    def tp_group(self) -> object:
        """The process group of this stage's TP ranks (None without a "tp" dim)."""
        return None if self.tp_mesh is None else self.tp_mesh.get_group()

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


def pipeline_mesh(pp: int, device_type: str = "cpu"):
    """The job's ("dp", "pp") DeviceMesh for pipelines of ``pp`` ranks: dp = world size / pp.

    Example (on each of 4 ranks)::

        mesh = pipeline_mesh(2)          # 2 replicas of a 2-rank pipeline
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if not isinstance(pp, int) or pp < 1 or world % pp:
        raise PipelineConfigError(
            f"the job has {world} ranks, which is not a multiple of the pipeline size pp={pp}: launch "
            f"dp x {pp} processes, or choose a pp that divides {world}"
        )
    return init_device_mesh(device_type, (world // pp, pp), mesh_dim_names=DIM_NAMES)


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
    for name in KNOWN_DIMS:
        if name not in names:
            grid = grid.unsqueeze(-1)
            names = (*names, name)
    grid = grid.permute(*(names.index(name) for name in KNOWN_DIMS))
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
            "with init_device_mesh(device, (dp, pp), mesh_dim_names=('dp', 'pp'))"
        )
    names = tuple(mesh.mesh_dim_names or ())
    unknown = [n for n in names if n not in KNOWN_DIMS]
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
            "init_device_mesh('cpu', (dp, pp), mesh_dim_names=('dp', 'pp'))"
        )
    if "tp" in names and names[-1] != "tp":
        wanted = tuple(n for n in names if n != "tp") + ("tp",)
        raise PipelineConfigError(
            f"the mesh has dims {names}: 'tp' must be the innermost (last) dim, so that a stage's "
            f"tensor-parallel ranks are neighbours (one node); build it with mesh_dim_names={wanted}"
        )
    return names
