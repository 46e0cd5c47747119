"""The rules a :class:`~conveyor.train.config.TrainConfig` must keep, checked before anything starts.

:func:`validate` gathers every broken rule and raises one
:class:`~conveyor.errors.ConfigError` listing them; each line names the key, the value and
what is allowed, so one run of ``conveyor train`` shows every mistake at once.

Example:
    >>> from conveyor.train.config import TrainConfig
    >>> cfg = TrainConfig()
    >>> cfg.parallel.microbatches = 3
    >>> validate(cfg)  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    conveyor.errors.ConfigError: parallel.microbatches=3: must divide the per-replica batch
        train.batch_size / parallel.dp = 16 / 1 = 16; try one of 1, 2, 4, 8, 16
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from conveyor.errors import ConfigError, ScheduleError
from conveyor.train import sources
from conveyor.train.config import RECIPES, model_kind
from conveyor.train.expert_shards import expert_size
from conveyor.train.parity import parity_problems

CHOICES = MappingProxyType({
    "parallel.data_parallel": ("ddp", "fsdp"),
    "optim.lr_schedule": ("cosine", "constant"),
    "loss.normalize": ("microbatch", "tokens"),
    "data.batching": ("windows", "by_length"),
    "loss.on_nonfinite": ("skip", "stop"),
    "run.device": ("auto", "cpu", "cuda"),
})
# key -> (lowest, highest, whether the lowest itself is refused); None: unbounded.
RANGES = MappingProxyType({
    "model.layers": (1, None, False), "model.width": (1, None, False), "model.heads": (1, None, False),
    "model.seq_len": (1, None, False), "model.intermediate": (1, None, False), "model.kv_heads": (1, None, False),
    "data.val_fraction": (0.0, 1.0, False), "data.max_bytes": (1, None, False),
    "parallel.pp": (1, None, False), "parallel.virtual": (1, None, False),
    "parallel.microbatches": (1, None, False), "parallel.dp": (1, None, False), "parallel.tp": (1, None, False),
    "optim.lr": (0.0, None, True), "optim.weight_decay": (0.0, None, False),
    "optim.warmup_steps": (0, None, False), "optim.min_lr_ratio": (0.0, 1.0, False),
    "train.steps": (1, None, False), "train.batch_size": (1, None, False),
    "train.eval_interval": (0, None, False), "train.eval_batches": (1, None, False),
    "train.clip": (0.0, None, False), "train.seed": (0, None, False),
    "train.sample_tokens": (0, None, False),
    "checkpoint.interval": (0, None, False), "checkpoint.keep_last": (0, None, False),
    "run.log_interval": (1, None, False), "run.max_restarts": (0, None, False),
})

_SIZE_KEYS = ("parallel.", "train.batch_size", "model.layers")


def validate(cfg: Any, *, world_size: int | None = None, problems: Sequence[str] = ()) -> None:
    """Raise a ConfigError listing every rule ``cfg`` breaks (nothing when it keeps them all).

    ``world_size``, when known, must equal ``parallel.pp x parallel.dp x parallel.tp``. ``problems``: found before
    (the option records' own refusals), listed with the rest.
    """
    problems = list(problems)
    _check_choices_and_ranges(cfg, problems)
    _check_model(cfg, problems)
    _check_data(cfg, problems)
    _check_optim(cfg, problems)
    # The size rules divide by these: meaningful only once they are in range.
    if not any(p.startswith(_SIZE_KEYS) for p in problems):
        _check_parallel(cfg, problems, world_size)
    _check_checkpoint(cfg, problems)
    problems.extend(parity_problems(cfg))
    if problems:
        if len(problems) == 1:
            raise ConfigError(problems[0])
        raise ConfigError(f"{len(problems)} problems in the config:\n" + "\n".join(f"  - {p}" for p in problems))


def _get(cfg: Any, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _check_choices_and_ranges(cfg: Any, problems: list[str]) -> None:
    for key, choices in CHOICES.items():
        value = _get(cfg, key)
        if value not in choices:
            problems.append(f"{key}={value!r}: expected one of {', '.join(choices)}{_close(value, choices)}")
    for key, (low, high, low_open) in RANGES.items():
        value = _get(cfg, key)
        if value is None:
            continue
        too_low = value <= low if low_open else value < low
        too_high = high is not None and (value >= high if key == "data.val_fraction" else value > high)
        if too_low or too_high:
            problems.append(f"{key}={value!r}: expected {_describe_range(key, low, high, low_open)}")


def _describe_range(key: str, low: float, high: float | None, low_open: bool) -> str:
    if high is None:
        return f"a value > {low}" if low_open else f"a value >= {low}"
    upper = "<" if key == "data.val_fraction" else "<="
    return f"{low} <= value {upper} {high}"


def _close(value: Any, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_model(cfg: Any, problems: list[str]) -> None:
    name, model = cfg.model.name, cfg.model
    if name.startswith("hf:"):
        if not name[3:].isidentifier():
            problems.append(f"model.name={name!r}: after 'hf:' comes a transformers class name, "
                            f"e.g. hf:GPT2LMHeadModel")
    elif name not in RECIPES and not Path(name).expanduser().is_dir():
        problems.append(f"model.name={name!r}: expected one of {', '.join(RECIPES)}, "
                        f"hf:<transformers class name>, or a local pretrained directory (no directory "
                        f"{name!r} here){_close(name, list(RECIPES))}")
    if model.heads >= 1 and model.width >= 1 and model.width % model.heads:
        problems.append(f"model.heads={model.heads}: must divide model.width={model.width}")
    _check_model_sizes(model, problems)
    # Seeing into a class or a directory imports transformers: only when one is named, or config fields are.
    if not (name in RECIPES and not model.hf_config) and not any(p.startswith("model.name") for p in problems):
        from conveyor.train.models import check_model

        problems.extend(check_model(model))


def _check_model_sizes(model: Any, problems: list[str]) -> None:
    kv, heads = model.kv_heads, model.heads
    if kv is not None and kv >= 1 and heads >= 1:
        if model.name in ("gpt", "mpt") and kv != heads:
            problems.append(f"model.kv_heads={kv}: {model.name} has no grouped-query attention; leave it null "
                            f"(or use model.name=llama)")
        elif heads % kv:
            problems.append(f"model.kv_heads={kv}: must divide model.heads={heads}")
    mlp = model.intermediate
    if model.name == "mpt" and mlp is not None and mlp >= 1 and model.width >= 1 and mlp % model.width:
        problems.append(f"model.intermediate={mlp}: mpt's MLP is a whole multiple of model.width={model.width}; "
                        f"try {max(1, round(mlp / model.width)) * model.width}")


def _check_data(cfg: Any, problems: list[str]) -> None:
    data = cfg.data
    if data.format is not None and data.format not in sources.FORMATS:
        problems.append(f"data.format={data.format!r}: expected one of {', '.join(sources.FORMATS)}, or "
                        f"null to infer it from each file's suffix{_close(data.format, sources.FORMATS)}")
    try:
        files = sources.source_files(data.source)
        if any(sources.file_format(path, data.format) == "parquet" for path in files):
            sources.require_pyarrow()
    except ConfigError as error:
        problems.append(str(error))
    if data.tokenizer != "bytes" and not Path(data.tokenizer).expanduser().is_dir():
        problems.append(f"data.tokenizer={data.tokenizer!r}: expected 'bytes' or a local tokenizer "
                        f"directory (no directory {data.tokenizer!r} here)")
    if cfg.train.eval_interval > 0 and data.val_fraction == 0:
        problems.append(f"data.val_fraction=0 leaves nothing to validate on, but train.eval_interval="
                        f"{cfg.train.eval_interval}; set data.val_fraction (e.g. 0.05) or train.eval_interval=0")
    if cfg.train.sample_prompt == "":
        problems.append("train.sample_prompt='': expected a text to continue (e.g. 'def '), or null for the "
                        "start of the validation text; train.sample_tokens=0 turns the sample off")


def _check_optim(cfg: Any, problems: list[str]) -> None:
    betas = cfg.optim.betas
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        problems.append(f"optim.betas={list(betas)!r}: expected two numbers in [0, 1), e.g. [0.9, 0.95]")
    stage = cfg.stage
    if stage.param_dtype is not None and stage.grad_accum_dtype != "none":
        # The loop's AdamW steps the parameters' .grad; main_grad is read by conveyor.MasterWeights alone.
        problems.append(f"stage.param_dtype={stage.param_dtype!r}: its gradients accumulate in fp32 main_grad, "
                        "which conveyor train's AdamW does not read (it would train nothing); use "
                        f"stage.autocast={stage.param_dtype} with fp32 parameters instead"
                        + ("" if stage.param_dtype == "fp16" else
                           ", or stage.grad_accum_dtype=none (gradients summed in .grad, in that dtype)"))


def _check_parallel(cfg: Any, problems: list[str], world_size: int | None) -> None:
    par, loop = cfg.parallel, cfg.train
    if loop.batch_size % par.dp:
        problems.append(f"train.batch_size={loop.batch_size}: must split evenly over parallel.dp={par.dp} "
                        f"replicas; try a multiple of {par.dp}")
        return
    per_replica = loop.batch_size // par.dp
    if per_replica % par.microbatches:
        divisors = ", ".join(str(d) for d in range(1, per_replica + 1) if per_replica % d == 0)
        problems.append(f"parallel.microbatches={par.microbatches}: must divide the per-replica batch "
                        f"train.batch_size / parallel.dp = {loop.batch_size} / {par.dp} = {per_replica}; "
                        f"try one of {divisors}")
    if par.in_process and par.dp != 1:
        problems.append(f"parallel.in_process=true runs one replica's pipeline ranks in one process, but "
                        f"parallel.dp={par.dp}; set parallel.dp=1 or parallel.in_process=false")
    if par.in_process and par.tp != 1:
        problems.append(f"parallel.in_process=true runs every pipeline rank in one process, but parallel.tp="
                        f"{par.tp} needs a process per tensor-parallel rank; set parallel.tp=1 or "
                        f"parallel.in_process=false")
    if world_size is not None and cfg.world_size != world_size:
        problems.append(_world_mismatch(par, world_size) if not par.in_process else
                        f"parallel.in_process=true runs in one process, but the job has {world_size} ranks; "
                        f"launch one process")
    _check_plan(cfg, problems)
    _check_schedule(cfg, problems)
    _check_tensor_parallel(cfg, problems)
    _check_expert_parallel(cfg, problems)


def _world_mismatch(par: Any, world_size: int) -> str:
    """The launched ranks are not ``pp x dp x tp``: say so, with the sizes that would fit."""
    product = par.pp * par.dp * par.tp
    text = (f"parallel.pp x parallel.dp x parallel.tp = {par.pp} x {par.dp} x {par.tp} = {product}, but the job "
            f"has {world_size} ranks; make pp x dp x tp equal {world_size}")
    if world_size % par.tp:
        text += f" (parallel.tp={par.tp} must divide the {world_size} ranks)"
    elif par.tp > 1 and world_size % (par.tp * par.dp) == 0:
        text += f", e.g. parallel.pp={world_size // (par.tp * par.dp)} with parallel.dp={par.dp} x parallel.tp={par.tp}"
    return text


def _check_expert_parallel(cfg: Any, problems: list[str]) -> None:
    """``parallel.ep``: "auto" or a size that divides ``parallel.dp x parallel.tp`` (EP borrows those ranks) and the
    recipe's expert count where its ``hf_config`` gives one; not in one process."""
    par, ep = cfg.parallel, cfg.parallel.ep
    capacity = par.expert_capacity
    if capacity is not None and not (math.isfinite(capacity) and capacity > 0):  # a float: the loader's type check
        problems.append(f"parallel.expert_capacity={capacity!r}: expected a capacity factor > 0 (e.g. 1.25), or "
                        "null to drop no token")
    elif capacity is not None and ep == 1:
        problems.append(f"parallel.expert_capacity={capacity} caps what each expert takes of a rank's tokens under "
                        "expert parallelism, which parallel.ep=1 leaves off; set parallel.ep (e.g. 'auto') or drop "
                        "parallel.expert_capacity")
    if par.expert_overlap and ep == 1:
        problems.append("parallel.expert_overlap=true hides expert parallelism's all-to-alls, which parallel.ep=1 "
                        "leaves off; set parallel.ep (e.g. 'auto') or drop parallel.expert_overlap")
    if ep == 1:
        return
    if not (ep == "auto" or (isinstance(ep, int) and ep > 1)):  # an int or a str, never a bool: the loader's check
        problems.append(f"parallel.ep={ep!r}: expected 'auto' (ep = parallel.dp) or a size >= 1 (1: no expert "
                        "parallelism)")
        return
    size = expert_size(par)
    if par.in_process:
        problems.append(f"parallel.ep={ep} moves tokens between processes, but parallel.in_process=true; set "
                        "parallel.ep=1 or parallel.in_process=false")
    if par.dp * par.tp < 2 or (par.dp * par.tp) % size:
        problems.append(f"parallel.ep={ep}: expert parallelism spreads the experts over the data-parallel replicas, "
                        f"which parallel.dp={par.dp} does not divide into groups of {size}; set parallel.dp to a "
                        f"multiple of {size} (e.g. parallel.dp={max(2, size)}) or parallel.ep=1"
                        if par.tp == 1 else
                        f"parallel.ep={ep}: expert parallelism spreads the experts over the replicas' TP ranks, "
                        f"parallel.dp x parallel.tp = {par.dp * par.tp}, which groups of {size} do not divide; "
                        "choose an ep dividing it or parallel.ep=1")
    hf_config = cfg.model.hf_config  # the recipe's experts per layer, where it names them (Mixtral's or Qwen's key)
    experts = next((hf_config[key] for key in ("num_local_experts", "num_experts")
                    if isinstance(hf_config.get(key), int)), None)
    if experts is not None and size > 0 and experts % size:
        problems.append(f"parallel.ep={ep} (groups of {size}) does not divide the model's {experts} experts; choose "
                        f"an ep dividing {experts} and parallel.dp")


def _check_tensor_parallel(cfg: Any, problems: list[str]) -> None:
    """sequence_parallel goes with tp; the model takes the "auto" plan at tp (built on the meta device)."""
    par = cfg.parallel
    if par.sequence_parallel and par.tp == 1:
        problems.append("parallel.sequence_parallel=true shards the activations over the tensor-parallel ranks, but "
                        "parallel.tp=1; set parallel.tp > 1 (e.g. 2) or parallel.sequence_parallel=false")
        return
    if par.tp == 1 or any(p.startswith(("model.", "data.tokenizer")) for p in problems):
        return
    # Sizes the config itself gives are checked first, by arithmetic: a tp that does not divide them is
    # refused at once, before torch and transformers are imported and the model is built on the meta device.
    quick = head_count_problems(cfg)
    if quick:
        problems.extend(quick)
        return
    from conveyor.train.tensor_parallel import tensor_parallel_problems

    problems.extend(tensor_parallel_problems(cfg))


def head_count_problems(cfg: Any, up_to: int = 8) -> list[str]:
    """A recipe's attention heads (``model.heads``, ``model.kv_heads``) that ``parallel.tp`` does not divide, from
    the config alone (tensor parallelism splits attention by heads); empty when they divide, or when the
    sizes come from elsewhere (a pretrained directory's config.json, an ``hf:`` class).

    Example:
        >>> from conveyor.train.config import TrainConfig
        >>> cfg = TrainConfig()
        >>> cfg.parallel.tp = 3
        >>> print(head_count_problems(cfg)[0])  # doctest: +NORMALIZE_WHITESPACE
        parallel.tp=3 does not divide model.heads=4 (tensor parallelism splits attention by heads); choose a
        tp that divides it (up to 8: 1, 2, 4), or change model.heads
    """
    model, tp = cfg.model, cfg.parallel.tp
    if ":" in model.name or Path(model.name).expanduser().exists():
        return []
    sizes = {"model.heads": model.heads}
    if model.kv_heads is not None:
        sizes["model.kv_heads"] = model.kv_heads
    undivided = [key for key, size in sizes.items() if isinstance(size, int) and size > 0 and size % tp]
    if not undivided:
        return []
    fits = [t for t in range(1, max(up_to, tp) + 1) if all(size % t == 0 for size in sizes.values())]
    named = " and ".join(f"{key}={sizes[key]}" for key in undivided)
    return [f"parallel.tp={tp} does not divide {named} (tensor parallelism splits attention by heads); choose a tp "
            f"that divides {'them' if len(undivided) > 1 else 'it'} (up to {max(up_to, tp)}: "
            f"{', '.join(map(str, fits))}), or change {' and '.join(undivided)}"]


def _check_plan(cfg: Any, problems: list[str]) -> None:
    """A plan (already read and applied by load_config, which refuses one it cannot read) is for this many
    pipeline ranks."""
    plan = cfg.plan  # read once, by the config
    if plan is None:
        return
    tp = plan.tensor_parallel
    if plan.ranks != cfg.parallel.pp and tp != 1:
        problems.append(f"parallel.plan={cfg.parallel.plan!r} is for {plan.ranks} pipeline ranks of {tp} "
                        f"tensor-parallel ranks but parallel.pp={cfg.parallel.pp}; set parallel.pp={plan.ranks} "
                        f"parallel.tp={tp}, or plan again with --ranks {cfg.parallel.pp * cfg.parallel.tp} --tp "
                        f"{cfg.parallel.tp}")
    elif plan.ranks != cfg.parallel.pp:
        problems.append(f"parallel.plan={cfg.parallel.plan!r} is for {plan.ranks} pipeline ranks but parallel.pp="
                        f"{cfg.parallel.pp}; set parallel.pp={plan.ranks} or plan again with --ranks {cfg.parallel.pp}")
    elif tp != cfg.parallel.tp:
        problems.append(f"parallel.plan={cfg.parallel.plan!r} is for pipeline ranks of {tp} tensor-parallel ranks "
                        f"but parallel.tp={cfg.parallel.tp}; set parallel.tp={tp} or plan again with --tp "
                        f"{cfg.parallel.tp}")
    elif plan.global_batch != cfg.replica_batch_size:
        problems.append(f"parallel.plan={cfg.parallel.plan!r} was made for a batch of {plan.global_batch} per "
                        f"replica, the run has train.batch_size / parallel.dp = {cfg.replica_batch_size}; set "
                        f"train.batch_size={plan.global_batch * cfg.parallel.dp} or plan again with --global-batch "
                        f"{cfg.replica_batch_size}")


def _check_schedule(cfg: Any, problems: list[str]) -> None:
    """The schedule exists and serves these sizes (building it is pure Python and quick)."""
    import conveyor.schedule as cs

    par = cfg.parallel
    known = cs.available()
    if par.schedule not in known:
        problems.append(f"parallel.schedule={par.schedule!r}: expected one of {', '.join(known)}"
                        f"{_close(par.schedule, list(known))}")
        return
    virtual = par.virtual if par.virtual is not None else known[par.schedule].default_virtual
    try:
        schedule = cs.build(par.schedule, ranks=par.pp, microbatches=par.microbatches, virtual=virtual)
    except ScheduleError as error:
        problems.append(f"parallel.schedule={par.schedule!r} with parallel.pp={par.pp}, "
                        f"parallel.microbatches={par.microbatches}, virtual={virtual}: "
                        f"{str(error).splitlines()[0]}")
        return
    stages = par.pp * virtual
    if model_kind(cfg.model.name) != "pretrained" and cfg.model.layers < stages:  # a directory sizes itself
        problems.append(f"model.layers={cfg.model.layers}: the pipeline has parallel.pp x virtual = "
                        f"{par.pp} x {virtual} = {stages} stages, each needs a block; give at least "
                        f"{stages} layers or fewer stages")
    _check_tied_replicas(cfg, schedule, problems)


def _check_tied_replicas(cfg: Any, schedule: Any, problems: list[str]) -> None:
    """Replicas of a pipeline whose first and last stage share the embedding: what the pipeline
    would refuse on every rank (conveyor.parallel.fsdp.check_supported), said here before any starts."""
    par = cfg.parallel
    stages = schedule.num_stages
    same_rank = schedule.placement.rank_of(0) == schedule.placement.rank_of(stages - 1)
    if (par.dp == 1 or stages == 1 or not (par.data_parallel == "fsdp" or same_rank)
            or any(p.startswith("model.") for p in problems)):
        return
    from conveyor.train.models import ties_embeddings

    if not ties_embeddings(cfg.model):
        return
    if par.data_parallel == "fsdp":
        problems.append(f"parallel.data_parallel='fsdp' with model.name={cfg.model.name!r}: its embedding is tied "
                        f"to the output head on the first and last stage, and FSDP cannot shard one parameter "
                        f"for two stages; use parallel.data_parallel=ddp, an untied model (llama, or "
                        f"model.hf_config.tie_word_embeddings=false), or parallel.dp=1")
    else:
        problems.append(f"parallel.schedule={par.schedule!r} puts the first and last stage on one rank, where "
                        f"model.name={cfg.model.name!r} uses its tied embedding twice, which replicas "
                        f"(parallel.dp={par.dp}) cannot reduce; use a schedule such as 1f1b or interleaved-1f1b, "
                        f"an untied model, or parallel.dp=1")


def _check_checkpoint(cfg: Any, problems: list[str]) -> None:
    resume = cfg.checkpoint.resume
    if isinstance(resume, str) and not Path(resume).expanduser().exists():
        problems.append(f"checkpoint.resume={resume!r}: no such checkpoint; expected false, true (the "
                        f"latest in the checkpoint directory) or an existing checkpoint path")
