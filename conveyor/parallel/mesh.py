"""Where a rank stands in a job of ``dp`` pipeline replicas of ``pp`` ranks each.

A :class:`~torch.distributed.device_mesh.DeviceMesh` with named dims "dp" and "pp" lays the
job out: ranks along "pp" form one pipeline, ranks along "dp" hold the same stages in
different replicas. :func:`layout_of` reads what a pipeline needs from it and refuses a mesh
it cannot use, before any communication.

Example (4 ranks: 2 replicas of a 2-rank pipeline)::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    layout = layout_of(mesh)
    layout.pp_ranks        # global ranks of this rank's pipeline, e.g. [0, 1]
    layout.dp_ranks        # global ranks holding the same stages, e.g. [0, 2]
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.errors import PipelineConfigError

DIM_NAMES = ("dp", "pp")


@dataclass(frozen=True)
class MeshLayout:
    """This rank's pipeline and its replicas, as global ranks.

    ``pipelines[r]`` lists the global ranks of replica ``r``'s pipeline, in pipeline-rank
    order; this rank is ``pipelines[dp_rank][pp_rank]``. ``pp_group`` is the mesh's group
    along "pp" (the one a pipeline is given as ``group=``).
    """

    pipelines: tuple[tuple[int, ...], ...]
    dp_rank: int
    pp_rank: int
    pp_group: object

    @property
    def dp_size(self) -> int:
        return len(self.pipelines)

    @property
    def pp_size(self) -> int:
        return len(self.pipelines[0])

    @property
    def pp_ranks(self) -> list[int]:
        return list(self.pipelines[self.dp_rank])

    @property
    def dp_ranks(self) -> list[int]:
        return [pipeline[self.pp_rank] for pipeline in self.pipelines]

    def replica_ranks(self, pipeline_ranks: list[int]) -> list[list[int]]:
        """For each replica, the global ranks at the pipeline positions ``pipeline_ranks``."""
        return [[pipeline[r] for r in pipeline_ranks] for pipeline in self.pipelines]


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
    """Read a ("dp", "pp") or ("pp",) device mesh; raise PipelineConfigError on any other.

    Example::

        layout = layout_of(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp")))
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise PipelineConfigError(
            f"mesh= takes a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}; build one "
            "with init_device_mesh(device, (dp, pp), mesh_dim_names=('dp', 'pp'))"
        )
    names = tuple(mesh.mesh_dim_names or ())
    if "pp" not in names:
        raise PipelineConfigError(
            f"the mesh has dims {names or '(unnamed)'} but no 'pp' dim: name its dims, e.g. "
            "init_device_mesh('cpu', (dp, pp), mesh_dim_names=('dp', 'pp'))"
        )
    unknown = [n for n in names if n not in DIM_NAMES]
    if unknown:
        raise PipelineConfigError(
            f"the mesh has dims {names}; conveyor uses 'dp' and 'pp' only (got {unknown}). "
            "Give the pipeline a ('dp', 'pp') mesh, or its 'pp' sub-mesh"
        )
    world = dist.get_world_size()
    if mesh.size() != world:
        raise PipelineConfigError(
            f"the mesh covers {mesh.size()} ranks but the job has {world}: a ('dp', 'pp') mesh must "
            f"cover every rank (world size = dp x pp; {world} is not {mesh.size()})"
        )
    grid = mesh.mesh.tolist()
    if names == ("pp",):
        pipelines = (tuple(grid),)
    elif names == ("pp", "dp"):
        pipelines = tuple(zip(*grid))
    else:
        pipelines = tuple(tuple(row) for row in grid)
    me = dist.get_rank()
    dp_rank = next(r for r, pipeline in enumerate(pipelines) if me in pipeline)
    return MeshLayout(pipelines, dp_rank, pipelines[dp_rank].index(me), mesh["pp"].get_group())
