"""The pieces batching by length trains on, cut once and kept on disk for the next run.

``data.batching=by_length`` cuts every training document into pieces of at most ``seq_len + 1``
tokens (:func:`conveyor.train.data.document_pieces`): seconds for the standard library, tens
of seconds for ``data.source=stdlib-definitions`` (every file parsed with :mod:`ast`), and the
same work on every rank that reads data and in every run. :func:`cached_pieces` keeps the result
in ``$XDG_CACHE_HOME/conveyor/pieces/<key>.pt`` (``~/.cache`` without it), where ``key`` is a
hash of everything the pieces depend on (:func:`pieces_key`): the data settings, ``seq_len``, the
tokenizer and the size and modification time of every source file. A changed file or setting
makes another key; nothing is ever read from a stale entry. Ranks that miss at once take turns
on a lock: the first cuts and writes, the others read what it wrote.

Example:
    >>> import tempfile
    >>> from conveyor.train.config import DataConfig
    >>> cfg, folder = DataConfig(max_bytes=20_000), Path(tempfile.mkdtemp())
    >>> made = cached_pieces(cfg, 64, lambda: [torch.arange(5), torch.arange(3)], folder=folder)
    >>> again = cached_pieces(cfg, 64, lambda: 1 / 0, folder=folder)       # read back: not cut again
    >>> [p.tolist() for p in again]
    [[0, 1, 2, 3, 4], [0, 1, 2]]
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from conveyor.train import sources

_FORMAT = 1  # bumped whenever the cutting changes, so that older entries are never read


def cache_folder(environ: dict[str, str] | None = None) -> Path:
    """Where the pieces are kept: ``$XDG_CACHE_HOME/conveyor/pieces``, else ``~/.cache/conveyor/pieces``.

    Example:
        >>> str(cache_folder({"XDG_CACHE_HOME": "/tmp/c"}))
        '/tmp/c/conveyor/pieces'
    """
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "conveyor" / "pieces"


def pieces_key(cfg: Any, seq_len: int) -> str:
    """A hash of what the pieces of ``cfg`` (a DataConfig) at ``seq_len`` depend on: the settings, the
    tokenizer, and the name, size and modification time of every file read (the stdlib's own for
    "stdlib" and "stdlib-definitions", with this Python's version).

    Example:
        >>> from conveyor.train.config import DataConfig
        >>> pieces_key(DataConfig(), 64) == pieces_key(DataConfig(), 64) != pieces_key(DataConfig(), 128)
        True
    """
    patterns = sources.source_patterns(cfg.source)
    files = sources.source_files(cfg.source)
    if not files:  # "stdlib" or "stdlib-definitions": this Python's library
        root = sources.stdlib_root()
        files = [root / name for name in sources.stdlib_names()]
    if cfg.tokenizer != "bytes":
        files += sorted(path for path in Path(cfg.tokenizer).expanduser().rglob("*") if path.is_file())
    described = {
        "format": _FORMAT, "python": sys.version, "patterns": patterns, "seq_len": seq_len,
        "settings": [cfg.format, cfg.text_key, cfg.tokenizer, cfg.val_fraction, cfg.max_bytes],
        "files": [[str(path), (stat := path.stat()).st_size, stat.st_mtime_ns] for path in files],
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:24]


def cached_pieces(cfg: Any, seq_len: int, cut: Callable[[], Sequence[torch.Tensor]],
                  folder: str | os.PathLike | None = None) -> list[torch.Tensor]:
    """The pieces of ``cfg``'s training documents at ``seq_len``: read from ``folder`` (None:
    :func:`cache_folder`) when an entry for :func:`pieces_key` is there, else made by ``cut()`` and
    written there (atomically, under a lock that other ranks wait on). A folder that cannot be written
    (read-only, full) only costs the saving: the pieces are returned all the same.

    The pieces come back as views of one tensor, in the narrowest integer dtype that holds the tokens.
    """
    folder = Path(folder) if folder is not None else cache_folder()
    key = pieces_key(cfg, seq_len)
    path = folder / f"{key}.pt"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / f"{key}.lock", "w")  # noqa: SIM115 - held until the entry is there
    except OSError:
        return list(cut())
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a rank that cuts the same pieces now: wait, then read its entry
        if path.is_file():
            try:
                return _unpack(torch.load(path, weights_only=True))
            except (OSError, RuntimeError, KeyError, ValueError):
                pass  # a damaged entry: cut again, and replace it
        pieces = list(cut())
        packed = _pack(pieces)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            torch.save(packed, temporary)
            os.replace(temporary, path)
        except OSError:
            temporary.unlink(missing_ok=True)
        return _unpack(packed)


def _pack(pieces: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    lengths = torch.tensor([len(piece) for piece in pieces], dtype=torch.int64)
    tokens = torch.cat(list(pieces)) if pieces else torch.empty(0, dtype=torch.int64)
    small = not tokens.numel() or (int(tokens.min()) >= 0 and int(tokens.max()) < 256)
    narrow = torch.uint8 if small else torch.int32
    return {"lengths": lengths, "tokens": tokens.to(narrow)}


def _unpack(packed: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.split(packed["tokens"], packed["lengths"].tolist()))
