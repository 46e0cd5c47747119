"""Where a corpus comes from ("stdlib", or local files and globs, each with a format), and how it is capped and split.

Shared by the config checks (a source that matches nothing is refused before anything
starts), the launcher's data check (:mod:`conveyor.train.data_check`) and the readers in
:mod:`conveyor.train.data`; it imports no torch, so the launcher stays quick.

Example:
    >>> file_format(Path("shard-000.parquet"), None), file_format(Path("notes.md"), None)
    ('parquet', 'text')
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from conveyor.errors import ConfigError

STDLIB = "stdlib"
DEFINITIONS = "stdlib-definitions"
# The corpora built in, by the name data.source gives them: every message that lists what data.source takes
# reads this, so none can leave one out.
BUILT_IN = MappingProxyType({
    STDLIB: "the Python standard library's .py sources",
    DEFINITIONS: "each function or class of them one document (conveyor.train.corpus)",
})
FORMATS = ("text", "jsonl", "parquet")
# Suffixes that name a structured format; every other file is read as plain text.
_SUFFIX_FORMATS = MappingProxyType({".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"})
# Directories of the stdlib left out of the corpus: installed packages are not the stdlib, and
# Debian-like distributions ship the test suites as separate packages.
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})



class Document(NamedTuple):
    """One unit of the corpus: a file, a record of a JSON-lines or Parquet file, or a definition
    (:mod:`conveyor.train.corpus`)."""

    name: str
    data: bytes

    @property
    def size(self) -> int:
        return len(self.data)

    def cut(self, start: int, stop: int, name: str) -> Document:
        """Its bytes ``[start, stop)`` as the document ``name`` (what the cap and the split cut)."""
        return Document(name, self.data[start:stop])

def stdlib_root() -> Path:
    """The directory of this Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_names() -> list[str]:
    """The standard library's ``.py`` files, as paths under :func:`stdlib_root`, sorted (tests and packages left out).

    Example:
        >>> names = stdlib_names()
        >>> "os.py" in names and "json/decoder.py" in names, names == sorted(names)
        (True, True)
    """
    root = stdlib_root()
    names = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _STDLIB_SKIP)  # pruned in place: never walked
        rel = Path(folder).relative_to(root)
        names += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    # Sort the whole list, not per folder: the order must not depend on the walk.
    return sorted(names)


def held_out(names: Sequence[str], val_fraction: float) -> set[int]:
    """The indices of the documents held out for validation: ``round(val_fraction x n)`` of them
    (at least one when the fraction is > 0, never all), chosen by a hash of their names.

    Example:
        >>> sorted(held_out([f"f{i}.py" for i in range(10)], 0.2))
        [2, 5]
    """
    if val_fraction <= 0 or len(names) < 2:
        return set()
    count = min(len(names) - 1, max(1, round(val_fraction * len(names))))
    # A hash of the name, not the position: adding a file moves no other file across the split.
    by_hash = sorted(range(len(names)), key=lambda i: hashlib.sha256(names[i].encode()).digest())
    return set(by_hash[:count])


def cap_documents(documents: Iterable[Any], max_bytes: int | None) -> list[Any]:
    """Documents in order up to ``max_bytes`` bytes in all (None: every one), the one that reaches it cut short.

    A document has a ``name``, a ``size`` in bytes and ``cut(start, stop, name)``: its bytes ``[start, stop)`` as
    the document ``name``. The readers' documents (:class:`Document`) and the launcher's
    sizes (:mod:`conveyor.train.data_check`) go through this one cap, so the two agree.
    """
    kept, total = [], 0
    for doc in documents:
        if max_bytes is not None and total + doc.size >= max_bytes:
            if max_bytes > total:
                kept.append(doc.cut(0, max_bytes - total, doc.name))
            break
        kept.append(doc)
        total += doc.size
    return kept


def split_documents(documents: Sequence[Any], val_fraction: float) -> tuple[list[Any], list[Any]]:
    """``(train, validation)``: ``round(val_fraction x n)`` documents (at least one when the fraction
    is > 0) held out, chosen by a hash of their names (:func:`held_out`); both keep the corpus order.

    A corpus of one document is cut instead: its last ``val_fraction`` of bytes is validation. Documents
    as :func:`cap_documents` takes them.
    """
    if val_fraction <= 0 or not documents:
        return list(documents), []
    if len(documents) == 1:
        doc = documents[0]
        end = doc.size - max(1, round(doc.size * val_fraction))
        return [doc.cut(0, end, doc.name)], [doc.cut(end, doc.size, doc.name + "#validation")]
    held = held_out([d.name for d in documents], val_fraction)
    return ([d for i, d in enumerate(documents) if i not in held],
            [d for i, d in enumerate(documents) if i in held])


def expected_sources() -> str:
    """What ``data.source`` takes, in words, from :data:`BUILT_IN`.

    Example:
        >>> expected_sources()  # doctest: +ELLIPSIS
        "'stdlib' (the Python standard library's .py sources), 'stdlib-definitions' (each function ...
    """
    names = ", ".join(f"{name!r} ({what})" for name, what in BUILT_IN.items())
    return f"{names}, or local files: a path or glob, or a list of them"


def source_patterns(source: Any) -> list[str]:
    """``data.source`` as a list of strings (a built-in name, paths or globs); a ConfigError for anything else.

    Example:
        >>> source_patterns(None)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        conveyor.errors.ConfigError: data.source=None: expected 'stdlib' (...), 'stdlib-definitions' (...
    """
    items = [source] if isinstance(source, str) else source
    if not isinstance(items, Sequence) or isinstance(items, str) or not items or not all(
            isinstance(item, str) and item for item in items):
        raise ConfigError(f"data.source={source!r}: expected {expected_sources()}, e.g. data.source=corpus/*.txt")
    return list(items)


def built_in(source: Any) -> str | None:
    """The built-in corpus ``data.source`` names (a key of :data:`BUILT_IN`, given alone, as itself or as a
    list of one), or None for local files. The readers (:func:`conveyor.train.data.read_documents`) and the
    launcher's data check (:mod:`conveyor.train.data_check`) both ask this, so the two read one corpus.

    Example:
        >>> built_in("stdlib-definitions"), built_in(["stdlib-definitions"]), built_in("corpus/*.txt")
        ('stdlib-definitions', 'stdlib-definitions', None)
    """
    patterns = source_patterns(source)
    return patterns[0] if len(patterns) == 1 and patterns[0] in BUILT_IN else None


def source_files(source: Any) -> list[Path]:
    """The files ``data.source`` names, sorted within each pattern (globs may use ``**``); [] for a built-in corpus.

    Raises ConfigError for a pattern that matches no file, or "stdlib" mixed with files.
    """
    patterns = source_patterns(source)
    for embedded in BUILT_IN:
        if embedded in patterns:
            if len(patterns) > 1:
                raise ConfigError(f"data.source={source!r}: {embedded!r} stands alone; give it or local files, "
                                  "not both")
            return []
    files: list[Path] = []
    for pattern in patterns:
        path = Path(pattern).expanduser()
        matched = [path] if path.is_file() else sorted(
            Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not matched:
            raise ConfigError(f"data.source: {pattern!r} matches no file; expected {expected_sources()} "
                              f"(relative to {Path.cwd()})")
        files += [m for m in matched if m not in files]
    return files


def file_format(path: Path, fmt: str | None) -> str:
    """``fmt`` if given, else the format ``path``'s suffix names (text when it names none)."""
    return fmt if fmt is not None else _SUFFIX_FORMATS.get(path.suffix.lower(), "text")


def require_pyarrow() -> Any:
    """``pyarrow.parquet``, or a ConfigError that says how to install it."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("data: reading Parquet needs pyarrow, which is not installed; "
                          "install it with `python -m pip install pyarrow`, or give text/jsonl files") from None
    return pq
