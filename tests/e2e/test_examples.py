"""The README's data-parallel example, launched as a user would: torchrun, 4 processes, clean exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
# fsdp is the extended tier here: tests/checkpoint/test_data_parallel.py resumes and reshards an fsdp job in CI.
@pytest.mark.parametrize("kind", ["ddp", pytest.param("fsdp", marks=pytest.mark.extended)])
def test_the_data_parallel_example_resumes_bitwise_and_exits_cleanly(tmp_path, kind):
    """CI twin of ``[fsdp]``: ``[ddp]`` (the same assertions)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([str(torchrun), "--nproc-per-node=4", str(ROOT / "examples" / "data_parallel.py"),
                           "--data-parallel", kind, "--out", str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=280, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "bitwise equal" in done.stdout
    assert "terminate called" not in done.stderr  # no abort at exit on any rank
    assert (tmp_path / "ckpt" / "latest").exists()
