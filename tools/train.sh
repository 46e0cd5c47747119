#!/usr/bin/env bash
# Sets up .venv/ (quick when done) and runs `conveyor train` with its embedded defaults:
# a small GPT trained on the Python standard library's sources, pipelined over 2 local CPU ranks.
# Any arguments go to `conveyor train` (a config file, key=value overrides).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash tools/bootstrap.sh
exec .venv/bin/conveyor train "$@"
