"""Where a traced model may be cut: module spans, splittable units, split points.

A cut "before module X" starts a new stage at the first operation that ran inside X.
Because the traced operations are in execution order, a cut anywhere in that order
gives stages whose values only flow forward; values used further on are passed
through the stages between.

For balancing, the model is seen as a row of *units*: the repeated blocks (the
children of each outermost ``ModuleList`` / ``Sequential`` holding same-class
modules, e.g. ``model.layers.0``, ``model.layers.1``, ...) and, around them, the
other modules met on the way from the root to those containers, taken whole
(``model.embed_tokens``, ``model.norm``, ``lm_head``). A module named in
``unsplittable`` is always taken whole.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from conveyor.errors import SplitError
from conveyor.frontend.trace import TracedModel


@dataclass(frozen=True, slots=True)
class Unit:
    """A module the balancer may start a stage with.

    ``start`` is the index (in ``TracedModel.nodes``) of the first operation that ran
    inside it; ``is_block`` says whether it is one of the repeated blocks; ``blocks``
    counts the repeated blocks it stands for (more than one when a region traced as one
    operation, a ``torch.no_grad()`` around several blocks, holds them).
    """

    name: str
    class_name: str
    start: int
    is_block: bool
    blocks: int = 0


class ModuleSpans:
    """First and last operation index of every module that ran (or whose children ran)."""

    def __init__(self, traced: TracedModel):
        self.first: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.regions = traced.regions
        for index, paths in enumerate(traced.module_paths):
            for path in paths:
                # A container (ModuleList) is iterated, never called, so it is not in
                # the module stack; its span is its children's.
                parts = path.split(".")
                for depth in range(1, len(parts) + 1):
                    prefix = ".".join(parts[:depth])
                    self.first.setdefault(prefix, index)
                    self.last[prefix] = index

    def ran(self, path: str) -> bool:
        return path in self.first

    def cuts_inside(self, position: int, module: str) -> bool:
        """Whether starting a stage at ``position`` would cut through ``module``."""
        return module in self.first and self.first[module] < position <= self.last[module]


def is_block_container(module: nn.Module) -> bool:
    """A ``ModuleList`` / ``Sequential`` / ``ModuleDict`` holding at least two modules of one class.

    Example:
        >>> is_block_container(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
        True
        >>> is_block_container(nn.ModuleList([nn.Linear(2, 2), nn.ReLU()]))
        False
    """
    if not isinstance(module, nn.ModuleList | nn.Sequential | nn.ModuleDict):
        return False
    counts = Counter(type(child) for child in module.children())
    return bool(counts) and counts.most_common(1)[0][1] >= 2


def module_units(model: nn.Module, unsplittable: Iterable[str] = ()) -> list[tuple[str, nn.Module, bool]]:
    """``(path, module, is_block)`` of every unit, in registration order (no tracing).

    The children of every outermost block container are units (the repeated
    blocks); modules on the path from the root to a container are opened up; any
    other module, and any module named in ``unsplittable``, is one unit. A model
    without any container is cut between the root's children.

    Example:
        >>> model = nn.Sequential(nn.Embedding(8, 4), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
        >>> [(name, is_block) for name, _, is_block in module_units(model)]
        [('0', False), ('1.0', True), ('1.1', True)]
    """
    whole = set(unsplittable)
    holds: dict[int, bool] = {}

    def has_container(module: nn.Module) -> bool:
        if id(module) not in holds:
            holds[id(module)] = is_block_container(module) or any(has_container(c) for c in module.children())
        return holds[id(module)]

    any_container = has_container(model)
    units: list[tuple[str, nn.Module, bool]] = []

    def visit(path: str, module: nn.Module) -> None:
        container = is_block_container(module)
        if path in whole or not (container or has_container(module) or (path == "" and not any_container)):
            units.append((path, module, False))
            return
        for name, child in module.named_children():
            child_path = f"{path}.{name}" if path else name
            if container:
                units.append((child_path, child, True))
            else:
                visit(child_path, child)

    visit("", model)
    return units


def find_units(model: nn.Module, spans: ModuleSpans, unsplittable: Iterable[str]) -> list[Unit]:
    """The units of ``model`` (:func:`module_units`) in execution order (modules that never ran are left out)."""
    units = [Unit(path, type(module).__name__, spans.first[path], is_block, int(is_block))
             for path, module, is_block in module_units(model, unsplittable) if path and spans.ran(path)]
    units.sort(key=lambda unit: unit.start)
    # Two units start at the same operation when one ran inside the other's span, or when
    # both run inside one region: keep the first listed, standing for the blocks of both.
    unique: list[Unit] = []
    for unit in units:
        if unique and unique[-1].start == unit.start:
            kept = unique[-1]
            unique[-1] = dataclasses.replace(kept, is_block=kept.is_block or unit.is_block,
                                             blocks=kept.blocks + unit.blocks)
            continue
        unique.append(unit)
    return unique


def resolve_split_points(spans: ModuleSpans, names: list[str], unsplittable: Iterable[str]) -> list[int]:
    """Operation indices at which the named modules start; checks their order.

    ``names`` are modules of the model (``split_model`` checks them before tracing). Raises
    ``SplitError`` for a module that never ran, points out of execution order, or a cut inside
    an ``unsplittable`` module or inside a region (``torch.no_grad()``, autocast).
    """
    positions = []
    for name in names:
        if not spans.ran(name):
            raise SplitError(
                f"split point {name!r} is a module that never ran while tracing the example "
                "microbatch, so there is nothing to cut before; name a module that forward calls."
            )
        position = spans.first[name]
        region = spans.regions.get(position)
        if region is not None and name not in region.opening:
            opening = f"before {region.opening[-1]!r}" if region.opening else "before the region"
            raise SplitError(
                f"split point {name!r} runs inside {region.kind}, which is traced as one operation "
                f"and cannot be cut; start the stage at the region ({opening}) or after it."
            )
        if position == 0:
            raise SplitError(
                f"split point {name!r} starts at the model's first operation, so stage 0 would be "
                "empty; name a later module."
            )
        for module in unsplittable:
            if spans.cuts_inside(position, module):
                raise SplitError(
                    f"split point {name!r} cuts inside {module!r}, which is marked unsplittable; "
                    f"cut before {module!r} or after it."
                )
        positions.append(position)
    for (name_a, a), (name_b, b) in zip(zip(names, positions), zip(names[1:], positions[1:])):
        if b <= a:
            raise SplitError(
                f"split points must follow execution order: {name_b!r} (operation {b}) does not "
                f"start after {name_a!r} (operation {a}). Reorder them, or drop duplicates."
            )
    return positions


def check_module_names(model: nn.Module, names: Iterable[str], what: str) -> list[str]:
    """Raise ``SplitError`` for a name that is no module of ``model``, listing close names.

    Example:
        >>> check_module_names(nn.Sequential(nn.Linear(2, 2)), ["0"], "split point")
        ['0']
    """
    module_names = [name for name, _ in model.named_modules() if name]
    known = set(module_names)
    checked = list(names)
    for name in checked:
        if name not in known:
            close = difflib.get_close_matches(name, module_names, n=5, cutoff=0.6)
            suggestion = f" Close names: {', '.join(close)}." if close else ""
            raise SplitError(
                f"{what} {name!r} names no module of {type(model).__name__}.{suggestion} "
                "Use module paths as in model.named_modules() (e.g. 'model.layers.4')."
            )
    return checked
