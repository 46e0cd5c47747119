"""Local ranks in processes of their own: the one way conveyor starts, watches and stops them.

:class:`RankGroup` starts ``world_size`` processes (forked or spawned from this one, or forked
from a :class:`Zygote` that imported little), joins them in a process group and runs call
after call on them: the calibration (:mod:`conveyor.plan.calibration`) steps a pipeline on
them, the benchmarks alternate two libraries' groups. :func:`run_once` is a group for one
call, what :func:`conveyor.testing.run_ranks` runs for tests. A failed or hung call raises
:class:`~conveyor.errors.RankFailure` or :class:`~conveyor.errors.RankTimeout` with every
failed rank's traceback or every stuck rank's stack. Importing this package does not import
torch.

Example:
    >>> with RankGroup(2, distributed=False) as group:
    ...     group.call(place)
    [(0, 2), (1, 2)]
"""

from conveyor.processes.group import MAX_RESULT_BYTES, RankGroup, run_once
from conveyor.processes.rank import Worker, place
from conveyor.processes.zygote import Zygote

__all__ = ["MAX_RESULT_BYTES", "RankGroup", "Worker", "Zygote", "place", "run_once"]
