"""tools/gpu_check.sh: it never passes falsely, and its logic runs on the CPU (--device cpu, gloo ranks).

"no CUDA GPU: skipped" only where nvidia-smi is absent or lists no GPU; where it lists one and the
torch at hand has no CUDA, exit 2 and a message naming what to do, or another interpreter whose
torch has CUDA. nvidia-smi and python3 are played by small scripts on PATH.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GPU_LINE = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)"


def _run(*args: str, bin_dir: Path | None = None, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(bin_dir) if bin_dir else None, "/usr/bin", "/bin"]))
    return subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHON": sys.executable, "PATH": path, **env})


def _script(where: Path, name: str, body: str) -> None:
    where.mkdir(exist_ok=True)
    (where / name).write_text(f"#!/bin/sh\n{body}\n")
    (where / name).chmod(0o755)


def test_without_nvidia_smi_it_says_skipped_and_exits_0(tmp_path):
    done = _run(bin_dir=tmp_path)  # no nvidia-smi on PATH, and this torch has no CUDA
    assert done.returncode == 0 and done.stdout.strip() == "no CUDA GPU: skipped", done.stdout + done.stderr


def test_where_nvidia_smi_lists_no_gpu_it_says_skipped(tmp_path):
    _script(tmp_path, "nvidia-smi", "exit 0")
    done = _run(bin_dir=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "no CUDA GPU: skipped", done.stdout + done.stderr


@pytest.mark.parametrize("smi", [f"echo '{GPU_LINE}'", "echo 'NVIDIA-SMI has failed' >&2; exit 9"],
                         ids=["lists-a-gpu", "fails"])
def test_a_gpu_with_a_torch_without_cuda_fails_loudly(tmp_path, smi):
    assert not torch.cuda.is_available()  # this machine's torch: a CPU build, as the repo's .venv is
    _script(tmp_path, "nvidia-smi", smi)
    done = _run(bin_dir=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "skipped" not in done.stdout
    assert "GPU check FAILED" in done.stderr and "has no CUDA" in done.stderr and "PYTHON=" in done.stderr
    assert ("nvidia-smi sees 1 GPU(s)" in done.stderr) == smi.startswith("echo 'GPU")


def test_on_a_gpu_machine_it_uses_a_python_whose_torch_has_cuda(tmp_path):
    _script(tmp_path, "nvidia-smi", f"echo '{GPU_LINE}'")
    # The machine's python3 has a CUDA torch (it answers the probe with 0), the repo's .venv has not.
    _script(tmp_path, "python3", 'case "$1" in -c) exit 0;; esac; echo "cuda python ran $*"')
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--quick"], capture_output=True, text=True,
                          timeout=120, env={**env, "PATH": f"{tmp_path}:/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("cuda python ran ") and done.stdout.rstrip().endswith("gpu_check.py --quick")


def test_the_checks_logic_passes_on_cpu_and_lists_what_needs_a_gpu():
    # A fast subset (--quick: 4 schedules); the whole --device cpu run is by hand (benchmarks/README.md).
    done = _run("--device", "cpu", "--quick", "--rows", "clip,world1", timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    results = {line.split()[0]: line for line in lines[1:] if line.split() and line.split()[0] in
               {"clip", "world1", "world1-bf16", "world1-syncs"}}
    assert set(results) == {"clip", "world1", "world1-bf16", "world1-syncs"}, done.stdout
    for row in ("clip", "world1", "world1-bf16"):
        assert results[row].split()[1] == "ok", results[row]
    assert "bitwise" in results["clip"] and "resume bitwise" in results["world1"]
    assert "needs a GPU" in results["world1-syncs"]
    assert lines[-2].startswith("3/3 passed on cpu") and lines[-1] == "needs a GPU (not run here): world1-syncs"


def test_a_one_ulp_difference_fails_the_comparison():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from gpu_rows.common import compare
    finally:
        sys.path.remove(str(ROOT / "tools"))
    value = torch.tensor([1.0, 2.0])
    assert compare({"w": value}, {"w": value.clone()}) == (True, "bitwise")
    ok, detail = compare({"w": torch.nextafter(value, value + 1)}, {"w": value})
    assert not ok and "w differs" in detail
    assert not compare({"w": value.double()}, {"w": value})[0]  # the dtype counts too
    assert not compare({"w": None}, {"w": value})[0]


def _gpu_rows_common():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from gpu_rows import common
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return common


@pytest.mark.parametrize("where", ["got", "want"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_value_anywhere_fails_the_bound_folds(where, bad):
    # max(0.0, nan) is 0.0: a fold that starts at 0 and takes max() would call a NaN gradient bitwise.
    common = _gpu_rows_common()
    clean = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0, 4.0]), "c": torch.tensor([5.0, 6.0])}
    spoiled = {**clean, "b": torch.tensor([3.0, bad])}  # neither the first name nor the last
    got, want = (spoiled, clean) if where == "got" else (clean, spoiled)
    assert common.relative_difference(got["b"], want["b"]) == float("inf")
    worst, name = common.worst_relative(got, want, ["a", "b", "c"])
    assert worst == float("inf") and name == "b"
    assert not worst <= 1e-5  # how every row reads a bound
    assert common.worst_relative(clean, {k: v.clone() for k, v in clean.items()}, ["a", "b", "c"]) == (0.0, "")
    one_ulp_up = torch.nextafter(torch.tensor(6.0), torch.tensor(7.0))  # 6 + 2^-21
    near = {**clean, "c": torch.stack([torch.tensor(5.0), one_ulp_up])}
    assert common.worst_relative(near, clean, ["a", "b", "c"]) == (2.0**-21 / 6.0, "c")
    assert not common.compare(got, want)[0]  # torch.equal: a NaN equals nothing, itself included


def test_the_env_row_fails_where_the_card_cannot_be_read():
    common = _gpu_rows_common()
    name = "NVIDIA H100 80GB HBM3"
    assert common.card_verdict(1, name, [GPU_LINE])[0]
    failing = {
        "no nvidia-smi": (1, name, None),
        "nvidia-smi fails": (1, name, "nvidia-smi -L exited 9: NVIDIA-SMI has failed"),
        "nvidia-smi lists none": (1, name, []),
        "torch sees none": (0, name, [GPU_LINE]),
        "torch sees more": (2, name, [GPU_LINE]),
        "no name": (1, "", [GPU_LINE]),
        "another card": (1, "NVIDIA A100-SXM4-40GB", [GPU_LINE]),
    }
    for case, args in failing.items():
        ok, detail = common.card_verdict(*args)
        assert not ok and detail, case
    # On this CPU-only torch the row itself cannot read a card, and says so.
    ok, detail = common.environment_row(common.Context(torch.device("cpu")))
    assert not ok and "no CUDA device" in detail
