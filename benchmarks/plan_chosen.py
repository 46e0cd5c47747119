"""The planner's own plan as a case of ``python -m benchmarks --plan``.

For each (workload, P), ``conveyor.plan.plan()`` runs on the whole model (the workload's one-stage
cut), one microbatch as the example and the benchmark's global batch, with no memory limit
(these models take a few MiB a rank) and this machine's calibration, so that its predicted
step is the one the run checks. It runs in the benchmark's single-thread profiling process,
as the ranks compute single-threaded.

The GPT's units are profiled by the planner itself. The emulated workload's blocks sleep in
autograd functions that the frontend's trace does not keep (it records the ops, not the
sleeps), so its unit costs come from the workload's own blocks, one block per stage, timed
as the runtime runs them (I and W split, and the full B), and are given to ``conveyor.plan``
as ``costs``.

The plan's split points are mapped onto the workload's blocks (``blocks.k`` starts a stage at
block k; a GPT's ``final_norm`` gives the last stage no block), and the case runs the same
hand-built stage modules as the built-in schedules.

Example:
    >>> split_of(("blocks.1", "blocks.3"), num_blocks=4, units=["blocks.0", "blocks.1", "blocks.2", "blocks.3"])
    (1, 2, 1)
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence

from benchmarks import libraries as lib
from conveyor.testing.models import Emulated

CHOSEN = "chosen"


def split_of(split_points: Sequence[str], *, num_blocks: int, units: Sequence[str]) -> tuple[int, ...]:
    """Blocks per stage for the plan's ``split_points``; a ValueError for a cut the workload cannot build."""
    edges = [0]
    for point in split_points:
        if point.startswith("blocks."):
            edges.append(int(point.split(".")[1]))
        elif point == "final_norm":
            edges.append(num_blocks)
        else:
            raise ValueError(f"the plan cuts before {point!r} (units {list(units)}); the benchmark's hand-built "
                             "stages cut between blocks only (or before a GPT's final norm)")
    edges.append(num_blocks)
    return tuple(b - a for a, b in zip(edges, edges[1:]))


def emulated_costs(workload: Emulated):
    """A CostTable of the emulated blocks (one block per stage), their sleeps fixed in the microbatch size."""
    import torch

    from benchmarks.costs import StageCostProbe, per_pass
    from conveyor.plan.costs import CostTable, UnitCost
    from conveyor.plan.profile import split_backward_seconds
    from conveyor.runtime.stage.backward import GraphAnalysisCache

    blocks = workload.num_blocks
    probe = StageCostProbe(workload, blocks)
    costs = per_pass([probe.sample() for _ in range(3)], statistics.median)
    caches = [GraphAnalysisCache() for _ in range(blocks)]
    split = []
    for stage, module in enumerate(probe.modules):
        samples = []
        for _ in range(3):
            outs = probe._forward(stage)
            inputs = [t for t in probe.inputs[stage] if t.requires_grad]
            samples.append(split_backward_seconds(list(outs), [torch.ones_like(o) for o in outs], inputs,
                                                  list(module.parameters()), caches[stage]))
            module.zero_grad(set_to_none=True)
        split.append((statistics.median(i for i, _ in samples), statistics.median(w for _, w in samples)))
    rows, width = workload.rows_per_microbatch, workload.width
    units = []
    for k in range(blocks):
        f, b = costs.forward_ms[k] / 1e3, costs.backward_ms[k] / 1e3
        i, w = split[k] if k else (0.0, split[k][0] + split[k][1])
        units.append(UnitCost(f"blocks.{k}", f, i, w, 2.0 * rows * width * 4, rows * width * 4,
                              width * width * 4.0, width * width, rows * width * 4.0, True, backward=b))
    fixed = tuple((u.forward, u.backward_input, u.backward_weight) for u in units)
    return CostTable(tuple(units), rows, fixed, source="emulated blocks, timed as the runtime runs them")


def choose(worker, workload, global_microbatches: int, calibration: dict):
    """``conveyor.plan.plan()`` for ``workload`` at its P (runs in the profiling process)."""
    import conveyor

    whole = workload.build_stage(0, 1)
    example = workload.batch(1)[0]
    costs = emulated_costs(workload) if isinstance(workload, Emulated) else None
    global_batch = workload.rows_per_microbatch * global_microbatches
    # The emulated ranks sleep (a device each); the GPT's share this machine's cores.
    cores = None if isinstance(workload, Emulated) else os.cpu_count()
    return conveyor.plan.plan(whole, example, ranks=workload.num_ranks, global_batch=global_batch,
                              machine=conveyor.plan.Machine(calibration=calibration, cores=cores),
                              measure=conveyor.plan.Measurement(costs=costs))


def chosen_case(plan, workload) -> lib.Case:
    """The case that runs ``plan`` on ``workload``'s hand-built blocks."""
    num_blocks = workload.num_blocks if isinstance(workload, Emulated) else workload.num_layers
    split = split_of(plan.split_points, num_blocks=num_blocks, units=plan.costs.names)
    return lib.Case(workload, plan.schedule, plan.virtual, plan.microbatches, split=split, plan=plan)


def describe(plan) -> str:
    """``zb-h1 V=2 M=4 split blocks.2,blocks.4``.

    Example:
        >>> from conveyor.plan.result import Plan
        >>> describe(Plan("1f1b", 2, 1, 4, 8, ("blocks.2",), 1.5, 0.2, (1.0, 1.0), (0.3, 0.3), 4e9))
        '1f1b V=1 M=4 split blocks.2'
    """
    return f"{plan.schedule} V={plan.virtual} M={plan.microbatches} split {','.join(plan.split_points)}"


def verdicts(records: list[dict]) -> list[str]:
    """Per (workload, P): the chosen plan's prediction and measurement against the fastest built-in.

    "faster" or "slower" when the spreads (min-max over the timed steps) do not overlap,
    otherwise "as fast (within the noise)" qualified by the medians.

    Example:
        >>> rows = [{"workload": "gpt", "ranks": 2, "schedule": "1f1b", "virtual": 1, "chosen": False,
        ...          "measured_ms": 10.0, "measured_min_ms": 9.5, "measured_max_ms": 11.0},
        ...         {"workload": "gpt", "ranks": 2, "schedule": "zb-h1", "virtual": 2, "chosen": True,
        ...          "plan": "zb-h1 V=2 M=4 split blocks.4", "predicted_ms": 9.0, "measured_ms": 9.2,
        ...          "measured_min_ms": 9.0, "measured_max_ms": 9.4, "ratio": 1.022}]
        >>> print(verdicts(rows)[0])  # doctest: +NORMALIZE_WHITESPACE
        gpt P=2: chosen zb-h1 V=2 M=4 split blocks.4: predicted 9.0 ms, measured 9.2 (9.0-9.4), ratio 1.022;
        best built-in 1f1b V=1 10.0 (9.5-11.0): faster
    """
    lines = []
    for workload, ranks in sorted({(r["workload"], r["ranks"]) for r in records}):
        rows = [r for r in records if r["workload"] == workload and r["ranks"] == ranks]
        chosen = [r for r in rows if r.get("chosen")]
        builtins = [r for r in rows if not r.get("chosen")]
        if not chosen or not builtins:
            continue
        c, best = chosen[0], min(builtins, key=lambda r: r["measured_ms"])
        if c["measured_max_ms"] < best["measured_min_ms"]:
            verdict = "faster"
        elif c["measured_min_ms"] > best["measured_max_ms"]:
            verdict = "slower"
        else:
            verdict = ("as fast (within the noise; median "
                       f"{'at most' if c['measured_ms'] <= best['measured_ms'] else 'above'} the best's)")
        planned = ("" if c.get("predicted_before_ms") is None else
                   f" (the planner's own, before the runs: {c['predicted_before_ms']:.1f} ms, ratio "
                   f"{c['measured_ms'] / c['predicted_before_ms']:.3f})")
        lines.append(
            f"{workload} P={ranks}: chosen {c['plan']}: predicted {c['predicted_ms']:.1f} ms{planned}, measured "
            f"{c['measured_ms']:.1f} ({c['measured_min_ms']:.1f}-{c['measured_max_ms']:.1f}), ratio {c['ratio']:.3f}; "
            f"best built-in {best['schedule']} V={best['virtual']} {best['measured_ms']:.1f} "
            f"({best['measured_min_ms']:.1f}-{best['measured_max_ms']:.1f}): {verdict}")
    return lines
