"""Pinned results of the schedule layer on a grid of small cases (see tests/schedule/test_golden.py).

``python -m conveyor.testing.rigs.schedule_golden`` rewrites ``tests/schedule/data/golden.json`` from the
code as it is; do that only when a result is meant to change, and say why in the commit.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import MappingProxyType

import conveyor.schedule as cs
from conveyor.errors import ConveyorError
from conveyor.schedule.compare import busy_per_rank
from conveyor.schedule.passes import merge_backward_halves

# The pins live beside the test that reads them, in the checkout this rig serves.
GOLDEN = Path(__file__).resolve().parents[3] / "tests" / "schedule" / "data" / "golden.json"
RANKS = (1, 2, 3, 4)
MICROBATCHES = (1, 2, 3, 5, 8)


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _timeline(tl: cs.Timeline) -> dict:
    spans = "\n".join(f"{s.rank} {s.action} {s.start!r} {s.end!r}" for s in tl.spans)
    return {
        "makespan": repr(tl.makespan),
        "bubble": repr(tl.bubble_ratio),
        "peaks": tl.peak_activations(),
        "peak_bytes": [repr(p) for p in tl.peak_activation_bytes()],
        "busy": [repr(b) for b in busy_per_rank(tl)],
        "spans": _digest(spans),
        "count": len(tl.spans),
    }


def _costs(num_stages: int, latency: float) -> cs.CostModel:
    return cs.CostModel.per_stage(
        [cs.StageCosts(0.1 + 0.3 * (s % 3), 0.2 + 0.1 * (s % 2), 0.7 - 0.2 * (s % 4),
                       activation_bytes=3.0 + s, weight_activation_bytes=1.5 + 0.5 * s) for s in range(num_stages)],
        latency=latency,
    )


def case(name: str, ranks: int, microbatches: int, virtual: int) -> dict:
    """Every figure pinned for one (schedule, P, M, V)."""
    try:
        built = cs.build(name, ranks=ranks, microbatches=microbatches, virtual=virtual)
    except ConveyorError as error:
        return {"error": str(error)}
    merged = merge_backward_halves(built)
    lowered = cs.lower(built)
    runs = cs.executable(built)
    S = built.num_stages
    out = {
        "programs": _digest(str(built)),
        "lowered": _digest(str(lowered)),
        "train": _digest(str(runs.train)),
        "eval": _digest(str(runs.eval)),
        "compute": _digest(str(runs.compute)),
        "train_in_order": sorted(f"{k.name}{s}" for k, s in runs.train_in_order),
        "eval_in_order": sorted(f"{k.name}{s}" for k, s in runs.eval_in_order),
        "gradients_final": [sorted(map(list, runs.gradients_final(r).items())) for r in range(ranks)],
        "unit": _timeline(cs.simulate(built)),
        "merged": _timeline(cs.simulate(merged)),
        "costs": _timeline(cs.simulate(built, _costs(S, 0.0))),
        "latency": _timeline(cs.simulate(merged, _costs(S, 0.25))),
        "lowered_latency": _timeline(cs.simulate(lowered, _costs(S, 0.25))),
        "train_latency": _timeline(cs.simulate(runs.train, cs.CostModel.uniform(S, 1.0, 2.0, 0.5, latency=1.5))),
    }
    return out


# The built-ins when the pins were taken (schedules added since are tested where they are added).
PINNED_SCHEDULES = ("1f1b", "dualpipev", "gpipe", "interleaved-1f1b", "looped-bfs", "zb-h1", "zb-h2", "zbv")


def grid() -> list[tuple[str, int, int, int]]:
    cases = []
    for name in PINNED_SCHEDULES:
        info = cs.available()[name]
        virtuals = info.virtual_choices or (1, 2, 3)
        for ranks in RANKS:
            for microbatches in MICROBATCHES:
                for virtual in virtuals:
                    cases.append((name, ranks, microbatches, virtual))
        for ranks, microbatches in ((5, 13), (8, 16)):
            cases.append((name, ranks, microbatches, info.default_virtual))
    return cases


BROKEN = MappingProxyType({
    "swap": [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]],
    "order": [["0B0", "0F0"], ["1F0", "1B0"]],
    "missing": [["0F0", "0B0"], ["1F0"]],
    "twice": [["0F0", "0F0", "0B0"], ["1F0", "1B0"]],
    "split": [["0F0", "0I0", "0B0"], ["1F0", "1B0"]],
    "w_without_i": [["0F0", "0B0", "0W0"], ["1F0", "1B0"]],
    "lowered_missing_recv": [["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1F0", "1B0", "1SEND_B0"]],
    "lowered_deadlock": [["0RECV_B0", "0F0", "0SEND_F0", "0B0"], ["1RECV_F0", "1F0", "1B0", "1SEND_B0"]],
})


def broken() -> dict:
    """verify()'s message (and grid) and simulate()'s for small broken schedules."""
    out = {}
    for name, rows in BROKEN.items():
        sched = cs.Schedule.from_programs(name, cs.Placement.looped(2), None, rows)
        for what, fn in (("verify", cs.verify), ("simulate", cs.simulate)):
            try:
                fn(sched)
                out[f"{name} {what}"] = "passes"
            except ConveyorError as error:
                out[f"{name} {what}"] = f"{type(error).__name__}: {error}\n{getattr(error, 'grid', '')}"
    return out


def pin(figures: dict) -> dict:
    """What is stored of a case: a digest of every figure, and the headline ones to read."""
    if "error" in figures:
        return figures
    return {
        "digest": _digest(json.dumps(figures, sort_keys=True)),
        "makespan": figures["unit"]["makespan"],
        "bubble": figures["unit"]["bubble"],
    }


def compute_all() -> dict:
    cases = {f"{n} P={p} M={m} V={v}": pin(case(n, p, m, v)) for n, p, m, v in grid()}
    return {"cases": cases, "broken": broken()}


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(compute_all(), sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
