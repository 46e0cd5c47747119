"""What every row shares: the device, the models, bitwise comparison, timers, rank launches.

Example::

    ctx = Context(torch.device("cpu"), quick=True, compile=False)
    ok, detail = compare({"w": torch.ones(2)}, {"w": torch.ones(2)})   # (True, "bitwise")
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.testing import run_ranks
from conveyor.testing.data_parallel import MLPStack, make_batch

MICROBATCHES_PER_RANK = 2  # M = 2P: every built-in schedule takes it at every P
LR = 1e-2


@dataclass(frozen=True)
class Context:
    """How the check runs: on ``device`` (cuda:0 or cpu), ``quick`` (fewer schedules), ``compile``."""

    device: torch.device
    quick: bool = False
    compile: bool = True

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def deterministic(device: torch.device) -> None:
    """Kernels that give the same bits on every run: bitwise comparison means nothing otherwise.

    cuBLAS needs its workspace fixed before the first call (``CUBLAS_WORKSPACE_CONFIG``, set by
    ``tools/gpu_check.sh`` and here for ranks); attention runs eager in every model of the check,
    since the efficient SDPA kernel's backward adds with atomics.
    """
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.cuda.set_device(device)


def launch(fn: Callable[..., Any], world: int, ctx: Context, *args: Any, backend: str = "gloo",
           timeout_s: float = 240.0) -> list[Any]:
    """``fn(rank, world, device_str, *args)`` on ``world`` fresh ranks (spawned where CUDA is used).

    Spawn, not fork, on a GPU: a forked child of a process that touched CUDA cannot use it.
    """
    return run_ranks(fn, world, args=(str(ctx.device), *args), timeout_s=timeout_s, backend=backend,
                     start_method="spawn" if ctx.cuda else "fork",
                     env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"} if ctx.cuda else None)


def by_stage(model: Any, tensor_of: Callable[[torch.nn.Parameter], Any]) -> dict[str, Any]:
    """{"<stage>.<name>": tensor_of(parameter)} over every stage of a stacked reference model."""
    return {f"{s}.{n}": tensor_of(p) for s, st in enumerate(model.stages) for n, p in st.named_parameters()}


def cpu(value: Any) -> Any:
    """Tensors (in dicts, lists, tuples) copied to the CPU: what a rank may return."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        return {k: cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(cpu(v) for v in value)
    return value


def compare(got: Mapping[str, Any], want: Mapping[str, Any], what: str = "") -> tuple[bool, str]:
    """Bitwise (``torch.equal``) comparison of two name -> tensor maps; the first difference named."""
    if set(got) != set(want):
        return False, f"{what}names differ: only got {sorted(set(got) - set(want))[:3]}, only wanted " \
                      f"{sorted(set(want) - set(got))[:3]}"
    for name in want:
        g, w = got[name], want[name]
        if g is None or w is None:
            if g is not w:
                return False, f"{what}{name}: {'no gradient' if g is None else 'a gradient'} where the reference " \
                              f"has {'none' if w is None else 'one'}"
            continue
        g, w = g.detach().cpu(), w.detach().cpu()
        if g.dtype != w.dtype or not torch.equal(g, w):
            diff = (g.double() - w.double()).abs().max().item() if g.shape == w.shape else float("nan")
            return False, f"{what}{name} differs (max {diff:.3g}, {g.dtype} vs {w.dtype})"
    return True, "bitwise"


def first_failure(results: Mapping[str, tuple[bool, str]]) -> tuple[bool, str]:
    """One row's verdict from named sub-results: all bitwise, or the failures named."""
    failed = [f"{name}: {detail}" for name, (ok, detail) in results.items() if not ok]
    if failed:
        return False, f"{len(failed)}/{len(results)} failed; " + "; ".join(failed[:2])
    return True, f"{len(results)}/{len(results)} bitwise"




class Timer:
    """Milliseconds of GPU work (CUDA events) on a GPU, of host time on the CPU.

    Example::

        timer = Timer(device)
        with timer:
            y = model(x)
        timer.ms()
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._start = self._end = None

    def __enter__(self) -> Timer:
        if self.cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            self._end.record()
        else:
            self._end = time.perf_counter()

    def ms(self) -> float:
        if self.cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end)
        return (self._end - self._start) * 1e3


def mlp_reference(num_stages: int, device: torch.device, microbatches: int, steps: int, *,
                  clip: float | None = None) -> dict[str, Any]:
    """One process, the unsplit MLP stack on ``device``: step-1 grads, losses, norms, final params.

    Names are ``"<stage>.<parameter>"``, as :func:`mlp_state` gives them from a pipeline.
    """
    from conveyor.testing.models import lm_loss, reference_step

    model = MLPStack(num_stages).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms, grads = [], [], {}
    for step in range(steps):
        ids, targets = make_batch(seed=step)
        losses.append(reference_step(model, ids.to(device), targets.to(device), microbatches, lm_loss))
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        if step == 0:
            grads = cpu(by_stage(model, lambda p: p.grad))
        optimizer.step()
        optimizer.zero_grad()
    params = by_stage(model, lambda p: p)
    return cpu({"losses": losses, "norms": norms, "grads": grads, "params": params})


def mlp_state(stages: Mapping[int, torch.nn.Module], attribute: str) -> dict[str, Any]:
    """``"<stage>.<parameter>"`` -> the parameter (``attribute="data"``) or its ``.grad``."""
    out = {}
    for s, module in stages.items():
        for n, p in module.named_parameters():
            value = p.grad if attribute == "grad" else p.detach()
            out[f"{s}.{n}"] = _gathered(value) if hasattr(value, "device_mesh") else value
    return cpu(out)


def _gathered(shard: Any) -> torch.Tensor:
    """The whole of a data-parallel parameter (a DTensor sharded on dim 0 or replicated), via the host.

    Not ``full_tensor()``: its all-gather of a CUDA tensor over gloo (the rows' ranks share one
    GPU, so gloo) crashed torch 2.11 with a segfault; the host copies cost nothing at this size.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    if tuple(shard.placements) == (Replicate(),):  # ddp (torch's replicate): each rank holds it whole
        return shard.to_local()
    if tuple(shard.placements) != (Shard(0),):
        raise AssertionError(f"expected a parameter sharded on dim 0 or replicated, got {shard.placements}")
    group = shard.device_mesh.get_group()
    pieces: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(pieces, shard.to_local().detach().cpu(), group=group)
    return torch.cat(pieces, dim=0)


def nvidia_smi_gpus() -> list[str] | None | str:
    """The GPUs ``nvidia-smi -L`` lists; None without nvidia-smi; a message when it fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi -L failed: {exc}"
    if done.returncode != 0:
        return f"nvidia-smi -L exited {done.returncode}: {(done.stderr or done.stdout).strip()[:200]}"
    return [line for line in done.stdout.splitlines() if line.startswith("GPU ")]


def environment_row(ctx: Context) -> tuple[bool, str]:
    """What this torch sees against what nvidia-smi sees."""
    seen = nvidia_smi_gpus()
    count = torch.cuda.device_count()
    return count >= 1, (f"{torch.cuda.get_device_name(ctx.device)}; torch {torch.__version__}, CUDA "
                        f"{torch.version.cuda}; torch sees {count} GPU(s), nvidia-smi "
                        f"{len(seen) if isinstance(seen, list) else seen}")
