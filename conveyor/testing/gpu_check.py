"""The GPU check (``tools/gpu_check.sh``): what CI cannot run, in one command, as one table.

On a machine with CUDA GPUs it runs, on ``cuda``: every built-in schedule through
:class:`conveyor.LocalPipeline` against one device on the same GPU (bitwise), a NCCL
:class:`conveyor.Pipeline` over every GPU (world 1 on a single one), autocast bf16 (bitwise
against the single-device run under the same autocast) and ``compile=True`` (losses within
1e-6 relative of the compiled single-device run). ``--device cpu`` runs the same logic on
CPU, with gloo ranks in place of NCCL, so that it is itself tested where no GPU is.

Example::

    python -m conveyor.testing.gpu_check --device cpu --no-compile
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

import conveyor
import conveyor.schedule as cs

WIDTH, BATCH, MICROBATCHES, STEPS = 32, 8, 4, 2


def _stage(stage: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(100 + stage)
        return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.LayerNorm(WIDTH))


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.float() - target).pow(2).mean()


def _batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return (torch.randn(BATCH, WIDTH, generator=gen).to(device), torch.randn(BATCH, WIDTH, generator=gen).to(device))


def _place(cls: type, modules: list[nn.Module], device: torch.device, **kwargs):
    """``cls(modules, **kwargs)`` on ``device``: by its ``device=`` where it has one, else by moving the modules."""
    if "device" in inspect.signature(cls.__init__).parameters:
        return cls(modules, device=device, **kwargs)
    return cls([m.to(device) for m in modules], **kwargs)


def _reference(num_stages: int, device: torch.device, autocast: bool, compiled: bool) -> list[torch.Tensor]:
    model = nn.Sequential(*[_stage(s) for s in range(num_stages)]).to(device)
    forward = torch.compile(model) if compiled else model
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, device)
        total = None
        for xi, yi in zip(torch.tensor_split(x, MICROBATCHES), torch.tensor_split(y, MICROBATCHES)):
            with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
                loss = _loss(forward(xi), yi) / MICROBATCHES
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        losses.append(total)
        model.zero_grad()
    return losses


def _local(schedule: cs.Schedule, device: torch.device, **options) -> list[torch.Tensor]:
    modules = [_stage(s) for s in range(schedule.num_stages)]
    pipe = _place(conveyor.LocalPipeline, modules, device, schedule=schedule, loss_fn=_loss, **options)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, device)
        losses.append(pipe.step(x, target=y))
        for module in modules:
            module.zero_grad()
    return losses


def _distributed(rank: int, world_size: int, device_type: str) -> list[torch.Tensor]:
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    schedule = cs.build("1f1b", ranks=world_size, microbatches=MICROBATCHES)
    transport = "auto" if device_type == "cuda" else "ordered"  # NCCL's transport, over gloo here
    pipe = _place(conveyor.Pipeline, [_stage(s) for s in schedule.stages_of(rank)], device, schedule=schedule,
                  loss_fn=_loss, transport=transport, timeout_s=120)
    losses = []
    with pipe:
        for step in range(STEPS):
            x, y = _batch(step, device)
            losses.append(pipe.step(x, target=y if pipe.needs_target else None).cpu())
    return losses


def _row(name: str, run: Callable[[], tuple[bool, str]]) -> tuple[str, str, str, float]:
    start = time.perf_counter()
    try:
        ok, detail = run()
    except Exception as exc:  # a row that raises fails, the table goes on
        ok, detail = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return name, "ok" if ok else "FAIL", detail, time.perf_counter() - start


def _same(got: list[torch.Tensor], want: list[torch.Tensor], rtol: float = 0.0) -> tuple[bool, str]:
    worst = max(float(((g.cpu() - w.cpu()).abs() / w.cpu().abs().clamp_min(1e-30)).max()) for g, w in zip(got, want))
    ok = worst == 0.0 if rtol == 0.0 else worst <= rtol
    return ok, "bitwise" if worst == 0.0 else f"max relative difference {worst:.3g}"


def rows(device: torch.device, compile_too: bool, world: int) -> list[tuple[str, str, str, float]]:
    """Every check's (name, ok/FAIL, detail, seconds)."""
    table = []
    for name, info in sorted(cs.available().items()):
        virtual = info.default_virtual
        schedule = cs.build(name, ranks=2, microbatches=MICROBATCHES, virtual=virtual)
        table.append(_row(f"LocalPipeline {name} P=2 V={virtual}", lambda s=schedule: _same(
            _local(s, device), _reference(s.num_stages, device, False, False))))
    one_f = cs.build("1f1b", ranks=2, microbatches=MICROBATCHES)
    table.append(_row("LocalPipeline 1f1b autocast=bf16", lambda: _same(
        _local(one_f, device, autocast="bf16"), _reference(2, device, True, False))))
    if compile_too:
        table.append(_row("LocalPipeline 1f1b compile=True", lambda: _same(
            _local(one_f, device, compile=True), _reference(2, device, False, True), rtol=1e-6)))
    table.append(_row(f"Pipeline {'nccl' if device.type == 'cuda' else 'gloo ordered'} 1f1b world={world}",
                      lambda: _distributed_check(device, world)))
    return table


def _distributed_check(device: torch.device, world: int) -> tuple[bool, str]:
    from conveyor.testing import run_ranks

    cuda = device.type == "cuda"
    results = run_ranks(_distributed, world, args=(device.type,), timeout_s=300, backend="nccl" if cuda else "gloo",
                        start_method="spawn" if cuda else "fork")
    want = _reference(world, device, False, False)
    return _same(results[0], want)


def main(argv: list[str] | None = None) -> int:
    """Run the checks, print the table; 0 when every row passed (or no CUDA GPU to check)."""
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--no-compile", action="store_true", help="skip the compile=True row (slow on CPU)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU: skipped")
        return 0
    device = torch.device(args.device)
    world = torch.cuda.device_count() if args.device == "cuda" else 2
    table = rows(device, not args.no_compile, world)
    width = max(len(name) for name, *_ in table)
    print(f"{'check':<{width}}  result  {'seconds':>7}  detail")
    for name, result, detail, seconds in table:
        print(f"{name:<{width}}  {result:<6}  {seconds:7.2f}  {detail}")
    failed = sum(result != "ok" for _, result, _, _ in table)
    print(f"{len(table) - failed}/{len(table)} passed on {device}"
          f"{' (' + torch.cuda.get_device_name() + ')' if device.type == 'cuda' else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
