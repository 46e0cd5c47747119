#!/usr/bin/env bash
# Sets up .venv/ (quick when done) and runs the parity demo: conveyor train configs/demo.yaml [key=value ...].
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash tools/bootstrap.sh
exec .venv/bin/conveyor demo "$@"
