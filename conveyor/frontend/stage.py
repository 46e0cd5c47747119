"""Stage graphs cut from the traced model, and the module that runs one of them.

A stage is a slice of the traced operations (in execution order) plus:

* its inputs: the model's own flattened inputs (stage 0), or exactly the previous
  stage's outputs (stage i > 0);
* its outputs: every value made on this stage or earlier that a later stage, or the
  model's result, still needs (skip connections and late inputs such as labels pass
  through the stages in between), or, on the last stage, the model's own output;
* the parameters, buffers and constants its operations read, registered on the
  ``StageModule`` under their original names, so ``state_dict()`` keys are the
  model's own keys.
"""

from __future__ import annotations

import copy
import linecache
import operator
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from conveyor.errors import PipelineConfigError, SpecMismatchError
from conveyor.frontend.attention import _submodule
from conveyor.frontend.dynamic import describe_shape, fits
from conveyor.frontend.leaves import held_in_order, hollow_copy, restore_leaves
from conveyor.frontend.materialize import named_tensors
from conveyor.frontend.trace import StateInput, TracedModel, ValueSpec

# Attribute names on a StageModule that can never clash with a model's module names.
_SUBGRAPH_PREFIX = "_conveyor_subgraph_"
_CONSTANT_PREFIX = "_conveyor_constants"


def as_received(value: Any) -> Any:
    """A value as the next stage receives it: a leaf that requires grad iff the sent one did."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    return value


@dataclass(frozen=True, slots=True)
class StageTensor:
    """A tensor a stage holds: ``name`` on the stage module, ``source`` in the model."""

    name: str
    kind: str  # "parameter", "buffer" or "constant"
    source: str
    persistent: bool


@dataclass(eq=False)
class StageRecipe:
    """What one stage runs, as references into the traced graph (built once per split).

    ``inputs`` are traced nodes in placeholder order; ``outputs`` are traced nodes
    (or literal values, on the last stage) in output order.
    """

    stage: int
    num_stages: int
    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[Any]
    tensors: dict[str, StageTensor]  # placeholder name in the traced graph -> tensor
    subgraphs: dict[str, str]  # get_attr node name in the traced graph -> attribute name
    # Other names of tensors in ``tensors`` (a tied tensor read under two names).
    extra_tensors: list[StageTensor] = field(default_factory=list)
    input_specs: tuple[ValueSpec, ...] = ()
    output_specs: tuple[ValueSpec, ...] = ()

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


def _name_for_use(traced: TracedModel, placeholder: str, module_paths: tuple[str, ...]) -> str:
    """The name of a (possibly tied) tensor that belongs to the module reading it.

    torch.export gives a tied tensor one placeholder; GPT-2's embedding lookup in
    ``transformer.wte`` should still hold it as ``transformer.wte.weight`` and the
    head as ``lm_head.weight``.
    """
    state = traced.state_inputs[placeholder]
    if state.kind == "constant":
        return _constant_name(traced, state.target)
    names = traced.aliases.get(state.target, (state.target,))
    for path in reversed(module_paths):
        for name in names:
            if name.rpartition(".")[0] == path:
                return name
    return state.target


def _constant_name(traced: TracedModel, target: str) -> str:
    # A plain tensor attribute of a module keeps its path; a constant created inside
    # forward (torch.export names it "lifted_tensor_0") goes under a reserved name.
    owner, _, attribute = target.rpartition(".")
    exists = hasattr(_submodule(traced.model, owner), attribute)  # (None has no such attribute)
    return target if exists else f"{_CONSTANT_PREFIX}.{target.replace('.', '_')}"


def _tensor_for(traced: TracedModel, placeholder: str, name: str) -> StageTensor:
    state: StateInput = traced.state_inputs[placeholder]
    if state.kind != "constant":
        return StageTensor(name, state.kind, name, state.persistent)
    return StageTensor(name, "constant", state.target, False)


def build_recipes(
    traced: TracedModel, stage_of_node: Sequence[int], num_stages: int
) -> list[StageRecipe]:
    """Cut the traced graph: ``stage_of_node[i]`` is the stage of ``traced.nodes[i]``.

    Stages must be non-decreasing along the nodes. ``getitem`` nodes are moved to the
    stage of the node they read, so a tuple-valued result never crosses a boundary.
    """
    index_of = {node: index for index, node in enumerate(traced.nodes)}
    stage_of: dict[fx.Node, int] = {}
    for node, stage in zip(traced.nodes, stage_of_node):
        if node.target is operator.getitem and node.args[0] in index_of:
            stage = stage_of[node.args[0]]
        stage_of[node] = stage
    for node in traced.user_inputs:
        stage_of[node] = 0

    # last_use[v]: the last stage that reads value v (the last stage for model outputs).
    last_use: dict[fx.Node, int] = {node: 0 for node in traced.user_inputs}
    for node in traced.nodes:
        for source in node.all_input_nodes:
            if source in stage_of:
                last_use[source] = max(last_use.get(source, 0), stage_of[node])
    for value in pytree.tree_leaves(traced.outputs):
        if isinstance(value, fx.Node):
            last_use[value] = num_stages - 1

    ordered_values = [*traced.user_inputs, *traced.nodes]
    recipes = []
    previous_outputs: list[fx.Node] = list(traced.user_inputs)
    for stage in range(num_stages):
        nodes = [node for node in traced.nodes if stage_of[node] == stage]
        tensors: dict[str, StageTensor] = {}
        subgraphs: dict[str, str] = {}
        extra_names: dict[str, StageTensor] = {}
        for node in nodes:
            for source in node.all_input_nodes:
                if source.op == "placeholder" and source.name in traced.state_inputs:
                    name = _name_for_use(traced, source.name, traced.module_paths[index_of[node]])
                    primary = tensors.setdefault(
                        source.name, _tensor_for(traced, source.name, name)
                    )
                    if name != primary.name:
                        extra_names.setdefault(
                            name, StageTensor(name, primary.kind, name, primary.persistent)
                        )
                elif source.op == "get_attr":
                    subgraphs.setdefault(source.name, f"{_SUBGRAPH_PREFIX}{source.target}")
        if stage == num_stages - 1:
            outputs: list[Any] = list(traced.outputs)
            # A parameter or buffer the model returns as it is (a learned temperature) is read
            # by no node: the stage that returns it must hold it all the same.
            for value in pytree.tree_leaves(traced.outputs):
                if isinstance(value, fx.Node) and value.op == "placeholder" and value.name in traced.state_inputs:
                    use_name = _name_for_use(traced, value.name, ())
                    tensors.setdefault(value.name, _tensor_for(traced, value.name, use_name))
        else:
            outputs = [
                value
                for value in ordered_values
                if value in stage_of and stage_of[value] <= stage < last_use.get(value, -1)
            ]
        recipes.append(StageRecipe(stage, num_stages, nodes, previous_outputs, outputs, tensors, subgraphs,
                                   list(extra_names.values())))
        previous_outputs = outputs
    return recipes


def _rewrite_devices(graph: fx.Graph, device_map: dict[torch.device, torch.device]) -> None:
    if not device_map:
        return

    def moved(value: Any) -> Any:
        return device_map.get(value, value) if isinstance(value, torch.device) else value

    for node in graph.nodes:
        node.args = fx.node.map_aggregate(node.args, moved)
        node.kwargs = fx.node.map_aggregate(node.kwargs, moved)


def _aliasing(node: fx.Node, value: fx.Node) -> str | None:
    """How ``node`` aliases its argument ``value``: ``"write"`` (it updates it in place), ``"view"`` (it returns
    a view of it: slice, select, view, transpose...), or None."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    aliases = [argument.alias_info for argument, arg in zip(schema.arguments, node.args)
               if arg is value and argument.alias_info is not None]
    if any(alias.is_write for alias in aliases):
        return "write"
    return "view" if aliases and schema.returns and schema.returns[0].alias_info is not None else None


def _clone_inputs_mutated_in_place(graph: fx.Graph) -> None:
    # A received activation is a leaf that requires grad; autograd forbids in-place
    # updates of such leaves and of their views (e.g. ReLU(inplace=True) right after a
    # cut). A clone keeps the values and the gradients bitwise equal, for one copy.
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    for placeholder in placeholders:
        mutated = False
        aliases = [placeholder]
        while aliases and not mutated:
            value = aliases.pop()
            for user in value.users:
                how = _aliasing(user, value)
                if how == "write":
                    mutated = True
                elif how == "view":
                    aliases.append(user)
        if not mutated:
            continue
        with graph.inserting_after(placeholders[-1]):
            clone = graph.call_function(torch.ops.aten.clone.default, (placeholder,))
        placeholder.replace_all_uses_with(
            clone, delete_user_cb=lambda user, clone=clone: user is not clone
        )


def build_graph(
    recipe: StageRecipe, traced: TracedModel, device: torch.device
) -> tuple[fx.Graph, dict[str, nn.Module]]:
    """A fresh fx graph for ``recipe`` and the nested graph modules it loads, the trace device rewritten to
    ``device``."""
    device_map = {} if traced.trace_device == device else {traced.trace_device: device}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {node: graph.placeholder(node.name) for node in recipe.inputs}
    by_name = {node.name: node for node in traced.exported.graph_module.graph.nodes}
    for placeholder, tensor in recipe.tensors.items():
        env[by_name[placeholder]] = graph.get_attr(tensor.name)
    submodules: dict[str, nn.Module] = {}
    for node_name, attribute in recipe.subgraphs.items():
        env[by_name[node_name]] = graph.get_attr(attribute)
        subgraph = copy.deepcopy(traced.subgraphs[node_name])
        for module in subgraph.modules():
            if isinstance(module, fx.GraphModule):
                _rewrite_devices(module.graph, device_map)
                _drop_metadata_assertions(module.graph)
                module.recompile()
        submodules[attribute] = subgraph
    for node in recipe.nodes:
        env[node] = graph.node_copy(node, lambda source: env[source])
    result = tuple(fx.node.map_arg(value, lambda source: env[source]) for value in recipe.outputs)
    graph.output(result)
    for path in restore_leaves(graph):  # a module the trace kept whole, at its own path (dotted)
        submodules[path] = hollow_copy(traced.model.get_submodule(path))
    _rewrite_devices(graph, device_map)
    _drop_metadata_assertions(graph)
    if not recipe.is_first:
        _clone_inputs_mutated_in_place(graph)
    graph.lint()
    return graph, submodules


class _Container(nn.Module):
    """Holds a stage's tensors at their original path (``model.layers.0.mlp``...)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a container inside a StageModule only holds tensors; call the StageModule")


def _register(root: nn.Module, path: str, tensor: torch.Tensor | nn.Module, persistent: bool) -> None:
    *parents, leaf = path.split(".")
    owner = root
    for part in parents:
        child = owner._modules.get(part)
        if child is None:
            child = _Container()
            owner.add_module(part, child)
        owner = child
    if isinstance(tensor, nn.Module):  # a nested graph, or a leaf of the trace (conveyor.frontend.leaves)
        owner.add_module(leaf, tensor)
    elif isinstance(tensor, nn.Parameter):
        owner.register_parameter(leaf, tensor)
    else:
        owner.register_buffer(leaf, tensor, persistent=persistent)


def _drop_metadata_assertions(graph: fx.Graph) -> None:
    # torch.export guards each traced `.to(dtype)` with an assertion of the dtype it saw. Under
    # autocast the tensor before the cast may be bf16 where tracing saw fp32: the cast itself
    # is what the model asked for, the assertion only what tracing happened to see.
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            graph.erase_node(node)


def _compile(graph: fx.Graph, what: str) -> tuple[Callable[..., Any], str]:
    """``graph``'s generated ``forward(self, ...)`` and its source, under a file name saying ``what`` it runs."""
    python_code = graph.python_code(root_module="self")
    source = python_code.src
    filename = f"<conveyor {what} {uuid.uuid4().hex[:8]}>"
    # Registered so that tracebacks through a stage show its generated source lines.
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace = dict(python_code.globals)
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - code generated by torch.fx
    return namespace["forward"], source


class StageModule(nn.Module):
    """One pipeline stage: runs its slice of the traced model.

    Call convention: stage 0 takes the model's own arguments (one microbatch, same
    structure, shapes and non-tensor values as the example it was split with); stage
    ``i > 0`` takes the previous stage's output tuple unpacked. Intermediate stages
    return a tuple; the last stage returns what the model returns.

    Its parameters and buffers keep the model's names (``state_dict()`` keys are model
    keys). ``code`` shows the generated Python source.

    Example:
        >>> import conveyor.frontend as frontend
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> split = frontend.split_model(model, 2, example_args=(torch.randn(3, 4),))
        >>> stage = split.stage_module(1)
        >>> sorted(stage.state_dict())
        ['2.bias', '2.weight']
    """

    def __init__(
        self,
        recipe: StageRecipe,
        graph: fx.Graph,
        tensors: dict[str, tuple[torch.Tensor, bool]],
        submodules: dict[str, nn.Module],
        in_spec: pytree.TreeSpec,
        out_spec: pytree.TreeSpec,
        check_inputs: bool = True,
        traced_training: bool = True,
    ):
        super().__init__()
        for name, (value, persistent) in held_in_order(tensors, submodules):  # a leaf module holds its tensors
            _register(self, name, value, persistent)
        self._conveyor_stage = recipe.stage
        self._conveyor_num_stages = recipe.num_stages
        self._conveyor_input_specs = recipe.input_specs if check_inputs else None
        self._conveyor_in_spec = in_spec
        self._conveyor_out_spec = out_spec
        self._conveyor_traced_training = traced_training
        self.train(traced_training)
        run, code = _compile(graph, f"stage {recipe.stage}")
        # Per mode (training flag): the compiled forward, its source and what it receives.
        self._conveyor_runs = {traced_training: (run, code, self._conveyor_input_specs)}
        self._conveyor_graphs = {traced_training: graph}  # per mode: what wrap_blocks regroups

    @property
    def stage(self) -> int:
        return self._conveyor_stage

    @property
    def num_stages(self) -> int:
        return self._conveyor_num_stages

    def _run_for_display(self) -> tuple:
        """The current mode's compiled forward, source and input specs, else the traced mode's."""
        return self._conveyor_runs.get(self.training) or self._conveyor_runs[self._conveyor_traced_training]

    @property
    def code(self) -> str:
        """The generated Python source of this stage's forward (in the current mode, if it has one)."""
        return self._run_for_display()[1]

    @property
    def modes(self) -> tuple[bool, ...]:
        """The modes this stage can run in (``training`` flags): the traced one, and any added."""
        return tuple(sorted(self._conveyor_runs, reverse=True))

    def add_mode(self, training: bool, recipe: StageRecipe, graph: fx.Graph, submodules: dict[str, nn.Module]) -> None:
        """Let this stage also run in the other mode, with ``graph`` traced in that mode.

        The graph must use this stage's own tensors (the same cut of the same model
        gives the same names), so both modes train and read one set of parameters and
        buffers. :meth:`ModelSplit.stage_module` calls this when asked for both modes.
        """
        if training in self._conveyor_runs:
            raise PipelineConfigError(f"stage {self.stage} already runs in {'train' if training else 'eval'} mode")
        own = dict(named_tensors(self))
        missing = sorted(t.name for t in recipe.tensors.values() if t.name not in own)
        if missing:
            raise PipelineConfigError(
                f"stage {self.stage} traced in {'train' if training else 'eval'} mode uses tensors the "
                f"{'eval' if training else 'train'}-mode stage lacks: {', '.join(missing)}; build that mode's "
                "stages on their own with split.with_mode()"
            )
        suffix = "_train" if training else "_eval"
        submodules = {name: module for name, module in submodules.items() if "." not in name}  # leaves: this mode's
        for node in graph.nodes:  # the other mode's nested graphs (cond, no_grad regions) get their own names
            if node.op == "get_attr" and node.target in submodules:
                node.target = f"{node.target}{suffix}"
        for name, module in submodules.items():
            self.add_module(f"{name}{suffix}", module)
        graph.lint()
        run, code = _compile(graph, f"stage {self.stage}")
        input_specs = recipe.input_specs if self._conveyor_input_specs is not None else None
        self._conveyor_runs[training] = (run, code, input_specs)
        self._conveyor_graphs[training] = graph

    def block_names(self, pattern: str | None = None) -> list[str]:
        """The blocks this stage runs, in order (see :mod:`conveyor.frontend.regions`)."""
        from conveyor.frontend.regions import graph_blocks

        return graph_blocks(self._conveyor_graphs[self._conveyor_traced_training], pattern)

    def wrap_blocks(self, chosen: set[str], wrap: Callable, pattern: str | None = None) -> None:
        """Run each block in ``chosen`` as ``wrap(function, block)(*values)``, in every mode (the
        activation recomputation of :class:`~conveyor.options.RecomputePolicy`)."""
        from conveyor.frontend.regions import wrap_blocks

        for training, graph in self._conveyor_graphs.items():
            regrouped = wrap_blocks(graph, chosen, wrap, pattern)
            run, code = _compile(regrouped, f"stage {self.stage}")
            self._conveyor_runs[training] = (run, code, self._conveyor_runs[training][2])

    @property
    def input_specs(self) -> tuple[ValueSpec, ...]:
        return self._run_for_display()[2] or ()

    @property
    def graph(self) -> fx.Graph:
        """The graph this stage runs in its current mode (:meth:`run_in_steps` walks it)."""
        return self._conveyor_graphs[self.training]

    def run_in_steps(self, args: tuple, kwargs: dict[str, Any], intercepts: dict[str, Callable]) -> Any:
        """This stage's call as a generator pausing in intercepted modules (:mod:`conveyor.frontend.stepped`)."""
        from conveyor.frontend.stepped import run_in_steps

        return run_in_steps(self, args, kwargs, intercepts)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        runs = self._conveyor_runs.get(self.training)
        if runs is None:
            mode, traced = ("train", "eval") if self.training else ("eval", "train")
            raise PipelineConfigError(
                f"stage {self.stage} was traced with the model in {traced} mode and is now in {mode} "
                "mode; the traced operations fix dropout and BatchNorm behaviour to the traced mode. "
                "Trace both modes (conveyor.pipeline(..., "
                "options=PipelineOptions(split=SplitOptions(both_modes=True))), or "
                "split.stage_module(stage, both_modes=True)), build "
                f"{mode}-mode stages with split.with_mode(training={self.training}) (same cut, same "
                "names), or put the stage back in its mode."
            )
        return self.result(runs[0](self, *self.flat_inputs(args, kwargs)))

    def flat_inputs(self, args: tuple, kwargs: dict[str, Any]) -> list[Any] | tuple[Any, ...]:
        """What the stage's graph takes for this call's arguments (checked as :meth:`forward` checks them)."""
        if self._conveyor_stage == 0:
            return self._flatten_model_inputs(args, kwargs)
        if kwargs:
            raise SpecMismatchError(f"stage {self.stage} takes the previous stage's outputs as positional arguments; "
                                    f"got keyword arguments {sorted(kwargs)}.")
        self._check_received(args, self._run_for_display()[2])
        return args

    def result(self, outputs: Sequence[Any]) -> Any:
        """What the stage returns for its graph's outputs: the model's own structure on the last stage."""
        if self._conveyor_stage == self._conveyor_num_stages - 1:
            return pytree.tree_unflatten(list(outputs), self._conveyor_out_spec)
        return tuple(outputs)

    def _flatten_model_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        positional_spec, keyword_spec = self._conveyor_in_spec.children()  # (args, kwargs)
        expected_keys = list(keyword_spec.context)
        if len(args) != positional_spec.num_children or set(kwargs) != set(expected_keys):
            raise SpecMismatchError(
                f"stage 0 was split for {positional_spec.num_children} positional argument(s) and "
                f"keyword arguments {expected_keys}; got {len(args)} positional and {sorted(kwargs)}. "
                "Call it with the same arguments as the example microbatch, or split again with an "
                "example that has these arguments."
            )
        ordered = {key: kwargs[key] for key in expected_keys}
        flat, spec = pytree.tree_flatten((tuple(args), ordered))
        if spec != self._conveyor_in_spec:
            raise SpecMismatchError(
                f"stage 0 inputs have another structure than the example microbatch:\nexpected "
                f"{self._conveyor_in_spec}\ngot {spec}\nPass the same structure (None stays None)."
            )
        if self._conveyor_input_specs is not None:
            for spec, value in zip(self._conveyor_input_specs, flat):
                _check_leaf(spec, value)
        return flat

    def _check_received(self, values: tuple[Any, ...], specs: tuple[ValueSpec, ...] | None) -> None:
        if specs is None:
            return
        if len(values) != len(specs):
            raise SpecMismatchError(
                f"stage {self.stage} expects {len(specs)} values from stage {self.stage - 1} "
                f"({', '.join(spec.name for spec in specs)}); got {len(values)}."
            )
        for spec, value in zip(specs, values):
            if spec.is_tensor and (
                not isinstance(value, torch.Tensor)
                or not fits(spec.shape, spec.dynamic, value.shape)
                or value.dtype != spec.dtype
            ):
                got = (
                    f"{list(value.shape)} {value.dtype}"
                    if isinstance(value, torch.Tensor)
                    else type(value).__name__
                )
                raise SpecMismatchError(
                    f"stage {self.stage} input {spec.name!r}: expected {spec.describe()}, got {got}."
                )

    def extra_repr(self) -> str:
        return f"stage={self.stage}, num_stages={self.num_stages}"


def _check_leaf(spec: ValueSpec, value: Any) -> None:
    """Raise unless ``value`` fits ``spec``, a leaf of the example microbatch stage 0 was split for."""
    if spec.is_tensor:
        if isinstance(value, torch.Tensor) and value.dtype == spec.dtype and fits(spec.shape, spec.dynamic,
                                                                                   value.shape):
            return
        got = f"tensor{list(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else repr(value)
        split_for = f"tensor{describe_shape(spec.shape, spec.dynamic)} {str(spec.dtype).removeprefix('torch.')}"
    else:
        if not isinstance(value, torch.Tensor) and value == spec.value:
            return
        got, split_for = repr(value), repr(spec.value)
    raise SpecMismatchError(
        f"stage 0 input {spec.name!r}: the model was split for {split_for}, got {got}. "
        "Stages are specialised to the example microbatch's shapes and non-tensor values: "
        "split with an example like this one (or pad inputs to the example's shape), or let a dim vary with "
        "split_model(..., dynamic_shapes={name: {dim: 'seq'}}) (SplitOptions(dynamic_shapes=...))."
    )
