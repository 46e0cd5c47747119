#!/usr/bin/env bash
# Sets up .venv/ (quick when done) and runs the whole test suite plus ruff (what CI runs).
# --extended adds the extended tier (tests marked `extended`); other arguments go to pytest, after
# ours (so `-n 4` or `-n 0` overrides the worker count).
# Two pytest-xdist workers: on CI's 2 cores one process at a time left a quarter of the CPU idle
# while tests waited on ranks starting, rendezvous and launcher polls. --dist loadfile keeps each
# file on one worker, so a module fixture (one launch of ranks for several cases) runs once.
# The tests whose bounds are derived for two different computations run once more on ATen's portable
# kernels inside the suite (tests/test_portable_kernels.py; CONVEYOR_KERNEL_RERUN=0 skips that).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash tools/bootstrap.sh
.venv/bin/ruff check --quiet .
status=0
# The run's time per test file, printed after pytest's own summary (tools/file_times.py).
times="$(mktemp -t conveyor-test-times.XXXXXX.xml)"
trap 'rm -f "$times"' EXIT
# --no-loadscope-reorder: files go out in collection order, the slowest first (tests/conftest.py).
.venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=60 --junitxml="$times" "$@" \
  || status=$?
echo "== time per test file (setup + call + teardown of its tests) =="
.venv/bin/python tools/file_times.py "$times" || true
exit "$status"
