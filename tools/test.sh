#!/usr/bin/env bash
# Sets up .venv/ (quick when done) and runs the whole test suite plus ruff (what CI runs).
# --extended adds the extended tier (tests marked `extended`); other arguments go to pytest, after
# ours (so `-n 4` or `-n 0` overrides the worker count).
# Two pytest-xdist workers: on CI's 2 cores one process at a time left a quarter of the CPU idle
# while tests waited on ranks starting, rendezvous and launcher polls. --dist loadfile keeps each
# file on one worker, so a module fixture (one launch of ranks for several cases) runs once.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash tools/bootstrap.sh
.venv/bin/ruff check --quiet .
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=60 "$@"
