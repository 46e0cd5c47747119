"""A chosen pipeline plan, as an object and as a JSON file (pure Python: no torch).

The file names everything ``conveyor.pipeline(..., plan=PATH)`` and ``conveyor train``
(``parallel.plan=PATH``) need: schedule, ranks, stages per rank, microbatches, the split
points by module name; plus what was predicted and the unit costs the prediction came from.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from conveyor.errors import PlanError
from conveyor.plan.costs import CostTable
from conveyor.schedule.cost import CostModel, StageCosts
from conveyor.schedule.ir import Schedule
from conveyor.schedule.registry import build

PLAN_FORMAT = "conveyor-plan/1"
_UNITS = MappingProxyType({"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
                           "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 2**10, "mib": 2**20, "gib": 2**30,
                           "tib": 2**40})


def parse_size(value: str | float) -> float:
    """Bytes from ``4GiB``, ``500MB``, ``1.5e9`` or a number (``inf``: no limit).

    Example:
        >>> parse_size("4GiB"), parse_size("500MB"), parse_size(1024)
        (4294967296.0, 500000000.0, 1024.0)
    """
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?|inf)\s*([a-z]*)\s*", str(value).lower())
        if not match or match.group(2) not in _UNITS:
            raise PlanError(f"memory size {value!r}: expected bytes or a number with a unit such as 4GiB, 512MiB, "
                            f"16GB (units: {', '.join(u for u in _UNITS if u)})")
        number = float(match.group(1)) * _UNITS[match.group(2)]
    if not number > 0 or math.isnan(number):
        raise PlanError(f"memory size {value!r}: expected a positive size")
    return number


@dataclass
class Plan:
    """What the planner chose for ``ranks`` ranks and a global batch of ``global_batch`` samples.

    ``conveyor.pipeline(..., plan=plan)`` runs it (the only way a chosen split reaches a pipeline).
    ``split_points``: the module each stage after the first starts with. ``step_time`` (seconds),
    ``bubble`` and ``memory_per_rank`` (bytes) are predictions of the simulation on ``costs``.
    ``alternatives``: the next best candidates (one line each); ``outcome``: how many candidates
    ended how; ``best_over_memory``: the fastest one that did not fit (None if none). ``recompute``:
    a recomputation policy per stage (``StageOptions.recompute``) the plan needs to fit its memory limit
    (empty: none). ``expert_overlap``: the plan hides expert parallelism's all-to-alls in the schedule's
    forward/backward pairs (``DistributedLayout.expert_overlap``), which its step and memory assume.

    Example:
        >>> plan = Plan("1f1b", 2, 1, 4, 8, ("layers.2",), 1.5, 0.2, (1e9, 9e8), (0.3, 0.3), 4e9)
        >>> plan.microbatch_size, plan.split_points
        (2, ('layers.2',))
    """

    schedule: str
    ranks: int
    virtual: int
    microbatches: int
    global_batch: int
    split_points: tuple[str, ...]
    step_time: float
    bubble: float
    memory_per_rank: tuple[float, ...]
    stage_times: tuple[float, ...]
    memory_limit: float
    costs: CostTable | None = None
    alternatives: list[str] = field(default_factory=list)
    outcome: dict[str, int] = field(default_factory=dict)
    best_over_memory: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    schedule_costs: CostModel | None = None  # a cost-planned schedule's (zb-1p, zb-2p) costs: its order's source
    tensor_parallel: int = 1  # each of the ``ranks`` pipeline ranks is a group of this many TP ranks
    tensor_parallel_report: list[str] = field(default_factory=list)  # the tp search's table: a line per tp, why
    recompute: tuple = ()  # per stage: a policy mapping ({"every": 2}) or None
    expert_parallel: int = 1  # the replicas that share each experts module's experts (their ranks' tokens moved)
    expert_parallel_report: list[str] = field(default_factory=list)  # the ep search's table: a line per ep, why
    expert_overlap: bool = False  # the all-to-alls overlapped in the schedule's pairs (parallel.expert_overlap)

    @property
    def microbatch_size(self) -> int:
        return self.global_batch // self.microbatches

    @property
    def num_stages(self) -> int:
        return self.ranks * self.virtual

    def schedule_spec(self) -> str | Schedule:
        """The schedule to run: its name, or, for a schedule that plans its order for the costs
        (zb-1p, zb-2p), that schedule built for the costs it was simulated with (a name alone would
        rebuild it for uniform costs, another order than the one predicted).

        Example:
            >>> Plan("1f1b", 2, 1, 4, 8, ("layers.2",), 1.5, 0.2, (1e9, 9e8), (0.3, 0.3), 4e9).schedule_spec()
            '1f1b'
        """
        if self.schedule_costs is None:
            return self.schedule
        return build(self.schedule, ranks=self.ranks, microbatches=self.microbatches, virtual=self.virtual,
                     costs=self.schedule_costs)

    def to_json(self) -> dict[str, Any]:
        """The plan as a JSON-ready dict (what :meth:`save` writes)."""
        return {
            "format": PLAN_FORMAT, "schedule": self.schedule, "ranks": self.ranks, "virtual": self.virtual,
            "microbatches": self.microbatches, "global_batch": self.global_batch,
            "microbatch_size": self.microbatch_size, "split_points": list(self.split_points),
            "predicted": {"step_time_s": self.step_time, "bubble": self.bubble,
                          "memory_per_rank_bytes": list(self.memory_per_rank),
                          "stage_times_s": list(self.stage_times)},
            "memory_limit_bytes": None if math.isinf(self.memory_limit) else self.memory_limit,
            "alternatives": self.alternatives, "outcome": self.outcome, "best_over_memory": self.best_over_memory,
            "settings": {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in self.settings.items()},
            "costs": None if self.costs is None else self.costs.to_json(),
            "schedule_costs": None if self.schedule_costs is None else _cost_model_json(self.schedule_costs),
            "tensor_parallel": self.tensor_parallel, "tensor_parallel_report": self.tensor_parallel_report,
            "recompute": list(self.recompute),
            "expert_parallel": self.expert_parallel, "expert_parallel_report": self.expert_parallel_report,
            "expert_overlap": self.expert_overlap,
        }

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON at ``path``; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1, allow_nan=False) + "\n")
        return path

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "the plan") -> Plan:
        """The plan :meth:`to_json` wrote; a PlanError naming what is missing or wrong otherwise."""
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise PlanError(f"{where} is not a conveyor plan (expected a JSON object with \"format\": "
                            f"\"{PLAN_FORMAT}\", as `conveyor plan --out` writes)")
        if "checkpoint" in data:  # the key's name before recomputation stopped being called checkpointing
            raise PlanError(f"{where} names its recomputation policies \"checkpoint\", as older conveyor wrote them; "
                            f"rename that key to \"recompute\", or write the plan again with `conveyor plan ... --out`")
        try:
            predicted = data["predicted"]
            plan = cls(str(data["schedule"]), int(data["ranks"]), int(data["virtual"]), int(data["microbatches"]),
                       int(data["global_batch"]), tuple(str(s) for s in data["split_points"]),
                       float(predicted["step_time_s"]), float(predicted["bubble"]),
                       tuple(float(m) for m in predicted["memory_per_rank_bytes"]),
                       tuple(float(t) for t in predicted["stage_times_s"]),
                       math.inf if data.get("memory_limit_bytes") is None else float(data["memory_limit_bytes"]),
                       None if data.get("costs") is None else CostTable.from_json(data["costs"]),
                       list(data.get("alternatives", [])), dict(data.get("outcome", {})),
                       data.get("best_over_memory"), dict(data.get("settings", {})),
                       None if data.get("schedule_costs") is None else _cost_model(data["schedule_costs"]),
                       int(data.get("tensor_parallel", 1)), list(data.get("tensor_parallel_report", [])))
            plan.recompute = tuple(None if p is None else dict(p) for p in data.get("recompute") or ())
            plan.expert_parallel = int(data.get("expert_parallel", 1))
            plan.expert_parallel_report = list(data.get("expert_parallel_report", []))
            plan.expert_overlap = bool(data.get("expert_overlap", False))
        except (KeyError, TypeError, ValueError) as error:
            raise PlanError(f"{where} is malformed ({type(error).__name__}: {error}); write it again with "
                            f"`conveyor plan ... --out`") from None
        if len(plan.split_points) != plan.num_stages - 1:
            raise PlanError(f"{where}: {plan.ranks} ranks x {plan.virtual} stages per rank need "
                            f"{plan.num_stages - 1} split points, the plan has {len(plan.split_points)}")
        return plan

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """The plan saved at ``path``.

        Example:
            >>> import tempfile
            >>> plan = Plan("1f1b", 2, 1, 4, 8, ("layers.2",), 1.5, 0.2, (1e9, 9e8), (0.3, 0.3), 4e9)
            >>> Plan.load(plan.save(Path(tempfile.mkdtemp()) / "plan.json")).split_points
            ('layers.2',)
        """
        path = Path(path).expanduser()
        try:
            data = json.loads(path.read_text())
        except OSError as error:
            raise PlanError(
                f"cannot read the plan {str(path)!r}: {error.strerror or error}; write one with "
                f"`conveyor plan MODEL --ranks P --global-batch B --memory-per-rank SIZE --out PATH`"
            ) from None
        except json.JSONDecodeError as error:
            raise PlanError(f"the plan {str(path)!r} is not JSON ({error})") from None
        return cls.from_json(data, f"the plan {str(path)!r}")


def _cost_model_json(costs: CostModel) -> dict[str, Any]:
    """Per stage: F, I, W, the activation bytes, the bytes W keeps, and its all-to-alls (one's time, their count)."""
    return {"latency": costs.latency,
            "stages": [[c.forward, c.backward_input, c.backward_weight, c.activation_bytes, c.weight_activation_bytes,
                        c.exchange, c.exchanges] for c in costs.stages]}


def _cost_model(data: dict[str, Any]) -> CostModel:
    """What :func:`_cost_model_json` wrote (a stage of five values: a plan from before the all-to-alls were kept).

    Example:
        >>> costs = CostModel((StageCosts(1.0, 2.0, 1.0, 8.0, None, exchange=0.5, exchanges=2),), 0.1)
        >>> _cost_model(_cost_model_json(costs)) == costs
        True
    """
    stages = []
    for stage in data["stages"]:
        *timed, exchanges = stage if len(stage) == 7 else (*stage, 0.0, 0)
        stages.append(StageCosts(*(None if v is None else float(v) for v in timed), exchanges=int(exchanges)))
    return CostModel(tuple(stages), float(data["latency"]))


def as_plan(plan: Plan | str | Path) -> Plan:
    """A :class:`Plan` as given, or loaded from a path.

    Example:
        >>> as_plan("/nowhere/plan.json")  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        conveyor.errors.PlanError: cannot read the plan '/nowhere/plan.json': No such file or directory; write one with
        `conveyor plan MODEL --ranks P --global-batch B --memory-per-rank SIZE --out PATH`
    """
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, str | Path):
        return Plan.load(plan)
    raise PlanError(f"plan must be a Plan or the path of a plan file, got {type(plan).__name__}")


def format_size(value: float) -> str:
    """``4294967296`` -> ``'4.00 GiB'``.

    Example:
        >>> format_size(3 * 2**20), format_size(512)
        ('3.00 MiB', '512 B')
    """
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"
