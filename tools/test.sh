#!/usr/bin/env bash
# Sets up .venv/ (quick when done) and runs the whole test suite plus ruff.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash tools/bootstrap.sh
.venv/bin/ruff check --quiet .
exec .venv/bin/python -m pytest -q --durations=25 "$@"
