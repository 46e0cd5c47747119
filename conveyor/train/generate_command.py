"""``conveyor generate RUN_OR_CHECKPOINT --prompt TEXT``: text from a trained run, through the pipeline.

``RUN_OR_CHECKPOINT`` is a run directory (its ``config.yaml`` and the latest checkpoint in its
checkpoint directory) or one checkpoint inside a run (the run's ``config.yaml`` is found above
it). The model the config names is built on this machine's CPU, the checkpoint loaded into it
by the model's names (any layout it was saved at), then cut into ``--stages`` stages in this
process and decoded with :meth:`conveyor.Pipeline.generate` within ``model.seq_len`` positions, as
the model was trained (a prompt longer than ``seq_len - --tokens`` keeps its end): a Hugging Face
causal LM through its stages' key/value caches (:func:`conveyor.frontend.decode.decode_stages`, the
prompt at once, then a token per step), any other model in windows recomputed whole at each token.

Example (after ``conveyor train``)::

    conveyor generate runs/train --prompt "def " --tokens 40
    conveyor generate runs/train/checkpoints/step_000500 --prompt "import " --sample --temperature 0.8
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from conveyor.errors import UsageError
from conveyor.train.config import load_config

CONFIG_FILE = "config.yaml"


def add_parser(commands: Any, positive_int: Any) -> None:
    """The ``generate`` subcommand's options, on the ``conveyor`` parser's ``commands``; :func:`run` handles it."""
    command = commands.add_parser(
        "generate", help="print text a trained run generates through the pipeline: conveyor generate RUN --prompt TEXT",
        description="Build the run's model, load its latest checkpoint (or the one given), cut it into stages "
        "in this process and continue the prompt (greedy unless --sample).")
    command.add_argument("run", metavar="RUN_OR_CHECKPOINT", help="a run directory, or a checkpoint inside one")
    command.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    command.add_argument("--tokens", type=positive_int, default=48, metavar="N", help="tokens to generate (48)")
    command.add_argument("--stages", type=positive_int, default=2, metavar="P", help="pipeline stages (2)")
    command.add_argument("--sample", action="store_true", help="sample instead of the argmax")
    command.add_argument("--temperature", type=float, metavar="T", help="with --sample: divide the logits by T")
    command.add_argument("--top-k", type=positive_int, metavar="K", help="with --sample: the K likeliest tokens")
    command.add_argument("--top-p", type=float, metavar="P", help="with --sample: the likeliest tokens up to P")
    command.add_argument("--seed", type=int, default=0, help="with --sample: the generator's seed (0)")
    command.set_defaults(handler=run)


def find_run(path: str | Path) -> tuple[Path, Path]:
    """``(config.yaml, checkpoint)`` of a run directory or of a checkpoint inside one.

    Example:
        >>> find_run("/nonexistent")   # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        conveyor.errors.UsageError: /nonexistent is neither a run directory (with config.yaml) nor a checkpoint ...
    """
    from conveyor.checkpoint.files import is_checkpoint, latest

    path = Path(path)
    if (path / CONFIG_FILE).is_file():
        config = path / CONFIG_FILE
        parent = Path(load_config(config).checkpoint_dir)
        parent = parent if parent.is_absolute() or parent.is_dir() else path / "checkpoints"
        found = latest(parent)
        if found is None:
            raise UsageError(f"the run {path} has no checkpoint in {parent}: train it longer (checkpoint.interval), "
                             "or pass a checkpoint directory")
        return config, found
    if is_checkpoint(path):
        for above in path.resolve().parents:
            if (above / CONFIG_FILE).is_file():
                return above / CONFIG_FILE, path
        raise UsageError(f"no {CONFIG_FILE} above the checkpoint {path}: generate needs the run's config to build "
                         "its model; pass the run directory")
    raise UsageError(f"{path} is neither a run directory (with {CONFIG_FILE}) nor a checkpoint inside one: pass the "
                     "run.dir of a `conveyor train` run")


def generate_text(path: str | Path, prompt: str, tokens: int, stages: int = 2, sampling: Any = None,
                  seed: int = 0) -> tuple[str, str]:
    """``(the prompt as the model saw it, the continuation)`` of the run or checkpoint at ``path``."""
    import torch  # here, not at the top: the command line's parser imports this module, and must not import torch

    import conveyor
    from conveyor.checkpoint import load
    from conveyor.frontend import split_model
    from conveyor.frontend.decode import decode_stages
    from conveyor.pipe.generation import CAUSAL_HEADS, Sampling
    from conveyor.train.data import load_tokenizer
    from conveyor.train.models import build_model

    config, checkpoint = find_run(path)
    cfg = load_config(config)
    seq_len = cfg.model.seq_len
    if tokens >= seq_len:
        raise UsageError(f"--tokens {tokens} leaves no room for the prompt in the model's {seq_len} positions: "
                         f"pass --tokens {seq_len - 1} or fewer")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    ids = tokenizer.encode(prompt.encode("utf-8")).long()[-(seq_len - tokens):]
    if ids.numel() == 0:
        raise UsageError("--prompt is empty: give at least one character to continue")
    model = build_model(cfg, tokenizer.vocab_size, device="cpu").eval()
    load(checkpoint, model)
    window = torch.zeros(1, seq_len, dtype=torch.long)
    layout = conveyor.InProcessLayout(ranks=stages)
    if type(model).__name__.endswith(CAUSAL_HEADS):  # the model's own cache code, traced once more
        split = split_model(model, stages, example_args=(window,))
        cached = decode_stages(split, rows=1, length=seq_len, prefill=ids.numel() if ids.numel() > 1 else None)
        pipe = conveyor.Pipeline(cached, "gpipe", microbatches=1, layout=layout)
    else:
        pipe = conveyor.pipeline(model, example_args=(window,), schedule="gpipe", microbatches=1, layout=layout)
    sampling = dataclasses.replace(sampling or Sampling(), eos_token_id=tokenizer.eos_id)
    out = pipe.generate(ids[None], tokens, sampling=sampling, generator=torch.Generator().manual_seed(seed),
                        length=seq_len)
    made = out.tokens[0, :int(out.lengths[0])]
    return tokenizer.decode(ids.tolist()), tokenizer.decode(made.tolist())


def run(args: argparse.Namespace) -> int:
    """``conveyor generate``: print the prompt and its continuation."""
    from conveyor.pipe.generation import Sampling

    sampling = Sampling(do_sample=args.sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    seen, made = generate_text(args.run, args.prompt, args.tokens, args.stages, sampling, args.seed)
    print(seen + made)
    return 0
