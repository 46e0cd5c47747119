"""Shared pytest set-up for conveyor's tests.

Imports nothing heavy: ``tests/schedule`` must collect and run without torch. The per-test
timeout comes from pyproject.toml (pytest-timeout, 300 s), above run_ranks's default of 120 s,
so a hung distributed test is reported by the harness, with the stacks of its ranks.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "distributed: starts torch.distributed ranks in subprocesses (conveyor.testing.run_ranks)",
    )


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
