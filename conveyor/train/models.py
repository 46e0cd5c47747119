"""The models ``conveyor train`` builds from ``cfg.model``: transformers models made from a config, no download.

``model.name`` is one of:

* a recipe: ``gpt`` (GPT-2: learned positions, LayerNorm, embedding tied to the head),
  ``llama`` (RMSNorm, rotary positions, SwiGLU, an untied head, grouped-query attention
  through ``model.kv_heads``), ``mpt`` (ALiBi instead of positions, no biases, tied head) or
  ``moe`` (Mixtral: llama's blocks with a mixture of SwiGLU experts, 4 experts and 2 per token
  unless ``model.hf_config`` says otherwise, ``model.intermediate`` per expert; its router
  logits reach the loss, which adds ``router_aux_loss_coef`` x the load-balancing loss, see
  :func:`aux_loss_coefficient`);
* ``hf:<class>``, any transformers causal-LM class (``hf:Qwen2ForCausalLM``), built from its
  config class with the sizes derived from ``model.layers/width/heads/seq_len/intermediate/
  kv_heads`` and the tokenizer's vocabulary;
* a local pretrained directory (``config.json`` + safetensors, as ``save_pretrained`` writes):
  the model is built on the meta device from its ``config.json`` (the ``model`` sizes are not
  used), and each rank reads only its own stages' weights (:func:`load_weights`).

``model.hf_config`` (extra config fields) goes over what is derived, or over ``config.json``.
Dropout is off wherever the config has it: the runs are short, and without it a resumed run
repeats the uninterrupted one bit for bit.

Example:
    >>> from conveyor.train.config import load_config
    >>> model = build_model(load_config(None, ["model.layers=2", "model.width=32"]), 256)
    >>> type(model).__name__
    'GPT2LMHeadModel'
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from conveyor.errors import ConfigError
from conveyor.train.config import RECIPES, ModelConfig, TrainConfig, model_kind

# Where a config class keeps the context length and the MLP width, under the first of these it has.
_POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
_MLP_FIELDS = ("intermediate_size", "n_inner", "ffn_dim")
_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def build_model(cfg: TrainConfig, vocab_size: int, *, device: torch.device | str | None = None) -> torch.nn.Module:
    """The model ``cfg.model`` names, freshly initialised from the current torch seed (no download).

    ``device="meta"`` builds it without allocating parameters (the dry run; a pretrained
    directory is always built there, since its weights come from the files, per stage).

    Example:
        >>> from conveyor.train.config import load_config
        >>> model = build_model(load_config(None, ["model.layers=2", "model.width=32"]), 256)
        >>> model.config.n_layer, model.config.vocab_size
        (2, 256)
    """
    cls, config = model_config(cfg.model, vocab_size)
    if device is None and model_kind(cfg.model.name) == "pretrained":
        device = "meta"
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return cls(config)


def meta_model(cfg: TrainConfig) -> torch.nn.Module:
    """The model ``cfg`` describes, sized for its tokenizer's vocabulary, built on the meta device (nothing
    allocated): what the launcher's checks, the dry run and the ranks' tracing start from.

    Example:
        >>> from conveyor.train.config import load_config
        >>> next(meta_model(load_config(None, ["model.layers=2", "model.width=32"])).parameters()).device.type
        'meta'
    """
    from conveyor.train.data import load_tokenizer

    return build_model(cfg, load_tokenizer(cfg.data.tokenizer).vocab_size, device="meta")


def model_config(m: ModelConfig, vocab_size: int) -> tuple[type, Any]:
    """The transformers model class and the config ``m`` describes (for a tokenizer of ``vocab_size``).

    Example:
        >>> from conveyor.train.config import ModelConfig
        >>> cls, config = model_config(ModelConfig(name="mpt", layers=2, width=32, heads=4), 256)
        >>> cls.__name__, config.n_layers, config.expansion_ratio, config.tie_word_embeddings
        ('MptForCausalLM', 2, 4, True)
    """
    kind = model_kind(m.name)
    if kind == "pretrained":
        cls, config = pretrained_config(m.name, dict(m.hf_config))
        problems = pretrained_misfits(config, m, vocab_size)
        if problems:
            raise ConfigError("; ".join(problems))
        return cls, config
    cls = causal_lm_class(RECIPES[m.name] if kind == "recipe" else m.name[3:], f"model.name={m.name!r}")
    fields = _RECIPE_FIELDS[m.name](m, vocab_size) if kind == "recipe" else derived_fields(cls.config_class, m,
                                                                                           vocab_size)
    config = cls.config_class(**{**fields, **dict(m.hf_config)})
    return cls, config


def _gpt_fields(m: ModelConfig, vocab: int) -> dict[str, Any]:
    return dict(n_layer=m.layers, n_embd=m.width, n_head=m.heads, n_positions=m.seq_len, n_inner=m.intermediate,
                vocab_size=vocab, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                bos_token_id=0, eos_token_id=0)


def _llama_fields(m: ModelConfig, vocab: int) -> dict[str, Any]:
    return dict(num_hidden_layers=m.layers, hidden_size=m.width, num_attention_heads=m.heads,
                num_key_value_heads=m.kv_heads or m.heads, intermediate_size=m.intermediate or 4 * m.width,
                max_position_embeddings=m.seq_len, vocab_size=vocab, tie_word_embeddings=False,
                use_cache=False, bos_token_id=0, eos_token_id=0)


def _mpt_fields(m: ModelConfig, vocab: int) -> dict[str, Any]:
    # MPT's MLP is expansion_ratio x d_model wide (config_checks keeps intermediate a multiple of width);
    # attn_pdrop is typed int in transformers 5 (0.0 fails its strict check).
    return dict(n_layers=m.layers, d_model=m.width, n_heads=m.heads,
                expansion_ratio=(m.intermediate or 4 * m.width) // m.width, max_seq_len=m.seq_len,
                vocab_size=vocab, resid_pdrop=0.0, emb_pdrop=0.0, no_bias=True, tie_word_embeddings=True,
                attn_config={"alibi": True, "attn_pdrop": 0}, use_cache=False)


def _moe_fields(m: ModelConfig, vocab: int) -> dict[str, Any]:
    # Mixtral's intermediate_size is one expert's; 2 of 4 experts per token keep a token's MLP work at
    # 2 x intermediate. The router logits must come out for the loss to add the load-balancing loss.
    return dict(_llama_fields(m, vocab), num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                router_aux_loss_coef=0.02, router_jitter_noise=0.0)


_RECIPE_FIELDS = MappingProxyType({"gpt": _gpt_fields, "llama": _llama_fields, "mpt": _mpt_fields, "moe": _moe_fields})


def aux_loss_coefficient(model: torch.nn.Module) -> float | None:
    """The weight of ``model``'s auxiliary (load-balancing) loss in the training loss, or None if it has none.

    A transformers mixture-of-experts model (Mixtral, Qwen2-MoE, OLMoE, ...) built with
    ``output_router_logits=True`` returns ``aux_loss`` (its load-balancing loss over the router
    logits of every layer) and adds ``router_aux_loss_coef`` x it to the language-model loss
    when given labels; ``conveyor train`` gives the pipeline's loss the same sum.

    Example:
        >>> from conveyor.train.config import load_config
        >>> cfg = load_config(None, ["model.name=moe", "model.layers=2", "model.width=32"])
        >>> aux_loss_coefficient(build_model(cfg, 256, device="meta"))
        0.02
        >>> aux_loss_coefficient(build_model(load_config(None, ["model.layers=2"]), 256, device="meta")) is None
        True
    """
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return None
    coefficient = getattr(config, "router_aux_loss_coef", None)
    return float(coefficient) if coefficient is not None else None


def derived_fields(config_class: type, m: ModelConfig, vocab_size: int) -> dict[str, Any]:
    """The config fields ``hf:<class>`` gets from ``m``: sizes under the names the class knows, no dropout.

    A config class maps the common names (``hidden_size``, ``num_hidden_layers``) to its own
    (GPT-2's ``n_embd``); the context length and the MLP width go under the first name it has.

    Example:
        >>> from transformers import Qwen2Config
        >>> from conveyor.train.config import ModelConfig
        >>> fields = derived_fields(Qwen2Config, ModelConfig(layers=2, width=64, heads=4, kv_heads=2), 256)
        >>> fields["num_key_value_heads"], fields["intermediate_size"], fields["max_position_embeddings"]
        (2, 256, 128)
    """
    default = config_class()
    missing = [name for name in ("num_hidden_layers", "hidden_size", "vocab_size") if not hasattr(default, name)]
    if missing:
        raise ConfigError(f"model.name='hf:...': {config_class.__name__} has no {', '.join(missing)}, so "
                          f"model.layers/width and the vocabulary cannot be set on it; this class is not a "
                          f"transformer language model conveyor train can size")
    fields: dict[str, Any] = {"num_hidden_layers": m.layers, "hidden_size": m.width, "vocab_size": vocab_size,
                              "use_cache": False}
    if hasattr(default, "num_attention_heads"):
        fields["num_attention_heads"] = m.heads
    if hasattr(default, "num_key_value_heads"):
        fields["num_key_value_heads"] = m.kv_heads or m.heads
    for names, value in ((_POSITION_FIELDS, m.seq_len), (_MLP_FIELDS, m.intermediate or 4 * m.width)):
        name = next((n for n in names if hasattr(default, n)), None)
        if name is not None:
            fields[name] = value
    for name, value in default.to_dict().items():
        if isinstance(value, float) and ("dropout" in name or "pdrop" in name):
            fields[name] = 0.0
        elif name in _TOKEN_FIELDS and isinstance(value, int) and value >= vocab_size:
            fields[name] = None  # the class's ids belong to its own tokenizer, outside this vocabulary
    return fields


def causal_lm_class(name: str, where: str) -> type:
    """The transformers class ``name``, checked to be a causal language model (else a ConfigError).

    Example:
        >>> causal_lm_class("Qwen2ForCausalLM", "model.name").__name__
        'Qwen2ForCausalLM'
        >>> causal_lm_class("BertModel", "model.name")  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        conveyor.errors.ConfigError: model.name: BertModel is a transformers class but not a causal language model;
        expected one such as GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM (any of transformers' *ForCausalLM
        classes)
    """
    import transformers

    causal = causal_lm_names()
    cls = getattr(transformers, name, None) if name.isidentifier() else None
    if cls is None:
        close = difflib.get_close_matches(name, sorted(causal), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{where}: transformers {transformers.__version__} has no class {name!r}{hint} Expected a "
                          f"causal language model class such as LlamaForCausalLM or Qwen2ForCausalLM")
    if name not in causal or not inspect.isclass(cls):
        raise ConfigError(f"{where}: {name} is a transformers class but not a causal language model; expected one "
                          f"such as GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM (any of transformers' "
                          f"*ForCausalLM classes)")
    return cls


def causal_lm_names() -> set[str]:
    """The class names transformers builds causal language models with (``AutoModelForCausalLM``'s)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    # A model type maps to one class name or to several.
    return {name for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
            for name in ([value] if isinstance(value, str) else value)}


def pretrained_config(directory: str, overrides: dict[str, Any] | None = None) -> tuple[type, Any]:
    """The causal-LM class and config of a local pretrained ``directory`` (its ``config.json``; no download).

    ``overrides`` (``model.hf_config``) go over the file's fields.

    Example:
        >>> pretrained_config("/nowhere")  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        conveyor.errors.ConfigError: model.name='/nowhere': no config.json there; a pretrained model directory holds
        config.json and model.safetensors (what save_pretrained(..., safe_serialization=True) writes)
    """
    from transformers import AutoConfig

    where = f"model.name={directory!r}"
    path = Path(directory).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(f"{where}: no config.json there; a pretrained model directory holds config.json and "
                          f"model.safetensors (what save_pretrained(..., safe_serialization=True) writes)")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True, use_cache=False, **(overrides or {}))
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError(f"{where}: cannot read its config.json ({error}); expected one written by "
                          f"save_pretrained") from None
    architectures = getattr(config, "architectures", None) or []
    if architectures:
        return causal_lm_class(architectures[0], f"{where} (config.json's architectures)"), config
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if name is None:
        raise ConfigError(f"{where}: config.json names no architectures and model_type {config.model_type!r} has "
                          f"no causal language model in transformers; add \"architectures\": [\"...ForCausalLM\"]")
    return causal_lm_class(name if isinstance(name, str) else name[0], where), config


def pretrained_misfits(config: Any, m: ModelConfig, vocab_size: int | None = None) -> list[str]:
    """What keeps a pretrained ``config`` from training on ``model.seq_len`` windows of a tokenizer's ids."""
    problems = []
    positions = next((getattr(config, n) for n in _POSITION_FIELDS if getattr(config, n, None)), None)
    if positions is not None and m.seq_len > positions:
        problems.append(f"model.seq_len={m.seq_len}: the pretrained model at {m.name!r} takes at most {positions} "
                        f"positions; set model.seq_len <= {positions}")
    if vocab_size is not None and vocab_size > config.vocab_size:
        problems.append(f"the tokenizer has {vocab_size} ids but the pretrained model at {m.name!r} embeds only "
                        f"{config.vocab_size}; use the model's own tokenizer (data.tokenizer={m.name!r} if it is "
                        f"saved there)")
    return problems


def ties_embeddings(m: ModelConfig) -> bool:
    """Whether the model ``m`` describes shares its input embedding with its output head.

    Example:
        >>> from conveyor.train.config import ModelConfig
        >>> ties_embeddings(ModelConfig(name="mpt")), ties_embeddings(ModelConfig(name="llama"))
        (True, False)
    """
    config = pretrained_config(m.name, dict(m.hf_config))[1] if model_kind(m.name) == "pretrained" \
        else model_config(m, 256)[1]  # the vocabulary does not decide it
    return bool(getattr(config, "tie_word_embeddings", False))


def load_weights(cfg: TrainConfig, pipe: Any) -> Any:
    """Fill this rank's stages from ``model.name`` when it is a pretrained directory; returns the
    :class:`~conveyor.frontend.pretrained.PretrainedReport` (None for a model built from scratch).

    Example (each rank, after building the pipeline)::

        report = load_weights(cfg, pipe)     # report.tensors, report.bytes_read
    """
    if model_kind(cfg.model.name) != "pretrained":
        return None
    return pipe.load_pretrained(str(Path(cfg.model.name).expanduser()))


def check_model(m: ModelConfig) -> list[str]:
    """The problems of ``m`` that need transformers to see: an unknown or non-causal class, a directory
    without config.json, ``hf_config`` keys the config class does not have or values it refuses
    (checked in the launcher, before any rank starts).

    Example:
        >>> from conveyor.train.config import ModelConfig
        >>> check_model(ModelConfig(name="llama", hf_config={"rms_norm_epss": 1e-5}))
        ["model.hf_config.rms_norm_epss: LlamaConfig has no field 'rms_norm_epss'; did you mean 'rms_norm_eps'?"]
    """
    kind = model_kind(m.name)
    try:
        if kind == "pretrained":
            config = pretrained_config(m.name)[1]
            config_class = type(config)
            problems = pretrained_misfits(config, m)
            if problems:
                return problems
        else:
            config_class = causal_lm_class(RECIPES.get(m.name) or m.name[3:], f"model.name={m.name!r}").config_class
    except ConfigError as error:
        return [str(error)]
    unknown = [_unknown_field(config_class, key) for key in m.hf_config if not _has_field(config_class, key)]
    if unknown:
        return unknown
    try:
        # The whole config, as the ranks will build it (the vocabulary is the tokenizer's; any will do here).
        model_config(m, 256) if kind != "pretrained" else pretrained_config(m.name, dict(m.hf_config))
    except ConfigError as error:
        return [str(error)]
    except Exception as error:  # noqa: BLE001 - the config class's own check names the field; said here, before any rank
        first = str(error).strip().splitlines()
        return [f"model.hf_config={dict(m.hf_config)!r}: {config_class.__name__} refuses the config: "
                f"{type(error).__name__}: {' '.join(line.strip() for line in first[:3])}"]
    return []


def _has_field(config_class: type, key: str) -> bool:
    if hasattr(config_class(), key) or key in inspect.signature(config_class).parameters:
        return True
    # A legacy name the class turns into one of its fields (LlamaConfig's rope_theta goes into
    # rope_parameters) is consumed; an unknown one is kept as a plain attribute that nothing reads.
    try:
        return not hasattr(config_class(**{key: None}), key)
    except Exception:  # noqa: BLE001 - refused outright: the class knows the name (the value is checked later)
        return True


def _unknown_field(config_class: type, key: str) -> str:
    known = sorted(config_class().to_dict())
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else f"; its fields are: {', '.join(known)}"
    return f"model.hf_config.{key}: {config_class.__name__} has no field {key!r}{hint}"
