"""Shared pytest set-up for conveyor's tests.

Imports nothing heavy: ``tests/schedule`` must collect and run without torch. The per-test
timeout comes from pyproject.toml (pytest-timeout, 300 s), above run_ranks's default of 120 s,
so a hung distributed test is reported by the harness, with the stacks of its ranks.

CI runs the suite on two pytest-xdist workers (``tools/test.sh``: ``-n 2 --dist loadfile``): each
test file runs whole on one worker, so a module fixture (often one launch of ranks for several
cases) or a module's cache is built once. (``--dist loadgroup`` would split files finer, but
pytest-xdist 3.8 cannot group under pytest 9: it renames ``item._nodeid``, which pytest 9 no
longer reads.)
"""

from __future__ import annotations

import gc
import importlib
import sys
import warnings
from collections.abc import Iterator

import pytest

# What ranks import when they trace, shard, compile or save, and this process has not: a forked rank
# inherits this process's modules, so each rank of each run_ranks call imported these again (about 4 s
# of CPU a rank for the whole list; listed from sys.modules in ranks at the end of their calls, against
# the pytest process's). Imported here once, before the first test of a run that forks ranks, each
# later rank starts with them.
RANKS_IMPORT = (
    "torch._dynamo",  # tracing and splitting (torch.export), torch.compile, FSDP2
    "torch._inductor.compile_fx",  # what dynamo's backends and the partitioner pull in (sympy, networkx)
    "torch.export",
    "torch.distributed.tensor.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.mixtral.modeling_mixtral",
    "conveyor.build",
    "conveyor.checkpoint",
    "conveyor.train",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--extended", action="store_true",
        help="also run the extended tier: the wider grids whose every promise CI already checks on a narrower one",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "distributed: starts torch.distributed ranks in subprocesses (conveyor.testing.run_ranks)",
    )
    config.addinivalue_line(
        "markers",
        "extended: a wider grid of a promise that a narrower CI test already checks; "
        "runs with --extended (bash tools/test.sh --extended)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave the extended tier out unless ``--extended`` is given, and say how many were left out;
    then put the slowest files first (:data:`SLOWEST_FILES_FIRST`).

    CI's suite must stay within 15 minutes on 2 cores; each test moved to the extended tier keeps
    a narrower twin in CI (the same promise on fewer ranks, transports or variants).
    """
    _slowest_files_first(items)
    if config.getoption("--extended"):
        return
    extended = [item for item in items if item.get_closest_marker("extended")]
    if extended:
        config.hook.pytest_deselected(items=extended)
        items[:] = [item for item in items if not item.get_closest_marker("extended")]
        config._conveyor_extended_left_out = len(extended)  # type: ignore[attr-defined]
        if hasattr(config, "workeroutput"):  # an xdist worker: the controller prints the summary
            config.workeroutput["conveyor_extended_left_out"] = len(extended)


# The slowest files of CI's run at 7ce4de6 (tests/ per file, seconds summed over their tests), slowest first.
# ``--dist loadfile`` hands whole files to the two workers in collection order (``tools/test.sh`` turns
# off xdist's own order, most tests first, which put these files of few but long tests last): started
# first, they leave the many short files to fill in behind them, and no worker ends the run alone on a
# long file. A stale entry costs balance only, never a test.
SLOWEST_FILES_FIRST = (
    "tests/test_portable_kernels.py",  # 70 s alone: a child pytest of the derived bounds on portable kernels
    "tests/e2e/test_recipes.py",  # 155 s
    "tests/runtime/test_compile.py",  # 137 s: inductor compiles its kernels from a cold cache
    "tests/e2e/test_launches.py",  # 89 s
    "tests/parallel/test_tensor_parallel_traced.py",  # 77 s
    "tests/parallel/test_expert_parallel.py",  # 63 s
    "tests/e2e/test_examples.py",  # 62 s
    "tests/runtime/test_pipeline_dist.py",  # 62 s
    "tests/train/test_tensor_parallel.py",  # 62 s
    "tests/e2e/test_train.py",  # 53 s
    "tests/parallel/test_tensor_parallel_pipeline_checks.py",  # 51 s
    "tests/checkpoint/test_tensor_parallel.py",  # 47 s
    "tests/train/test_layouts_save_and_start_alike.py",  # 46 s (105 s with its 4-rank launch, now extended)
    "tests/e2e/test_restart.py",  # 44 s
    "tests/runtime/test_lifecycle.py",  # 41 s
    "tests/parallel/test_tensor_data_parallel.py",  # 40 s
)


def _slowest_files_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: the files of :data:`SLOWEST_FILES_FIRST` in its order, then the
    others as collected (a stable sort: the order of the tests within a file is kept)."""
    rank = {path: index for index, path in enumerate(SLOWEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """On the xdist controller: every worker collected the same tests, so any one's count is the count."""
    left_out = getattr(node, "workeroutput", {}).get("conveyor_extended_left_out")
    if left_out:
        node.config._conveyor_extended_left_out = left_out


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    left_out = getattr(config, "_conveyor_extended_left_out", 0)
    if left_out:
        terminalreporter.write_line(
            f"{left_out} extended-tier tests left out (a narrower twin of each is in this run); "
            "everything: bash tools/test.sh --extended")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Import :data:`RANKS_IMPORT` in this process once, before the first test, when the tests
    collected here can fork ranks (one of them imported ``conveyor.testing``, whose ``run_ranks`` forks them).

    A run of the torch-free tests (``tests/schedule``) or of tests that start no ranks imports
    nothing more. Importing initialises neither torch.distributed nor CUDA (the fixture below
    checks that after every test).
    """
    config = item.config
    if getattr(config, "_conveyor_ranks_imports_done", False):
        return
    config._conveyor_ranks_imports_done = True  # type: ignore[attr-defined]
    if "conveyor.testing.multiprocess" not in sys.modules:
        return
    with warnings.catch_warnings():  # torch's own deprecations at import (torch.jit.script_method), not the test's
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in RANKS_IMPORT:
            importlib.import_module(name)
    # Everything alive now moves to the collector's permanent generation: a rank's full collections
    # then skip the inherited heap (0.26 s a collection with these modules) and leave its pages shared.
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _pytest_process_stays_out_of_distributed() -> Iterator[None]:
    """Fail the test that initialised torch.distributed or CUDA in the pytest process.

    Ranks are forked from this process: a process group or a CUDA context here would be
    inherited, half-broken, by every rank of every later test. Only modules already imported
    are looked at, so torch-free tests stay torch-free.
    """
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()  # spare the tests that come after
        pytest.fail(
            "this test initialised torch.distributed in the pytest process; "
            "run distributed code inside conveyor.testing.run_ranks instead"
        )
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        pytest.fail(
            "this test initialised CUDA in the pytest process, which forked ranks cannot use; "
            "touch CUDA only inside ranks started with start_method='spawn'"
        )


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread for the test: CPU kernels' reduction order depends on the thread
    count, so bitwise comparisons with ranks (one thread each) need the same."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``conveyor train`` in this process may check, print and exit, but never start ranks
    (and does not believe itself launched already)."""
    from conveyor.train import launch

    def refuse(*args, **kwargs):
        raise AssertionError("conveyor train started ranks in a test that expects none")

    monkeypatch.setattr(launch, "launch", refuse)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
