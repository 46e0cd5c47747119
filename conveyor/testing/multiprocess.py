"""Run a function on N torch.distributed CPU ranks, each in its own process, and fail loud.

``run_ranks(fn, world_size)`` starts ``world_size`` processes, joins them into one
process group (gloo by default) and returns what ``fn(rank, world_size, *args, **kwargs)``
returned on each rank, in rank order. It never hangs and never hides a failure:

- a rank that raises makes the whole run stop at once: the other ranks (perhaps blocked
  in a collective or a receive) are killed and :class:`RankFailure` carries each failed
  rank's full traceback and names the ranks that were killed while still running;
- a rank that dies without a Python exception (``os._exit``, a signal, a segfault) is
  reported with its exit code (and the crash stack, if Python printed one);
- a run that outlives ``timeout_s`` first has every unfinished rank dump its Python stack
  (``faulthandler`` on SIGUSR1), then kills them and raises :class:`RankTimeout`, whose
  message shows where each one was stuck.

The calling process (pytest) never initialises torch.distributed or CUDA. Ranks are forked
by default because a forked rank inherits the already imported torch (about 0.3 s for a
whole test file, against 6-7 s per spawned process); ``start_method="spawn"`` works too
when ``fn`` and its arguments can be pickled (a function defined at module level).

Example (a test in ``tests/runtime/``; the rank function lives at module level so the
same test also runs under ``start_method="spawn"``):

    import torch
    import torch.distributed as dist

    from conveyor.testing import run_ranks

    def _sum_of_ranks(rank: int, world_size: int) -> float:
        value = torch.tensor([float(rank)])
        dist.all_reduce(value)
        return value.item()

    def test_all_reduce_sums_ranks() -> None:
        assert run_ranks(_sum_of_ranks, 4, timeout_s=30) == [6.0] * 4

Inside a rank, RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR (127.0.0.1) and MASTER_PORT are
set, ``torch.get_num_threads()`` is 1, and the default process group is ready (unless
``init_process_group=False``). Return small, picklable values (numbers, lists, tensors,
state dicts, CPU tensors only: a CUDA tensor would initialise CUDA in the caller);
anything that cannot be pickled or weighs more than ``max_result_bytes`` fails the run
with a message saying so.

``run_ranks`` is a :class:`conveyor.processes.RankGroup` that lives for one call
(:func:`conveyor.processes.run_once`): the ranks that the calibration steps a pipeline on, or
that a benchmark keeps between steps, start, fail, time out and stop the same way. A test
that needs ranks to keep their state between calls uses a ``RankGroup`` directly.

Notes for test and benchmark authors:
- mark such tests ``@pytest.mark.distributed`` (registered in ``tests/conftest.py``);
- keep ``timeout_s`` below pytest-timeout's per-test limit (300 s in pyproject.toml), or
  raise that with ``@pytest.mark.timeout(...)``, so that the harness, not pytest-timeout,
  reports a hang (with stacks);
- ranks killed after a failure run no ``finally`` blocks: keep cleanup that matters in
  the caller (pytest's ``tmp_path`` is shared by all ranks under fork and spawn alike);
- a failed rank keeps its sockets open until the harness has killed its peers, so they do
  not add "connection closed" errors that bury the root cause.
"""

from __future__ import annotations

from conveyor.errors import HarnessConfigError, RankError, RankFailure, RankTimeout
from conveyor.processes import MAX_RESULT_BYTES
from conveyor.processes import run_once as run_ranks

__all__ = ["MAX_RESULT_BYTES", "HarnessConfigError", "RankError", "RankFailure", "RankTimeout", "run_ranks"]
