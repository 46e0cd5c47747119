"""A key/value cache for traced Hugging Face causal LMs: a decode program cut like the training one.

The training trace has no cache (:mod:`conveyor.frontend.trace` turns it off). For generation
:func:`decode_stages` traces a second program of the same model, one token per row:
``(input_ids [rows, 1], position_ids [rows, 1], attention_mask [rows, L + 1], past)`` where
``past`` holds each layer's keys and values ``[rows, kv_heads, L, head_dim]`` as plain tensors
(``L``: the cache's fixed length, so every shape is static). The model runs its own attention
code on them through a Hugging Face cache whose layers concatenate the past with the new key and
value (:func:`past_layer_class`), and the program returns the logits and each layer's new key and
value. The program is cut at the training split's split points; each layer's past enters the
stage that runs the layer, and its new key and value leave it there: the cache is that stage's
input and output, never a boundary value and never part of the graph's state.

Each stage (:class:`CachedTracedStage`) keeps its layers' cache per lane (a batch in flight)
and follows the protocol of :mod:`conveyor.pipe.generation`'s cached loop: it takes
``(ids, lane, start)`` (stage 0) and runs positions ``start ..`` one at a time, writes each new key
and value at its position, and hands the next stage each value stacked over those positions.
A prompt of the length given as ``prefill`` runs at once instead, through a second program of
that many positions traced and cut the same way (its queries attend to each other under the
model's own causal mask): one call per stage and lane instead of one per position. Between
stages a flag says which program made the values. Cache slots not yet written are masked out, so
a decode attends to the same keys as the model's own cached ``generate()``: slot order and the
masked slots change the reductions' order, so logits agree to rounding, not bitwise (the test
bounds them).

Example:
    >>> import torch
    >>> from conveyor.frontend import split_model
    >>> from conveyor.testing.models import hf
    >>> cls, config = hf.gpt2(2)
    >>> model = cls(config).eval()
    >>> split = split_model(model, 2, example_args=(torch.zeros(2, 8, dtype=torch.long),))
    >>> stages = decode_stages(split, rows=2, length=12)
    >>> [len(stage.cached_layers) for stage in stages]
    [1, 1]
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from conveyor.errors import PipelineConfigError, positive_int
from conveyor.frontend import attention
from conveyor.frontend.leaves import held_in_order
from conveyor.frontend.materialize import named_tensors
from conveyor.frontend.split import ModelSplit, split_model
from conveyor.frontend.stage import _compile, _register, build_graph
from conveyor.frontend.trace import model_device

_WRAPPED = "lm"  # the decode program's root holds the model here: its names are "lm." + the model's
# A Hugging Face model class that ends so has a causal language-model head (GPT2LMHeadModel, LlamaForCausalLM).
CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel")


@functools.cache
def past_layer_class() -> type:
    """A Hugging Face cache layer built from explicit tensors (defined on first use: transformers is
    imported only by those who decode). ``PastLayer(keys, values)``: the past ``[rows, heads, L, dim]``;
    after the model's call :attr:`new` holds the new key and value."""
    from transformers.cache_utils import DynamicLayer

    class PastLayer(DynamicLayer):
        def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            super().__init__()
            self.past = (keys, values)
            self.new: tuple[torch.Tensor, torch.Tensor] | None = None

        def get_seq_length(self) -> int:
            return self.past[0].shape[-2]

        def get_mask_sizes(self, query_length: int, *args: Any) -> tuple[int, int]:
            return self.past[0].shape[-2] + query_length, 0

        def update(self, key_states, value_states, *args, **kwargs):
            # Called inside the attention module: the concatenation belongs to the layer's stage.
            self.new = (key_states, value_states)
            self.keys = torch.cat([self.past[0], key_states], dim=-2)
            self.values = torch.cat([self.past[1], value_states], dim=-2)
            self.is_initialized = True
            return self.keys, self.values

    return PastLayer


class DecodeStep(nn.Module):
    """The decode program's root: one token per row through ``lm`` with the past as tensors."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, position_ids, attention_mask, past):
        from transformers import DynamicCache

        cache = DynamicCache()
        layer = past_layer_class()
        cache.layers = [layer(keys, values) for keys, values in past]
        out = self.lm(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                      cache=cache, use_cache=True)
        return out.logits, tuple(tensor for layer in cache.layers for tensor in layer.new)


def cache_shape(config: Any, rows: int, length: int) -> tuple[int, tuple[int, int, int, int]]:
    """The number of layers and one layer's key (or value) cache shape for a Hugging Face config."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, (rows, kv_heads, length, head_dim)


class _Tensors(nn.Module):
    """The tensors and submodules a stage graph reads by name (a decode stage's; the prefill program's, beside it)."""

    def __init__(self, tensors: dict[str, tuple[torch.Tensor, bool]], submodules: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, (value, persistent) in held_in_order(tensors, submodules):
            _register(self, name, value, persistent)


class CachedTracedStage(_Tensors):
    """One stage of the decode program, with its layers' keys and values per lane.

    Built by :func:`decode_stages`; ``forward(*values, lane, start)`` as the cached loop of
    :mod:`conveyor.pipe.generation` calls it (stage 0: ``(input_ids, lane, start)``).
    """

    def __init__(self, stage: int, num_stages: int, run: Any, tensors: dict[str, tuple[torch.Tensor, bool]],
                 submodules: dict[str, nn.Module], reads: list[int], makes: list[int], shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(tensors, submodules)
        self.stage, self.num_stages = stage, num_stages
        self._run = run
        self.reads, self.makes = reads, makes  # flat past indices (layer * 2 + key/value) in and out
        self.shape, self.dtype, self.device = shape, dtype, device
        self.kv_cache: dict[int, dict[int, torch.Tensor]] = {}
        # The prefill program (decode_stages(prefill=T)): (T, its graph's run, the module it reads its tensors from).
        # Kept out of the module's children: its tensors are this stage's, under the second trace's names.
        self.prefill: tuple[int, Any, nn.Module] | None = None

    @property
    def cache_length(self) -> int:
        """How many positions each lane's cache holds (prompt and generated tokens together)."""
        return self.shape[2]

    @property
    def cached_layers(self) -> list[int]:
        """The layers whose keys and values this stage keeps."""
        return sorted({index // 2 for index in self.makes})

    def reset_kv_cache(self) -> None:
        """Forget every lane's keys and values (before a new generation)."""
        self.kv_cache = {}

    def _lane(self, lane: int) -> dict[int, torch.Tensor]:
        if lane not in self.kv_cache:
            self.kv_cache[lane] = {index: torch.zeros(self.shape, dtype=self.dtype, device=self.device)
                                   for index in set(self.reads) | set(self.makes)}
        return self.kv_cache[lane]

    def forward(self, *args: Any) -> Any:
        # Stage 0 takes (ids, lane, start); a later stage what the one before returned: (*values, lane, start,
        # batched), batched saying whether the values are the prefill program's or stacked position by position.
        *values, lane, start = args if self.stage == 0 else args[:-1]
        if lane is None:
            raise PipelineConfigError(
                f"decode stage {self.stage} runs one lane's positions with its key/value cache; it has no "
                "full forward: compute log-probs with the training pipeline (pipe.logprobs)")
        cache = self._lane(lane)
        length = self.shape[2]
        batched = args[-1] if self.stage else self.prefill is not None and values[0].shape[1] == self.prefill[0]
        # Positions: stage 0's ids [rows, n]; the prefill program's own count; the values stacked over them.
        steps = values[0].shape[1] if self.stage == 0 else self.prefill[0] if batched else values[0].shape[0]
        if start + steps > length:
            raise PipelineConfigError(f"positions {start}..{start + steps - 1} do not fit the key/value cache of "
                                      f"{length} positions: build the decode stages with a larger length")
        if batched:
            return self._prefill(values, cache, lane, start, steps)
        outputs = []
        for step in range(steps):  # stage 0's token at this position, or the values stacked for it
            one = [values[0][:, step:step + 1]] if self.stage == 0 else \
                [value[step] if isinstance(value, torch.Tensor) else value for value in values]
            outputs.append(self._positions(self._run, self, one, cache, start + step, 1))
        if self.stage == self.num_stages - 1:
            return torch.cat([out[0] for out in outputs], dim=1)
        stacked = tuple(torch.stack([out[i] for out in outputs]) if isinstance(outputs[0][i], torch.Tensor)
                        else outputs[0][i] for i in range(len(outputs[0])))
        return (*stacked, lane, start, False)

    def _prefill(self, values: list[Any], cache: dict[int, torch.Tensor], lane: int, start: int, steps: int) -> Any:
        """Positions ``start .. start + steps - 1`` at once through the prefill program (its queries attend to
        the written slots and, causally, to each other: the model's own mask code)."""
        assert self.prefill is not None
        _, run, holder = self.prefill
        result = self._positions(run, holder, values, cache, start, steps)
        return result[0] if self.stage == self.num_stages - 1 else (*result, lane, start, True)

    def _positions(self, run: Any, holder: nn.Module, values: list[Any], cache: dict[int, torch.Tensor], start: int,
                   steps: int) -> tuple:
        """Positions ``start .. start + steps - 1`` through one call of ``run`` (the decode program's, for one
        position, or the prefill program's) on ``holder``'s tensors: their keys and values written at their
        positions, the program's other outputs returned. Stage 0 gives the program :func:`_token_inputs`."""
        flat = _token_inputs(values[0], self.shape[2], start) if self.stage == 0 else values
        result = run(holder, *flat, *(cache[index] for index in self.reads))
        kept = len(result) - len(self.makes)
        for index, new in zip(self.makes, result[kept:]):
            cache[index][:, :, start:start + steps] = new
        return result[:kept]


def decode_stages(split: ModelSplit, rows: int, length: int, stages: Sequence[nn.Module] | None = None,
                  device: torch.device | str | None = None, which: Sequence[int] | None = None,
                  prefill: int | None = None) -> list[CachedTracedStage]:
    """Stages of ``split``'s model's decode program, cut at its split points, each with a key/value
    cache of ``length`` positions for lanes of ``rows`` rows (see the module docstring).

    ``stages``: the training stage modules (one per entry of ``which``, default every stage)
    whose parameters the decode stages read, so generation follows training; default the
    model's own tensors. ``prefill``: the prompts' length, for a second program that runs a prompt's
    positions at once (one call per stage instead of one per position; traced once more, so worth it
    for prompts longer than a few tokens); None: prompts go through the decode program position by position.

    Example::

        cached = decode_stages(split, rows=4, length=64, stages=[split.stage_module(s) for s in range(2)],
                               prefill=prompts.shape[1])
        Pipeline(cached, "1f1b", microbatches=2, layout=InProcessLayout()).generate(prompts, max_new_tokens=32)
    """
    model = split.model
    config = getattr(model, "config", None)
    if config is None or not type(model).__name__.endswith(CAUSAL_HEADS):
        raise PipelineConfigError(f"decode_stages needs a Hugging Face causal LM (its own cache code); got "
                                  f"{type(model).__name__}: build stages with a cache by hand "
                                  "(conveyor.testing.models.cached_lm shows the protocol)")
    layers, shape = cache_shape(config, rows, length)
    positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if positions is not None and length > positions:
        raise PipelineConfigError(f"a key/value cache of length={length} positions outgrows the model's {positions}: "
                                  f"pass length <= {positions}")
    if prefill is not None and (not positive_int(prefill) or prefill >= length):
        raise PipelineConfigError(f"prefill={prefill!r}: expected the prompts' length, a whole number from 1 to "
                                  f"length - 1 = {length - 1} (None: no prefill program)")
    device = torch.device(device) if device is not None else split.device
    dtype = next(model.parameters()).dtype
    which = list(which if which is not None else range(split.num_stages))
    decode = _trace(split, layers, shape, dtype, 1, device)
    built = [CachedTracedStage(stage, decode.num_stages, *_program(decode, stage, stages and stages[position], device),
                               shape, dtype, device) for position, stage in enumerate(which)]
    if prefill is not None and prefill > 1:
        whole = _trace(split, layers, shape, dtype, prefill, device)
        for position, (stage, cached) in enumerate(zip(which, built)):
            run, tensors, submodules, reads, makes = _program(whole, stage, stages and stages[position], device)
            if (reads, makes) != (cached.reads, cached.makes):  # one cut of one model: the same layers
                raise PipelineConfigError(f"stage {stage}'s prefill program holds other layers than its decode "
                                          "program; report this with the model's class")
            cached.prefill = (prefill, run, _Tensors(tensors, submodules))
    return built


def _trace(split: ModelSplit, layers: int, shape: tuple[int, int, int, int], dtype: torch.dtype, tokens: int,
           device: torch.device) -> ModelSplit:
    """The program of ``tokens`` new positions per row over a past of ``shape``, cut at ``split``'s points."""
    model = split.model
    rows, length = shape[0], shape[2]
    trace_device = model_device(model)  # a meta model's: tracing takes its examples on the meta device
    # The mask has masked slots (nothing written yet), so that the trace keeps it (an all-ones example lets a
    # model drop it).
    ids, positions, mask = _token_inputs(torch.zeros(rows, tokens, dtype=torch.long, device=trace_device), length, 0)
    example = (ids, positions, mask.contiguous(),
               # One tensor each: an input given twice would be traced as one.
               tuple(tuple(torch.zeros(shape, dtype=dtype, device=trace_device) for _ in "kv") for _ in range(layers)))
    was_training = model.training
    # The warning that grouped key/value heads differ from eager in their gradients concerns training only.
    attention_log = logging.getLogger(attention.__name__)
    level = attention_log.level
    try:  # generation never drops out: the decode program is traced in eval mode
        model.eval()
        attention_log.setLevel(logging.ERROR)
        return split_model(DecodeStep(model), split.num_stages, example_args=example, device=device,
                           split_points=[f"{_WRAPPED}.{point}" for point in split.split_points])
    finally:
        attention_log.setLevel(level)
        model.train(was_training)


def _program(decode: ModelSplit, stage: int, training: nn.Module | None, device: torch.device) -> tuple:
    """Stage ``stage``'s graph with the past and the new keys and values moved off the boundaries: ``(run,
    tensors, submodules, reads, makes)``, its tensors the ``training`` stage's where one is given."""
    traced, recipe = decode._traced, decode._recipes[stage]
    past = traced.user_inputs[3:]
    new = list(traced.outputs[1:])
    cache_values = set(past) | set(new)
    node_set = set(recipe.nodes)
    reads = [i for i, node in enumerate(past) if any(node in n.all_input_nodes for n in recipe.nodes)]
    makes = [i for i, node in enumerate(new) if node in node_set]
    recipe.inputs = [n for n in recipe.inputs if n not in cache_values] + [past[i] for i in reads]
    kept = [n for n in recipe.outputs if not (isinstance(n, torch.fx.Node) and n in cache_values)]
    recipe.outputs = kept + [new[i] for i in makes]
    graph, submodules = build_graph(recipe, traced, device)
    run, _ = _compile(graph, f"stage {stage}")
    tensors = decode._resolve_tensors(stage, device, keep_meta=training is not None)
    if training is not None:
        constants = {t.name for t in decode._stage_tensors[stage] if t.kind == "constant"}
        tensors = _training_tensors(training, stage, tensors, constants)
    return run, tensors, submodules, reads, makes


def _token_inputs(ids: torch.Tensor, length: int, start: int) -> list[torch.Tensor]:
    """The program's inputs besides the past for the tokens ``ids`` [rows, steps] at positions ``start ..``: the
    ids, their positions, and the mask of the cache's ``length`` slots (those before ``start`` written) and of the
    new keys (the last ``steps``)."""
    rows, steps = ids.shape
    positions = (start + torch.arange(steps, device=ids.device)).expand(rows, -1)
    seen = torch.arange(length + steps, device=ids.device)
    return [ids, positions, ((seen < start) | (seen >= length)).long().expand(rows, -1)]


def _training_tensors(module: nn.Module, stage: int, tensors: dict[str, tuple[torch.Tensor, bool]],
                      constants: set[str]) -> dict[str, tuple[torch.Tensor, bool]]:
    """The training stage's own tensors under the decode program's names (the model's, after "lm."): what
    training updates, generation reads (constants made inside forward stay the decode trace's own). Every
    parameter and buffer must be there: another cut would decode another model."""
    own = dict(named_tensors(module))
    missing = sorted(name for name in tensors if name not in constants and name.removeprefix(f"{_WRAPPED}.") not in own)
    if missing:
        raise PipelineConfigError(
            f"decode stage {stage} reads {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}, which the "
            f"training stage given for it does not hold: pass the training stages of the same split, in `which` order")
    return {name: (tensor if name in constants else own[name.removeprefix(f"{_WRAPPED}.")], persistent)
            for name, (tensor, persistent) in tensors.items()}
