"""tools/gpu_check.sh: its logic on CPU (--device cpu, gloo ranks), and its answer where no GPU is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHON": sys.executable, **env})


def test_the_gpu_check_says_it_skipped_where_there_is_no_gpu():
    done = _run(CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 0 and done.stdout.strip() == "no CUDA GPU: skipped", done.stdout + done.stderr


def test_the_gpu_checks_logic_passes_on_cpu():
    done = _run("--device", "cpu", "--no-compile")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    from conveyor.schedule.registry import available

    schedules = sorted(available())
    # every built-in through LocalPipeline, autocast bf16, and a gloo Pipeline
    expected = len(schedules) + 2
    assert lines[-1].startswith(f"{expected}/{expected} passed on cpu"), done.stdout
    assert sum(" ok " in line and "bitwise" in line for line in lines) == expected, done.stdout
    for name in schedules:
        assert any(f"LocalPipeline {name} " in line for line in lines), (name, done.stdout)
