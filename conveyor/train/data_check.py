"""The launcher's data check: each split must hold what the ranks will need, found before any rank starts.

:func:`check_data` repeats, from the files' sizes, what every rank does with ``cfg.data``
(read the documents, cap them at ``data.max_bytes``, split them by document, tokenize, cut
the streams into windows of ``model.seq_len + 1`` tokens), and raises
:class:`~conveyor.errors.ConfigError` when a split is too short: the training split must
give every replica a batch (``train.batch_size`` windows over all replicas), the validation
split one window, or a batch when ``train.eval_interval`` > 0. Without it such a config fails
inside the ranks, after they started.

What it reads, so that it stays cheap (the corpus may be far larger than the launcher's memory):

* the bytes tokenizer on "stdlib" or text files: the files' sizes only (``os.stat``); the
  counts are exact, since a byte is a token;
* "stdlib-definitions": the definitions the ranks read, from the same function
  (:func:`~conveyor.train.corpus.definition_documents`, which parses every file it reads);
* a tokenizer directory: a split of more than 64 bytes per token it needs passes unread
  (no tokenizer makes tokens that long); a shorter one is tokenized document by document
  until it gives what it needs, reading at most :data:`READ_BUDGET` bytes of it;
* JSON lines and Parquet: the records are read (as the ranks read them) when the files
  total at most :data:`READ_BUDGET` bytes; larger ones are left to the ranks, which raise
  the same kind of error when a split is short.

Example:
    >>> from conveyor.train.config import load_config
    >>> sizes = check_data(load_config(None, ["data.max_bytes=200000", "data.val_fraction=0.3"]))
    >>> sizes["training"].tokens, sizes["validation"].tokens, sizes["validation"].need
    (191450, 8550, 2049)
    >>> check_data(load_config(None, ["data.max_bytes=2000", "model.seq_len=512"]))   # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    conveyor.errors.ConfigError: data: 2 splits are too short:
      - the training split of data.source='stdlib' holds 1900 tokens (1900 bytes in 1 document): 3 of ...
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from conveyor.errors import ConfigError
from conveyor.train import corpus, sources

READ_BUDGET = 8 * 2**20  # bytes the launcher reads at most for one split, or of JSON-lines/Parquet files
_BYTES_PER_TOKEN = 64  # no tokenizer's tokens are this long on average: more bytes than this suffice


class _Doc(NamedTuple):
    name: str
    size: int  # bytes
    source: Callable[[int, int], bytes]  # bytes [start, stop) of the file or record it comes from
    start: int = 0

    def read(self) -> bytes:
        return self.source(self.start, self.start + self.size)

    def cut(self, start: int, stop: int, name: str) -> _Doc:
        return _Doc(name, stop - start, self.source, self.start + start)


@dataclass(frozen=True)
class SplitSize:
    """One split as the ranks will see it: documents, bytes, and tokens (None: not counted here,
    the ranks check it); ``need`` is the tokens they need, ``windows`` what they need them for."""

    documents: int
    bytes: int
    tokens: int | None
    need: int
    windows: int

    @property
    def short(self) -> bool:
        return self.tokens is not None and self.tokens < self.need


def check_data(cfg: Any) -> dict[str, SplitSize | None]:
    """The sizes of ``{"training": ..., "validation": ...}`` (validation None without one), or a
    ConfigError naming the keys, the sizes that came and what would fit, when a split is short.

    ``cfg`` is a :class:`~conveyor.train.config.TrainConfig` (checked by ``load_config``).

    Example:
        >>> from conveyor.train.config import load_config
        >>> cfg = load_config(None, ["data.max_bytes=50000", "data.val_fraction=0", "train.eval_interval=0"])
        >>> check_data(cfg)["validation"] is None
        True
    """
    data, seq_len, batch = cfg.data, cfg.model.seq_len, cfg.train.batch_size
    docs = _corpus(data)
    if docs is None:
        return {"training": None, "validation": None}
    docs = sources.cap_documents(docs, data.max_bytes)
    train_docs, val_docs = sources.split_documents(docs, data.val_fraction)
    tokenizer = _Tokenizer(data.tokenizer)
    val_windows = batch if cfg.train.eval_interval > 0 else 1
    sizes = {"training": _measure(train_docs, tokenizer, batch * seq_len + 1, batch),
             "validation": _measure(val_docs, tokenizer, val_windows * seq_len + 1, val_windows)
             if val_docs else None}
    problems = [_explain(name, size, cfg, len(docs)) for name, size in sizes.items() if size and size.short]
    if len(problems) == 1:
        raise ConfigError(f"data: {problems[0]}")
    if problems:
        raise ConfigError(f"data: {len(problems)} splits are too short:\n" + "\n".join(f"  - {p}" for p in problems))
    return sizes


def _reader(path: Path) -> Callable[[int, int], bytes]:
    def read(start: int, stop: int) -> bytes:
        with path.open("rb") as file:  # only the part asked for: the file may be large
            file.seek(start)
            return file.read(stop - start)

    return read


def _corpus(data: Any) -> list[_Doc] | None:
    """The documents ``data.source`` names, with their sizes and how to read them; None when the
    JSON-lines/Parquet files are too large to read here."""
    # As conveyor.train.data.read_documents reads it, cap included.
    if sources.built_in(data.source) == corpus.SOURCE_NAME:
        return _in_memory(corpus.definition_documents(data.max_bytes))
    files = sources.source_files(data.source)
    if not files:
        root = sources.stdlib_root()
        return [_Doc(name, (root / name).stat().st_size, _reader(root / name)) for name in sources.stdlib_names()]
    if all(sources.file_format(path, data.format) == "text" for path in files):
        return [_Doc(str(path), path.stat().st_size, _reader(path)) for path in files]
    if sum(path.stat().st_size for path in files) > READ_BUDGET:
        return None
    from conveyor.train.data import read_documents  # torch comes with it: only on this path

    return _in_memory(read_documents(data))


def _in_memory(documents: Sequence[sources.Document]) -> list[_Doc]:
    return [_Doc(doc.name, len(doc.data), lambda a, b, data=doc.data: data[a:b]) for doc in documents]


class _Tokenizer:
    """Counts tokens as ``data.token_stream`` makes them; a tokenizer directory is loaded only when needed."""

    def __init__(self, spec: str) -> None:
        self.spec, self.loaded = spec, None

    def count(self, docs: Sequence[_Doc], need: int) -> int | None:
        if self.spec == "bytes":
            return sum(doc.size for doc in docs)
        if sum(doc.size for doc in docs) >= need * _BYTES_PER_TOKEN:
            return None
        if self.loaded is None:
            from conveyor.train.data import load_tokenizer

            self.loaded = load_tokenizer(self.spec)
        eos = 0 if self.loaded.eos_id is None else 1
        tokens = read = 0
        for doc in docs:
            if tokens >= need:
                break  # enough: the rest need not be read
            read += doc.size
            if read > READ_BUDGET:
                return None
            tokens += len(self.loaded.encode(doc.read())) + eos
        return tokens


def _measure(docs: Sequence[_Doc], tokenizer: _Tokenizer, need: int, windows: int) -> SplitSize:
    return SplitSize(len(docs), sum(d.size for d in docs), tokenizer.count(docs, need), need, windows)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _explain(name: str, size: SplitSize, cfg: Any, corpus_docs: int) -> str:
    seq_len, batch, data = cfg.model.seq_len, cfg.train.batch_size, cfg.data
    tokens = size.tokens or 0
    have = max(0, tokens - 1) // seq_len
    what = (f"a step needs train.batch_size={batch} (one batch per replica)" if name == "training"
            else f"a validation needs train.batch_size={batch}" if size.windows > 1 else "it needs 1")
    counted = _plural(tokens, "token") + ("" if data.tokenizer == "bytes" else f" of data.tokenizer={data.tokenizer!r}")
    capped = f", or a larger data.max_bytes (now {data.max_bytes})" if data.max_bytes is not None else ""
    fixes = [f"more data (data.source{capped})"]
    fitting = max(0, tokens - 1) // size.windows
    # A sequence this short is no advice worth giving: then only more data helps.
    if fitting >= 8:
        fixes.append(f"model.seq_len <= {fitting}")
    if size.windows > 1 and have >= 1:
        fixes.append(f"train.batch_size <= {have} (with parallel.dp and parallel.microbatches dividing it)")
    if name == "validation":
        held = f"now {data.val_fraction}: " + (f"{size.documents} of {corpus_docs} documents held out"
                                             if corpus_docs > 1 else "the end of the only document")
        fixes.append(f"a larger data.val_fraction ({held})")
        fixes.append("no validation (train.eval_interval=0 data.val_fraction=0)")
    elif data.val_fraction > 0:
        fixes.append(f"a smaller data.val_fraction (now {data.val_fraction})")
    return (f"the {name} split of data.source={data.source!r} holds {counted} ({_plural(size.bytes, 'byte')} "
            f"in {_plural(size.documents, 'document')}): {have} of the windows of model.seq_len + 1 = "
            f"{seq_len + 1} tokens it is cut into; {what} of them, {size.windows} x {seq_len} + 1 = "
            f"{size.need} tokens. Fix: " + ", or ".join(fixes))
