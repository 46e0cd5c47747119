"""``conveyor export``: a checkpoint as Hugging Face safetensors, loadable by ``from_pretrained``.

Writes ``model.safetensors`` or, above ``max_shard_size``, ``model-0000i-of-0000n.safetensors``
shards with ``model.safetensors.index.json``, plus ``config.json`` when the checkpoint
recorded a transformers config. A tied tensor is written once, under its first name, when
the config ties word embeddings (transformers ties the other name itself, and safetensors
refuses two names for one storage); otherwise every name gets its own copy.

Example:
    >>> export("ckpt/step_100", "out/model", max_shard_size="2GB")       # doctest: +SKIP
    ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
    >>> AutoModelForCausalLM.from_pretrained("out/model")                # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import MappingProxyType

import torch

from conveyor.checkpoint import files
from conveyor.checkpoint.loading import to_state_dict
from conveyor.errors import CheckpointError
from conveyor.frontend.pretrained import INDEX_FILE, SINGLE_FILE

_UNITS = MappingProxyType({"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
                           "KIB": 2**10, "MIB": 2**20, "GIB": 2**30})


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string such as ``"5GB"``, ``"200MiB"`` (the units transformers uses).

    Example:
        >>> parse_size("20KB"), parse_size("1GiB"), parse_size(512)
        (20000, 1073741824, 512)
    """
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise CheckpointError(f"max_shard_size must be bytes or a size such as '5GB' or '500MiB'; got {size!r}")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise CheckpointError(f"max_shard_size must be at least one byte; got {size!r}")
    return value


def export(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, max_shard_size: int | str = "5GB") -> list[str]:
    """Write the model of ``checkpoint`` to ``out_dir`` as safetensors (+ config.json); returns the files.

    One process, no torch.distributed. Shards hold whole tensors in the model's order, each
    shard at most ``max_shard_size`` unless one tensor alone is larger.
    """
    from safetensors.torch import save_file

    limit = parse_size(max_shard_size)
    directory = files.resolve(checkpoint)
    meta = files.read_meta(directory)
    info = meta["model"].get("info") or {}
    config = info.get("config")
    state = to_state_dict(directory)
    aliases = meta["model"]["aliases"]
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in aliases:
            if config is not None and config.get("tie_word_embeddings", True):
                continue  # transformers ties it again when it loads
            tensor = tensor.clone()  # safetensors stores no two names for one storage
        tensors[name] = tensor.contiguous()
    shards = _shards(tensors, limit)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file_name, shard in zip(names, shards):
        save_file({n: tensors[n] for n in shard}, str(out / file_name), metadata={"format": "pt"})
        # safetensors creates its file 0600; give it the mode of every other file written here (0644 under umask 022).
        os.chmod(out / file_name, 0o666 & ~_umask())
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                 "weight_map": {n: f for f, shard in zip(names, shards) for n in shard}}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if config is not None:
        config = dict(config)
        if not config.get("architectures") and info.get("class"):
            config["architectures"] = [info["class"]]
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return names


def _umask() -> int:
    """This process's umask (only readable by setting it: set back at once, before any file is created)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += tensor.nbytes
    return shards
