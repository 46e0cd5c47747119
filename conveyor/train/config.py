"""Typed training configs: a YAML file plus dotted command-line overrides, checked before anything starts.

A :class:`TrainConfig` has one section per concern (``model``, ``data``, ``parallel``, ``stage``,
``transfer``, ``optim``, ``train``, ``loss``, ``checkpoint``, ``run``); ``stage`` and ``transfer``
ARE the pipeline's option records (:class:`~conveyor.options.StageOptions`,
:class:`~conveyor.options.TransferOptions`), passed whole to :func:`conveyor.pipeline`, their checks
included. Every field has a default, so no
file at all gives a small byte-level GPT trained on the Python standard library's sources,
pipelined over 2 CPU ranks. :func:`load_config` layers the defaults, the YAML file and the
overrides (OmegaConf structured configs: later wins), then checks every key and value;
a mistake raises :class:`~conveyor.errors.ConfigError` naming the key, what came and what is
allowed (an unknown key also lists its section's keys and a close match).
:func:`save_config` writes the resolved config; loading that file gives an equal config.

Example:
    >>> cfg = load_config(None, ["parallel.pp=2", "optim.lr=3e-4"])
    >>> cfg.parallel.pp, cfg.optim.lr, cfg.model.name
    (2, 0.0003, 'gpt')
    >>> load_config(None, ["optim.lrr=1"])  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    conveyor.errors.ConfigError: unknown key 'optim.lrr' (command-line override 'optim.lrr=1'); did you mean
        'optim.lr'? The keys of section 'optim' are: lr, betas, weight_decay, warmup_steps, lr_schedule,
        min_lr_ratio
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from conveyor.errors import ConfigError, PipelineConfigError, PlanError
from conveyor.layout import DistributedLayout, InProcessLayout, Layout
from conveyor.options import StageOptions, TransferOptions, _f, _plan_recompute
from conveyor.train import sources

if TYPE_CHECKING:
    from conveyor.plan.result import Plan


@dataclass
class ModelConfig:
    name: str = _f("gpt", "gpt | llama | mpt | moe | hf:<transformers class name> | a local pretrained directory "
                          "(config.json + safetensors; its config.json sets the sizes below)")
    layers: int = _f(4, "transformer blocks")
    width: int = _f(128, "hidden size")
    heads: int = _f(4, "attention heads (must divide width)")
    seq_len: int = _f(128, "tokens per training sequence (the vocabulary comes from the tokenizer)")
    intermediate: int | None = _f(None, "MLP hidden size (None: 4 x width; mpt: a multiple of width; moe: per expert)")
    kv_heads: int | None = _f(None, "key/value heads for grouped-query attention (None: heads); llama, moe, and "
                              "hf: classes that have them")
    hf_config: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "extra transformers config fields over the derived ones (a pretrained directory: over its "
                "config.json), e.g. model.hf_config.rope_theta=500000"})


# The recipes model.name takes, each a transformers class sized by the model keys (conveyor.train.models): kept
# here, beside the key, so that the config's checks know them without importing torch.
RECIPES = MappingProxyType({"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mpt": "MptForCausalLM",
                            "moe": "MixtralForCausalLM"})


def model_kind(name: str) -> str:
    """``"recipe"``, ``"hf"`` or ``"pretrained"`` (a local directory) for a ``model.name``.

    Example:
        >>> model_kind("llama"), model_kind("hf:Qwen2ForCausalLM")
        ('recipe', 'hf')
    """
    if name in RECIPES:
        return "recipe"
    return "hf" if name.startswith("hf:") else "pretrained"


@dataclass
class DataConfig:
    # Any: a single path or glob, "stdlib", or a list of paths/globs (OmegaConf has no str | list).
    source: Any = _f("stdlib", sources.expected_sources())
    format: str | None = _f(None, "text | jsonl | parquet; None: from each file's suffix")
    text_key: str = _f("text", "the field holding the text in jsonl records and parquet columns")
    tokenizer: str = _f("bytes", "'bytes' (vocab 256) or a local tokenizer directory")
    val_fraction: float = _f(0.05, "share of the documents (files or records) held out for validation")
    max_bytes: int | None = _f(None, "read at most this many bytes of the corpus (None: all)")
    batching: str = _f("windows", "windows (seq_len tokens across documents) | by_length (each document cut at its "
                                  "end, microbatches of similar lengths, no padding across documents; with "
                                  "loss.normalize=tokens every token weighs the same)")


@dataclass
class ParallelConfig:
    pp: int = _f(2, "pipeline ranks")
    virtual: int | None = _f(None, "stages per rank (None: the schedule's default)")
    schedule: str = _f("1f1b", "schedule name (see `conveyor schedules`)")
    microbatches: int = _f(4, "microbatches per step (must divide the per-replica batch)")
    dp: int = _f(1, "data-parallel replicas")
    data_parallel: str = _f("ddp", "ddp | fsdp (how replicas share gradients)")
    tp: int = _f(1, "tensor-parallel ranks per stage: the mesh is (pp, dp, tp), tp innermost, so a stage's TP "
                    "ranks are neighbours (one node); tensor_parallel='auto' splits attention, MLPs, embedding "
                    "and head")
    sequence_parallel: bool = _f(False, "with parallel.tp > 1: activations between blocks sharded on the "
                                        "sequence (norms and dropout per shard)")
    ep: int | str = _f(1, "expert parallelism: each experts module's experts spread over ep of the dp replicas (a "
                          "size dividing parallel.dp and the expert count), tokens moved all-to-all; 'auto': ep = "
                          "parallel.dp; 1: every replica keeps every expert")
    expert_capacity: float | None = _f(None, "with parallel.ep: a capacity factor (e.g. 1.25): each expert takes at "
                                             "most ceil(factor x a rank's routed slots / experts) per microbatch and "
                                             "layer, the rest dropped; null: no token dropped")
    expert_overlap: bool | None = _f(None, "with parallel.ep: each forward runs with the backward next to it on its "
                                           "rank, each one's all-to-alls in flight while the other computes "
                                           "(schedules with 2 stages per rank: zbv, dualpipev, interleaved-1f1b); the "
                                           "same losses. null: as parallel.plan chose (off without a plan)")
    plan: str | None = _f(None, "a plan file from `conveyor plan --out`: its schedule, virtual, microbatches and "
                                "split points replace these keys' (None: split by parameters)")
    in_process: bool = _f(False, "every pipeline rank in this one process (no launcher; parallel.dp=1): the "
                                 "same losses, bit for bit, as parallel.pp processes")

    def layout(self, device: Any = None) -> Layout:
        """The pipeline's layout on ``device``: every rank here (``in_process``), or the distributed record
        whose ``dp``, ``tp``, ``data_parallel``, ``sequence_parallel`` are these keys, by name (and ``ep``:
        expert parallelism over the replicas).

        Example:
            >>> ParallelConfig(dp=2, data_parallel="fsdp").layout().dp
            2
        """
        if self.in_process:
            return InProcessLayout(ranks=self.pp, device=device)
        experts = self.ep != 1  # "auto" (ep = dp) or a size over 1
        return DistributedLayout(device=device, dp=self.dp, tp=self.tp, data_parallel=self.data_parallel,
                                 sequence_parallel=self.sequence_parallel,
                                 expert_parallel="auto" if experts else None,
                                 ep=self.ep if experts and isinstance(self.ep, int) else None,
                                 expert_capacity=self.expert_capacity if experts else None,
                                 expert_overlap=bool(self.expert_overlap) and experts)


@dataclass
class OptimConfig:
    lr: float = _f(1e-3, "peak learning rate (AdamW)")
    betas: tuple[float, float] = _f((0.9, 0.95), "AdamW betas")
    weight_decay: float = _f(0.1, "AdamW weight decay")
    warmup_steps: int = _f(50, "linear warm-up steps")
    lr_schedule: str = _f("cosine", "cosine | constant (after warm-up)")
    min_lr_ratio: float = _f(0.1, "cosine's final lr as a fraction of lr")


@dataclass
class LoopConfig:
    steps: int = _f(500, "optimizer steps")
    batch_size: int = _f(16, "global batch (sequences per step over all replicas)")
    eval_interval: int = _f(100, "steps between validations (0: never)")
    eval_batches: int = _f(8, "validation batches per evaluation")
    clip: float = _f(1.0, "clip the gradients' total norm to this (0: no clipping)")
    seed: int = _f(0, "seed of the model's initialisation and the data order")
    sample_tokens: int = _f(48, "tokens generated greedily after training, shown and in <run.dir>/sample.txt (0: none)")
    sample_prompt: str | None = _f(None, "the sample's prompt (None: the start of the validation text, or 'def ')")
    # train.parity (conveyor.train.parity): rank 0 checks every step against one device.
    parity: bool = _f(False, "rank 0 also trains the unsplit model on one device and prints each step's loss and "
                             "gradient norm beside the pipeline's, and whether they are bitwise equal")


@dataclass
class LossConfig:
    normalize: str = _f("microbatch", "microbatch (mean per microbatch) | tokens (mean over the step's tokens)")
    on_nonfinite: str = _f("skip", "skip (drop the step) | stop (end the run) when loss or gradients are not finite "
                                   "(under stage.autocast=fp16 a step whose scaled gradients overflow is always "
                                   "skipped, as GradScaler skips it)")


@dataclass
class CheckpointConfig:
    dir: str | None = _f(None, "where checkpoints go (None: <run.dir>/checkpoints)")
    interval: int = _f(100, "steps between checkpoints (0: only at the end)")
    keep_last: int = _f(2, "checkpoints kept (0: all)")
    resume: bool | str = _f(False, "false | true (the latest in dir) | a checkpoint path")


@dataclass
class RunConfig:
    dir: str = _f("runs/train", "the run's directory: config, logs, pictures")
    log_interval: int = _f(10, "steps between progress lines")
    tensorboard: bool = _f(True, "rank 0 writes TensorBoard events under <run.dir>/tensorboard (if installed)")
    max_restarts: int = _f(0, "times the launcher restarts every rank after one fails; each restart "
                              "resumes from the latest checkpoint this job wrote (0: a failure ends the run)")
    device: str = _f("auto", "auto | cpu | cuda: auto trains on the GPUs (NCCL) when this machine has one per "
                             "local rank, else on the CPU (gloo), saying why; cuda insists on the GPUs")
    share_gpus: bool = _f(False, "with fewer GPUs than local ranks, put several ranks on one GPU (over gloo, "
                                 "with a warning: slower than a GPU per rank) instead of training on the CPU")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    stage: StageOptions = field(default_factory=StageOptions)  # what each stage does: the pipeline's own record
    transfer: TransferOptions = field(default_factory=TransferOptions)  # how bytes move: the pipeline's own record
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: LoopConfig = field(default_factory=LoopConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def world_size(self) -> int:
        """Processes the run needs: ``pp x dp x tp`` (1 with ``parallel.in_process``)."""
        return 1 if self.parallel.in_process else self.parallel.pp * self.parallel.dp * self.parallel.tp

    @property
    def checkpoint_dir(self) -> str:
        """``checkpoint.dir``, or ``<run.dir>/checkpoints`` when it is None."""
        return self.checkpoint.dir if self.checkpoint.dir is not None else f"{self.run.dir}/checkpoints"

    @property
    def replica_batch_size(self) -> int:
        """Sequences per step on one replica: ``train.batch_size / dp``."""
        return self.train.batch_size // self.parallel.dp

    @property
    def plan(self) -> Plan | None:
        """The :class:`~conveyor.plan.Plan` that ``parallel.plan`` names (None without one).

        Read from its file once (by :func:`load_config`) and kept with the config, which carries it
        to every rank: the checks, ``--dry-run`` and the pipeline all see the plan that was read first,
        whatever happens to the file later. A ConfigError if the file cannot be read.

        Example:
            >>> TrainConfig().plan is None
            True
        """
        path = self.parallel.plan
        if not path:
            return None
        read = self.__dict__.get("_plan_read")  # (path, Plan): not a field, so neither saved nor compared
        if read is None or read[0] != path:
            from conveyor.plan.result import Plan

            try:
                read = (path, Plan.load(path))
            except PlanError as error:
                raise ConfigError(f"parallel.plan={path!r}: {error}") from None
            self.__dict__["_plan_read"] = read
        return read[1]


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), *,
                world_size: int | None = None) -> TrainConfig:
    """The defaults, then the YAML file at ``path`` (if any), then ``overrides`` (``"section.key=value"``), checked.

    ``world_size`` (when known, e.g. from the launcher) must equal ``parallel.pp x parallel.dp x parallel.tp``.
    Raises :class:`~conveyor.errors.ConfigError` for an unknown key, a value of the wrong
    type or outside its choices or range, naming key, value and what is allowed.

    Example:
        >>> cfg = load_config(None, ["train.steps=20", "parallel.microbatches=2"])
        >>> cfg.train.steps, cfg.parallel.microbatches, cfg.checkpoint_dir
        (20, 2, 'runs/train/checkpoints')
    """
    layers = []
    if path is not None:
        layers.append((_read_yaml(Path(path)), f"in {path}"))
    if overrides:
        layers.append((_read_overrides(overrides), None))
    for node, where in layers:
        _check_keys(node, TrainConfig, "", where, overrides)
    cfg, record_problems = _merge([node for node, _ in layers])
    from conveyor.train.config_checks import validate

    expand_home(cfg)
    apply_plan(cfg)
    validate(cfg, world_size=world_size, problems=record_problems)
    return cfg


def apply_plan(cfg: TrainConfig) -> None:
    """Take schedule, virtual and microbatches from ``parallel.plan`` (a ConfigError if it cannot be read),
    its pp and tp where they split the same ranks per replica as ``parallel.pp x parallel.tp`` (the plan
    chose between stages and tensor-parallel ranks; other counts are refused by the checks), and its
    checkpoint policies per stage where it needs some and ``stage.recompute`` is not set, and its overlapped
    all-to-alls where it chose them and ``parallel.expert_overlap`` is not set (``parallel.ep`` sharing experts,
    and no recomputation or compile, which overlap cannot take).

    Example:
        >>> cfg = TrainConfig()
        >>> apply_plan(cfg)   # no plan: nothing changes
        >>> cfg.parallel.schedule
        '1f1b'
    """
    plan = cfg.plan  # the one read of the file: the config keeps it
    if plan is not None:
        cfg.parallel.schedule, cfg.parallel.virtual, cfg.parallel.microbatches = (plan.schedule, plan.virtual,
                                                                                  plan.microbatches)
        if plan.ranks * plan.tensor_parallel == cfg.parallel.pp * cfg.parallel.tp:
            cfg.parallel.pp, cfg.parallel.tp = plan.ranks, plan.tensor_parallel
        cfg.stage = _plan_recompute(plan, cfg.stage)  # the policies the plan needs to fit its memory
        if cfg.parallel.expert_overlap is None:  # not set: the plan's choice, where the run can take it
            stage = cfg.stage
            cfg.parallel.expert_overlap = bool(plan.expert_overlap and cfg.parallel.ep != 1
                                               and stage.recompute is None and not stage.compile)


def expand_home(cfg: TrainConfig) -> None:
    """Expand a leading ``~`` in every path the config holds, once, so checks and ranks read the same paths.

    Example:
        >>> cfg = load_config(None, ["run.dir=~/runs/a"])
        >>> cfg.run.dir.startswith("~")
        False
    """
    def expand(value: Any) -> Any:
        return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value

    cfg.model.name = expand(cfg.model.name)
    source = cfg.data.source
    cfg.data.source = [expand(s) for s in source] if isinstance(source, list | tuple) else expand(source)
    cfg.data.tokenizer = expand(cfg.data.tokenizer)
    cfg.run.dir = expand(cfg.run.dir)
    cfg.checkpoint.dir = expand(cfg.checkpoint.dir)
    cfg.checkpoint.resume = expand(cfg.checkpoint.resume)
    cfg.parallel.plan = expand(cfg.parallel.plan)


def save_config(cfg: TrainConfig, path: str | Path) -> Path:
    """Write ``cfg`` (resolved: no interpolations left) as YAML at ``path``; returns the path.

    Example:
        >>> import tempfile
        >>> cfg = load_config(None, ["optim.lr=3e-4"])
        >>> out = save_config(cfg, Path(tempfile.mkdtemp()) / "config.yaml")
        >>> load_config(out) == cfg
        True
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_yaml(cfg))
    return path


def config_yaml(cfg: TrainConfig) -> str:
    """``cfg`` as YAML text (what :func:`save_config` writes)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg), resolve=True)


def field_help(section: str, key: str) -> str:
    """The help text of ``section.key`` (for command-line help).

    Example:
        >>> field_help("parallel", "pp")
        'pipeline ranks'
    """
    cls = _section_types()[section]
    return next(f.metadata.get("help", "") for f in dataclasses.fields(cls) if f.name == key)


def config_reference() -> str:
    """Every key with its default and help text, one per line (``conveyor train --help`` lists them).

    Example:
        >>> config_reference().splitlines()[1].split()[:2]
        ['model.name', '(gpt):']
    """
    lines = ["configuration keys (section.key (default): meaning):"]
    # The fields' own defaults, not TrainConfig(): making the option records would import torch, and
    # `conveyor --help` (which shows this) and `conveyor simulate` run without it.
    for section, cls in _section_types().items():
        for f in dataclasses.fields(cls):
            value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  {section}.{f.name} ({value}): {f.metadata.get('help', '')}")
    return "\n".join(lines)


def _section_types() -> dict[str, type]:
    return typing.get_type_hints(TrainConfig)  # the sections, in order: TrainConfig's fields are its annotations


def _read_yaml(path: Path) -> Any:
    from omegaconf import DictConfig, OmegaConf

    if not path.is_file():
        raise ConfigError(f"config file not found: {path}; expected a YAML file such as configs/gpt.yaml "
                          f"(or leave it out to use the defaults)")
    try:
        node = OmegaConf.load(path)
    except Exception as error:  # noqa: BLE001 - YAML's own message says where the syntax broke
        raise ConfigError(f"cannot read {path} as YAML: {error}") from None
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{path} holds a {type(node).__name__}, expected a mapping of sections "
                          f"({', '.join(_section_types())})")
    return node


def _read_overrides(overrides: Sequence[str]) -> Any:
    from omegaconf import OmegaConf

    for item in overrides:
        if not isinstance(item, str) or "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form section.key=value; "
                              f"e.g. parallel.pp=2 or optim.lr=3e-4")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except Exception as error:  # noqa: BLE001 - the grammar's message names the bad item
        raise ConfigError(f"cannot read the overrides {list(overrides)}: {error}") from None


def _origin(where: str | None, key: str, overrides: Sequence[str]) -> str:
    if where is not None:
        return where
    # The override that sets ``key`` or a key under it.
    item = next((o for o in overrides if f"{o.split('=', 1)[0].strip()}.".startswith(f"{key}.")), None)
    return f"command-line override {item!r}" if item else "command-line overrides"


def _check_keys(node: Any, cls: type, prefix: str, where: str | None, overrides: Sequence[str]) -> None:
    """Every key of ``node`` is a field of ``cls`` (recursively), else a ConfigError with a close match."""
    from omegaconf import DictConfig

    fields, hints = {f.name: f for f in dataclasses.fields(cls)}, typing.get_type_hints(cls)
    for key in node:
        full = f"{prefix}{key}"
        if key not in fields and full in RENAMED_KEYS:
            raise ConfigError(f"{full} was renamed: use {RENAMED_KEYS[full]} ({_origin(where, full, overrides)})")
        if key not in fields:
            raise ConfigError(_unknown_key(full, str(key), prefix, list(fields), _origin(where, full, overrides)))
        kind = hints[key]
        value = node._get_node(key)
        if dataclasses.is_dataclass(kind):
            if not isinstance(value, DictConfig):
                raise ConfigError(f"{full!r} is a section, not a value ({_origin(where, full, overrides)}); "
                                  f"set its keys instead, e.g. {full}.{dataclasses.fields(kind)[0].name}=...")
            _check_keys(value, kind, f"{full}.", where, overrides)
        elif _wrong_length(kind, value):
            raise ConfigError(f"{full}={_plain(value)!r} ({_origin(where, full, overrides)}): expected "
                              f"{len(typing.get_args(kind))} values, e.g. {full}={list(fields[key].default)}")
        elif isinstance(value, DictConfig) and kind is not Any and typing.get_origin(kind) is not dict:
            raise ConfigError(f"{full!r} is a value, not a section ({_origin(where, full, overrides)}): "
                              f"its keys {list(value)} cannot be set; give {full}=<value>")


# Keys of earlier releases that users' YAML files still hold -> what replaces them.
RENAMED_KEYS = MappingProxyType({
    "stage.checkpoint_activations": "stage.recompute=true",
    "stage.checkpoint": "stage.recompute (the same policy or list of policies)",
})


def _wrong_length(kind: Any, value: Any) -> bool:
    """A fixed-length tuple field given a list of another length (OmegaConf's own error names no key)."""
    from omegaconf import ListConfig

    return (typing.get_origin(kind) is tuple and isinstance(value, ListConfig)
            and len(value) != len(typing.get_args(kind)))


def _plain(value: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _unknown_key(full: str, key: str, prefix: str, names: Sequence[str], origin: str) -> str:
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    hint = f"; did you mean {prefix + close[0]!r}?" if close else ";"
    if prefix:
        return (f"unknown key {full!r} ({origin}){hint} The keys of section {prefix[:-1]!r} are: "
                f"{', '.join(names)}")
    return f"unknown section {full!r} ({origin}){hint} The sections are: {', '.join(names)}"


RECORD_SECTIONS = ("stage", "transfer")  # conveyor.options records: they check themselves when made


def _merge(nodes: Sequence[Any]) -> tuple[TrainConfig, list[str]]:
    """Defaults <- each node in turn, as a TrainConfig; OmegaConf's type errors become ConfigErrors.
    Also returns what the option records refused (each such section is left at its defaults, so that
    the other checks still run and every problem is reported at once)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError, ValidationError

    schema = OmegaConf.structured(TrainConfig)
    problems: list[str] = []
    try:
        merged = OmegaConf.merge(schema, *nodes)
        for section in RECORD_SECTIONS:
            try:
                OmegaConf.to_object(merged[section])
            except PipelineConfigError as error:  # the record's own check, as the pipeline makes it
                problems.append(f"{section}.{error}")
                merged[section] = schema[section]
        cfg = OmegaConf.to_object(merged)
    except ValidationError as error:
        raise ConfigError(_type_message(error, nodes)) from None
    except InterpolationResolutionError as error:
        key = getattr(error, "full_key", None) or "?"
        raise ConfigError(f"{key}: cannot resolve an interpolation: {str(error).splitlines()[0]}; "
                          f"interpolations look like ${{run.dir}}/ckpt") from None
    cfg.optim.betas = tuple(cfg.optim.betas)  # OmegaConf may hand a list back
    return cfg, problems


def _type_message(error: Exception, nodes: Sequence[Any]) -> str:
    key = getattr(error, "full_key", None) or ""
    section, _, name = key.partition(".")
    expected = "?"
    if name and section in _section_types():
        kind = typing.get_type_hints(_section_types()[section])[name]
        expected = kind.__name__ if isinstance(kind, type) else str(kind).replace("typing.", "")
    value = _value_at(nodes, key)
    reason = str(error).splitlines()[0]
    return f"{key}={value!r}: expected {expected} ({reason})"


def _value_at(nodes: Sequence[Any], key: str) -> Any:
    from omegaconf import OmegaConf

    value = None
    for node in nodes:
        found = OmegaConf.select(node, key, default=None) if key else None
        if found is not None:
            value = _plain(found)
    return value

