#!/usr/bin/env bash
# Creates .venv/ at the repo root and installs conveyor with its test tools.
# Re-running is quick: it reinstalls only when pyproject.toml changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python_bin="${CONVEYOR_PYTHON:-}"
if [ -z "$python_bin" ]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then python_bin="$candidate"; break; fi
  done
fi
if [ ! -x .venv/bin/python ]; then
  "$python_bin" -m venv .venv
fi
stamp=".venv/.conveyor-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip >/dev/null
  # torch pinned in the same resolve, so no other requirement can pull a multi-GB CUDA build. pip would
  # byte-compile every installed file one at a time (45 of its 85 s on 2 cores); compileall does it on
  # every core (30 s). Compiled now, not at first import: a machine with PYTHONDONTWRITEBYTECODE would
  # otherwise compile torch again in every process. (A file compileall cannot compile, such as torch's
  # Python 3.12-only test helper, fails it as it fails pip's own pass, which ignores it: so do we.)
  .venv/bin/python -m pip install --quiet --no-compile "torch==2.13.0" -e ".[dev]"
  # Left out: what no conveyor process imports whole (transformers' hundreds of model families, of which
  # a process imports one or two files, compiled in memory in a tenth of a second; torch's own test
  # suite; the installers): 29% of the bytes, about 12 of the 40 s.
  .venv/bin/python -m compileall -q -j 0 \
    -x '/site-packages/(transformers/models|torch/testing/_internal|pip|setuptools|_distutils_hack)/' \
    .venv/lib/python*/site-packages >/dev/null 2>&1 || true
  echo "$want" > "$stamp"
fi
