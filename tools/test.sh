#!/usr/bin/env bash
# Sets up .venv/ (quick when done) and runs the whole test suite plus ruff (what CI runs).
# --extended adds the extended tier (tests marked `extended`); other arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash tools/bootstrap.sh
.venv/bin/ruff check --quiet .
exec .venv/bin/python -m pytest -q --durations=60 "$@"
