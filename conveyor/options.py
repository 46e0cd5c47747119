"""A pipeline's options as typed records, one per concern, each checking itself.

- :class:`StageOptions`: what each stage does (activation recomputation, autocast, parameter and
  accumulation dtypes, fp16's loss scaling, compile, random streams, memory measurement, the timeline).
- :class:`RecomputePolicy`: which part of a stage recomputes its activations in backward, per stage.
- :class:`TransferOptions`: how bytes move between stages (transport, timeout, fixed shapes).
- :class:`WholeModel`: what :func:`conveyor.pipeline` learned about the unsplit model (tied
  parameters, parameter order, signature), which a hand-built pipeline may leave out.
- :class:`SplitOptions` and :class:`PipelineOptions`: how :func:`conveyor.pipeline` cuts the model,
  and every record it passes on, in one.

Where the ranks are is the one record of :mod:`conveyor.layout` that ``layout=`` takes.

Each record is frozen; its ``__post_init__`` normalises what it was given (``torch.bfloat16`` ->
``"bf16"``) and refuses a bad value or combination with a message that names the fix, when the
record is made, before any rank communicates. The records pass whole from
:func:`conveyor.pipeline` to :class:`conveyor.Pipeline` and to each stage's runner, and what the
ranks compare when a pipeline is built is their :meth:`describe` text. A new option is one field
of one record. ``conveyor train``'s config sections are these same records (OmegaConf structured
configs): each field's ``help`` metadata is its documentation, there and here.

Example:
    >>> import torch
    >>> StageOptions(autocast=torch.bfloat16, recompute=True).autocast
    'bf16'
    >>> StageOptions(param_dtype="bf16").grad_accum_dtype
    'fp32'
    >>> TransferOptions(transport="carrier pigeon")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    conveyor.errors.PipelineConfigError: transport must be one of 'auto', 'shared_memory', 'process_group',
    'hybrid', 'ordered'; got 'carrier pigeon'
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from conveyor.errors import PipelineConfigError, positive_int

TRANSPORTS = ("auto", "shared_memory", "process_group", "hybrid", "ordered")


def _f(default: Any, help: str, **metadata: Any) -> Any:
    # The help text rides in the field's metadata: the field's documentation, which
    # `conveyor train --help` lists as well (a layout's size field names its mesh dim there too).
    return field(default=default, metadata={"help": help, **metadata})


def _set(record: Any, name: str, value: Any) -> None:
    object.__setattr__(record, name, value)  # a frozen record normalising itself, in __post_init__


def _dtype_name(value: Any, what: str) -> str | None:
    """``torch.bfloat16`` / ``"bfloat16"`` / ``"BF16"`` -> ``"bf16"`` (None stays None)."""
    import torch  # here, not above: conveyor train's config (and so the CLI) reads these records without torch

    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
    if value is None:
        return None
    if isinstance(value, torch.dtype) and value in names:
        return names[value]
    aliases = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
               "fp32": "fp32", "float32": "fp32", "float": "fp32", "fp64": "fp64", "float64": "fp64",
               "none": "none", "no": "none"}
    if isinstance(value, str) and value.lower() in aliases:
        return aliases[value.lower()]
    raise PipelineConfigError(f"{what}={value!r} is not a dtype conveyor knows; use 'bf16', 'fp32' or a "
                              "torch floating-point dtype")

RECOMPUTE_KEYS = ("every", "blocks", "save")
# Names for groups of operators whose outputs a selective recomputation keeps (the rest is recomputed).
SAVE_PRESETS = MappingProxyType({
    "matmul": ("mm", "bmm", "addmm", "baddbmm"),
    "attention": ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"),
})


@dataclass(frozen=True)
class RecomputePolicy:
    """Which part of one stage recomputes its activations in backward (``torch.utils.checkpoint``).

    No ``every`` and no ``blocks``: the whole stage is one recomputed region (what
    ``recompute=True`` gives). ``every=N``: the stage's blocks are its outermost
    modules that are items of a ``ModuleList`` or ``Sequential`` (``model.layers.3``), and blocks 0,
    N, 2N, ... of the stage (counted from its first block) each recompute on their own; the rest
    of the stage (embedding, head, the other blocks) keeps its activations. ``blocks``: a regular
    expression; the outermost modules whose full names match it are the blocks instead. ``save``:
    torch's per-operator policy (``create_selective_checkpoint_contexts``) inside each region: the
    outputs of these operators are kept, the rest recomputed; operator names (``"mm"``,
    ``"aten.addmm"``) or the groups ``"matmul"`` and ``"attention"``.

    Example:
        >>> RecomputePolicy(every=2, save=("matmul",)).describe()
        'every=2 save=matmul'
        >>> RecomputePolicy(every=0)  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        conveyor.errors.PipelineConfigError: RecomputePolicy.every takes a positive whole number of blocks
        (1: every block, 2: every other); got 0
    """

    every: int | None = _f(None, "recompute every Nth block of the stage (1: each block on its own), "
                                 "None: the whole stage as one region unless blocks= is given")
    blocks: str | None = _f(None, "a regular expression over module names: the outermost matching modules are "
                                  "the blocks (None: items of a ModuleList or Sequential)")
    save: tuple[str, ...] = _f((), "operators whose outputs are kept rather than recomputed (torch's selective "
                                   "checkpointing): 'matmul', 'attention' or aten operator names")

    def __post_init__(self) -> None:
        if self.every is not None and not positive_int(self.every):
            raise PipelineConfigError("RecomputePolicy.every takes a positive whole number of blocks (1: every "
                                      f"block, 2: every other); got {self.every!r}")
        if self.blocks is not None:
            if not isinstance(self.blocks, str):
                raise PipelineConfigError(f"RecomputePolicy.blocks takes a regular expression; got {self.blocks!r}")
            try:
                re.compile(self.blocks)
            except re.error as error:
                raise PipelineConfigError(f"RecomputePolicy.blocks={self.blocks!r} is not a regular expression: "
                                          f"{error}") from None
        save = (self.save,) if isinstance(self.save, str) else self.save
        if not isinstance(save, Sequence) or not all(isinstance(name, str) for name in save):
            raise PipelineConfigError(f"RecomputePolicy.save takes operator names; got {self.save!r}")
        _set(self, "save", tuple(save))
        self.saved_operators()  # refuses a name torch does not know

    @property
    def per_block(self) -> bool:
        """Whether blocks recompute one by one (else the whole stage is one region)."""
        return self.every is not None or self.blocks is not None

    def saved_operators(self) -> tuple[Any, ...]:
        """The aten operator packets whose outputs a region keeps (``save``, groups expanded)."""
        import torch

        found = []
        for name in self.save:
            for op in SAVE_PRESETS.get(name, (name,)):
                packet = getattr(torch.ops.aten, op.removeprefix("aten.").split(".")[0], None)
                if not isinstance(packet, torch._ops.OpOverloadPacket):
                    raise PipelineConfigError(f"RecomputePolicy.save: {name!r} is no aten operator; use "
                                              f"{', '.join(map(repr, SAVE_PRESETS))} or a name such as 'mm'")
                found.append(packet)
        return tuple(found)

    def describe(self) -> str:
        """Short and stable: what the ranks compare and tables print."""
        parts = [f"every={self.every}"] if self.every is not None else []
        parts += [f"blocks={self.blocks}"] if self.blocks is not None else []
        parts += [f"save={'+'.join(self.save)}"] if self.save else []
        return " ".join(parts) or "stage"

    __str__ = describe

    @classmethod
    def parse(cls, value: Any) -> RecomputePolicy | None:
        """A policy from what a user or a config gives: None/False (none), True (whole stage), a
        policy, or a mapping of its fields.

        Example:
            >>> RecomputePolicy.parse({"every": 2})
            RecomputePolicy(every=2, blocks=None, save=())
        """
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(RECOMPUTE_KEYS))
            if unknown:
                raise PipelineConfigError(f"recompute={dict(value)}: a policy takes the keys "
                                          f"{', '.join(RECOMPUTE_KEYS)}; got {', '.join(map(str, unknown))}")
            return cls(**value)
        raise PipelineConfigError(f"recompute={value!r}: a policy is true, false, a RecomputePolicy or a mapping "
                                  "such as {'every': 2}")


def _recompute_policies(value: Any) -> Any:
    """``StageOptions.recompute`` normalised: None, one policy for every stage, or a tuple per stage."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        policies = tuple(RecomputePolicy.parse(item) for item in value)
        if not policies:
            raise PipelineConfigError("StageOptions.recompute got an empty list; give one policy per stage "
                                      "(None for a stage that keeps its activations) or one for all")
        return policies if any(policies) else None
    return RecomputePolicy.parse(value)


@dataclass(frozen=True)
class StageOptions:
    """What each stage does, the same on every stage and rank (a field of ``conveyor train``'s ``stage:``).

    Example:
        >>> options = StageOptions(recompute=True, autocast="bf16")
        >>> print(options.describe())  # doctest: +NORMALIZE_WHITESPACE
        recompute=stage autocast=bf16 param_dtype=None grad_accum_dtype=None loss_scaling=None compile=off
        random_streams=True measure_memory=False record_timeline=True

    Recomputation per stage and per block: ``recompute=`` takes True (the whole of every stage), a
    :class:`RecomputePolicy` (or its fields as a mapping) for every stage, or a list with one per
    stage (None: that stage keeps its activations), so the first stages, which hold the most
    microbatches under 1F1B, recompute more than the last:

        >>> options = StageOptions(recompute=[{"every": 1}, {"every": 2}, None])
        >>> [str(options.recompute_policy(stage, 3)) for stage in range(3)]
        ['every=1', 'every=2', 'None']
    """

    recompute: Any = _f(None, "recompute activations in backward (saves memory, costs a forward): true for the "
                              "whole of every stage, a policy {every: N, blocks: regex, save: [matmul, ...]} for "
                              "every stage, or a list of one per stage (null: none)")
    autocast: str | None = _f(None, "bf16 or fp16: each stage's forward and loss under torch.autocast in that "
                                    "dtype, bitwise as one device (fp16 with loss_scaling); None or fp32: full "
                                    "precision")
    param_dtype: str | None = _f(None, "bf16 or fp16: the stages cast to it, their gradients summed over the "
                                       "microbatches in fp32 main_grad (use conveyor.MasterWeights); None: "
                                       "parameters as given")
    grad_accum_dtype: str | None = _f(None, "where gradients accumulate over microbatches with param_dtype: fp32 "
                                            "(main_grad, the default below fp32) or none (.grad, in param_dtype)")
    loss_scaling: Any = _f(None, "dynamic loss scaling as torch.amp.GradScaler (on for fp16 when unset): true, "
                                 "false, or {init_scale, growth_factor, backoff_factor, growth_interval, min_scale}")
    compile: Any = _f(False, "true, or a mapping of torch.compile keywords (backend, mode, dynamic, fullgraph, "
                             "options): each stage's forward compiled; false: eager")
    random_streams: bool = _f(True, "random ops (dropout) draw from generators seeded per (stage, microbatch) "
                                    "from one draw of the global CPU generator per step; false leaves the "
                                    "generators to the user")
    measure_memory: bool = _f(False, "count the bytes autograd saves for backward, read by pipe.memory() "
                                     "(a few percent of a small step)")
    record_timeline: bool = _f(True, "time every action of each step, read by pipe.timeline()")

    def __post_init__(self) -> None:
        from conveyor.runtime.stage.compile import compile_options
        from conveyor.runtime.stage.loss_scale import loss_scaling
        from conveyor.runtime.stage.main_grad import param_precision
        from conveyor.runtime.stage.precision import autocast_dtype

        _set(self, "autocast", _dtype_name(autocast_dtype(self.autocast), "autocast"))  # "bf16", "fp16" or None
        param = _dtype_name(self.param_dtype, "param_dtype")
        # Refuses fp16 gradients summed in fp16, and an accumulation dtype alone (so None with no param_dtype).
        precision = param_precision(param, _dtype_name(self.grad_accum_dtype, "grad_accum_dtype"))
        _set(self, "param_dtype", param)
        accum = None if precision is None else "fp32" if precision.grad_accum_dtype is not None else "none"
        _set(self, "grad_accum_dtype", accum)
        _set(self, "loss_scaling", loss_scaling(self.loss_scaling, "fp16" in (self.autocast, param)))
        options = compile_options(self.compile)  # refuses keywords torch.compile does not take
        _set(self, "compile", False if options is None else (True if options == {} else dict(options)))
        for name in ("random_streams", "measure_memory", "record_timeline"):
            if not isinstance(getattr(self, name), bool):
                raise PipelineConfigError(f"StageOptions.{name} takes True or False; got {getattr(self, name)!r}")
        _set(self, "recompute", _recompute_policies(self.recompute))

    def recompute_policy(self, stage: int, num_stages: int) -> RecomputePolicy | None:
        """What stage ``stage`` of ``num_stages`` recomputes (None: nothing)."""
        policies = self.recompute
        if not isinstance(policies, tuple):
            return policies
        if len(policies) != num_stages:
            raise PipelineConfigError(f"StageOptions.recompute lists {len(policies)} policies for a pipeline of "
                                      f"{num_stages} stages; give one per stage (None where a stage keeps its "
                                      "activations) or one policy for all")
        return policies[stage]

    @property
    def autocast_dtype(self) -> Any:
        """The dtype of the stages' autocast region (None: none)."""
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.autocast)

    def param_precision(self, data_parallel: str | None = None) -> Any:
        """The stages' :class:`~conveyor.runtime.stage.main_grad.ParamPrecision` (None: parameters as given),
        checked against the data-parallel kind."""
        from conveyor.runtime.stage.main_grad import param_precision

        return param_precision(self.param_dtype, self.grad_accum_dtype, data_parallel)

    def describe(self) -> str:
        """What the ranks compare when a pipeline is built: ``name=value`` for every field (a new one
        included), stably: the same text on every rank (a function given as a torch.compile backend by
        its name, not its address)."""
        from conveyor.runtime.stage.compile import describe_compile

        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "compile":
                value = describe_compile(value)
            elif hasattr(value, "describe"):  # a RecomputePolicy, the LossScaling
                value = value.describe()
            elif f.name == "recompute" and isinstance(value, tuple):  # one policy per stage (None: none)
                value = "[" + ", ".join(map(str, value)) + "]"
            parts.append(f"{f.name}={value}")
        return " ".join(parts)


def _plan_recompute(plan: Any, stage: StageOptions) -> StageOptions:
    """The stage options with the plan's recomputation policies, where it needs some to fit and the
    user gave none (a user's own ``recompute=`` wins): for ``conveyor.pipeline`` and ``conveyor train`` alike."""
    if not plan.recompute or stage.recompute is not None:
        return stage
    return dataclasses.replace(stage, recompute=list(plan.recompute))


@dataclass(frozen=True)
class TransferOptions:
    """How bytes move between stages (a field of ``conveyor train``'s ``transfer:``).

    Example:
        >>> TransferOptions(fixed_shapes=True, timeout_s=60).describe()
        "transport='auto' timeout_s=60.0 fixed_shapes=True shapes given for stages []"
    """

    transport: str = _f("auto", "auto | shared_memory (rings in shared memory: every rank on this host, CPU "
                                "tensors) | process_group (the group's point-to-point calls) | hybrid (shared "
                                "memory to peers on this host, the group to others) | ordered (transfers "
                                "matched by order: NCCL's choice under auto)")
    timeout_s: float = _f(300.0, "seconds any blocking receive waits before it fails naming what it waited for")
    fixed_shapes: bool = _f(False, "promise that what crosses each stage boundary keeps the first step's shapes, "
                                   "dtypes, structure and strides: later steps send data only; a stage output "
                                   "that breaks the promise is an error naming rank, stage, microbatch, tensor")
    shapes: Any = _f(None, "{stage: an example of its output for ONE microbatch}, the same on every rank: skips "
                           "even the first step's exchange of shapes")
    variable_shapes: bool = _f(False, "microbatches of different shapes in every step (pipe.step(Microbatches(...))): "
                                      "transport='ordered' then agrees on each transfer's shape every step, not "
                                      "once (the other transports carry each transfer's shape anyway)")

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise PipelineConfigError(f"transport must be one of {', '.join(map(repr, TRANSPORTS))}; "
                                      f"got {self.transport!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float) or self.timeout_s <= 0:
            raise PipelineConfigError(f"timeout_s must be a positive number of seconds; got {self.timeout_s!r} "
                                      "(set it above your slowest step: 300 by default)")
        _set(self, "timeout_s", float(self.timeout_s))
        if self.shapes is not None and not isinstance(self.shapes, Mapping):
            raise PipelineConfigError(f"shapes takes {{stage: an example output of that stage}}; got "
                                      f"{type(self.shapes).__name__}")
        if self.variable_shapes and (self.fixed_shapes or self.shapes is not None):
            raise PipelineConfigError("variable_shapes=True lets every microbatch have its own shapes; "
                                      "fixed_shapes=True and shapes= promise the opposite: choose one")

    def describe(self) -> str:
        """What the ranks compare when a pipeline is built (the timeout may differ between ranks)."""
        return (f"transport={self.transport!r} timeout_s={self.timeout_s} fixed_shapes={self.fixed_shapes} "
                f"shapes given for stages {sorted(self.shapes) if self.shapes else []}"
                f"{' variable_shapes=True' if self.variable_shapes else ''}")


@dataclass(frozen=True)
class WholeModel:
    """What a pipeline knows of the unsplit model its stages came from (:func:`conveyor.pipeline` fills it).

    Example:
        >>> WholeModel().describe()
        'stages built by hand, tied parameters []'
    """

    tied_parameters: Sequence = _f((), "records with `uses` ((stage, name) pairs, conveyor.frontend's TiedGroup): "
                                       "copies on one rank become one Parameter, copies on several ranks have "
                                       "their gradients summed after every step")
    parameter_order: Mapping[str, int] | None = _f(None, "{name: index in the model's parameters()}: the order "
                                                         "clip_grad_norm_ sums the norms in (None: stage by stage)")
    signature: str | None = _f(None, "conveyor.build.model_signature of the model and its cut, compared across ranks")
    info: dict | None = _f(None, "the model's class, names and config: what checkpoints record and export writes")
    parameter_placements: Mapping[str, Any] | None = _f(None, "traced stages under tensor parallelism: each "
                                                              "parameter's placement by its original name, from the "
                                                              "unchanged model's plan; None: stages that torch's "
                                                              "parallelize_module takes as they are")

    def __post_init__(self) -> None:
        _set(self, "tied_parameters", tuple(self.tied_parameters))
        for tied in self.tied_parameters:
            if not hasattr(tied, "uses"):
                raise PipelineConfigError(f"tied_parameters takes records with `uses` ((stage, name) pairs), as "
                                          f"conveyor.frontend finds them; got {type(tied).__name__}")

    def describe(self) -> str:
        """What the ranks compare: the signature and the tied parameters' uses."""
        text = (f"{self.signature or 'stages built by hand'}, tied parameters "
                f"{[tuple(t.uses) for t in self.tied_parameters]}")
        if self.parameter_placements is not None:
            placements = sorted((n, repr(p)) for n, p in self.parameter_placements.items())
            text += f", traced parameter placements {placements}"
        return text


@dataclass(frozen=True)
class SplitOptions:
    """How :func:`conveyor.pipeline` cuts a model (without ``split_points``).

    Example:
        >>> SplitOptions(method="bogus")  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        conveyor.errors.PipelineConfigError: split method 'bogus' unknown; use 'uniform', 'parameters', 'time'
        or 'type:<regex>'
    """

    method: str = _f("parameters", "uniform | parameters | time (rank 0 measures, every rank follows) | "
                                   "type:<regex> (cut before modules whose class matches)")
    unsplittable: Sequence[str] | None = _f(None, "module paths never cut inside")
    both_modes: bool = _f(False, "trace in train and eval mode, so pipe.eval()/pipe.train() switch dropout and "
                                 "BatchNorm (else one trace, in the model's current mode)")
    dynamic_shapes: Any = _f(None, "{input name: {dim: name}}: dims that may differ between microbatches, e.g. "
                                   "{'input_ids': {1: 'seq'}, 'labels': {1: 'seq'}} (conveyor.frontend.dynamic)")

    def __post_init__(self) -> None:
        if self.method not in ("uniform", "parameters", "time") and not self.method.startswith("type:"):
            raise PipelineConfigError(f"split method {self.method!r} unknown; use 'uniform', 'parameters', "
                                      "'time' or 'type:<regex>'")


@dataclass(frozen=True)
class PipelineOptions:
    """Every record :func:`conveyor.pipeline` passes on, beside its everyday keywords (``layout=`` among them).

    Example:
        >>> PipelineOptions(stage=StageOptions(autocast="bf16")).stage.autocast
        'bf16'
    """

    stage: StageOptions = field(default_factory=StageOptions, metadata={"help": "what each stage does"})
    transfer: TransferOptions = field(default_factory=TransferOptions, metadata={"help": "how bytes move"})
    split: SplitOptions = field(default_factory=SplitOptions, metadata={"help": "how the model is cut"})
    virtual: int | None = _f(None, "stages per rank, for a schedule given by name (None: the schedule's default)")
    # Typed Any: the record lives in conveyor.plan, above this module (conveyor.pipeline checks the type).
    plan_options: Any = _f(None, "with schedule='auto': a conveyor.plan.PlanOptions (memory per rank, schedules, "
                                 "search space, machine, measurement; None: its defaults)")

    def __post_init__(self) -> None:
        for name, kind in (("stage", StageOptions), ("transfer", TransferOptions), ("split", SplitOptions)):
            if not isinstance(getattr(self, name), kind):
                raise PipelineConfigError(f"PipelineOptions.{name} takes a {kind.__name__}; got "
                                          f"{type(getattr(self, name)).__name__}")


def check_together(stage: StageOptions, data_parallel: str | None) -> None:
    """The checks that span two records: bf16 weights with main_grad, and the data-parallel kind the
    layout resolved to (None with one replica).

    Example:
        >>> check_together(StageOptions(param_dtype="bf16"), "ddp")  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        conveyor.errors.PipelineConfigError: param_dtype='bf16' with gradients accumulated in float32 main_grad
        does not work with data_parallel='ddp' yet (the replicas' reduction reads .grad, not main_grad): drop
        data_parallel=, or use autocast='bf16' with fp32 parameters, which data parallelism supports
    """
    stage.param_precision(data_parallel)
