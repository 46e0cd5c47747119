"""``split_model``: trace a model once, decide the cuts, and describe every stage.

The split is cheap to hold: it keeps the traced graph and, per stage, which slice
of it to run and which tensors it needs. Stage modules are built on demand, one
stage at a time (``ModelSplit.stage_module``), so each rank allocates only its own.
"""

from __future__ import annotations

import bisect
import functools
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from conveyor.errors import SplitError
from conveyor.frontend.balance import partition
from conveyor.frontend.materialize import copy_tensor, materialize, named_tensors
from conveyor.frontend.split_steps import SPLIT_METHODS as SPLIT_METHODS  # re-exported: public here
from conveyor.frontend.split_steps import (
    _cut_allowed,
    _dry_run,
    _unit_weights,
)
from conveyor.frontend.stage import (
    StageModule,
    StageRecipe,
    StageTensor,
    ValueSpec,
    build_graph,
    build_recipes,
)
from conveyor.frontend.trace import TracedModel, model_device, trace_model
from conveyor.frontend.units import (
    ModuleSpans,
    Unit,
    check_module_names,
    find_units,
    resolve_split_points,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TiedParameter:
    """A parameter that several stages hold a copy of.

    ``names``: every name the model's ``state_dict`` has for it (GPT-2:
    ``transformer.wte.weight`` and ``lm_head.weight``). ``uses``: ``(stage, name)``
    pairs, the name under which each stage holds its copy. The pipeline keeps the
    copies equal by summing their gradients before the optimizer step.
    """

    names: tuple[str, ...]
    uses: tuple[tuple[int, str], ...]

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(sorted({stage for stage, _ in self.uses}))


class ModelSplit:
    """The result of ``split_model``: how a model is cut, and how to build each stage.

    Attributes:
        num_stages: number of stages.
        split_points: for each stage after the first, the module it starts with.
        stage_weights: per stage, the sum of the balancing weights (blocks,
            parameters, seconds, or matching modules; ``None`` for named split points).
        tied_groups: parameters held by several stages (see ``TiedParameter``).
        device: default device of ``stage_module``.
        seed: seed of the per-module initialisation of meta-device models.
    """

    def __init__(
        self,
        traced: TracedModel,
        recipes: list[StageRecipe],
        stage_tensors: list[list[StageTensor]],
        tied_groups: tuple[TiedParameter, ...],
        shared_ids: set[int],
        split_points: tuple[str, ...],
        stage_weights: tuple[float, ...] | None,
        device: torch.device,
        seed: int,
    ):
        self._traced = traced
        self._recipes = recipes
        self._stage_tensors = stage_tensors
        self.tied_groups = tied_groups
        self.split_points = split_points
        self.stage_weights = stage_weights
        self.device = device
        self.seed = seed
        self._other_mode_split: ModelSplit | None = None  # with_mode(not training), traced on demand
        self._tensor_by_name = dict(named_tensors(traced.model))
        self._shared_ids = shared_ids  # of tensors several stages hold: each stage gets its own copy
        _warn_of_shared_buffers_updated_in_place(traced, stage_tensors)

    @property
    def num_stages(self) -> int:
        return len(self._recipes)

    @property
    def model(self) -> nn.Module:
        return self._traced.model

    def stage_parameter_names(self, stage: int) -> tuple[str, ...]:
        """Names (model ``state_dict`` keys) of the parameters ``stage`` holds."""
        return tuple(t.name for t in self._stage_tensors[stage] if t.kind == "parameter")

    def stage_buffer_names(self, stage: int) -> tuple[str, ...]:
        """Names of the buffers ``stage`` holds (non-persistent ones included)."""
        return tuple(t.name for t in self._stage_tensors[stage] if t.kind == "buffer")

    def stage_input_specs(self, stage: int) -> tuple[ValueSpec, ...]:
        """What ``stage`` receives: the flattened model inputs (stage 0) or the previous outputs."""
        return self._recipes[stage].input_specs

    def stage_output_specs(self, stage: int) -> tuple[ValueSpec, ...]:
        """What ``stage`` returns (flattened for the last stage)."""
        return self._recipes[stage].output_specs

    def stage_module(
        self, stage: int, device: torch.device | str | None = None, *, both_modes: bool = False,
        keep_meta: bool = False,
    ) -> StageModule:
        """Build the module of ``stage`` only, on ``device`` (default: ``self.device``).

        Tensors follow ``conveyor.frontend.materialize``: the model's own tensors where
        possible, copies for tied ones, fresh initialised ones for a meta model.
        ``both_modes=True`` also traces the model in the other mode (once per split) so
        that the stage follows ``train()`` / ``eval()`` like the model would, dropout and
        BatchNorm included, on the same parameters and buffers. ``keep_meta=True`` leaves a meta
        model's tensors on the meta device (the graph still runs on ``device``), for the caller to
        materialize (tensor parallelism: each rank its own shards).

        Example:
            >>> import conveyor.frontend as frontend
            >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
            >>> split = frontend.split_model(model, 2, example_args=(torch.randn(3, 4),))
            >>> split.stage_module(1)(*split.stage_module(0)(torch.randn(3, 4))).shape
            torch.Size([3, 2])
        """
        if not 0 <= stage < self.num_stages:
            raise SplitError(f"stage must be in [0, {self.num_stages}); got {stage}")
        device = torch.device(device) if device is not None else self.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        module = self._build_stage(stage, self._resolve_tensors(stage, device, keep_meta), device)
        if both_modes:
            if self._other_mode_split is None:
                self._other_mode_split = self.with_mode(not self.training)
            other = self._other_mode_split
            if other.split_points != self.split_points:
                raise SplitError(
                    f"the model traced in the other mode cuts at {other.split_points}, not at "
                    f"{self.split_points}; build each mode's stages with split.with_mode()"
                )
            module.add_mode(other.training, other._recipes[stage],
                            *build_graph(other._recipes[stage], other._traced, device))
        # Where the model was cut: generation cuts the model's decode program there (conveyor.pipe.generation).
        module._conveyor_split_points = tuple(self.split_points)
        return module

    def _build_stage(self, stage: int, tensors: dict[str, tuple[torch.Tensor, bool]], device: torch.device,
                     check_inputs: bool = True) -> StageModule:
        """The module of ``stage`` holding ``tensors``, its graph running on ``device``."""
        recipe, traced = self._recipes[stage], self._traced
        graph, submodules = build_graph(recipe, traced, device)
        return StageModule(recipe, graph, tensors, submodules, traced.in_spec, traced.out_spec,
                           check_inputs=check_inputs, traced_training=traced.training)

    def stage_modules(
        self, device: torch.device | str | None = None, *, both_modes: bool = False
    ) -> list[StageModule]:
        """Every stage's module, for running them all in one process (tests, debugging)."""
        return [self.stage_module(stage, device, both_modes=both_modes) for stage in range(self.num_stages)]

    def _source(self, tensor_spec: StageTensor) -> torch.Tensor:
        """The tensor a stage holds (a copy of) under ``tensor_spec``: the model's own, or a constant of the trace."""
        if tensor_spec.kind == "constant":
            return self._traced.exported.constants[tensor_spec.source]
        return self._tensor_by_name[tensor_spec.source]

    def _resolve_tensors(
        self, stage: int, device: torch.device, keep_meta: bool = False
    ) -> dict[str, tuple[torch.Tensor, bool]]:
        resolved: dict[str, tuple[torch.Tensor, bool]] = {}
        copy = functools.cache(functools.partial(copy_tensor, device=device))  # once per tensor (hashed by identity)
        on_meta: list[StageTensor] = []
        for tensor_spec in self._stage_tensors[stage]:
            tensor = self._source(tensor_spec)
            if tensor_spec.kind == "constant":
                if tensor.device.type == "meta":
                    raise SplitError(
                        f"constant tensor {tensor_spec.source!r} was created on the meta device, so "
                        "its value is unknown; register it as a buffer set in reset_parameters(), "
                        "or build the model on a real device."
                    )
                resolved[tensor_spec.name] = (tensor.detach().to(device, copy=True), False)
                continue
            if tensor.device.type == "meta":
                if keep_meta:
                    resolved[tensor_spec.name] = (tensor, tensor_spec.persistent)
                else:
                    on_meta.append(tensor_spec)
                continue
            if id(tensor) in self._shared_ids or tensor.device != device:
                tensor = copy(tensor)
            resolved[tensor_spec.name] = (tensor, tensor_spec.persistent)
        if on_meta:
            made = materialize(self.model, [spec.source for spec in on_meta], device, self.seed)
            for tensor_spec in on_meta:
                resolved[tensor_spec.name] = (made[tensor_spec.source], tensor_spec.persistent)
        return resolved

    @property
    def training(self) -> bool:
        """The model's mode when it was traced (the stages run in that mode only)."""
        return self._traced.training

    def with_mode(self, training: bool) -> ModelSplit:
        """The same cut traced with the model in train (``True``) or eval mode.

        Dropout, BatchNorm and ``if self.training`` are fixed when tracing, so eval
        needs its own trace. Stages keep the same split points and tensor names; the
        model's mode is restored afterwards.

        Example:
            >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 4))
            >>> split = split_model(model, 2, example_args=(torch.randn(2, 4),))
            >>> evaluation = split.with_mode(training=False)
            >>> (evaluation.training, evaluation.split_points == split.split_points)
            (False, True)
        """
        if training == self.training:
            return self
        model = self.model
        was_training = model.training
        args, kwargs = self._traced.example_inputs(self._traced.trace_device)
        try:
            model.train(training)
            split = split_model(
                model,
                self.num_stages,
                example_args=args,
                example_kwargs=kwargs,
                split_points=self.split_points,
                device=self.device,
                dynamic_shapes=self._traced.dynamic_shapes,
            )
        finally:
            model.train(was_training)
        split.seed = self.seed
        split.stage_weights = self.stage_weights
        return split

    def describe(self) -> str:
        """A short table: per stage, where it starts, its parameters, what it sends on."""
        lines = []
        for stage in range(self.num_stages):
            start = "<model inputs>" if stage == 0 else self.split_points[stage - 1]
            numel = sum(
                self._tensor_by_name[name].numel() for name in self.stage_parameter_names(stage)
            )
            sends = ", ".join(spec.describe() for spec in self.stage_output_specs(stage))
            weight = (
                "" if self.stage_weights is None else f" weight {self.stage_weights[stage]:.4g}"
            )
            lines.append(
                f"stage {stage}: from {start}; {numel:,} parameters{weight}; returns {sends}"
            )
        for group in self.tied_groups:
            lines.append(f"tied: {' = '.join(group.names)} on stages {list(group.stages)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"ModelSplit(num_stages={self.num_stages}, split_points={list(self.split_points)})"


def _warn_of_shared_buffers_updated_in_place(traced, stage_tensors: list[list[StageTensor]]) -> None:
    """A buffer that forward updates in place (BatchNorm's running statistics) and that several
    stages use: each stage updates its own copy, and nothing brings the copies together."""
    updated = set()
    for node in traced.nodes:
        schema = getattr(node.target, "_schema", None)
        # batch_norm's schema does not mark the running statistics it updates as written.
        in_place = schema is not None and (
            schema.is_mutable
            or (schema.name.endswith("batch_norm") and len(node.args) > 5 and node.args[5] is True)
        )
        if node.op == "call_function" and in_place:
            for source in node.all_input_nodes:
                state = traced.state_inputs.get(source.name) if source.op == "placeholder" else None
                if state is not None and state.kind == "buffer":
                    updated.add(state.target)
    holders: dict[str, list[int]] = {}
    for stage, tensors in enumerate(stage_tensors):
        for tensor_spec in tensors:
            if tensor_spec.source in updated:
                holders.setdefault(tensor_spec.source, []).append(stage)
    shared = {name: stages for name, stages in holders.items() if len(stages) > 1}
    if shared:
        logger.warning(
            "buffer(s) updated in place by forward are used on several stages, each of which updates "
            "its own copy (the copies drift apart, and state_dict() keeps one of them): %s. Give the "
            "module that updates them to one stage (split elsewhere), or use one module per use",
            ", ".join(f"{name} (stages {', '.join(map(str, stages))})" for name, stages in sorted(shared.items())),
        )


def split_model(
    model: nn.Module,
    num_stages: int,
    *,
    example_args: Sequence[Any] = (),
    example_kwargs: Mapping[str, Any] | None = None,
    split_points: Sequence[str] | None = None,
    split_method: str = "parameters",
    unsplittable: Iterable[str] | None = None,
    device: torch.device | str | None = None,
    dynamic_shapes: Mapping[str, Any] | None = None,
) -> ModelSplit:
    """Trace ``model`` (unchanged) on one example microbatch and cut it into stages.

    Args:
        model: any ``nn.Module``, on a real device or on the meta device.
        num_stages: number of stages.
        example_args, example_kwargs: ONE microbatch, as the model's forward takes it.
        split_points: ``num_stages - 1`` module paths to start stages 1.. with
            (``"model.layers.4"``); if given, ``split_method`` is not used.
        split_method: ``"uniform"`` (equal number of repeated blocks per stage),
            ``"parameters"`` (balance parameter counts), or ``"type:<regex>"`` (balance
            the number of modules whose class name matches). Balancing measured time
            runs the model: :func:`conveyor.plan.time_split.time_split` chooses the
            split points (``conveyor.pipeline`` does, with ``SplitOptions(method="time")``).
        unsplittable: module paths never cut inside.
        device: where stages are built by default (default: the model's device, or cpu
            for a meta-device model).
        dynamic_shapes: ``{input name: {dim: name}}``, dims that may differ between
            microbatches (``{"input_ids": {1: "seq"}, "labels": {1: "seq"}}``: any sequence
            length); see :mod:`conveyor.frontend.dynamic`.

    Example:
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> split = split_model(model, 2, example_args=(torch.randn(2, 8),))
        >>> split.split_points
        ('2',)
        >>> split.stage_parameter_names(1)
        ('2.weight', '2.bias', '3.weight', '3.bias')
    """
    if not isinstance(num_stages, int) or num_stages < 1:
        raise SplitError(f"num_stages must be a positive int; got {num_stages!r}")
    # Names are checked before tracing: a typo should not wait for (or hide behind) a trace.
    unsplittable = check_module_names(model, unsplittable or (), "unsplittable module")
    if split_points is not None:
        check_module_names(model, split_points, "split point")
    seed = torch.initial_seed()
    traced = trace_model(model, example_args, example_kwargs, dynamic_shapes)
    default_device = torch.device(device) if device is not None else model_device(model)
    if default_device.type == "meta":
        default_device = torch.device("cpu")
    spans = ModuleSpans(traced)
    positions, names, stage_weights = _cuts(traced, spans, num_stages, split_points, split_method, unsplittable)
    # A node's stage: how many stages start at or before it (positions rise).
    stage_of_node = [bisect.bisect_right(positions, index) for index in range(len(traced.nodes))]
    recipes = build_recipes(traced, stage_of_node, num_stages)
    stage_tensors, tied_groups, shared_ids = _assign_tensors(traced, spans, recipes)
    split = ModelSplit(traced, recipes, stage_tensors, tied_groups, shared_ids, names, stage_weights,
                       default_device, seed)
    _dry_run(split)
    return split


def _cuts(
    traced: TracedModel,
    spans: ModuleSpans,
    num_stages: int,
    split_points: Sequence[str] | None,
    split_method: str,
    unsplittable: list[str],
) -> tuple[list[int], tuple[str, ...], tuple[float, ...] | None]:
    """Where stages 1.. start (operation indices), the modules they start with, and each stage's weight: at the
    modules ``split_points`` name (no weights), else balancing ``split_method``'s weights of the model's units."""
    model = traced.model
    if split_points is not None:
        names = list(split_points)
        if len(names) != num_stages - 1:
            raise SplitError(
                f"{num_stages} stages need {num_stages - 1} split points (the modules that start "
                f"stages 1..{num_stages - 1}); got {len(names)}: {names}"
            )
        return resolve_split_points(spans, names, unsplittable), tuple(names), None
    units = find_units(model, spans, unsplittable)
    if not units:
        units = [Unit("", type(model).__name__, 0, False)]
    starts = [0] + [unit.start for unit in units[1:]]
    weights = _unit_weights(split_method, traced, units, starts, spans, model)
    cut_allowed = _cut_allowed(
        model, units, starts, weights, spans, unsplittable, num_stages, split_method
    )
    cuts = partition(weights, num_stages, cut_allowed)
    bounds = [0, *cuts, len(units)]
    stage_weights = tuple(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
    return [starts[j] for j in cuts], tuple(units[j].name for j in cuts), stage_weights


def _assign_tensors(
    traced: TracedModel, spans: ModuleSpans, recipes: list[StageRecipe]
) -> tuple[list[list[StageTensor]], tuple[TiedParameter, ...], set[int]]:
    """Each stage's tensors (those its operations read, plus unused ones placed nearby), the parameters several
    stages hold, and the ids of every tensor several stages hold (tied parameters among them)."""
    model = traced.model
    all_names = list(named_tensors(model))
    by_name = dict(all_names)
    order = {name: index for index, (name, _) in enumerate(all_names)}
    uses: dict[int, set[tuple[int, str]]] = {}  # id(tensor) -> (stage, name) of each stage holding it
    stage_tensors: list[list[StageTensor]] = []
    for recipe in recipes:
        tensors = [*recipe.tensors.values(), *recipe.extra_tensors]  # sorted below, with the unused ones
        stage_tensors.append(tensors)
        for tensor_spec in tensors:
            if tensor_spec.kind == "constant":
                continue
            uses.setdefault(id(by_name[tensor_spec.source]), set()).add((recipe.stage, tensor_spec.name))

    # Tensors no operation reads (unused modules, BatchNorm's counter in eval mode)
    # still belong to some stage: the one where their module (or its nearest
    # ancestor that ran) starts, else the stage of the tensor before them.
    index_of = {node: index for index, node in enumerate(traced.nodes)}
    firsts = [min((index_of[n] for n in recipe.nodes), default=None) for recipe in recipes]  # where each starts
    non_persistent = {
        f"{module_name}.{buffer}" if module_name else buffer
        for module_name, module in model.named_modules(remove_duplicate=False)
        for buffer in module._non_persistent_buffers_set
    }
    previous_stage = 0
    for name, tensor in all_names:
        if id(tensor) in uses:
            previous_stage = min(uses[id(tensor)])[0]
            continue
        stage = previous_stage
        owner = name.rpartition(".")[0]
        while owner:
            if spans.ran(owner):
                stage = max((candidate for candidate, first in enumerate(firsts)
                             if first is not None and first <= spans.first[owner]), default=0)
                break
            owner = owner.rpartition(".")[0]
        kind = "parameter" if isinstance(tensor, nn.Parameter) else "buffer"
        stage_tensors[stage].append(StageTensor(name, kind, name, name not in non_persistent))
        uses[id(tensor)] = {(stage, name)}
        previous_stage = stage
    for tensors in stage_tensors:
        tensors.sort(key=lambda t: (order.get(t.source, len(order)), t.name))

    missing = [name for name, tensor in all_names if id(tensor) not in uses]
    if missing:  # cannot happen by construction; a dropped layer must never go unnoticed
        raise SplitError(f"internal error: tensors on no stage: {missing}")

    groups = (TiedParameter(traced.aliases.get(name, (name,)), tuple(sorted(uses[id(tensor)])))
              for name, tensor in model.named_parameters())
    tied = tuple(group for group in groups if len(group.stages) > 1)
    # A stage counts a tensor once, under whichever of its names it holds it.
    shared = {tensor_id for tensor_id, held in uses.items() if len({stage for stage, _ in held}) > 1}
    return stage_tensors, tied, shared

