"""A checkpoint on disk: its directory, the atomic rename, ``latest``, ``keep_last``, and safe reading.

Layout of ``save("ckpt/step_100", ...)``::

    ckpt/
      latest                       "step_100": the last checkpoint saved here (replaced atomically)
      step_100/
        .metadata                  DCP's index of every tensor (shapes, dtypes, where its bytes are)
        __0_0.distcp, __1_0.distcp ...   each rank's tensors
        conveyor.json              everything else, as JSON; written last
      .step_100.partial-<token>/   a save in progress (or one interrupted): never a checkpoint

Why it is atomic: every rank writes into the ``.partial`` directory; DCP's last step (on the
coordinator, after every rank's files are written and fsynced) writes ``.metadata``; the
coordinator then writes ``conveyor.json`` and renames the directory to its name, one
``rename`` that either happened or did not. A directory is a checkpoint only if it holds
``conveyor.json`` of this format, so a rank killed mid-write leaves a ``.partial`` directory
that nothing loads or counts, and the previous checkpoint (and ``latest``) untouched. The
next save into the same parent removes such leftovers.

Reading never unpickles arbitrary objects: DCP's ``.metadata`` is a pickle, read here
through an unpickler that admits only DCP's own metadata classes, ``torch.Size``, dtypes
and paths; tensors are read by DCP with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from conveyor.errors import CheckpointError, CheckpointIncompleteError

META_FILE = "conveyor.json"
LATEST_FILE = "latest"
FORMAT = "conveyor-checkpoint"
VERSION = 1
_PARTIAL = ".partial-"
_OLD = ".replaced-"


def partial_dir(final: Path, token: str) -> Path:
    """Where a save of ``final`` writes before it is renamed (hidden, and never a checkpoint)."""
    return final.parent / f".{final.name}{_PARTIAL}{token}"


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a complete checkpoint conveyor wrote."""
    try:
        return read_meta(path).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def checkpoints(parent: str | os.PathLike) -> list[Path]:
    """The complete checkpoints conveyor wrote in ``parent``, oldest first.

    Example:
        >>> [p.name for p in checkpoints("ckpt")]      # doctest: +SKIP
        ['step_100', 'step_200']
    """
    parent = Path(parent)
    if not parent.is_dir():
        return []
    found = [c for c in parent.iterdir() if c.is_dir() and not c.name.startswith(".") and is_checkpoint(c)]
    return sorted(found, key=lambda child: (read_meta(child).get("saved_at", 0.0), child.name))


def latest(parent: str | os.PathLike) -> Path | None:
    """The last checkpoint saved in ``parent`` (its ``latest`` marker, else the newest), or None.

    Example:
        >>> conveyor.checkpoint.latest("ckpt")         # doctest: +SKIP
        PosixPath('ckpt/step_200')
    """
    parent = Path(parent)
    marker = parent / LATEST_FILE
    if marker.is_file():
        named = parent / marker.read_text().strip()
        if is_checkpoint(named):
            return named
    found = checkpoints(parent)
    return found[-1] if found else None


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory ``path`` names: itself, or the ``latest`` of a parent directory."""
    path = Path(path)
    if is_checkpoint(path):
        return path
    if path.is_dir() and (path / LATEST_FILE).is_file():
        found = latest(path)
        if found is not None:
            return found
    last = latest(path.parent)
    hint = f"; the last complete checkpoint there is {last}" if last is not None else ""
    if path.name.startswith(".") and _PARTIAL in path.name:
        raise CheckpointIncompleteError(f"{path} is an unfinished save (a rank stopped while writing it), "
                                        f"not a checkpoint{hint}")
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint at {path}: the directory does not exist{hint}")
    if (path / META_FILE).is_file():
        raise CheckpointIncompleteError(
            f"{path} is not a complete conveyor checkpoint: its {META_FILE} is not the JSON a save writes (cut "
            f"short, or changed by hand); use another checkpoint{hint}"
        )
    held = sorted(p.name for p in path.iterdir())[:6]
    raise CheckpointIncompleteError(
        f"{path} is not a complete conveyor checkpoint: it has no {META_FILE} (it holds {held or 'nothing'}); "
        f"a save that was interrupted, or a directory conveyor did not write{hint}"
    )


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / META_FILE).read_text())


def write_meta(directory: Path, meta: dict[str, Any]) -> None:
    """Write ``conveyor.json`` durably: the file that makes the directory a checkpoint."""
    _write_durably(directory / META_FILE, json.dumps(meta, indent=1, sort_keys=True))


def _write_durably(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def _sync_directory(path: Path) -> None:
    # A rename is durable once the directory holding it is synced.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_destination(final: Path) -> None:
    """Refuse to save over something that is not a conveyor checkpoint (before anything is written)."""
    if final.exists() and not (final.is_dir() and (is_checkpoint(final) or not any(final.iterdir()))):
        raise CheckpointError(
            f"{final} exists and is not a conveyor checkpoint; saving would replace it: choose another "
            "name, or remove it first"
        )


def remove_leftovers(parent: Path, keep: Path) -> None:
    """Remove what interrupted saves left in ``parent`` (one job writes a parent at a time)."""
    if not parent.is_dir():
        return
    for child in parent.iterdir():
        if child.name.startswith(".") and (_PARTIAL in child.name or _OLD in child.name) and child != keep:
            shutil.rmtree(child, ignore_errors=True)


def publish(partial: Path, final: Path, keep_last: int | None) -> None:
    """Rename the finished ``partial`` directory to ``final``, mark it latest, prune the oldest."""
    old = None
    if final.exists():  # a checkpoint of the same name (check_destination refused anything else)
        old = final.parent / f".{final.name}{_OLD}{partial.name.rsplit('-', 1)[-1]}"
        os.rename(final, old)
    os.rename(partial, final)
    _sync_directory(final.parent)
    _write_durably(final.parent / LATEST_FILE, final.name + "\n")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if keep_last is not None:
        found = checkpoints(final.parent)  # oldest first; only those conveyor wrote
        excess = len(found) - keep_last
        for stale in [p for p in found if p != final][:max(0, excess)]:
            shutil.rmtree(stale)


def new_meta(fields: dict[str, Any]) -> dict[str, Any]:
    """``conveyor.json``'s content: the format, version, time and torch version, then ``fields``."""
    return {"format": FORMAT, "version": VERSION, "saved_at": time.time(), "torch": torch.__version__, **fields}


# --- reading DCP's files safely ----------------------------------------------------------------

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
        "StorageMeta", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "Path"), ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata and nothing else: no other class or function can be called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(
            f"the checkpoint's .metadata refers to {module}.{name}, which DCP metadata never holds; "
            "refusing to unpickle it (the file is damaged or was not written by DCP)"
        )


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, reading ``.metadata`` with :class:`_MetadataUnpickler` instead of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return read_dcp_metadata(Path(self.path), load_id=self.load_id)


def read_dcp_metadata(path: Path, load_id: str | None = None) -> Metadata:
    """DCP's index of the checkpoint at ``path`` (raises CheckpointIncompleteError if absent)."""
    try:
        with open(path / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointIncompleteError(
            f"{path} has no .metadata (DCP's index of its tensors): the directory was cut short; "
            "copy the whole checkpoint again, or use an earlier one"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointIncompleteError(f"{path}/.metadata does not hold DCP metadata")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = load_id
    return metadata


def missing_bytes(path: Path, metadata: Metadata, keys: Iterable[str]) -> str | None:
    """Why the first of ``keys`` whose bytes are not all on disk cannot be read, or None."""
    wanted = set(keys)
    sizes: dict[str, int | None] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn not in wanted:
            continue
        if info.relative_path not in sizes:
            file = path / info.relative_path
            sizes[info.relative_path] = file.stat().st_size if file.is_file() else None
        size = sizes[info.relative_path]
        if size is None or size < info.offset + info.length:
            expected = info.offset + info.length
            what = "is missing" if size is None else f"has {size} bytes, fewer than the {expected} it should"
            return (f"checkpoint {path} is incomplete: {index.fqn!r} is stored in {info.relative_path}, which {what}; "
                    "the files were removed or the copy was cut short: copy the whole directory again, or use "
                    "an earlier checkpoint")
    return None


def tensor_entry(metadata: Metadata, key: str) -> TensorStorageMetadata | None:
    entry = metadata.state_dict_metadata.get(key)
    return entry if isinstance(entry, TensorStorageMetadata) else None


@contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns that it "assumes one process" whenever torch.distributed is not initialised,
    even when told so (no_dist=True): one process is what was asked for here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
