"""Test helpers for conveyor and its users: run functions on N torch.distributed ranks.

``run_ranks`` runs one function on fresh ranks; ``RankGroup`` keeps ranks alive between
calls (optionally forked from a ``Zygote``); ``conveyor.testing.models`` is the model zoo.
Importing this package does not import torch; ``run_ranks`` does, when called.

Example:
    >>> from conveyor.testing import run_ranks
    >>> run_ranks(lambda rank, world_size: rank * 10, 2, init_process_group=False)
    [0, 10]
"""

from conveyor.testing.multiprocess import (
    MAX_RESULT_BYTES,
    GroupClosed,
    HarnessConfigError,
    RankError,
    RankFailure,
    RankGroup,
    RankTimeout,
    Worker,
    Zygote,
    ZygoteFailure,
    place,
    run_ranks,
)

__all__ = [
    "MAX_RESULT_BYTES",
    "GroupClosed",
    "HarnessConfigError",
    "RankError",
    "RankFailure",
    "RankGroup",
    "RankTimeout",
    "Worker",
    "Zygote",
    "ZygoteFailure",
    "place",
    "run_ranks",
]
