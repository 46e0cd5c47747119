"""Profile what the planner costs: every splittable unit's F, I, W time and bytes, the split backward, the optimizer.

:func:`profile_units` times the units (:func:`~conveyor.plan.analytic.analytic_units` costs them from
their shapes instead); :func:`split_backward_seconds` one graph's I and W as the runtime runs them;
:func:`optimizer_seconds_per_parameter` an AdamW step. ``split_method="time"``
(:mod:`conveyor.plan.time_split`) weighs units with :func:`profile_units` and times whole stages;
both follow the timing rules here (:func:`synchronize`, the model's state saved and restored
around a timed run: :func:`save_module_state`, :func:`restore_module_state`).


The model is cut before every unit (``conveyor.frontend.split_model`` with the units' names as
split points), so each unit runs exactly as it would at the start of a stage: on what the unit
before it sends. Per unit and round: forward (counting the bytes autograd saves, and which of
them feed an operation together with a parameter: what the weight gradient W still needs after
I), the input gradient alone (I, graph kept), then the weight gradient (W), each pass on several
microbatches alive at once as in a pipeline (``IN_FLIGHT``, their median). Each time keeps its
best over the rounds. On CUDA every timed span is closed by a synchronize. The model is left as
it was (gradients, buffers, the random state).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from conveyor.errors import PlanError
from conveyor.frontend import split_model
from conveyor.frontend.stage import as_received
from conveyor.frontend.trace import trace_model
from conveyor.frontend.units import ModuleSpans, find_units
from conveyor.plan.costs import CostTable, UnitCost
from conveyor.runtime.stage.backward import GraphAnalysisCache, backward_input
from conveyor.runtime.stage.runner import grad_leaves

logger = logging.getLogger(__name__)


def unit_split(model: torch.nn.Module, example_args: Sequence[Any], example_kwargs: Mapping[str, Any] | None,
               unsplittable: Sequence[str] = ()) -> tuple[Any, list]:
    """The model cut before every unit: ``(split, units)``, one stage per unit.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        >>> split, units = unit_split(model, (torch.randn(2, 4),), None)
        >>> split.num_stages, [unit.name for unit in units]
        (2, ['0', '1'])
    """
    traced = trace_model(model, tuple(example_args), example_kwargs)
    units = find_units(model, ModuleSpans(traced), unsplittable)
    if len(units) < 2:
        raise PlanError(f"{type(model).__name__} has {len(units)} splittable unit(s); a pipeline plan needs at least "
                        "2 (repeated blocks in a ModuleList/Sequential, or several child modules)")
    names = [unit.name for unit in units[1:]]
    split = split_model(model, len(units), example_args=tuple(example_args), example_kwargs=example_kwargs,
                        split_points=names, unsplittable=unsplittable)
    return split, units


def profile_units(model: torch.nn.Module, example_args: Sequence[Any], example_kwargs: Mapping[str, Any] | None = None,
                  *, device: torch.device | str | None = None, repeats: int = 3,
                  unsplittable: Sequence[str] = ()) -> CostTable:
    """Every unit's measured F, I, W seconds and bytes for one microbatch like ``example_args``.

    Example:
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
        >>> table = profile_units(model, (torch.randn(4, 8),), repeats=1)
        >>> table.names, table.units[0].parameter_bytes
        (['0', '1', '2'], 288.0)
    """
    if any(p.device.type == "meta" for p in model.parameters()):
        raise PlanError("profile_units runs the model, but its parameters are on the meta device; use "
                        "analytic_units (costs from the shapes) or build the model on a real device")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    split, units = unit_split(model, example_args, example_kwargs, unsplittable)
    args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to(device),
                                        (tuple(example_args), dict(example_kwargs or {})))
    modules = [split.stage_module(stage, device) for stage in range(split.num_stages)]
    by_name = dict(model.named_parameters(remove_duplicate=False))
    best = [[float("inf")] * 4 for _ in units]
    analyses = [GraphAnalysisCache() for _ in units]  # one per stage, as the runtime keeps them
    sizes: list[tuple[float, float]] = []
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        for round_index in range(repeats + 1):  # round 0 warms up and counts bytes
            inputs: tuple = ()
            for stage, module in enumerate(modules):
                saved = save_module_state(module)
                times, outputs, counted = _run_unit(module, stage, args, kwargs, inputs, device,
                                                    count=round_index == 0, analyses=analyses[stage])
                restore_module_state(module, saved)
                if round_index == 0:
                    sizes.append(counted)
                else:
                    best[stage] = [min(a, b) for a, b in zip(best[stage], times)]
                if stage < len(modules) - 1:
                    inputs = tuple(as_received(v) for v in outputs)
    best = _pooled(best, [(u.class_name, sizes[i]) for i, u in enumerate(units)])
    out = []
    for stage, unit in enumerate(units):
        names = split.stage_parameter_names(stage)
        parameters = sum(by_name[name].numel() for name in names)
        parameter_bytes = sum(by_name[name].numel() * by_name[name].element_size() for name in names)
        sent = 0.0 if stage == len(units) - 1 else _spec_bytes(split.stage_output_specs(stage))
        out.append(UnitCost(unit.name, *best[stage][:3], sizes[stage][0], sizes[stage][1], float(parameter_bytes),
                            float(parameters), sent, unit.is_block, backward=best[stage][3]))
    logger.info("measured unit costs (s): %s", {u.name: round(u.full, 6) for u in out})
    return CostTable(tuple(out), _batch_size(example_args, example_kwargs), source=f"measured on {device.type}")


def _pooled(best: list[list[float]], kinds: list[tuple]) -> list[list[float]]:
    """Each unit's times, pooled over the units of its kind (same class, same saved bytes: the repeated
    blocks): the median of their best times, or the lower of two. They do the same work, and on a loaded
    host a burst that outlasts every round of one unit is still rare across many."""
    groups: dict[tuple, list[int]] = {}
    for index, kind in enumerate(kinds):
        groups.setdefault(kind, []).append(index)
    pooled = [list(times) for times in best]
    for members in groups.values():
        if len(members) < 2:
            continue
        for part in range(len(best[members[0]])):
            values = sorted(best[i][part] for i in members)
            value = values[0] if len(values) == 2 else values[len(values) // 2]
            for i in members:
                pooled[i][part] = value
    return pooled


def save_module_state(module: torch.nn.Module) -> tuple[list[Any], list[torch.Tensor]]:
    """A module's gradients and a copy of its buffers, for :func:`restore_module_state` after a timed run.

    Example:
        >>> bn = torch.nn.BatchNorm1d(2); saved = save_module_state(bn); _ = bn(torch.randn(4, 2))
        >>> restore_module_state(bn, saved); bn.running_mean.tolist()
        [0.0, 0.0]
    """
    grads = [parameter.grad for parameter in module.parameters()]
    buffers = [buffer.detach().clone() for buffer in module.buffers()]
    return grads, buffers


def restore_module_state(module: torch.nn.Module, saved: tuple[list[Any], list[torch.Tensor]]) -> None:
    """Put back what :func:`save_module_state` saved: timing leaves no trace on the model."""
    grads, buffers = saved
    for parameter, grad in zip(module.parameters(), grads):
        parameter.grad = grad
    with torch.no_grad():
        for buffer, value in zip(module.buffers(), buffers):
            buffer.copy_(value)


def synchronize(device: torch.device | None) -> None:
    """Wait for a GPU's queued work, so that a host clock times it (nothing on the CPU, or for None).

    Example:
        >>> synchronize(torch.device("cpu"))  # returns at once
    """
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(call: Any, device: torch.device | None) -> tuple[float, Any]:
    """``(seconds, result)`` of ``call()``, its span closed by :func:`synchronize` on ``device`` at both ends.

    Example:
        >>> seconds, result = timed(lambda: 6 * 7, torch.device("cpu"))
        >>> result, seconds >= 0
        (42, True)
    """
    synchronize(device)
    start = time.perf_counter()
    result = call()
    synchronize(device)
    return time.perf_counter() - start, result


IN_FLIGHT = 4  # microbatches a unit's passes are timed with, as a pipeline keeps several alive


def _run_unit(module, stage, args, kwargs, inputs, device, *, count: bool, analyses=None,
              in_flight: int = IN_FLIGHT):
    """Forward, I, W, B of one unit: ((F, I, W, B) seconds, outputs, (saved bytes, bytes W needs)).

    I and W are the runtime's own split (``conveyor.runtime.stage.backward``: I keeps the gradients at the
    weights' frontier, W re-enters there), which costs more than one full backward; B is that full
    backward, on fresh forwards (untimed), for where the runtime does not split.

    Each pass runs on ``in_flight`` microbatches whose graphs are alive together (their forwards,
    then their backwards), and its time is the median of those: a pipeline keeps several
    microbatches' activations, so its passes write to memory just allocated rather than to what
    the previous pass freed, which on a CPU costs 10-25% more on activations of a few hundred KiB.
    """
    received = tuple(as_received(value) for value in inputs)

    def forward():
        return module(*args, **kwargs) if stage == 0 else module(*received)

    counted = (0.0, 0.0)
    if count:
        counter = SavedTensorBytes(module)
        with counter, counter.mode:
            first = timed(forward, device)
        counted = counter.result()
    else:
        first = timed(forward, device)
    runs = [first] + [timed(forward, device) for _ in range(in_flight - 1)]
    outputs = runs[0][1]
    forward_s = statistics.median(t for t, _ in runs)
    if not grad_leaves(outputs):
        return (forward_s, 0.0, 0.0, 0.0), outputs, counted
    wanted_inputs = [v for v in received if isinstance(v, torch.Tensor) and v.requires_grad]
    weights = [p for p in module.parameters() if p.requires_grad]
    grads = [torch.ones_like(t) for t in grad_leaves(outputs)]
    split = [split_backward_seconds(grad_leaves(out), grads, wanted_inputs, weights, analyses, device)
             for _, out in runs]
    input_s, weight_s = statistics.median(i for i, _ in split), statistics.median(w for _, w in split)
    if not wanted_inputs:  # no input gradient to give: all of it is weight work
        input_s, weight_s = 0.0, input_s + weight_s
    again = [grad_leaves(forward()) for _ in range(in_flight)]
    backward_s = statistics.median(
        timed(lambda out=out: torch.autograd.backward(out, grads), device)[0] for out in again)
    return (forward_s, input_s, weight_s, backward_s), outputs, counted


class SavedTensorBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes of the tensors autograd saves while it is entered (its ``bytes``): the module's
    parameters excluded, each storage once. Entered with its ``mode`` too, :meth:`result` also gives the
    part of them that feeds an operation together with a parameter (what the weight gradient needs).

    Example:
        >>> lin = torch.nn.Linear(4, 4)
        >>> counter = SavedTensorBytes(lin)
        >>> with counter:
        ...     _ = lin(torch.randn(2, 4, requires_grad=True))
        >>> counter.bytes  # the input; the weight (its transpose is a view of it) is a parameter
        32
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.parameters = {id(p) for p in module.parameters()}
        self.saved: dict[int, torch.Tensor] = {}  # holding them keeps their ids unique
        self.mode = _WeightInputs(set(self.parameters))
        self.views: dict[int, set[int]] = {}
        self._alive: list[torch.Tensor] = []
        super().__init__(self.pack, lambda packed: packed)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """The pack hook: counts ``tensor`` and saves it as it is."""
        # Views (a transposed weight, a reshaped activation) count as the tensor they view.
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in self.parameters:
            self.saved.setdefault(id(base), base)
            # Autograd saves an operation's inputs before the operation runs (and the mode sees it):
            # which of them W needs is decided in result().
            self.views.setdefault(id(base), set()).add(id(tensor))
            self._alive.append(tensor)
        return tensor

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.saved.values())

    def result(self) -> tuple[float, float]:
        """``(bytes, the part of them the weight gradient needs)``."""
        needed = self.mode.needed
        kept = sum(t.numel() * t.element_size() for key, t in self.saved.items()
                   if key in needed or not needed.isdisjoint(self.views[key]))
        return float(self.bytes), float(kept)


class _WeightInputs(TorchDispatchMode):
    """Which tensors enter an operation together with a parameter (or a view or cast of one)."""

    def __init__(self, parameter_ids: set[int]) -> None:
        super().__init__()
        self.from_parameters = parameter_ids
        self.needed: set[int] = set()
        self._alive: list[torch.Tensor] = []  # keeps ids unique while the forward runs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        marked = [id(t) in self.from_parameters for t in tensors]
        if tensors and all(marked):
            for value in pytree.tree_leaves(out):
                if isinstance(value, torch.Tensor):
                    self.from_parameters.add(id(value))
                    self._alive.append(value)
        elif any(marked):
            for tensor, is_parameter in zip(tensors, marked):
                if not is_parameter:
                    self.needed.add(id(tensor))
                    self._alive.append(tensor)
        return out


def _spec_bytes(specs) -> float:
    return float(sum(math.prod(spec.shape) * spec.dtype.itemsize for spec in specs
                     if spec.shape is not None and spec.dtype is not None))


def split_backward_seconds(roots: Sequence[Any], root_grads: Sequence[Any], inputs: Sequence[Any],
                           params: Sequence[Any], analyses: Any = None,
                           device: torch.device | None = None) -> tuple[float, float]:
    """Seconds of conveyor's input-gradient pass (I) then weight-gradient pass (W) on one graph.

    What the runtime runs where a schedule splits a backward (``conveyor.runtime.stage.backward``):
    I walks the graph and keeps the gradients at the weights' frontier, W re-enters there once
    per group of weights, so I + W costs more than one full backward (a small GPT stage: 5.7 +
    5.4 ms against 9.3 ms). Profile I and W this way for a split schedule; pass the same
    ``analyses`` (a ``GraphAnalysisCache``) for every microbatch of a stage, as the runtime does.
    ``device``: a GPU whose queued work each clock waits for (:func:`synchronize`; None: none).

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(4, 4)
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> i, w = split_backward_seconds([lin(x)], [torch.ones(2, 4)], [x], list(lin.parameters()))
        >>> i > 0 and w > 0 and lin.weight.grad is not None
        True
    """
    input_s, pending = timed(lambda: backward_input(roots, root_grads, inputs, params, analyses), device)
    return input_s, timed(pending.backward_weight, device)[0]


def optimizer_seconds_per_parameter(model: torch.nn.Module, repeats: int = 5) -> float:
    """Seconds an AdamW step takes per parameter of ``model``, timed on copies (the model is untouched).

    Example:
        >>> optimizer_seconds_per_parameter(torch.nn.Linear(64, 64), repeats=1) > 0
        True
    """
    copies = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in copies)
    if not count:
        return 0.0
    optimizer = torch.optim.AdamW(copies, lr=1e-4)
    times = []
    for index in range(repeats + 2):  # the first steps allocate AdamW's state
        for p in copies:
            p.grad = torch.zeros_like(p)
        seconds, _ = timed(optimizer.step, copies[0].device)
        if index >= 2:
            times.append(seconds)
    return sorted(times)[len(times) // 2] / count


def _batch_size(example_args: Sequence[Any], example_kwargs: Mapping[str, Any] | None) -> int:
    for leaf in pytree.tree_leaves((tuple(example_args), dict(example_kwargs or {}))):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
    return 1


def resize_batch(example: Any, size: int) -> Any:
    """``example`` (a pytree of tensors, batch first) with ``size`` samples: its rows repeated or cut.

    Example:
        >>> resize_batch((torch.arange(4).view(2, 2),), 3)[0].tolist()
        [[0, 1], [2, 3], [0, 1]]
    """
    leaves = [leaf for leaf in pytree.tree_leaves(example) if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1]
    if not leaves:
        return example
    batch = leaves[0].shape[0]

    def resize(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0 or tensor.shape[0] != batch:
            return tensor
        index = torch.arange(size, device=tensor.device) % batch
        return tensor.index_select(0, index)

    return pytree.tree_map_only(torch.Tensor, resize, example)

