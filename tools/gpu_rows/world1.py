"""Rows at world size 1 on NCCL (gloo on the CPU): every collective the pipeline issues, a
checkpoint saved and resumed bitwise, bf16 weights with fp32 main grads, and steps 2 onward
under ``torch.cuda.set_sync_debug_mode("warn")`` (every site that syncs, named). One rank
process runs the parts asked for.

Example::

    ok, detail = world1_row(Context(torch.device("cpu")), "bf16")
"""

from __future__ import annotations

import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch alias

import conveyor
import conveyor.schedule as cs
from conveyor.parallel import count_tokens
from conveyor.testing.models import lm_loss
from conveyor.testing.references.data_parallel import MLPStack, MLPStage, make_batch
from conveyor.testing.references.main_grad import MainGradReference

from .common import LR, Context, compare, cpu, deterministic, launch, mlp_state

CLIP, M = 0.05, 4


def _sum_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


def _schedule(name: str = "interleaved-1f1b") -> cs.Schedule:
    return cs.build(name, ranks=1, microbatches=M, virtual=2)  # two stages on the one rank


def _steps(pipe, stages, optimizer, device, first: int, last: int) -> dict:
    """Steps ``first``..``last``: per-token loss, on_nonfinite="skip", clipping; losses, norms, params."""
    losses, norms, grads = [], [], {}
    for step in range(first, last + 1):
        ids, targets = (t.to(device) for t in make_batch(seed=step))
        tokens = count_tokens(pipe, targets)
        losses.append(pipe.step(ids, target=targets, normalize_by=tokens, on_nonfinite="skip"))
        norms.append(pipe.clip_grad_norm_(CLIP))
        if step == first:
            grads = mlp_state(stages, "grad")
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": cpu(losses), "norms": cpu(norms), "grads": grads, "params": mlp_state(stages, "data")}


def _reference(device: torch.device) -> dict:
    model = MLPStack(2).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms, grads = [], [], {}
    for step in (1, 2):
        ids, targets = (t.to(device) for t in make_batch(seed=step))
        total = None
        for x, y in zip(torch.tensor_split(ids, M), torch.tensor_split(targets, M)):
            loss = _sum_loss(model(x), y) / targets.numel()
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        losses.append(total)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        if step == 1:
            grads = cpu({f"{s}.{n}": p.grad for s, st in enumerate(model.stages) for n, p in st.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    params = {f"{s}.{n}": p for s, st in enumerate(model.stages) for n, p in st.named_parameters()}
    return cpu({"losses": losses, "norms": norms, "grads": grads, "params": params})


def _verdict(got: dict, want: dict, what: str) -> tuple[bool, str]:
    for part in ("losses", "norms", "grads", "params"):
        g, w = got[part], want[part]
        g, w = (dict(enumerate(g)), dict(enumerate(w))) if isinstance(g, list) else (g, w)
        ok, detail = compare(g, w, f"{what}{part} ")
        if not ok:
            return ok, detail
    return True, "bitwise"


def _pipe(device, schedule=None, loss_fn=_sum_loss, stage=conveyor.StageOptions()):
    schedule = schedule or _schedule()
    stages = {s: MLPStage(s, 2) for s in range(2)}
    pipe = conveyor.Pipeline(list(stages.values()), schedule, loss_fn, stage=stage,
                             transfer=conveyor.TransferOptions(timeout_s=120),
                             layout=conveyor.DistributedLayout(device=device))
    return pipe, stages


def collectives(device: torch.device) -> tuple[bool, str]:
    """Per-token loss, skip check, clipping, forward, timeline, memory, checkpoint save and resume."""
    pipe, stages = _pipe(device, stage=conveyor.StageOptions(measure_memory=True))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
    ok, detail = _verdict(_steps(pipe, stages, optimizer, device, 1, 2), _reference(device), "steps 1-2: ")
    if not ok:
        return ok, detail
    outputs = pipe.forward(make_batch(seed=5)[0].to(device))
    timeline, memory = pipe.timeline(), pipe.memory(all_ranks=True)
    if outputs is None or outputs.device != device or not timeline.spans or not memory:
        return False, f"forward/timeline/memory: outputs on {getattr(outputs, 'device', None)}, " \
                      f"{len(timeline.spans)} spans, {len(memory)} memory reports"
    with tempfile.TemporaryDirectory() as where:
        path = Path(where) / "step_2"
        conveyor.checkpoint.save(path, pipe, optimizer, extra={"step": 2})
        went_on = _steps(pipe, stages, optimizer, device, 3, 4)
        pipe.close()
        pipe, stages = _pipe(device, stage=conveyor.StageOptions(measure_memory=True))
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
        extra = conveyor.checkpoint.load(path, pipe, optimizer)
        resumed = _steps(pipe, stages, optimizer, device, 3, 4)
        pipe.close()
    if extra != {"step": 2}:
        return False, f"the checkpoint's extra came back as {extra!r}, not {{'step': 2}}"
    ok, detail = _verdict(resumed, went_on, "resumed steps 3-4: ")
    return ok, "steps bitwise one process; forward, timeline, memory; resume bitwise" if ok else detail


def bf16_main_grads(device: torch.device) -> tuple[bool, str]:
    """param_dtype="bf16" + MasterWeights against MainGradReference on the same device, bitwise."""
    pipe, stages = _pipe(device, loss_fn=lm_loss, stage=conveyor.StageOptions(param_dtype="bf16"))
    optimizer = conveyor.MasterWeights(pipe, torch.optim.AdamW, lr=LR)
    reference = MainGradReference(MLPStack(2).to(device), torch.optim.AdamW, lr=LR)
    names = [f"{s}.{n}" for s, st in enumerate(reference.model.stages) for n, _ in st.named_parameters()]
    for step in range(2):
        ids, targets = (t.to(device) for t in make_batch(seed=step))
        loss = pipe.step(ids, target=targets)
        norm = pipe.clip_grad_norm_(CLIP)
        want_loss = reference.accumulate(ids, targets, M, lm_loss)
        want_norm = reference.clip_grad_norm_(CLIP)
        got_grads = {f"{s}.{n}": p.main_grad for s, st in stages.items() for n, p in st.named_parameters()}
        ok, detail = compare({"loss": loss, "norm": norm, **got_grads},
                             {"loss": want_loss, "norm": want_norm, **dict(zip(names, reference.main_grads))},
                             f"step {step + 1} ")
        if not ok:
            pipe.close()
            return ok, detail
        optimizer.step()
        optimizer.zero_grad()
        reference.optimizer_step()
    got = {f"{s}.{n}": p for s, st in stages.items() for n, p in st.named_parameters()}
    masters = dict(zip(optimizer.names, optimizer.masters))
    pipe.close()
    ok, detail = compare(got, dict(zip(names, reference.params)), "bf16 param ")
    if ok and len(masters) != len(reference.masters):
        return False, f"{len(masters)} fp32 masters, the reference has {len(reference.masters)}"
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in got.values()})
    return ok, f"losses, norms, fp32 main grads, {'/'.join(dtypes)} params bitwise" if ok else detail


def _project_frames(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frames of this repository's code (not torch's, not Python's), innermost first."""
    ours = [f for f in stack if "site-packages" not in f.filename and "/lib/python3" not in f.filename
            and not f.filename.endswith("world1.py")]
    return " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(ours[-3:]))


def _sync_sites(run) -> Counter:
    """Where ``run()`` made the GPU synchronise with the host: torch's sync debug mode "warn"
    raises a warning at each such call; its Python stack names the site (every site, not the first)."""
    sites: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "called a synchronizing CUDA operation" in str(message):  # not the mode's "prototype" notice
            sites[_project_frames(traceback.extract_stack()[:-1]) or f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


def sync_free(device: torch.device, quick: bool) -> tuple[bool, str]:
    """Steps 2.. (step and clip) with the GPU set to report any host synchronisation, and where."""
    names = ["interleaved-1f1b", "zbv"] if quick else ["interleaved-1f1b", "zb-h1", "zbv", "dualpipev", "looped-bfs"]
    found: dict[str, list[str]] = {}
    for name in names:
        for options in ({}, {"loss_fn": lm_loss, "stage": conveyor.StageOptions(param_dtype="bf16")}):
            pipe, stages = _pipe(device, _schedule(name), **options)
            optimizer = conveyor.MasterWeights(pipe, torch.optim.AdamW, lr=LR) if options \
                else torch.optim.AdamW(pipe.parameters(), lr=LR)
            try:
                for step in range(3):
                    ids, targets = (t.to(device) for t in make_batch(seed=step))

                    def one_step(pipe=pipe, ids=ids, targets=targets) -> None:
                        pipe.step(ids, target=targets)
                        pipe.clip_grad_norm_(CLIP)

                    if step == 0:
                        one_step()  # the first step may sync (allocations, lazy set-up)
                    else:
                        for site, count in _sync_sites(one_step).items():
                            found.setdefault(site, []).append(f"{name}{' bf16' if options else ''} x{count}")
                    optimizer.step()
                    optimizer.zero_grad()
            finally:
                pipe.close()
    if found:
        for site, where in found.items():
            print(f"world1-syncs: {site}: {', '.join(where)}", file=sys.stderr, flush=True)
        listed = "; ".join(f"{site} ({where[0]}{' ...' if len(where) > 1 else ''})" for site, where in found.items())
        return False, f"{len(found)} site(s) synchronised the host: {listed}"
    return True, f"{len(names)} schedules x (fp32, bf16 main grads): steps 2-3 made no host sync"


def _world1_rank(rank: int, world: int, device: str, parts: list[str], quick: bool) -> dict:
    device = torch.device(device)
    deterministic(device)
    jobs = {"collectives": lambda: collectives(device), "bf16": lambda: bf16_main_grads(device),
            "syncs": lambda: sync_free(device, quick)}
    out = {}
    for part in parts:
        start = time.perf_counter()
        try:
            ok, detail = jobs[part]()
        except Exception as exc:  # one part's failure is its row's, the others still run
            ok, detail = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        out[part] = (ok, detail, time.perf_counter() - start)
    return out


def world1_row(ctx: Context, part: str) -> tuple[bool, str]:
    """One part ("collectives", "bf16", "syncs") in a rank process of its own: NCCL on a GPU, gloo on the CPU."""
    backend = "nccl" if ctx.cuda else "gloo"
    ok, detail, _ = launch(_world1_rank, 1, ctx, [part], ctx.quick, backend=backend, timeout_s=300)[0][part]
    return ok, f"{detail} [{backend}]"
