"""The GPU check: what CI cannot run, in one command, as one table (``bash tools/gpu_check.sh``).

On one GPU (NCCL cannot put two ranks of one communicator on one GPU) it runs, on ``cuda:0``:
2 and 4 gloo ranks sharing the GPU (every built-in schedule on every transport, tied GPT-2,
clipping, skip on non-finite, dp=2 with ddp and fsdp), NCCL at world size 1 (every collective
the pipeline issues, checkpoint save and bitwise resume, bf16 weights with fp32 main grads, steps
2 onward under ``torch.cuda.set_sync_debug_mode("warn")``, every site named), ``conveyor train`` at pp=1 and its
default run, every schedule on traced GPT-2 and Llama (recomputation + bf16 against the unsplit
model; inductor-compiled stages against it within a derived bound; dropout + compile + bf16
against gpipe over the same stages), a GPU that lags the host under the in-order transport, and
the split backward (I + W) against the fused one (B) timed with CUDA events. Gradients and
parameters are compared with ``torch.equal`` against one process on the same device, except
where a row's detail names a bound (a tied weight's gradient summed in another order; inductor
against eager), each derived beside it in ``gpu_rows/``.

It never passes falsely: "no CUDA GPU: skipped" (exit 0) only where ``nvidia-smi`` is absent or
lists no GPU; where it lists one but this torch has no CUDA, it stops with exit 2 and says which
interpreter to use. ``--device cpu`` runs the same logic on the CPU (gloo ranks; the rows that
need a GPU are listed as such), so that the check itself is tested where no GPU is.

Example::

    python tools/gpu_check.py --device cpu --rows ranks2,clip --quick
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before torch: cuBLAS's bits then repeat

import argparse  # noqa: E402 - after the environment torch reads at import
import importlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
from gpu_rows.common import Context, nvidia_smi_gpus  # noqa: E402

SKIPPED = "no CUDA GPU: skipped"
NO_CUDA_EXIT = 2


@dataclass(frozen=True)
class Row:
    """One line of the table: ``gpu_rows.<target>(ctx, *args)`` gives (passed, detail); ``budget_s`` on one H100.

    Targets are imported when their row runs: a machine that only learns it has no GPU imports little.
    """

    id: str
    title: str
    target: str
    budget_s: float
    args: tuple = ()
    gpu_only: bool = False

    def run(self, ctx: Context) -> tuple[bool, str]:
        module, _, function = self.target.rpartition(".")
        return getattr(importlib.import_module(f"gpu_rows.{module}"), function)(ctx, *self.args)


ROWS = [
    Row("env", "the GPU this torch runs on", "common.environment_row", 5, gpu_only=True),
    Row("ranks2", "2 gloo ranks, one device: every schedule x transport", "ranks.schedules_row", 40, (2,)),
    Row("ranks4", "4 gloo ranks, one device: every schedule x transport", "ranks.schedules_row", 60, (4,)),
    Row("tied", "tied GPT-2 (conveyor.pipeline), 2 gloo ranks", "hf_rows.tied_row", 25),
    Row("clip", "clip_grad_norm_ + on_nonfinite=skip, 2 gloo ranks", "ranks.clip_skip_row", 15),
    Row("ddp", "dp=2 x pp=2 ddp, 4 gloo ranks", "ranks.replicas_row", 20, ("ddp",)),
    Row("fsdp", "dp=2 x pp=2 fsdp, 4 gloo ranks", "ranks.replicas_row", 20, ("fsdp",)),
    Row("lag", "device lags the host, ordered transport, 2 gloo ranks", "ranks.lag_row", 15),
    Row("world1", "world 1: every collective, checkpoint resume", "world1.world1_row", 20, ("collectives",)),
    Row("world1-bf16", "world 1: bf16 weights, fp32 main grads", "world1.world1_row", 15, ("bf16",)),
    Row("fp16", "world 1: fp16 autocast + loss scaling = GradScaler", "world1.world1_row", 15, ("fp16",)),
    Row("world1-syncs", "world 1: steps 2+ under sync debug, every sync named", "world1.world1_row", 30, ("syncs",),
        gpu_only=True),
    Row("train-pp1", "conveyor train pp=1: eval, ckpt, resume, bf16, tokens", "train_rows.train_pp1_row", 75),
    Row("train-default", "conveyor train: the default run", "train_rows.train_default_row", 35),
    Row("traced-gpt2", "traced GPT-2, every schedule: = unsplit model; compiled; dropout", "traced_rows.traced_row",
        180, ("gpt2",)),
    Row("traced-llama", "traced Llama, every schedule: = unsplit model; compiled; dropout", "traced_rows.traced_row",
        180, ("llama",)),
    Row("experts", "expert parallelism, 2 gloo ranks on one device: = EP alone", "experts.experts_row", 30),
    Row("overlap", "expert_overlap pairs, 4 gloo ranks on one device: = plain", "experts.overlap_row", 90),
    Row("split-bw", "GPT stages: split backward I + W against fused B", "split_bw.split_backward_row", 15),
    Row("generate", "world 1: pipe.generate = model.generate(), traced decode stages too; log-probs",
        "generate_rows.generate_row", 20),
]
# In-process rows that compile come after every row that forks ranks: fork after inductor's threads is unsafe.


def no_cuda_answer() -> tuple[int, str]:
    """Where this torch has no CUDA: skip only if there is truly no GPU, else fail loudly and say why."""
    seen = nvidia_smi_gpus()
    if seen is None or seen == []:
        return 0, SKIPPED
    tried = os.environ.get("GPU_CHECK_TRIED", sys.executable)
    what = seen if isinstance(seen, str) else f"nvidia-smi sees {len(seen)} GPU(s) ({seen[0]})"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return NO_CUDA_EXIT, (
        f"GPU check FAILED: {what}, but the torch this check runs on has no CUDA "
        f"({sys.executable}: torch {torch.__version__}, built for CUDA {torch.version.cuda}"
        f"{f', CUDA_VISIBLE_DEVICES={visible!r}' if visible is not None else ''}). Tried: {tried}. "
        "Run it with a CUDA build of torch: PYTHON=/path/to/python bash tools/gpu_check.sh "
        "(a python whose `torch.cuda.is_available()` is True), or install one (pip install torch).")


def select(rows: list[Row], wanted: str | None) -> list[Row]:
    if not wanted:
        return rows
    keys = [w.strip() for w in wanted.split(",") if w.strip()]
    unknown = [k for k in keys if not any(r.id == k or r.id.startswith(k) for r in rows)]
    if unknown:
        raise SystemExit(f"--rows: no row named {unknown}; the rows are {', '.join(r.id for r in rows)}")
    return [r for r in rows if any(r.id == k or r.id.startswith(k) for k in keys)]


def run_row(row: Row, ctx: Context) -> tuple[str, str, str, float]:
    if row.gpu_only and not ctx.cuda:
        return row.id, "needs a GPU", row.title, 0.0
    start = time.perf_counter()
    try:
        ok, detail = row.run(ctx)
    except Exception as exc:  # a row that raises fails; the table goes on, its traceback on stderr
        traceback.print_exc(file=sys.stderr)
        text = str(exc).strip().splitlines()
        ok, detail = False, f"{type(exc).__name__}: {(text[-1] if text else '')[:200]}"
    seconds = time.perf_counter() - start
    if ctx.cuda and seconds > row.budget_s:
        detail += f" [over its {row.budget_s:.0f} s budget]"
    return row.id, "ok" if ok else "FAIL", detail, seconds


WIDTH = max(len(row.id) for row in ROWS)


def print_row(name: str, result: str, detail: str, seconds: float) -> None:
    print(f"{name:<{WIDTH}}  {result:<11}  {seconds:7.1f}  {detail}", flush=True)


def print_summary(table: list[tuple[str, str, str, float]], ctx: Context, total_s: float) -> None:
    ran = [r for r in table if r[1] != "needs a GPU"]
    failed = [r[0] for r in table if r[1] == "FAIL"]
    where = f"{ctx.device} ({torch.cuda.get_device_name(ctx.device)})" if ctx.cuda else str(ctx.device)
    print(f"{len(ran) - len(failed)}/{len(ran)} passed on {where} in {total_s:.0f} s"
          f"{'; failed: ' + ', '.join(failed) if failed else ''}")
    gpu_only = [r[0] for r in table if r[1] == "needs a GPU"]
    if gpu_only:
        print(f"needs a GPU (not run here): {', '.join(gpu_only)}")


def main(argv: list[str] | None = None) -> int:
    """Run the rows, print the table; 0 when every row that ran passed (or truly no GPU)."""
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--rows", help="comma-separated row ids or prefixes (see --list)")
    parser.add_argument("--quick", action="store_true", help="4 schedules instead of every built-in one")
    parser.add_argument("--no-compile", action="store_true", help="traced rows without torch.compile")
    parser.add_argument("--list", action="store_true", help="list the rows and exit")
    args = parser.parse_args(argv)
    if args.list:
        for row in ROWS:
            print(f"{row.id:<14} {row.budget_s:4.0f} s  {row.title}{'  (GPU only)' if row.gpu_only else ''}")
        return 0
    rows = select(ROWS, args.rows)
    if args.device == "cuda" and not torch.cuda.is_available():
        code, message = no_cuda_answer()
        print(message, file=sys.stdout if code == 0 else sys.stderr)
        return code
    ctx = Context(torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu"), quick=args.quick,
                  compile=not args.no_compile)
    start = time.perf_counter()
    print(f"{'row':<{WIDTH}}  {'result':<11}  {'seconds':>7}  figure / detail", flush=True)
    table = []
    for row in rows:  # each line as its row ends: a long run shows where it is
        table.append(run_row(row, ctx))
        print_row(*table[-1])
    print_summary(table, ctx, time.perf_counter() - start)
    return 1 if any(r[1] == "FAIL" for r in table) else 0


if __name__ == "__main__":
    sys.exit(main())
