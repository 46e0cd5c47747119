"""The end of a run shows what the model learned: a few dozen tokens decoded greedily through the pipeline.

:func:`greedy_tokens` runs ``pipe.forward`` on the growing context (its last ``seq_len``
tokens, no key/value cache) and appends the argmax of the last position's logits, as
:func:`greedy_reference` does with the unsplit model. Stages are traced for one shape, a
microbatch of ``[rows / M, seq_len]``, so each forward gets the full replica batch of full
windows: the context at the start of every row, the rest padded. A causal model's logits at
the context's last position never see the padding (positions after it), so the tokens are
those of the unpadded context. The rank that runs the last stage picks the token; an
all-reduce hands it to every rank of every replica, so all run the same forwards (with FSDP
a forward is a collective across replicas) and generate the same text.

:func:`cached_tokens` decodes the same tokens with a key/value cache instead: stages of the model's
decode program (:mod:`conveyor.frontend.decode`, cut like the training program) that read the
pipeline's own weights, a token per step after the prompt. :func:`write_sample` is what ``conveyor
train`` calls after training: it takes the cache where it serves (one pipeline, no replicas or TP
shards, no mixture of experts, the context within ``seq_len``), else the window loop, decodes with
the run's tokenizer, writes ``<run.dir>/sample.txt`` on rank 0 and returns the summary's entries.

Example:
    >>> import torch, conveyor
    >>> from conveyor.frontend import split_model
    >>> from conveyor.train.config import load_config
    >>> from conveyor.train.models import build_model
    >>> _ = torch.manual_seed(0)
    >>> model = build_model(load_config(None, ["model.layers=2", "model.width=32", "model.seq_len=16"]), 256)
    >>> split = split_model(model, 2, example_args=(torch.zeros(2, 16, dtype=torch.long),))
    >>> pipe = conveyor.Pipeline([split.stage_module(s) for s in range(2)], "1f1b", microbatches=2,
    ...                          layout=conveyor.InProcessLayout())
    >>> got = greedy_tokens(pipe, list(b"def "), 20, seq_len=16, rows=4)
    >>> got == greedy_reference(model, list(b"def "), 20, seq_len=16), len(got)
    (True, 20)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from conveyor.pipe.logprobs import logits_of
from conveyor.runtime.stage.device import group_device
from conveyor.train.data import load_tokenizer

DEFAULT_PROMPT = "def "
PROMPT_TOKENS = 32  # of the validation text, when train.sample_prompt is None


def greedy_tokens(pipe: Any, prompt: Sequence[int], steps: int, *, seq_len: int, rows: int,
                  eos_id: int | None = None) -> list[int]:
    """``steps`` tokens after ``prompt`` (ids), each the argmax of the next-token logits, through ``pipe``.

    ``pipe`` is a :class:`conveyor.Pipeline` (then a collective: every rank of every replica
    calls it with the same arguments) or an in-process one. ``rows`` is the
    batch one forward takes (the replica batch the pipeline was built for) and ``seq_len`` the
    sequence length it was traced with. Stops early after ``eos_id``.

    Example (on every rank, after training)::

        ids = greedy_tokens(pipe, tokenizer.encode(b"def ").tolist(), 48, seq_len=128, rows=16)
    """
    if not prompt:
        raise ValueError("greedy_tokens needs a prompt of at least one token; got none")
    distributed = not pipe.ranks.in_process
    context, made = list(prompt), []
    for _ in range(steps):
        window = context[-seq_len:]
        x = None
        if pipe.needs_inputs:
            x = torch.zeros(rows, seq_len, dtype=torch.long)  # 0 pads: positions the context never attends to
            x[:, : len(window)] = torch.tensor(window, dtype=torch.long)
        output = pipe.forward(x)
        # Where the token's collective runs (NCCL: the stage's GPU; gloo: the CPU).
        token = torch.full((1,), -1, dtype=torch.long, device=group_device(pipe.device) if distributed else "cpu")
        if output is not None:
            token[0] = logits_of(output)[0, len(window) - 1].argmax()
        if distributed:
            # Every replica's last stage picked one (the same): max keeps it, and -1 elsewhere loses.
            dist.all_reduce(token, op=dist.ReduceOp.MAX)
        made.append(int(token.item()))
        context.append(made[-1])
        if made[-1] == eos_id:
            break
    return made


def cached_tokens(pipe: Any, prompt: Sequence[int], steps: int, *, length: int,
                  eos_id: int | None = None) -> list[int] | None:
    """``steps`` greedy tokens after ``prompt`` through key/value caches: ``pipe.generate`` with ``kv_cache=True``
    (the decode program of the model ``conveyor.pipeline`` traced, cut like its training one, reading ``pipe``'s
    own weights: :func:`conveyor.pipe.generation.traced_decoder`); None where the cache cannot serve and
    :func:`greedy_tokens` must: replicas or tensor-parallel ranks (sharded weights), stages built by hand, wrapped
    by a part or compiled, a model without a Hugging Face causal head, or a context that outgrows ``length``
    positions (the window then slides, which cached absolute positions cannot). A collective, as
    :func:`greedy_tokens`: one row per lane, one prompt for all.

    Example (every rank)::

        made = cached_tokens(pipe, prompt, 48, length=128) or greedy_tokens(...)
    """
    from conveyor.pipe.generation import Sampling, traced_decoder

    lanes = pipe.schedule.num_microbatches
    if len(prompt) + steps > length or traced_decoder(pipe, lanes, length, torch.full((lanes,), len(prompt)),
                                                      len(prompt))[0] is None:
        return None
    out = pipe.generate(torch.tensor([list(prompt)] * lanes, dtype=torch.long), steps,
                        sampling=Sampling(eos_token_id=eos_id), length=length, kv_cache=True)
    return out.tokens[0, :int(out.lengths[0])].tolist()


@torch.no_grad()
def greedy_reference(model: torch.nn.Module, prompt: Sequence[int], steps: int, *, seq_len: int,
                     eos_id: int | None = None) -> list[int]:
    """Plain greedy decoding with the unsplit ``model`` (what :func:`greedy_tokens` must equal).

    Example:
        >>> from conveyor.train.config import load_config
        >>> from conveyor.train.models import build_model
        >>> model = build_model(load_config(None, ["model.layers=2", "model.width=32"]), 256)
        >>> len(greedy_reference(model, [100, 101], 5, seq_len=128))
        5
    """
    context, made = list(prompt), []
    for _ in range(steps):
        logits = logits_of(model(torch.tensor([context[-seq_len:]], dtype=torch.long)))
        made.append(int(logits[0, -1].argmax()))
        context.append(made[-1])
        if made[-1] == eos_id:
            break
    return made


def prompt_ids(run: Any, tokenizer: Any) -> list[int]:
    """The sample's prompt as ids, the same on every rank (a collective when ``train.sample_prompt`` is None).

    None takes the first :data:`PROMPT_TOKENS` tokens of the validation text (the start of a
    held-out document), which only the ranks that read data hold; without a validation split,
    :data:`DEFAULT_PROMPT`.
    """
    text = run.cfg.train.sample_prompt
    if text is None:
        mine = [int(i) for i in run.val_data.dataset.tokens[:PROMPT_TOKENS]] if run.val_data is not None else None
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        found = next((ids for ids in gathered if ids), None)
        if found is not None:
            return found
        text = DEFAULT_PROMPT
    return [int(i) for i in tokenizer.encode(text.encode("utf-8"))]


def write_sample(run: Any) -> dict[str, Any]:
    """Generate ``train.sample_tokens`` tokens through ``run.pipe`` (a collective), decode them, write
    ``<run.dir>/sample.txt`` on rank 0; returns ``{"sample_prompt", "sample", "sample_txt"}`` (texts).

    Example (every rank, after the loop, before the pipeline closes)::

        summary.update(write_sample(run))
    """
    from conveyor.train.loop import LossWithAux

    cfg = run.cfg
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    prompt = prompt_ids(run, tokenizer)
    made = None
    if run.pipe.checkpoint_group is None and not isinstance(run.loss_fn, LossWithAux):
        # Replicas and TP shards (checkpoint_group) and mixture-of-experts models keep the window loop.
        made = cached_tokens(run.pipe, prompt, cfg.train.sample_tokens, length=cfg.model.seq_len,
                             eos_id=tokenizer.eos_id)
    if made is None:
        made = greedy_tokens(run.pipe, prompt, cfg.train.sample_tokens, seq_len=cfg.model.seq_len,
                             rows=cfg.replica_batch_size, eos_id=tokenizer.eos_id)
    path = Path(cfg.run.dir) / "sample.txt"
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(tokenizer.decode(prompt + made), encoding="utf-8")
    return {"sample_prompt": tokenizer.decode(prompt), "sample": tokenizer.decode(made), "sample_txt": str(path)}


def sample_lines(summary: dict[str, Any], max_lines: int = 12) -> list[str]:
    """The summary's lines that show the sample: the prompt, then the continuation in ⟨ ⟩, each line
    indented under a header; runs of blank lines (an untrained model's favourite) are squeezed,
    control characters escaped, and at most ``max_lines`` shown (sample.txt has it all as it came).
    None when the run made no sample.

    Example:
        >>> print("\\n".join(sample_lines({"sample_prompt": "def ", "sample": "f(x):\\n    return x" + "\\n" * 9,
        ...                                "sample_txt": "runs/train/sample.txt"})))
        sample (greedy, after training; runs/train/sample.txt):
          | def ⟨f(x):
          |     return x
          |
          | (7 more blank lines)
          | ⟩
    """
    if summary.get("sample") is None:
        return []
    text = f"{summary['sample_prompt']}⟨{summary['sample']}⟩"
    # Control characters (an undertrained byte model makes them) shown escaped, not sent to the terminal.
    text = "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)
    shown: list[str] = []
    blank = 0
    for line in text.split("\n"):
        if not line.strip():
            blank += 1
            continue
        shown += [""] * min(blank, 1) + ([f"({blank - 1} more blank lines)"] if blank > 1 else [])
        blank = 0
        shown.append(line)
    if len(shown) > max_lines:
        shown = shown[:max_lines] + [f"... ({len(shown) - max_lines} more lines)"]
    return [f"sample (greedy, after training; {summary['sample_txt']}):",
            *(f"  | {line}".rstrip() for line in shown)]
