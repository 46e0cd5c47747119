"""The README's data-parallel and tensor-parallel examples, launched as a user would: torchrun, 4 processes,
clean exit; every example names the mesh dims in one order."""

from __future__ import annotations

import os
import re
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


@pytest.mark.timeout(300)
def test_the_tensor_parallel_example_resumes_bitwise_and_exits_cleanly(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([str(torchrun), "--nproc-per-node=4", str(ROOT / "examples" / "tensor_parallel.py"),
                           "--out", str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=280, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "bitwise equal" in done.stdout
    assert "terminate called" not in done.stderr
    assert (tmp_path / "ckpt" / "step_2").is_dir()


def test_every_example_names_the_mesh_dims_in_one_order():
    # The library reads "pp" and "dp" in any order ("tp" last); the examples all write pp outermost, so that a
    # user who moves from data to tensor parallelism adds a dim instead of reordering them.
    readme = (ROOT / "README.md").read_text()
    texts = {"README.md": readme, **{f"examples/{p.name}": p.read_text() for p in (ROOT / "examples").glob("*.py")}}
    seen = 0
    for name, text in texts.items():
        for dims in re.findall(r"mesh_dim_names=\(([^)]*)\)", text):
            order = tuple(re.findall(r"[\"'](\w+)[\"']", dims))
            assert order == tuple(d for d in ("pp", "dp", "tp") if d in order), (name, order)
            seen += 1
    assert seen >= 4, seen
    # README's tensor-parallel lines are the example's own, which the test above runs.
    example = texts["examples/tensor_parallel.py"]
    snippet = readme.split('mesh = init_device_mesh("cpu", (2, 1, 2)', 1)[1].split("```", 1)[0]
    lines = ['mesh = init_device_mesh("cpu", (2, 1, 2)' + snippet.splitlines()[0], *snippet.splitlines()[1:3]]
    for line in lines:
        assert line.strip() in example, line
