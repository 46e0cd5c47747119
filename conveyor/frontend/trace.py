"""Trace an unchanged ``nn.Module`` into one flat graph with ``torch.export``.

We use ``torch.export.export(..., strict=False)``: it runs the model's Python code on
fake tensors and records the ATen operations eager mode dispatches to (the training
IR, not functionalised, so in-place updates such as BatchNorm's running statistics
stay in place). Every parameter and buffer enters the graph as a placeholder whose
original name is in the graph signature, and every operation carries
``nn_module_stack``: the module paths it ran inside. That is all the splitter needs:
the operations in execution order, the module each belongs to, and the names.

What tracing costs, and its limits (see also ``conveyor.frontend`` docs):

* Shapes and non-tensor inputs are specialised to the example microbatch. Stage 0
  checks its inputs against the example and raises ``SpecMismatchError`` otherwise.
* Python control flow on tensor *values* (``if x.sum() > 0``, ``.item()``,
  ``.tolist()``) cannot be traced; the error names the module and source line.
* Outputs must be pytrees of tensors and plain values (tuples, lists, dicts,
  Hugging Face ``ModelOutput``). A Hugging Face key/value cache is not, and training
  never reads it: a Hugging Face model whose config has ``use_cache`` on is traced
  with it off (its config is put back afterwards, and a log line says so). A
  ``use_cache=True`` passed in ``example_kwargs`` is kept, and fails with that advice.
* Devices met while tracing (``torch.arange(..., device=x.device)``) are recorded as
  constants; stages rewrite the trace device to their own device.
* The train/eval mode is fixed (dropout, BatchNorm, ``if self.training``).
* A shape or scalar read from tensor data (``x[mask]``, ``.item()``) is refused,
  since stages exchange tensors of known shapes.
* A custom ``torch.autograd.Function`` is refused: export keeps its forward, not its
  backward (``conveyor.frontend.functions``).
* A Hugging Face model given neither ``attention_mask`` nor ``position_ids`` is traced on
  the attention path eager takes (``conveyor.frontend.attention``).
"""

from __future__ import annotations

import itertools
import linecache
import logging
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from conveyor.errors import TracingError
from conveyor.frontend.attention import (
    eager_attention_path,
    is_hugging_face_model,
    warn_of_repeated_heads,
)
from conveyor.frontend.dynamic import (
    check_stayed_dynamic,
    concrete_shape,
    describe_shape,
    export_dynamic_shapes,
    is_data_dependent,
    symbolic_dims,
)
from conveyor.frontend.functions import custom_functions_met, refusal
from conveyor.frontend.materialize import tensor_names

logger = logging.getLogger(__name__)

_TORCH_DIR = os.path.dirname(torch.__file__)
# The last advice of every refusal to trace.
_BY_HAND = ("  or build the stages by hand: any list of nn.Modules whose outputs feed the next one works with "
            "conveyor.frontend.run_sequential and the pipeline.")
_FRONTEND_DIR = os.path.dirname(__file__)


@dataclass(frozen=True, slots=True)
class StateInput:
    """A graph placeholder that is not a user input: a parameter, buffer or constant.

    ``target`` is the original name (``"model.layers.0.mlp.up_proj.weight"``) or, for a
    constant created inside ``forward``, the name torch.export gave it.
    """

    kind: str  # "parameter", "buffer" or "constant"
    target: str
    persistent: bool = True


@dataclass(frozen=True, slots=True)
class ValueSpec:
    """One value crossing a stage boundary (or entering stage 0: a leaf of the example microbatch).

    ``shape`` and ``dtype`` are ``None`` for a non-tensor value, whose ``value`` is then
    kept. ``requires_grad`` says whether the producing stage's tensor requires grad,
    i.e. whether a gradient for it comes back in the backward pass.
    """

    name: str
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    requires_grad: bool = False
    value: Any = None
    dynamic: tuple[int, ...] = ()  # dims traced as dynamic: any size fits (conveyor.frontend.dynamic)

    @property
    def is_tensor(self) -> bool:
        return self.shape is not None

    def describe(self) -> str:
        if not self.is_tensor:
            return f"{self.name}={self.value!r}"
        grad = ", grad" if self.requires_grad else ""
        return f"{self.name}: {describe_shape(self.shape, self.dynamic)} {str(self.dtype).removeprefix('torch.')}{grad}"


class TracedModel:
    """The exported graph of one model, read into the form the splitter uses.

    Attributes:
        exported: the ``ExportedProgram``.
        nodes: compute nodes (``call_function``) in execution order.
        module_paths: for each node, the module paths it ran inside, outermost first
            (the root ``""`` left out); a region's node has those of its whole body.
        regions: node index -> :class:`Region`, for the nodes that are regions
            (``torch.no_grad()``, autocast): each is one operation, so no stage starts inside.
        state_inputs: placeholder name -> parameter / buffer / constant it stands for.
        subgraphs: ``get_attr`` node name -> the nested graph module it loads
            (bodies of higher-order ops such as ``torch.no_grad`` regions).
        user_inputs: placeholders of the model's own (flattened) inputs.
        example: one ``ValueSpec`` per user input (what stage 0 checks its inputs against).
        outputs: the flat outputs (nodes or literal values), unflattened by ``out_spec``.
        trace_device: the device the model's tensors were on while tracing.
    """

    def __init__(self, model: nn.Module, exported: ExportedProgram, trace_device: torch.device):
        self.model = model
        # Dropout, BatchNorm and any `if self.training` are fixed in the graph.
        self.training = model.training
        self.dynamic_shapes: Mapping[str, Any] | None = None  # what trace_model was asked to keep dynamic
        self.exported = exported
        self.trace_device = trace_device
        signature = exported.graph_signature
        graph = exported.graph_module.graph

        self.state_inputs: dict[str, StateInput] = {}
        user_input_names: list[str] = []
        for spec in signature.input_specs:
            name = spec.arg.name
            if spec.kind == InputKind.PARAMETER:
                self.state_inputs[name] = StateInput("parameter", spec.target)
            elif spec.kind == InputKind.BUFFER:
                self.state_inputs[name] = StateInput("buffer", spec.target, bool(spec.persistent))
            elif spec.kind == InputKind.CONSTANT_TENSOR:
                self.state_inputs[name] = StateInput("constant", spec.target, False)
            elif spec.kind == InputKind.USER_INPUT:
                user_input_names.append(name)
            else:
                raise TracingError(
                    f"torch.export produced an input of kind {spec.kind.name} ({name}), which conveyor "
                    "cannot split (expected parameters, buffers, constants and user inputs). "
                    "Build the stages by hand: pass a list of nn.Modules to conveyor.frontend.run_sequential."
                )
        for spec in signature.output_specs:
            if spec.kind != OutputKind.USER_OUTPUT:
                raise TracingError(
                    f"torch.export produced an output of kind {spec.kind.name}: the model mutates "
                    "one of its inputs in place, which conveyor cannot split. Return the new value "
                    "instead of updating the input in place."
                )

        by_name = {node.name: node for node in graph.nodes}
        self.user_inputs: list[fx.Node] = [by_name[name] for name in user_input_names]
        self.nodes: list[fx.Node] = []
        self.subgraphs: dict[str, fx.GraphModule] = {}
        for node in graph.nodes:
            if node.op == "call_function":
                self.nodes.append(node)
            elif node.op == "get_attr":
                value = getattr(exported.graph_module, node.target)
                if not isinstance(value, fx.GraphModule):
                    raise TracingError(
                        f"unexpected attribute {node.target!r} of type {type(value).__name__} in the "
                        "exported graph; build the stages by hand."
                    )
                self.subgraphs[node.name] = value
            elif node.op == "output":
                self.outputs: list[Any] = list(node.args[0])
        # A region (torch.no_grad, autocast, ...) is one node whose body is a nested graph:
        # it ran inside every module its body ran in, and it starts in the first of them.
        self.module_paths: list[tuple[str, ...]] = []
        self.regions: dict[int, Region] = {}
        for index, node in enumerate(self.nodes):
            body = [path for graph in _bodies(node, self.subgraphs) for path in _body_paths(graph)]
            own = _module_paths(node)
            if body:
                # A stage starting at the region starts with the first module that runs in it.
                self.regions[index] = Region(_region_kind(node), next((paths for paths in body if paths), ()))
                own = tuple(dict.fromkeys(own + tuple(path for paths in body for path in paths)))
            self.module_paths.append(own)
        for node in self.nodes:
            _reject_data_dependent(model, node)
        self.in_spec: pytree.TreeSpec = exported.call_spec.in_spec
        self.out_spec: pytree.TreeSpec = exported.call_spec.out_spec
        self.example: list[ValueSpec] = [_example_leaf(node) for node in self.user_inputs]
        # Every name of every tensor, for tied tensors: name -> all names, model order.
        self.aliases: dict[str, tuple[str, ...]] = {
            name: tuple(names) for names in tensor_names(model) if len(names) > 1 for name in names
        }

    def example_inputs(self, device: torch.device) -> tuple[tuple, dict]:
        """``(args, kwargs)`` shaped as the example microbatch: its non-tensor values, zeros for its tensors."""
        flat = [torch.zeros(leaf.shape, dtype=leaf.dtype, device=device) if leaf.is_tensor else leaf.value
                for leaf in self.example]
        return pytree.tree_unflatten(flat, self.in_spec)


def _module_paths(node: fx.Node) -> tuple[str, ...]:
    stack = node.meta.get("nn_module_stack") or {}
    # A module called twice is recorded as "name@1"; it is still the same module.
    paths = (re.sub(r"@\d+$", "", path) for path, _type in stack.values())
    return tuple(dict.fromkeys(path for path in paths if path))


@dataclass(frozen=True, slots=True)
class Region:
    """A traced region (the body of ``torch.no_grad()``, ``torch.autocast``, ...): one node, never cut.

    ``kind`` says what entered it, for messages; ``opening`` holds the module paths of the
    first of its operations that runs inside a module: the modules a stage may start with at
    the region's start.
    """

    kind: str
    opening: tuple[str, ...]


def _bodies(node: fx.Node, graphs: dict[str, fx.GraphModule]) -> list[fx.GraphModule]:
    """The region bodies ``node`` enters: those of its arguments that name one of ``graphs``."""
    return [graphs[arg.name] for arg in node.args if isinstance(arg, fx.Node) and arg.name in graphs]


def _body_paths(graph: fx.GraphModule) -> list[tuple[str, ...]]:
    """Module paths of each operation of a region's body, nested regions opened, in order."""
    found = []
    nested = {node.name: getattr(graph, node.target) for node in graph.graph.nodes if node.op == "get_attr"}
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        bodies = _bodies(node, nested)
        if bodies:  # a region within the region: its operations, in order
            found.extend(path for body in bodies for path in _body_paths(body))
        else:
            found.append(_module_paths(node))
    return found


def _region_kind(node: fx.Node) -> str:
    name = getattr(node.target, "__name__", str(node.target))
    if "set_grad_enabled" in name:
        return "a torch.no_grad() / torch.enable_grad() region"
    if "autocast" in name:
        return "a torch.autocast region"
    return f"a {name} region"


def _reject_data_dependent(model: nn.Module, node: fx.Node) -> None:
    """Stages are specialised to fixed shapes: a shape or scalar read from tensor data breaks that."""
    if not is_data_dependent(node.meta.get("val")):
        return
    stack = node.meta.get("nn_module_stack") or {}
    path, type_name = list(stack.values())[-1] if stack else ("", type(model).__qualname__)
    trace_lines = [
        line.strip() for line in (node.meta.get("stack_trace") or "").strip().splitlines()
    ]
    where = " / ".join(trace_lines[-2:]) if trace_lines else "<source unavailable>"
    module = re.sub(r"@\d+$", "", path) or "<root>"
    raise TracingError(
        f"could not split {type(model).__name__}: operation {node.target} in module "
        f"{module!r} ({type_name.rpartition('.')[2]}) gives a value whose "
        f"shape or content depends on tensor data ({node.meta.get('val')}).\n"
        f"  at {where}\n"
        "how to fix: stages need shapes known before running; keep data-dependent shapes "
        "(boolean indexing x[mask], nonzero, .item(), .tolist()) out of forward: use torch.where "
        "or a multiplied mask, or compute it after the model returns.\n"
        + _BY_HAND
    )


def _example_leaf(node: fx.Node) -> ValueSpec:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return ValueSpec(node.name, concrete_shape(value), value.dtype, dynamic=symbolic_dims(value))
    return ValueSpec(node.name, None, None, value=value)


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (cpu for a model without state)."""
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return first.device if first is not None else torch.device("cpu")


def trace_model(
    model: nn.Module, example_args: Sequence[Any], example_kwargs: Mapping[str, Any] | None,
    dynamic_shapes: Mapping[str, Any] | None = None,
) -> TracedModel:
    """Trace ``model`` on one example microbatch; raise ``TracingError`` naming the failure.

    ``dynamic_shapes`` ({input name: {dim: name}}): dims that may differ between microbatches
    (:mod:`conveyor.frontend.dynamic`); the others are fixed to the example's.

    Example inputs on another device than a meta-device model are moved to the meta
    device first, so a model built with ``torch.device("meta")`` can be traced with
    ordinary example tensors.

    Example:
        >>> traced = trace_model(torch.nn.Linear(2, 3), (torch.ones(4, 2),), None)
        >>> [leaf.describe() for leaf in traced.example]
        ['input: [4, 2] float32']
    """
    device = model_device(model)
    args = tuple(example_args)
    kwargs = dict(example_kwargs or {})
    if device.type == "meta":
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    try:
        with (_key_value_cache_off(model, kwargs), eager_attention_path(model, args, kwargs),
              custom_functions_met(model) as functions):
            exported = torch.export.export(model, args, kwargs, strict=False,
                                           dynamic_shapes=export_dynamic_shapes(model, args, kwargs, dynamic_shapes))
    except TracingError:
        raise
    except Exception as error:  # noqa: BLE001 - any failure is explained the same way
        raise TracingError(explain_trace_failure(model, error)) from error
    if functions:  # their backward is not in the graph: the stages would train another model
        raise TracingError(refusal(model, functions))
    traced = TracedModel(model, exported, device)
    check_stayed_dynamic(dynamic_shapes, model, args, kwargs, traced.example, traced.in_spec)
    traced.dynamic_shapes = dynamic_shapes
    warn_of_repeated_heads(model, traced.nodes, args, kwargs)
    return traced


@contextmanager
def _key_value_cache_off(model: nn.Module, example_kwargs: Mapping[str, Any]) -> Iterator[None]:
    """Within, the configs of the Hugging Face models in ``model`` have ``use_cache`` off.

    Training never reads the key/value cache, and torch.export cannot return one (a
    ``DynamicCache`` is not a pytree). The configs are switched for the trace only, and
    put back however it ends. Passing ``use_cache=False`` to the traced call instead
    would make it an input of the graph, which stage 0 would then demand at every step.
    A ``use_cache`` in ``example_kwargs`` is the user's own choice, and is kept.
    """
    if "use_cache" in example_kwargs:
        yield
        return
    switched: dict[int, tuple[Any, Any]] = {}  # id(config) -> (config, its use_cache)
    owners: list[str] = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if not is_hugging_face_model(module) or id(config) in switched:
            continue
        use_cache = getattr(config, "use_cache", False)
        if use_cache:
            switched[id(config)] = (config, use_cache)
            owners.append(type(module).__name__)
    if switched:
        logger.info(
            "tracing %s with use_cache=False (training never uses the key/value cache, which "
            "torch.export cannot return; the model's config is left as it is)",
            ", ".join(owners),
        )
    try:
        for config, _ in switched.values():
            config.use_cache = False
        yield
    finally:
        for config, use_cache in switched.values():
            config.use_cache = use_cache


def explain_trace_failure(model: nn.Module, error: BaseException) -> str:
    """A message naming the module and the source line where tracing failed, with a fix."""
    module_names = {id(module): name for name, module in model.named_modules()}
    module_where: tuple[str, str] | None = None
    line_where: str | None = None
    for exception in _exception_chain(error):
        traceback = exception.__traceback__
        while traceback is not None:
            frame = traceback.tb_frame
            owner = frame.f_locals.get("self")
            if owner is not None and id(owner) in module_names:
                module_where = (module_names[id(owner)], type(owner).__name__)
            filename = frame.f_code.co_filename
            if not filename.startswith((_TORCH_DIR, _FRONTEND_DIR, "<")):
                source = linecache.getline(filename, traceback.tb_lineno).strip() or "<source unavailable>"
                line_where = f"{filename}:{traceback.tb_lineno}: {source}"
            traceback = traceback.tb_next
        if module_where is not None:
            break
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if len(reason) > 300:
        reason = reason[:300] + "..."
    lines = [f"could not trace {type(model).__name__} with torch.export, which splitting needs."]
    if module_where is not None:
        path, cls = module_where
        lines.append(f"  failed in module {path or '<root>'!r} ({cls})")
    if line_where is not None:
        lines.append(f"  at {line_where}")
    lines.append(f"  reason: {type(error).__name__}: {reason}")
    lines.append("how to fix: " + _hint(error))
    lines.append(_BY_HAND)
    return "\n".join(lines)


def _exception_chain(error: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    # The innermost failure is the most precise about where it happened.
    return list(reversed(chain))


def _hint(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    if "data-dependent" in text or "GuardOnDataDependent" in text or "item()" in text:
        return (
            "this code branches on tensor values (an `if` on a tensor, .item(), .tolist()); "
            "compute on tensors instead (torch.where, masking), or move that decision out of "
            "forward (pass it as a plain Python argument)."
        )
    if "register a pytree" in text or "not a known type" in text:
        if "Cache" in text:
            return (
                "the model returns a Hugging Face key/value cache (the past_key_values or cache "
                "field of its output), which torch.export cannot carry and training never uses: "
                "pass use_cache=False in example_kwargs (without use_cache there, conveyor traces "
                "Hugging Face models with their config's use_cache off)."
            )
        return (
            "the model returns or takes an object that is not a tensor, tuple, list or dict; "
            "return tensors (or register the type with torch.utils._pytree)."
        )
    if "numpy" in text.lower():
        return "this code converts tensors to numpy; keep the computation in torch."
    return (
        "make this code traceable by torch.export (no Python logic on tensor values, no "
        "numpy, no unsupported objects in inputs or outputs); mark a module `unsplittable` "
        "only keeps cuts out of it, it does not change tracing."
    )
