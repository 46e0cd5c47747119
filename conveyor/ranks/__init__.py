"""Local ranks that stay alive between calls: how the library starts ranks of its own.

:class:`RankGroup` forks ``world_size`` processes (from this one, or from a :class:`Zygote`
that imported little), joins them in a gloo group and runs call after call on them; the
calibration (:mod:`conveyor.plan.calibration`) steps a pipeline on them, the benchmarks alternate
two libraries' groups. A failed or hung call raises
:class:`~conveyor.errors.RankFailure` or :class:`~conveyor.errors.RankTimeout` with every
rank's traceback or stack. Tests that run one function on fresh ranks use
:func:`conveyor.testing.run_ranks`, which shares this package's rank set-up
(:mod:`conveyor.ranks.support`). Importing this package does not import torch.

Example:
    >>> with RankGroup(2, distributed=False) as group:
    ...     group.call(place)
    [(0, 2), (1, 2)]
"""

from conveyor.ranks.group import RankGroup, Worker, Zygote, place

__all__ = ["RankGroup", "Worker", "Zygote", "place"]
