"""Expert parallelism: a mixture of experts' experts spread over ranks borrowed from the mesh's "dp" dim.

- :mod:`~conveyor.parallel.experts.discover`: which modules are experts ("auto" by structure, or a plan);
- :mod:`~conveyor.parallel.experts.dispatch`: the all-to-all dispatch and combine of one layer's tokens;
- :mod:`~conveyor.parallel.experts.part`: the stage part (shards, groups, the experts' gradient reduction);
- :mod:`~conveyor.parallel.experts.overlap`: the stages' forwards in steps, so that a pair's two passes take
  turns at their all-to-alls (``expert_overlap=True``).

Example (4 ranks: 2 replicas of a 2-stage pipeline, the experts split over the 2 replicas)::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pipe = conveyor.Pipeline(stages, schedule, loss_fn=loss_fn,
                             layout=DistributedLayout(mesh=mesh, expert_parallel="auto", ep=2))
"""

from conveyor.parallel.experts.discover import find_experts
from conveyor.parallel.experts.dispatch import dispatch_combine
from conveyor.parallel.experts.part import ExpertParallel

__all__ = ["ExpertParallel", "dispatch_combine", "find_experts"]
