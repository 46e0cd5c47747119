"""Generation through the pipeline: prompts in, tokens out, every forward the training forward.

:func:`generate` runs a token loop over the pipeline's forward-only program. The prompts are
cut into the schedule's microbatches, which are the lanes: batches in flight at once, so that
while the last stage reads one lane's logits the first stage already runs the next (as many
lanes as the pipeline has microbatches; by default that keeps every stage busy). Each step the
last stage reads each row's logits at its last position, picks the next token
(:func:`pick_tokens`: greedy, or sampled with temperature, top-k, top-p and a seeded
``torch.Generator``) and sends the tokens to every rank of the pipeline, stage 0 among them,
which feeds them back in.

Two loops, one per kind of stage:

- **Stages with a key/value cache** (each has ``reset_kv_cache()`` and takes ``(ids or hidden,
  lane, start)``, returning ``(hidden, lane, start)``: the lane and the position travel with
  the tensors as boundary values, so each stage reads the right lane's cache whatever order its
  program runs the microbatches in; :mod:`conveyor.testing.models.cached_lm` is an example) and
  prompts of one length: the prompt runs once (prefill), then each lane's last token at its
  position. On one pipeline (no replicas or TP ranks) the steps run as one unrolled program
  (:func:`conveyor.schedule.decode.decode_schedule`: step t's stages are stages ``t S .. t S + S - 1``
  of a deeper pipeline, each a :class:`_TokenStep` of the stage's own module and cache), in which the
  last stage hands each lane's token to stage 0 as a boundary value as soon as it picks it: a lane's
  next step starts while the other lanes are still on later stages, and with as many lanes as ranks
  no rank waits after the first ones (a step at a time, every lane through every stage and the tokens
  broadcast, P lanes on P ranks take 2P - 1 stage times a step). With eos, blocks of
  :data:`UNROLLED_BLOCK` steps, the rows checked between blocks. The cached decode attends one
  query to the cached keys under an explicit mask, the full forward all queries under
  ``is_causal``: other kernel calls, whose logits differ by rounding, so its greedy tokens equal
  the full forward's wherever no two logits are within rounding of each other.
  A traced Hugging Face causal LM gets such stages from
  :func:`conveyor.frontend.decode.decode_stages` (its decode program, cut like the training one):
  ``generate`` builds them itself for a pipeline of a traced Hugging Face causal LM's own stages
  (:func:`traced_decoder`; ``kv_cache=False`` keeps the window loop below), once per batch shape,
  reading the training stages' weights, and decodes through them on the same ranks.
- **Any other stage** (the training program's traced stages; prompts of several lengths): every
  row is a window of ``length`` positions (default: the longest prompt plus ``max_new_tokens``),
  right-padded, recomputed whole at every step (a prefill per token).
  A causal model's logits at a row's last real position never see the padding after it, so
  prompts of different lengths (``attention_mask``) share one batch, and traced stages (traced
  for one shape) get that shape at every step. Its greedy tokens equal the unsplit model's greedy
  loop bit for bit.

A row stops after ``eos_token_id``; what comes after it is ``pad_token_id``. The log-probs of
the generated tokens (``return_logprobs=True``) are :meth:`conveyor.Pipeline.logprobs` of the
finished sequences, recomputed at the end by the training forward itself (not the cached
decode's, which differ by rounding), so they equal what training computes by construction.

Example:
    >>> import torch, conveyor
    >>> from conveyor.testing.models import TinyConfig, build_stage
    >>> cfg = TinyConfig(num_stages=2, seq_len=12)
    >>> pipe = conveyor.Pipeline([build_stage(s, cfg) for s in range(2)], "1f1b", microbatches=2,
    ...                          layout=conveyor.InProcessLayout())
    >>> out = pipe.generate(torch.ones(2, 4, dtype=torch.long), max_new_tokens=5)
    >>> tuple(out.tokens.shape), tuple(out.sequences.shape), out.lengths.tolist()
    ((2, 5), (2, 9), [5, 5])
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from conveyor.errors import PipelineConfigError, positive_int
from conveyor.frontend.decode import CAUSAL_HEADS, decode_stages
from conveyor.frontend.split import split_model
from conveyor.frontend.stage import StageModule
from conveyor.microbatch import Microbatches
from conveyor.parallel.loss import whole_value
from conveyor.pipe.logprobs import logits_of

if TYPE_CHECKING:
    from conveyor.pipe.pipeline import Pipeline


@dataclass(frozen=True, slots=True)
class Sampling:
    """How the next token is picked: greedy (the default), or sampled.

    ``do_sample``: sample from the softmax of the logits divided by ``temperature`` (> 0), kept
    to the ``top_k`` likeliest tokens and to the smallest set whose probability reaches ``top_p``
    (in (0, 1]); otherwise the argmax, and none of the three may be set. ``eos_token_id``: a
    row stops after it; ``pad_token_id`` fills the rest.

    Example:
        >>> Sampling(do_sample=True, temperature=0.7, top_k=20).describe()
        'sample T=0.7 top_k=20 top_p=None eos=None pad=0'
        >>> Sampling(top_k=5)   # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        conveyor.errors.PipelineConfigError: top_k=5 shapes sampling, but do_sample=False picks the argmax: ...
    """

    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    eos_token_id: int | None = None
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if not self.do_sample:
            for name in ("temperature", "top_k", "top_p"):
                if getattr(self, name) is not None:
                    raise PipelineConfigError(f"{name}={getattr(self, name)!r} shapes sampling, but do_sample=False "
                                              f"picks the argmax: pass do_sample=True, or drop {name}")
        if self.temperature is not None and not (math.isfinite(self.temperature) and self.temperature > 0):
            raise PipelineConfigError(f"temperature={self.temperature!r} must be a positive number: for greedy "
                                      "decoding pass do_sample=False instead of temperature=0")
        if self.top_k is not None and not positive_int(self.top_k):
            raise PipelineConfigError(f"top_k={self.top_k!r} must be a whole number >= 1 (None: every token)")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise PipelineConfigError(f"top_p={self.top_p!r} must be in (0, 1] (None or 1: every token)")

    def describe(self) -> str:
        how = f"sample T={self.temperature or 1.0} top_k={self.top_k} top_p={self.top_p}" if self.do_sample \
            else "greedy"
        return f"{how} eos={self.eos_token_id} pad={self.pad_token_id}"


@dataclass(frozen=True)
class Generation:
    """What :meth:`conveyor.Pipeline.generate` returns, the same on every rank of a pipeline.

    ``tokens`` [batch, max_new_tokens]: the generated tokens, ``pad_token_id`` after a row's end;
    ``lengths`` [batch]: how many each row generated (its eos included); ``sequences``
    [batch, longest prompt + max_new_tokens]: each prompt followed by its tokens, right-padded;
    ``logprobs`` [batch, max_new_tokens] (with ``return_logprobs``, else None): each generated
    token's log-prob under the model (its own distribution, before temperature, top-k and top-p:
    what training computes), 0 after a row's end.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    sequences: torch.Tensor
    logprobs: torch.Tensor | None = None
    kv_cache: bool = False  # whether the tokens came from key/value caches (else each step the training forward)


def pick_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row of ``logits`` [batch, vocabulary]: [batch] int64.

    The one formula the pipeline's last stage and a reference loop both use (in float32 at
    least): the argmax, or a draw from ``generator`` after temperature, top-k and top-p.

    Example:
        >>> pick_tokens(torch.tensor([[0.0, 2.0, 1.0]]), Sampling()).tolist()
        [1]
        >>> g = torch.Generator().manual_seed(0)
        >>> pick_tokens(torch.tensor([[0.0, 2.0, 1.0]]), Sampling(do_sample=True, top_k=1), g).tolist()
        [1]
    """
    scores = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if not sampling.do_sample:
        return scores.argmax(dim=-1)
    if sampling.temperature is not None:
        scores = scores / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < scores.shape[-1]:
        kth = scores.topk(sampling.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if sampling.top_p is not None and sampling.top_p < 1:
        ordered, order = scores.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # Drop a token when the likelier ones already reach top_p (the likeliest always stays).
        dropped = probs.cumsum(dim=-1) - probs >= sampling.top_p
        scores = scores.masked_fill(dropped.scatter(-1, order, dropped), -math.inf)
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def prompt_lengths(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Each row's prompt length: the mask's ones, which must come first (right padding).

    Example:
        >>> prompt_lengths(torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 0], [1, 1, 1]])).tolist()
        [2, 3]
    """
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        raise PipelineConfigError(f"generate takes prompts as token ids [batch, sequence] (int64); got "
                                  f"{input_ids.dtype} of shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        return torch.full((input_ids.shape[0],), input_ids.shape[1], dtype=torch.long)
    mask = attention_mask.to(torch.long)
    lengths = mask.sum(dim=1)
    expected = (torch.arange(mask.shape[1]) < lengths[:, None]).to(torch.long)
    if mask.shape != input_ids.shape or not torch.equal(mask, expected) or bool((lengths < 1).any()):
        raise PipelineConfigError(
            "generate takes right-padded prompts: attention_mask must be ones then zeros in each row, at least one "
            "one, shaped like input_ids; left-padded prompts: move each row's tokens to its start"
        )
    return lengths


def check_request(pipe: Pipeline, input_ids: torch.Tensor, max_new_tokens: int, length: int) -> None:
    """Refuse what cannot work before any rank runs: a model without a causal LM head (when its class is
    known), a window beyond the model's positions, a batch the lanes do not divide."""
    info = pipe.model_info or {}
    name = info.get("class")
    if name is not None and info.get("config") is not None and not name.endswith(CAUSAL_HEADS):
        raise PipelineConfigError(
            f"generate needs a causal language model's head on the last stage; this pipeline was built from "
            f"{name}: build it from the model with its head (e.g. AutoModelForCausalLM)"
        )
    if not positive_int(max_new_tokens):
        raise PipelineConfigError(f"max_new_tokens={max_new_tokens!r} must be a whole number >= 1")
    config = info.get("config") or {}
    positions = config.get("n_positions", config.get("max_position_embeddings"))
    if positions is not None and input_ids.shape[1] > positions:
        raise PipelineConfigError(f"the prompts are {input_ids.shape[1]} tokens long, but the model has "
                                  f"{positions} positions: shorten them to at most {positions - 1} tokens")
    if positions is not None and length > positions:
        raise PipelineConfigError(
            f"{input_ids.shape[1]} prompt tokens + max_new_tokens={max_new_tokens} need {length} positions, but the "
            f"model has {positions}: pass max_new_tokens <= {positions - input_ids.shape[1]}, or shorter prompts"
        )
    held = [module.cache_length for module in pipe.modules if hasattr(module, "cache_length")]
    if held and length > min(held):
        raise PipelineConfigError(
            f"{input_ids.shape[1]} prompt tokens + max_new_tokens={max_new_tokens} need {length} positions, but the "
            f"stages' key/value caches hold {min(held)}: pass max_new_tokens <= {min(held) - input_ids.shape[1]}, "
            "or build the decode stages with a larger length"
        )
    lanes = pipe.schedule.num_microbatches
    if input_ids.shape[0] % lanes:
        raise PipelineConfigError(
            f"{input_ids.shape[0]} prompts do not split into the pipeline's {lanes} lanes (its microbatches, the "
            f"batches in flight): pass a multiple of {lanes} prompts (pad with copies), or build it with fewer"
        )


def uses_cache(pipe: Pipeline, lengths: torch.Tensor, prompt: int) -> bool:
    """Whether to decode with the stages' own key/value caches: every stage here keeps one
    (``reset_kv_cache``: :mod:`conveyor.testing.models.cached_lm` shows the protocol) and the prompts
    are of one length (right-padded prompts of several lengths take the window loop)."""
    return all(hasattr(module, "reset_kv_cache") for module in pipe.modules) and bool((lengths == prompt).all())


def stage_inputs(pipe: Pipeline, window: torch.Tensor) -> tuple[tuple, dict]:
    """The window as stage 0 takes it: as ``input_ids=`` where stage 0 was traced with that keyword, else positional
    (a stage with a key/value cache: ``(ids, None, 0)``, its plain forward)."""
    if all(hasattr(module, "reset_kv_cache") for module in pipe.modules):
        return (window, None, 0), {}
    first = pipe.runners.get(0)
    spec = getattr(getattr(first, "module", None), "_conveyor_in_spec", None)
    if spec is not None and "input_ids" in list(spec.child(1).context):
        return (), {"input_ids": window}
    return (window,), {}


def generate(pipe: Pipeline, input_ids: torch.Tensor, max_new_tokens: int, sampling: Sampling,
             generator: torch.Generator | None, attention_mask: torch.Tensor | None,
             return_logprobs: bool, length: int | None, kv_cache: bool | None = None,
             scorer: Pipeline | None = None) -> Generation:
    """The token loop (see the module docstring); a collective: every rank of the pipeline, the same arguments.
    ``kv_cache``: None decodes through key/value caches where the stages allow it, True insists, False never.
    ``scorer``: the pipeline whose training forward gives the log-probs (None: ``pipe``)."""
    if kv_cache not in (None, True, False):
        raise PipelineConfigError(f"kv_cache={kv_cache!r}: pass None (the cache where the stages allow it), True "
                                  "or False (every step the training forward over the whole window)")
    lengths = prompt_lengths(input_ids, attention_mask)
    width = length if length is not None else input_ids.shape[1] + max_new_tokens
    check_request(pipe, input_ids, max_new_tokens, width)
    if width < input_ids.shape[1] + max_new_tokens:
        raise PipelineConfigError(f"length={width} holds no {max_new_tokens} new tokens after {input_ids.shape[1]} "
                                  f"prompt tokens: pass length >= {input_ids.shape[1] + max_new_tokens}")
    cached = uses_cache(pipe, lengths, input_ids.shape[1])
    if kv_cache is not False and not cached:
        stages, why_not = traced_decoder(pipe, input_ids.shape[0], width, lengths, input_ids.shape[1])
        if stages is not None:  # the cached loop over them, a pipeline beside this one (its schedule, layout and
            # transfers, on the same ranks); the log-probs recomputed by this one's own training forward
            decoder = type(pipe)(list(stages), pipe.schedule, layout=pipe.layout, transfer=pipe.transfer)
            with contextlib.closing(decoder):
                return generate(decoder, input_ids, max_new_tokens, sampling, generator, None, return_logprobs, width,
                                scorer=pipe)
        if kv_cache:
            raise PipelineConfigError(f"kv_cache=True, but {why_not}; pass kv_cache=None (the window loop then "
                                      "serves) or False")
    elif kv_cache is False and cached:
        raise PipelineConfigError("kv_cache=False, but these stages decode only through their key/value caches "
                                  "(reset_kv_cache): pass kv_cache=None, or build the pipeline from stages without "
                                  "one")
    batch = input_ids.shape[0]
    window = torch.full((batch, width), sampling.pad_token_id, dtype=torch.long)
    window[:, :input_ids.shape[1]] = torch.where(
        torch.arange(input_ids.shape[1]) < lengths[:, None], input_ids.cpu().long(), sampling.pad_token_id)
    made = torch.zeros(batch, dtype=torch.long)
    done = torch.zeros(batch, dtype=torch.bool)
    rows = torch.arange(batch)
    steps = _cached_steps(pipe, window, input_ids.shape[1], max_new_tokens, sampling, generator) if cached else None
    # Closing the cached steps closes their pipelines, where every row ended early or a step failed too.
    with contextlib.closing(steps) if steps is not None else contextlib.nullcontext():
        for _ in range(max_new_tokens):
            if steps is not None:
                tokens = next(steps)
            else:
                tokens = pipe.ranks.guarded(_next_tokens, pipe, None, stage_inputs(pipe, window), lengths + made - 1,
                                            sampling, generator)
            tokens = torch.where(done, sampling.pad_token_id, tokens.cpu())
            window[rows, lengths + made] = tokens
            made += (~done).long()
            if sampling.eos_token_id is not None:
                done |= tokens == sampling.eos_token_id
                if _everyone_done(pipe, done):
                    break
    new = window.gather(1, (lengths[:, None] + torch.arange(max_new_tokens)).clamp(max=width - 1))
    new = torch.where(torch.arange(max_new_tokens) < made[:, None], new, sampling.pad_token_id)
    sequences = window[:, :input_ids.shape[1] + max_new_tokens]
    logprobs = _generated_logprobs(scorer or pipe, window, lengths, made, max_new_tokens) if return_logprobs else None
    return Generation(new, made, sequences, logprobs, kv_cache=cached)


# Token steps an unrolled program runs before the rows are checked for their eos (without one: every step at once).
UNROLLED_BLOCK = 16


def _cached_steps(pipe: Pipeline, window: torch.Tensor, prompt: int, max_new_tokens: int, sampling: Sampling,
                  generator: torch.Generator | None) -> Iterator[torch.Tensor]:
    """Each step's tokens [batch] through the stages' key/value caches (reset first), made a block of steps at a time.
    A block starts from ``window`` as the caller left it: the prompt (prefill), then each row's last token (pad after
    its end), each lane's rows at their position. On one pipeline a block is one unrolled program
    (:func:`_unrolled_block`; the pipeline of a block size is built once and runs every block of that size; all close
    when the steps end or the caller stops early, every row at its eos); with replicas or TP ranks a block is one
    step, every lane through every stage and the tokens sent to every rank (:func:`_next_tokens`)."""
    for module in pipe.modules:
        module.reset_kv_cache()
    unrolled = pipe.checkpoint_group is None  # one pipeline (conveyor.schedule.decode)
    block = max_new_tokens if sampling.eos_token_id is None else min(max_new_tokens, UNROLLED_BLOCK)
    built: dict[int, tuple[Pipeline, dict]] = {}
    step = 0
    try:
        while step < max_new_tokens:
            size = min(block if unrolled else 1, max_new_tokens - step)
            start = 0 if step == 0 else prompt + step - 1
            ids = window[:, start:prompt + step]
            lanes = [(part, lane, start) for lane, part in enumerate(ids.tensor_split(pipe.schedule.num_microbatches))]
            if unrolled:
                tokens = _unrolled_block(pipe, built, lanes, prompt + step, size, sampling, generator)
            else:
                last = torch.full((ids.shape[0],), ids.shape[1] - 1)  # each row's last position in its lane
                tokens = pipe.ranks.guarded(_next_tokens, pipe, lanes, None, last, sampling, generator)[:, None]
            for column in range(size):
                yield tokens[:, column]
            step += size
    finally:
        for program, _ in built.values():
            program.close()


def _unrolled_block(pipe: Pipeline, built: dict, lanes: list[tuple], first_token: int, steps: int, sampling: Sampling,
                    generator: torch.Generator | None) -> torch.Tensor:
    """``steps`` tokens of every row [batch, steps] after ``lanes`` (stage 0's inputs, each lane's ids ending before
    position ``first_token``), through ``pipe``'s stages' caches as one program:
    :func:`conveyor.schedule.decode.decode_schedule`'s stages, each a :class:`_TokenStep` of this rank's stage, run by
    a pipeline beside ``pipe`` (its layout and transfers), kept in ``built`` by ``steps``. A collective."""
    from conveyor.schedule.decode import decode_schedule

    depth, count = pipe.schedule.num_stages, len(lanes)
    if steps not in built:
        schedule = decode_schedule(pipe.schedule.placement, count, steps)
        state: dict[str, Any] = {"picked": {}}
        modules = [_TokenStep(pipe.runners[k % depth].module, k, depth, state, sampling, generator)
                   for k in range(schedule.num_stages) if k % depth in pipe.runners]  # this process's stages
        built[steps] = (type(pipe)(modules, schedule, layout=pipe.layout, transfer=pipe.transfer), state)
    unrolled, state = built[steps]
    state["picked"].clear()
    state["first_token"] = first_token  # where the first token picked goes: the next step's ids start there
    unrolled.ranks.guarded(_run_unrolled, unrolled, lanes)
    mine = None
    if depth - 1 in pipe.runners:
        picked = state["picked"]
        mine = [torch.stack([torch.cat([picked[(t, lane)] for lane in range(count)]) for t in range(steps)], dim=1)]
    return pipe.ranks.guarded(pipe.steps.backend.from_last_stage, mine)[0].cpu()


def _run_unrolled(unrolled: Pipeline, lanes: list[tuple]) -> None:
    unrolled.steps.forward_each(unrolled.steps.inputs.given(Microbatches(inputs=lanes), (), {}, None)[0])


class _TokenStep(torch.nn.Module):
    """Stage ``index`` of the unrolled decode program: the pipeline's stage ``index % depth`` (its module and cache,
    shared by every token step) at token step ``index // depth``. The last stage of a step picks each row's token
    at the lane's last position, keeps it in ``state["picked"]`` by (step, lane), and hands it on as the next step's
    ids ``(tokens [rows, 1], lane, state["first_token"] + step)``: stage 0's inputs in the cached protocol (a later
    stage takes ``(hidden, lane, start)``, or ``decode_stages``' ``(*values, lane, start, batched)``). ``state`` is
    the block's, shared by the program's stages and set anew before each block."""

    def __init__(self, stage_module: torch.nn.Module, index: int, depth: int, state: dict, sampling: Sampling,
                 generator: torch.Generator | None) -> None:
        super().__init__()
        self.__dict__["stage_module"] = stage_module  # not a submodule: its parameters stay the pipeline's own
        self.index, self.depth, self.state = index, depth, state
        self.sampling, self.generator = sampling, generator
        anchor = next(iter(stage_module.parameters()), None)
        self.register_buffer("anchor", torch.zeros((), device=anchor.device if anchor is not None else None),
                             persistent=False)  # where the stage runs, for the pipeline's device checks

    def forward(self, *args: Any) -> Any:
        out = self.stage_module(*args)
        if self.index % self.depth != self.depth - 1:
            return out
        lane = args[1] if len(args) == 3 else args[-3]
        step = self.index // self.depth
        tokens = pick_tokens(whole_value(logits_of(out))[:, -1], self.sampling, self.generator)
        self.state["picked"][(step, lane)] = tokens
        return tokens[:, None], lane, self.state["first_token"] + step


def traced_decoder(pipe: Pipeline, batch: int, width: int, lengths: torch.Tensor,
                   prompt: int) -> tuple[list | None, str]:
    """This rank's decode stages for ``pipe`` (:func:`conveyor.frontend.decode.decode_stages`: the model's decode
    program cut like its training one, a key/value cache of ``width`` positions per lane, reading the training
    stages' own weights), or None and why the window loop must serve instead: stages not traced from one model by
    conveyor (built by hand, wrapped by a part or compiled), replicas or TP ranks (their weights are shards), a
    model without a Hugging Face causal LM head, or prompts of several lengths. Built once per (rows, width, prompt).

    Example::

        stages, why_not = traced_decoder(pipe, 4, 24, torch.full((4,), 8), 8)
    """
    modules = {stage: runner.module for stage, runner in pipe.runners.items()}
    points = {getattr(module, "_conveyor_split_points", None) for module in modules.values()}
    if None in points or len(points) != 1 or not all(type(m) is StageModule for m in modules.values()):
        return None, "the stages are not a traced model's own (built by hand, wrapped by a part, or compiled)"
    if pipe.checkpoint_group is not None:
        return None, "the pipeline has replicas or tensor-parallel ranks, whose weights the decode stages cannot share"
    if not bool((lengths == prompt).all()):
        return None, "the prompts are of several lengths (the cache runs one prompt length for every row)"
    rows = batch // pipe.schedule.num_microbatches
    key = (rows, width, prompt)
    built = pipe.steps.decoders  # traced once per key, reused by later calls
    if key not in built:
        which = sorted(modules)
        first = next(modules[which[0]].parameters())
        model, why_not = _meta_model(pipe.model_info or {}, first.dtype)
        if model is None:
            return None, why_not
        split = split_model(model, pipe.schedule.num_stages, split_points=list(points.pop()),
                            example_args=(torch.zeros(1, 2, dtype=torch.long),))
        built[key] = decode_stages(split, rows=rows, length=width, stages=[modules[s] for s in which], which=which,
                                   device=first.device, prefill=prompt if prompt > 1 else None)
    return built[key], ""


def _meta_model(info: dict, dtype: torch.dtype) -> tuple[torch.nn.Module | None, str]:
    """The pipeline's model again, on the meta device (no weights: the decode stages read the training stages'),
    from its class and config as checkpoints record them; or None and why it cannot be built."""
    import transformers

    name, config = info.get("class"), info.get("config")
    model_class = getattr(transformers, name, None) if isinstance(name, str) else None
    if config is None or model_class is None or not name.endswith(CAUSAL_HEADS):
        return None, (f"the model ({name or 'unknown'}) is no Hugging Face causal LM transformers can rebuild from "
                      "its config (its own cache code)")
    with torch.device("meta"):
        model = model_class(model_class.config_class.from_dict(config))
    return model.to(dtype).eval(), ""


def _everyone_done(pipe: Pipeline, done: torch.Tensor) -> bool:
    """Whether every row of every replica has ended. The ranks of one pipeline hold the same rows; replicas
    (and TP ranks) hold others, and a forward under FSDP is a collective across replicas: all stop together."""
    finished = torch.tensor([int(bool(done.all()))], device=pipe.ranks.comm_device)
    group = pipe.checkpoint_group  # every rank of the job, where there are replicas or TP ranks
    if group is not None:
        import torch.distributed as dist

        pipe.ranks.guarded(dist.all_reduce, finished, dist.ReduceOp.MIN, group)
    return bool(finished.item())


def _next_tokens(pipe: Pipeline, lanes: list[tuple] | None, whole: tuple[tuple, dict] | None,
                 last_positions: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """One forward of every lane (given lane by lane, or as the whole batch's ``(args, kwargs)``); the last
    stage picks each row's token at ``last_positions``; every rank gets them."""
    steps = pipe.steps  # (where stage 0 does not run, the inputs give None)
    first = steps.inputs.given(Microbatches(inputs=lanes), (), {}, None)[0] if lanes is not None else \
        steps.inputs.split(*whole, None)[0]
    outputs = steps.forward_each(first)
    mine = None
    if outputs is not None:
        last = steps.runners[steps.schedule.num_stages - 1]
        with torch.no_grad(), last.context():
            logits = torch.cat([whole_value(logits_of(output)) for output in outputs])
        if logits.dim() != 3:
            raise PipelineConfigError(f"generate needs the last stage to return logits [batch, sequence, vocabulary]; "
                                      f"got {tuple(logits.shape)}: build the pipeline from a causal language model")
        at_end = logits[torch.arange(logits.shape[0]), last_positions.to(logits.device)]
        mine = [pick_tokens(at_end, sampling, generator)]
    return steps.backend.from_last_stage(mine)[0]


def _generated_logprobs(pipe: Pipeline, window: torch.Tensor, lengths: torch.Tensor, made: torch.Tensor,
                        max_new_tokens: int) -> torch.Tensor:
    """The generated tokens' log-probs: :meth:`Pipeline.logprobs` of the finished windows (the training
    forward), read at each generated token; 0 after a row's end."""
    args, kwargs = stage_inputs(pipe, window)
    every = pipe.logprobs(*args, **kwargs).cpu()  # [batch, width - 1]: position t predicts token t + 1
    positions = (lengths[:, None] - 1 + torch.arange(max_new_tokens)).clamp(max=every.shape[1] - 1)
    picked = every.gather(1, positions)
    return torch.where(torch.arange(max_new_tokens) < made[:, None], picked, torch.zeros((), dtype=picked.dtype))
