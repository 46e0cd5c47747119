#!/usr/bin/env bash
# Sets up .venv/ (quick when done) and runs the whole test suite plus ruff (what CI runs).
# --extended adds the extended tier (tests marked `extended`); other arguments go to pytest, after
# ours (so `-n 4` or `-n 0` overrides the worker count).
# Two pytest-xdist workers: on CI's 2 cores one process at a time left a quarter of the CPU idle
# while tests waited on ranks starting, rendezvous and launcher polls. --dist loadfile keeps each
# file on one worker, so a module fixture (one launch of ranks for several cases) runs once.
# Then the tests whose bounds are derived for two different computations (tensor parallel against one
# device, the vocabulary-parallel loss, AdamW's reach, data-parallel accumulation order, inductor's
# kernels) run once more on ATen's portable kernels (ATEN_CPU_CAPABILITY=default), so that a bound
# that holds with one CPU's kernels only fails here rather than on a user's machine.
# CONVEYOR_KERNEL_RERUN=0 skips that second run.
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
if [ "${CONVEYOR_KERNEL_RERUN:-1}" != "0" ]; then
  echo "== the derived bounds once more on ATen's portable kernels (ATEN_CPU_CAPABILITY=default) =="
  tp=tests/parallel/test_tensor_parallel.py traced=tests/parallel/test_tensor_parallel_traced.py
  sp=tests/parallel/test_tensor_sequence_traced.py
  ATEN_CPU_CAPABILITY=default .venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder \
    "$tp::test_auto_plan_matches_one_device[llama]" \
    "$tp::test_loss_parallel_keeps_the_logits_sharded_under_the_models_own_loss" \
    "$traced::test_tied_embedding_and_head_are_vocab_parallel_at_both_ends_of_the_pipeline[1f1b]" \
    "$traced::test_loss_parallel_on_traced_stages_keeps_the_logits_vocabulary_sharded" \
    "$sp::test_traced_stages_run_sequence_parallel_within_rounding_of_one_device[llama-mpt]" \
    "tests/parallel/test_data_parallel.py::test_pp2_x_dp2_matches_one_process_on_the_whole_batch[ddp]" \
    "tests/runtime/test_compile.py::test_the_default_inductor_backend_trains_within_1e_6_of_the_compiled_stages" \
    tests/test_compare.py || status=$?
fi
exit "$status"
