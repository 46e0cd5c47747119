#!/usr/bin/env bash
# The GPU check: every built-in schedule through LocalPipeline on the GPU (bitwise against one
# device on the same GPU), a NCCL Pipeline over every GPU, autocast bf16 and compile; one table.
# Exits 0 with "no CUDA GPU: skipped" where there is none. Extra arguments go to the Python part
# (conveyor/testing/gpu_check.py): --device cpu runs the same logic on CPU (gloo), --no-compile.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The repo's .venv (a CPU build of torch here); on a GPU machine without it, the python3 that
# holds that machine's CUDA build of torch (or PYTHON=...).
python="${PYTHON:-$root/.venv/bin/python}"
[ -n "${PYTHON:-}" ] || [ -x "$python" ] || python=python3
cd "$root"
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -m conveyor.testing.gpu_check "$@"
