"""Log-probs of the next tokens through the pipeline: the training forward, then one formula on the last stage.

RL post-training recomputes the log-probs of sampled sequences under the policy being trained
(and under a reference policy); they must equal what training computes. :func:`token_logprobs`
is that formula, written once: the log-softmax of a position's logits, at the token that comes
next. :func:`pipeline_logprobs` runs the pipeline's forward-only program (the same stage code
and microbatches as a training step) and applies :func:`token_logprobs` to each microbatch's
logits where the last stage runs; the ranks backend then hands the result to every rank of the
pipeline. A one-device reference that loops over the same microbatches and calls
:func:`token_logprobs` on the unsplit model's logits runs the same computation, so the two are
``torch.equal``.

Under tensor parallelism with ``loss_parallel`` the logits leave the head sharded on the
vocabulary (a DTensor): the formula then runs under the last stage's own context (torch's
``loss_parallel()``), whose ``log_softmax`` and ``nll_loss`` reduce across the TP ranks without
gathering the vocabulary.

Example:
    >>> import torch, conveyor
    >>> from conveyor.testing.models import TinyConfig, build_stage, reference_model
    >>> cfg = TinyConfig(num_stages=2)
    >>> pipe = conveyor.Pipeline([build_stage(s, cfg) for s in range(2)], "1f1b", microbatches=2,
    ...                          layout=conveyor.InProcessLayout())
    >>> ids = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
    >>> got = pipe.logprobs(ids)
    >>> model = reference_model(cfg)
    >>> want = torch.cat([token_logprobs(model(part), part) for part in ids.tensor_split(2)])
    >>> got.shape, torch.equal(got, want)
    (torch.Size([4, 7]), True)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from conveyor.errors import PipelineConfigError
from conveyor.microbatch import Microbatches, check_given_microbatches, split_value
from conveyor.parallel.loss import whole_value
from conveyor.runtime.stage.device import to_device

if TYPE_CHECKING:
    from conveyor.pipe.pipeline import PipelineSteps


def logits_of(output: Any) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, a ``.logits`` attribute or a ``"logits"`` entry.

    Example:
        >>> logits_of({"logits": torch.zeros(1, 2, 3)}).shape
        torch.Size([1, 2, 3])
    """
    if isinstance(output, torch.Tensor):
        return output
    found = getattr(output, "logits", None)
    if found is None and isinstance(output, dict):
        found = output.get("logits")
    if found is None and isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        found = output[0]
    if not isinstance(found, torch.Tensor):
        raise PipelineConfigError(
            f"log-probs need the last stage to return the logits ([batch, sequence, vocabulary]); it returned "
            f"{type(output).__name__}: return the logits, an object with .logits, or a dict with 'logits' "
            "(a causal language model's head on the last stage)"
        )
    return found


def token_logprobs(output: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """``log p(input_ids[:, t + 1] | input_ids[:, :t + 1])`` for every position t: [batch, sequence - 1].

    The one formula both the pipeline and a reference use: log-softmax over the vocabulary of
    the logits (in float32 at least, whatever the model computes in), read at the next token
    (as ``-nll_loss``, which torch's ``loss_parallel`` also runs on vocabulary-sharded logits).

    Example:
        >>> logits = torch.zeros(1, 3, 4)   # a uniform guess over 4 tokens
        >>> token_logprobs(logits, torch.tensor([[0, 1, 2]]))
        tensor([[-1.3863, -1.3863]])
    """
    logits = logits_of(output)
    if logits.dim() != 3 or input_ids.dim() != 2 or tuple(logits.shape[:2]) != tuple(input_ids.shape):
        raise PipelineConfigError(
            f"log-probs need logits [batch, sequence, vocabulary] for input ids [batch, sequence]; got logits "
            f"{tuple(logits.shape)} for ids {tuple(input_ids.shape)}: the last stage must return a causal "
            "language model's logits for every position"
        )
    scores = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32))
    following = input_ids[:, 1:].reshape(-1)
    log_probs = torch.nn.functional.log_softmax(scores.reshape(-1, scores.shape[-1]), dim=-1)
    picked = -torch.nn.functional.nll_loss(log_probs, following, reduction="none")
    return whole_value(picked).view(input_ids.shape[0], input_ids.shape[1] - 1)  # under loss_parallel: a DTensor


def ids_of(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A microbatch's token ids: its ``input_ids`` keyword, else its first positional input."""
    if kwargs.get("input_ids") is not None:
        return kwargs["input_ids"]
    return args[0] if args and isinstance(args[0], torch.Tensor) else None


def pipeline_logprobs(steps: PipelineSteps, args: tuple, kwargs: dict) -> torch.Tensor | list[torch.Tensor]:
    """The next tokens' log-probs of a minibatch given as the model's inputs ``args`` / ``kwargs``, on every rank.

    The token ids [batch, sequence] are the ``input_ids`` keyword, else the first positional
    input; they are read where stage 0 runs (the model's input) and where the last stage runs
    (whose log-probs are read); elsewhere they may be None. Given as one
    :class:`~conveyor.microbatch.Microbatches` (``inputs=``), each microbatch keeps its own
    shapes and a list of [b_i, s_i - 1] tensors comes back; otherwise one [batch, sequence - 1] tensor.
    """
    given = args[0] if args and isinstance(args[0], Microbatches) else None
    if given is not None:
        if len(args) > 1 or kwargs:
            raise PipelineConfigError("pipe.logprobs(Microbatches(...)) takes each microbatch's inputs inside it; "
                                      f"pass nothing beside it (got {len(args) - 1} more positional, {sorted(kwargs)})")
        first = steps.inputs.given(given, (), {}, None)[0]
    else:
        first = steps.inputs.split(args, kwargs, None)[0]  # None where stage 0 does not run
    outputs = steps.forward_each(first)
    mine = None
    if outputs is not None:
        ids = _last_stage_ids(steps, ids_of(args, kwargs), given)
        last = steps.runners[steps.schedule.num_stages - 1]
        with torch.no_grad(), last.context():
            mine = [token_logprobs(output, part) for output, part in zip(outputs, ids)]
    shared = steps.backend.from_last_stage(mine)
    if given is not None:
        return shared
    return torch.cat(shared)


def _last_stage_ids(steps: PipelineSteps, input_ids: Any, given: Microbatches | None) -> list[torch.Tensor]:
    """The token ids of each microbatch where the last stage runs, on its device."""
    rank = steps.inputs.rank
    if given is not None:
        if given.inputs is None:
            raise PipelineConfigError(
                f"rank {rank} runs the last stage, which reads the next tokens: pass Microbatches(inputs=...) there "
                "too (log-probs read the ids where stage 0 runs and where the last stage runs)"
            )
        parts = []
        each = check_given_microbatches(given.inputs, steps.schedule.num_microbatches)
        for index, (args, kwargs) in enumerate(each):
            ids = ids_of(args, kwargs)
            if ids is None:
                raise PipelineConfigError(f"microbatch {index} has no token ids: give each as its first positional "
                                          "input or as input_ids=")
            parts.append(ids)
    else:
        if input_ids is None:
            raise PipelineConfigError(
                f"rank {rank} runs the last stage, which reads the next tokens: pass input_ids= there too "
                "(log-probs read the ids where stage 0 runs and where the last stage runs; None elsewhere)"
            )
        parts = split_value(input_ids, steps.schedule.num_microbatches, "input_ids")
    return [to_device(part, steps.inputs.device) for part in parts]

