"""One mesh-dim order everywhere: pp outermost, tp innermost.

The mesh a user builds with :func:`conveyor.parallel.mesh.pipeline_mesh`, the one a
:class:`~conveyor.DistributedLayout` given sizes builds, and the one ``conveyor train`` trains on
(its ``parallel:`` keys, through the same record) are one mesh for the same sizes, and the global
ranks of a pipeline, a replica group and a TP group are where README says:
rank = (pp_rank x dp + dp_rank) x tp + tp_rank.
"""

from __future__ import annotations

import pytest

from conveyor.parallel.mesh import MESH_DIMS, mesh_dims
from conveyor.testing import run_ranks

SIZES = [(2, 2, 1), (2, 1, 2), (1, 2, 2)]  # (pp, dp, tp) on 4 ranks


def test_the_dims_conveyor_builds_put_pp_outermost_and_tp_innermost():
    assert MESH_DIMS == ("pp", "dp", "tp")
    assert mesh_dims(2, 3, 4) == (("pp", 2), ("dp", 3), ("tp", 4))
    assert mesh_dims(4, 2) == (("pp", 4), ("dp", 2))  # no tp dim without tensor parallelism


def _meshes(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from conveyor.layout import DistributedLayout
    from conveyor.parallel.mesh import layout_of, pipeline_mesh, with_mesh
    from conveyor.train.config import ParallelConfig

    found = {}
    for pp, dp, tp in SIZES:
        built = pipeline_mesh(pp, "cpu", tp=tp)
        by_record = with_mesh(DistributedLayout(dp=dp, tp=tp)).mesh
        trainer = with_mesh(ParallelConfig(pp=pp, dp=dp, tp=tp).layout("cpu")).mesh
        where = layout_of(trainer)
        found[(pp, dp, tp)] = {
            "names": [tuple(mesh.mesh_dim_names) for mesh in (built, by_record, trainer)],
            "grids": [mesh.mesh.tolist() for mesh in (built, by_record, trainer)],
            "position": (where.pp_rank, where.dp_rank, where.tp_rank),
            "pipeline": where.pp_ranks, "replicas": where.dp_ranks, "tp": list(where.tp_ranks),
            "rank": dist.get_rank(),
        }
    return found


@pytest.mark.distributed
def test_pipeline_mesh_the_layout_and_the_trainer_build_one_mesh_pp_outermost():
    results = run_ranks(_meshes, 4, timeout_s=120)
    for pp, dp, tp in SIZES:
        names = ("pp", "dp", "tp") if tp > 1 else ("pp", "dp")
        for found in (result[(pp, dp, tp)] for result in results):
            assert found["names"] == [names] * 3, (pp, dp, tp, found["names"])
            assert found["grids"][0] == found["grids"][1] == found["grids"][2], (pp, dp, tp)
            pp_rank, dp_rank, tp_rank = found["position"]
            assert found["rank"] == (pp_rank * dp + dp_rank) * tp + tp_rank, (pp, dp, tp, found)
            # A pipeline's ranks lie farthest apart, a stage's TP ranks are neighbours.
            assert found["pipeline"] == [(p * dp + dp_rank) * tp + tp_rank for p in range(pp)], found
            assert found["replicas"] == [(pp_rank * dp + d) * tp + tp_rank for d in range(dp)], found
            if tp > 1:
                assert found["tp"] == [(pp_rank * dp + dp_rank) * tp + t for t in range(tp)], found
    assert results[0][(2, 2, 1)]["pipeline"] == [0, 2]  # replica 0's pipeline, as README's example says
