"""What a user's own tests need: run a function on N torch.distributed ranks, models, and references.

- :func:`run_ranks` runs one function on fresh gloo ranks (forked or spawned) with a timeout,
  and reports a failed rank's traceback, or every stuck rank's stack; its errors are
  :class:`RankFailure`, :class:`RankTimeout` and :class:`HarnessConfigError`
  (:mod:`conveyor.testing.multiprocess`).
- :mod:`conveyor.testing.models`: the model zoo, small models to build pipelines of in tests.
- :mod:`conveyor.testing.references`: the single-device (or TP-alone) references a pipeline is
  compared with, e.g. :mod:`~conveyor.testing.references.main_grad` and
  :mod:`~conveyor.testing.references.data_parallel`, which a pipeline equals bit for bit;
  :mod:`conveyor.testing.compare`: NaN-propagating differences and derived bounds.
- :mod:`conveyor.testing.rigs`: what only particular tests and ``tools/``' commands use (kill
  trials, launch stress, the host-sync probe, the schedule layer's pins), each with its users named.

This is the one home of the suite's support: ``tests/`` keeps test files and data, no support modules;
``tools/`` and ``benchmarks/`` import from here too. No library module imports this package
(``tests/test_layers.py`` keeps it so). Importing this package does not import torch;
``run_ranks`` does, when called.

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

__all__ = ["MAX_RESULT_BYTES", "HarnessConfigError", "RankError", "RankFailure", "RankTimeout", "run_ranks"]
