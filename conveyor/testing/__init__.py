"""What a user's own tests need: run a function on N torch.distributed ranks, and references.

- :func:`run_ranks` runs one function on fresh gloo ranks (forked or spawned) with a timeout,
  and reports a failed rank's traceback, or every stuck rank's stack; its errors are
  :class:`RankFailure`, :class:`RankTimeout` and :class:`HarnessConfigError`.
- :mod:`conveyor.testing.main_grad` and :mod:`conveyor.testing.data_parallel`: the
  single-device references a pipeline equals bit for bit (``param_dtype="bf16"`` with fp32
  main grads; pipeline x data parallelism).
- :mod:`conveyor.testing.models`: small models to build pipelines of in tests.

No library module imports this package (``tests/test_layers.py`` keeps it so); the rigs
(kill trials, launch stress, the host-sync probe, the GPU check) live in ``tools/``. Importing
this package does not import torch; ``run_ranks`` does, when called.

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
