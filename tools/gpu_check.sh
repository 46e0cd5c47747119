#!/usr/bin/env bash
# The GPU check (tools/gpu_check.py): every check that needs a GPU, on one GPU, as one table; exits
# non-zero if any row fails. See benchmarks/README.md ("The GPU check") for how to read the table.
#
#   bash tools/gpu_check.sh                      # on a GPU machine
#   bash tools/gpu_check.sh --device cpu         # the same logic on the CPU (gloo ranks)
#   bash tools/gpu_check.sh --quick --rows ranks2,world1   # fewer schedules, some rows (--list)
#
# "no CUDA GPU: skipped" (exit 0) only where nvidia-smi is absent or lists no GPU. Where it lists
# one, the check needs a torch with CUDA: PYTHON=... if given, else the first of the repo's .venv
# and the machine's python3 whose torch has CUDA; if none has, it stops with exit 2 and says so
# (the repo's .venv is a CPU build of torch: it must not turn a GPU machine into a "skipped").
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"  # cuBLAS repeats its bits

wants_cpu=0
previous=""
for arg in "$@"; do
  if [ "$arg" = "--device=cpu" ] || { [ "$previous" = "--device" ] && [ "$arg" = "cpu" ]; }; then wants_cpu=1; fi
  previous="$arg"
done

gpus_listed() {  # how many GPUs nvidia-smi lists (0 without nvidia-smi or when it fails)
  command -v nvidia-smi >/dev/null 2>&1 || { echo 0; return; }
  { nvidia-smi -L 2>/dev/null || true; } | grep -c '^GPU ' || true
}

has_cuda() {  # whether "$1" runs and its torch sees a CUDA GPU
  "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}

candidates=()
if [ -n "${PYTHON:-}" ]; then
  candidates=("$PYTHON")
else
  [ -x "$root/.venv/bin/python" ] && candidates+=("$root/.venv/bin/python")
  command -v python3 >/dev/null 2>&1 && candidates+=("$(command -v python3)")
fi
[ ${#candidates[@]} -gt 0 ] || { echo "GPU check: no python found (set PYTHON=...)" >&2; exit 2; }

python="${candidates[0]}"
if [ "$wants_cpu" = 0 ] && [ "$(gpus_listed)" != 0 ]; then
  # A GPU is there: use the first interpreter whose torch has CUDA. If none has, the Python part
  # (run with the first) fails loudly, naming every interpreter tried.
  for candidate in "${candidates[@]}"; do
    if has_cuda "$candidate"; then
      [ "$candidate" = "${candidates[0]}" ] || \
        echo "GPU check: ${candidates[0]}'s torch has no CUDA; using $candidate" >&2
      python="$candidate"
      break
    fi
  done
  export GPU_CHECK_TRIED="${candidates[*]}"
fi
exec "$python" "$root/tools/gpu_check.py" "$@"
