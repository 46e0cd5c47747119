"""Pretrained weights for the stages of one process, read from a Hugging Face safetensors directory.

A directory written by ``save_pretrained`` holds either one ``model.safetensors`` or shards
listed by ``model.safetensors.index.json`` (tensor name -> file). Each process opens only
the files that hold its own stages' tensors and reads only those tensors
(``safetensors.safe_open`` maps the file and reads a tensor's bytes when asked for it), so a
pipeline of P ranks reads the model about once in all, not P times.

Names are the unsplit model's (``conveyor.pipeline`` keeps them). A tied tensor is found
under any of its names: GPT-2's files hold ``transformer.wte.weight`` only, which the last
stage's ``lm_head.weight`` is then read from. Values are copied into the stage's own tensors
(cast to their dtype, as ``load_state_dict`` does), so optimizers built before keep working;
a tensor still on the meta device (a stage built by hand on meta) gets the loaded storage in
place (``torch.utils.swap_tensors``: the same Python object, now real).

Example:
    >>> report = pipe.load_pretrained("gpt2-dir")        # doctest: +SKIP
    >>> report.bytes_read, report.total_bytes            # doctest: +SKIP
    (124000000, 497000000)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conveyor.errors import PretrainedWeightsError

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class PretrainedReport:
    """What :func:`load_pretrained` read on this process.

    ``files``: the files it opened; ``tensors``: how many tensors it read; ``bytes_read``:
    the bytes of tensor data it read from them (a tensor two local stages share counts
    once); ``total_bytes``: the size of every file of the model, for comparison.
    """

    files: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes_read: int = 0
    total_bytes: int = 0


def model_info(model: nn.Module) -> dict[str, Any]:
    """What a checkpoint records about the unsplit model: class name, state-dict order, config.

    ``config`` is a Hugging Face model's full config as JSON (what ``config.json`` holds),
    absent for other models. Works on a meta-device model (only names are read).

    Example:
        >>> model_info(torch.nn.Linear(2, 3))
        {'class': 'Linear', 'state_names': ['weight', 'bias']}
    """
    info: dict[str, Any] = {"class": type(model).__name__, "state_names": list(model.state_dict().keys())}
    to_json = getattr(getattr(model, "config", None), "to_json_string", None)
    if callable(to_json):
        try:
            info["config"] = json.loads(to_json(use_diff=False))
        except (TypeError, ValueError) as exc:  # a config holding something JSON cannot: export only loses it
            log.warning("conveyor: the model's config is not JSON (%s); checkpoints will not record it", exc)
    return info


def weight_map(path: str | Path) -> tuple[Path, dict[str, str]]:
    """The directory and ``{tensor name: file name}`` of a safetensors model (single file or sharded).

    ``path`` is a directory holding ``model.safetensors.index.json`` or ``model.safetensors``,
    or one ``.safetensors`` file.
    """
    from safetensors import safe_open

    path = Path(path)
    if path.is_file():
        directory, single = path.parent, path.name
    else:
        directory, single = path, SINGLE_FILE
        index = directory / INDEX_FILE
        if index.is_file():
            return directory, dict(json.loads(index.read_text())["weight_map"])
    if not (directory / single).is_file():
        held = sorted(p.name for p in directory.iterdir())[:8] if directory.is_dir() else []
        raise PretrainedWeightsError(
            f"no safetensors weights at {path}: expected {INDEX_FILE} or {SINGLE_FILE} in a directory "
            f"written by save_pretrained (it holds {held or 'nothing'}); pass that directory"
        )
    with safe_open(directory / single, framework="pt", device="cpu") as f:
        return directory, dict.fromkeys(f.keys(), single)


def load_pretrained(path: str | Path, modules: Iterable[nn.Module],
                    tied_names: Iterable[Sequence[str]] = ()) -> PretrainedReport:
    """Fill ``modules``' parameters and persistent buffers from the safetensors weights at ``path``.

    Every name in the modules' ``state_dict()`` must be in the files, under itself or under
    another name of the same tied tensor (``tied_names``: groups of names of one tensor).
    Only the files holding those tensors are opened. Raises :class:`PretrainedWeightsError`
    naming the first tensor that is missing or has another shape.

    Example:
        >>> report = load_pretrained("gpt2-dir", pipe.modules,                # doctest: +SKIP
        ...                          [("transformer.wte.weight", "lm_head.weight")])
    """
    from safetensors import safe_open

    directory, where = weight_map(path)
    tied = {name: names for names in tied_names for name in names}  # name -> every name of its tensor
    targets: dict[str, list[tuple[str, torch.Tensor]]] = {}  # name in the files -> (stage name, tensor)
    for module in modules:
        for name, tensor in module.state_dict(keep_vars=True).items():
            source = next((n for n in [name, *tied.get(name, ())] if n in where), None)
            if source is None:
                raise PretrainedWeightsError(_missing(name, tensor, directory, where))
            targets.setdefault(source, []).append((name, tensor))
    report = PretrainedReport(total_bytes=sum((directory / f).stat().st_size for f in set(where.values())))
    by_file: dict[str, list[str]] = {}
    for source in targets:
        by_file.setdefault(where[source], []).append(source)
    for file_name in sorted(by_file):
        report.files.append(file_name)
        with safe_open(directory / file_name, framework="pt", device="cpu") as f:
            for source in by_file[file_name]:
                loaded = f.get_tensor(source)
                report.tensors += 1
                report.bytes_read += loaded.nbytes
                for name, tensor in targets[source]:
                    _fill(tensor, loaded, name, source, directory / file_name)
    return report


def _fill(tensor: torch.Tensor, loaded: torch.Tensor, name: str, source: str, file: Path) -> None:
    if tuple(tensor.shape) != tuple(loaded.shape):
        via = "" if source == name else f" (read as its tied name {source!r})"
        raise PretrainedWeightsError(
            f"{name!r}{via} has shape {list(tensor.shape)} in the model but {list(loaded.shape)} in {file}; "
            "these weights belong to another configuration: build the model from the config.json next to them"
        )
    with torch.no_grad():
        if tensor.is_meta:
            # Nothing to copy into: give this very object real storage, so every holder sees it.
            real = loaded.to(tensor.dtype).clone()
            if isinstance(tensor, nn.Parameter):
                real = nn.Parameter(real, requires_grad=tensor.requires_grad)
            torch.utils.swap_tensors(tensor, real)
        else:
            tensor.copy_(loaded)


def _missing(name: str, tensor: torch.Tensor, directory: Path, where: dict[str, str]) -> str:
    examples = ", ".join(repr(n) for n in list(where)[:3])
    near = [n for n in where if n.endswith(name.split(".", 1)[-1])][:2]
    hint = f"; names that end alike: {near}" if near else ""
    return (
        f"{name!r} (shape {list(tensor.shape)}) is in none of the weight files in {directory} "
        f"({len(where)} tensors, such as {examples}{hint}). These weights are of another model, or "
        "name its tensors with another prefix: load weights saved from this model class"
    )
