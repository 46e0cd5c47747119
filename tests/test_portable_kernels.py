"""The derived bounds hold on ATen's portable kernels too, not only on this CPU's vectorized ones.

The tests below compare two different computations (tensor parallel against one device, the
vocabulary-parallel loss, AdamW's reach, data-parallel accumulation order, inductor's kernels) within
a bound derived beside each (``conveyor/testing/compare.py``). A bound that only one instruction set's
kernels meet would pass here and fail on a user's machine, so they run once more in a child pytest
with ``ATEN_CPU_CAPABILITY=default`` (read once, when torch loads: hence a fresh process). The child is
one test of the suite rather than a second pytest run after it, so it shares the two workers with
everything else instead of ending the run alone. ``CONVEYOR_KERNEL_RERUN=0`` skips it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_TP = "tests/parallel/test_tensor_parallel.py"
_TRACED = "tests/parallel/test_tensor_parallel_traced.py"
_SEQUENCE = "tests/parallel/test_tensor_sequence_traced.py"
BOUNDED = (
    f"{_TP}::test_auto_plan_matches_one_device[llama]",
    f"{_TP}::test_loss_parallel_keeps_the_logits_sharded_under_the_models_own_loss",
    f"{_TRACED}::test_tied_embedding_and_head_are_vocab_parallel_at_both_ends_of_the_pipeline[1f1b]",
    f"{_TRACED}::test_loss_parallel_on_traced_stages_keeps_the_logits_vocabulary_sharded",
    f"{_SEQUENCE}::test_traced_stages_run_sequence_parallel_within_rounding_of_one_device[llama-mpt]",
    "tests/parallel/test_data_parallel.py::test_pp2_x_dp2_matches_one_process_on_the_whole_batch[ddp]",
    "tests/runtime/test_compile.py::test_the_default_inductor_backend_trains_within_1e_6_of_the_compiled_stages",
    "tests/test_compare.py",
)
PORTABLE = "default"


def test_the_child_runs_on_the_kernels_its_environment_names():
    """Run by the child below (skipped elsewhere): it proves the child's ATen took the portable kernels."""
    if os.environ.get("ATEN_CPU_CAPABILITY") != PORTABLE:
        pytest.skip("checked inside test_derived_bounds_hold_on_atens_portable_kernels's child run")
    assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"


@pytest.mark.timeout(900)
def test_derived_bounds_hold_on_atens_portable_kernels():
    if os.environ.get("CONVEYOR_KERNEL_RERUN", "1") == "0":
        pytest.skip("CONVEYOR_KERNEL_RERUN=0")
    if os.environ.get("ATEN_CPU_CAPABILITY") == PORTABLE:
        pytest.skip("already on the portable kernels: the child would be this run again")
    # The child is a plain pytest: not an xdist worker, whatever this process is.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "ATEN_CPU_CAPABILITY"))}
    env["ATEN_CPU_CAPABILITY"] = PORTABLE
    check = f"tests/{Path(__file__).name}::test_the_child_runs_on_the_kernels_its_environment_names"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-rfE", check, *BOUNDED]
    child = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    tail = (child.stdout + child.stderr)[-6000:]
    assert child.returncode == 0, f"on ATEN_CPU_CAPABILITY={PORTABLE} ({' '.join(command[1:])}):\n{tail}"
    summary = child.stdout.strip().splitlines()[-1]
    assert "skipped" not in summary and "deselected" not in summary, f"the child left tests out:\n{tail}"
