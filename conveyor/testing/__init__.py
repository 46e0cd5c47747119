"""Test helpers for conveyor and its users: run a function on N torch.distributed ranks.

Importing this package does not import torch; ``run_ranks`` does, when called.

Example:
    >>> from conveyor.testing import run_ranks
    >>> run_ranks(lambda rank, world_size: rank * 10, 2, init_process_group=False)
    [0, 10]
"""

from conveyor.testing.multiprocess import (
    MAX_RESULT_BYTES,
    HarnessConfigError,
    RankError,
    RankFailure,
    RankTimeout,
    run_ranks,
)

__all__ = [
    "MAX_RESULT_BYTES",
    "HarnessConfigError",
    "RankError",
    "RankFailure",
    "RankTimeout",
    "run_ranks",
]
