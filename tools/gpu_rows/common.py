"""What every row shares: the device, the models, bitwise comparison, timers, rank launches.

Example::

    ctx = Context(torch.device("cpu"), quick=True, compile=False)
    ok, detail = compare({"w": torch.ones(2)}, {"w": torch.ones(2)})   # (True, "bitwise")
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.testing import run_ranks
from conveyor.testing.references.data_parallel import MLPStack, make_batch

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


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, and ``inf`` where either holds a NaN or an infinity.

    Never NaN, so ``max()`` over such values cannot drop a failure (``max(0.0, nan)`` is 0.0),
    and ``relative_difference(...) <= bound`` is False for anything not finite.

    Example::

        relative_difference(torch.tensor([1.0, float("nan")]), torch.ones(2))   # inf
    """
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape or not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return math.inf
    scale = want.abs().max().item() if want.numel() else 0.0
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale


def worst_relative(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor],
                   names: Iterable[str]) -> tuple[float, str]:
    """The largest :func:`relative_difference` over ``names`` and the name it came from (``inf`` if any
    tensor is not finite or missing on one side).

    Example::

        worst, name = worst_relative({"w": torch.ones(2)}, {"w": torch.ones(2)}, ["w"])   # (0.0, "w")
    """
    worst, where = 0.0, ""
    for name in sorted(names):
        if got.get(name) is None or want.get(name) is None:
            return math.inf, name
        value = relative_difference(got[name], want[name])
        if value > worst:  # never NaN (see relative_difference), so a failure cannot be dropped
            worst, where = value, name
    return worst, where


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


def card_verdict(torch_count: int, torch_name: str | None, listed: list[str] | None | str) -> tuple[bool, str]:
    """Whether this torch and ``nvidia-smi`` agree on a readable card; the reason when they do not.

    ``listed`` is what :func:`nvidia_smi_gpus` returned. Fails without nvidia-smi, when it fails or lists
    no GPU, when torch sees none or more than it lists, or when torch's name for the card is empty or in
    none of nvidia-smi's lines.

    Example::

        card_verdict(1, "NVIDIA H100", ["GPU 0: NVIDIA H100 (UUID: GPU-0)"])   # (True, ...)
    """
    if listed is None:
        return False, "nvidia-smi is not on PATH: the card cannot be read (install the NVIDIA driver's tools)"
    if isinstance(listed, str):
        return False, listed
    if not listed:
        return False, "nvidia-smi -L lists no GPU"
    if torch_count < 1:
        return False, f"torch sees no CUDA GPU where nvidia-smi lists {len(listed)}"
    if torch_count > len(listed):
        return False, f"torch sees {torch_count} GPUs, nvidia-smi lists only {len(listed)}"
    if not torch_name or not any(torch_name in line for line in listed):
        return False, f"torch names the card {torch_name!r}, which no nvidia-smi line names ({listed[0]!r})"
    return True, f"{torch_name}; torch sees {torch_count} GPU(s), nvidia-smi {len(listed)}"


def environment_row(ctx: Context) -> tuple[bool, str]:
    """The card torch runs on, read by torch and by nvidia-smi: fails where either cannot read it."""
    if not ctx.cuda or not torch.cuda.is_available():
        return False, f"no CUDA device to read (device {ctx.device}, torch.cuda.is_available() is False)"
    try:
        name = torch.cuda.get_device_name(ctx.device)
    except Exception as exc:  # noqa: BLE001 - a driver error is this row's verdict, not a crash
        return False, f"torch cannot read the card: {type(exc).__name__}: {exc}"
    ok, detail = card_verdict(torch.cuda.device_count(), name, nvidia_smi_gpus())
    return ok, f"{detail}; torch {torch.__version__}, CUDA {torch.version.cuda}"
