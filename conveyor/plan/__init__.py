"""Pipeline plans: which split, schedule, microbatch count and stages per rank, under a memory budget.

``conveyor.plan.plan(model, example, ranks=P, global_batch=B, memory_per_rank="4GiB")`` profiles
every splittable unit of the model (F, I, W time; activation and parameter bytes), or costs it
from its shapes on the meta device, searches split points x schedule x M x V by simulating
each candidate, and returns the fastest :class:`Plan` that fits. ``conveyor.pipeline(...,
plan=plan_or_path)`` and ``conveyor train parallel.plan=PATH`` run it; ``conveyor plan`` is the
command line. Options beyond the everyday keywords come as records (:mod:`conveyor.plan.settings`):
``space=SearchSpace(...)``, ``machine=Machine(...)``, ``measure=Measurement(...)``.

Importing it does not import torch (the plan file and the search are pure Python);
the profiling parts load on first use.

Example:
    >>> from conveyor.plan import Plan, parse_size
    >>> parse_size("4GiB")
    4294967296.0
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import Any

from conveyor.plan.costs import CostTable, UnitCost, synthetic_table
from conveyor.plan.result import Plan, as_plan, format_size, parse_size
from conveyor.plan.search import Candidate, SearchResult, search
from conveyor.plan.settings import Machine, Measurement, PlanOptions, SearchSpace

_LAZY = MappingProxyType({
    "plan": "conveyor.plan.planner",
    "choose": "conveyor.plan.planner",
    "format_plan": "conveyor.plan.planner",
    "unit_costs": "conveyor.plan.planner",
    "profile_units": "conveyor.plan.profile",
    "analytic_units": "conveyor.plan.analytic",
})

__all__ = ["Candidate", "CostTable", "Machine", "Measurement", "Plan", "PlanOptions", "SearchResult", "SearchSpace",
           "UnitCost", "analytic_units", "as_plan", "choose", "format_plan", "format_size", "parse_size", "plan",
           "profile_units", "search", "synthetic_table", "unit_costs"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'conveyor.plan' has no attribute {name!r}")
