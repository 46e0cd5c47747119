"""Training data: a corpus of documents, a tokenizer, fixed windows, and a resumable per-replica loader.

The default corpus is the Python standard library's own ``.py`` sources, read as bytes in
sorted order: no download, and the same bytes on every machine with this Python (its
tests and any installed packages are left out, since distributions ship those apart).
Local text files, JSON lines and Parquet work too. Documents (files, or records) are split
into training and validation by a hash of their names, so the split does not depend on
the order they were read in; the token stream of each split is cut into ``seq_len + 1``
windows (:class:`TokenBlocks`). :class:`ResumableLoader` draws one replica's share of them,
shuffled per epoch like ``DistributedSampler``; its ``state_dict()`` (plain JSON values) goes
into a checkpoint so a resumed run draws the batches an uninterrupted one would.
:func:`resumable_loader` builds the dataset only on the ranks that read data.

Example:
    >>> splits = build_splits(DataConfig(max_bytes=200_000), seq_len=64)
    >>> loader = ResumableLoader(splits.train, batch_size=4, seed=0)
    >>> ids, targets = next(loader)
    >>> ids.shape, bool((ids[:, 1:] == targets[:, :-1]).all())
    (torch.Size([4, 64]), True)
    >>> loader.state_dict()
    {'epoch': 0, 'position': 4, 'seed': 0}
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from conveyor.errors import CheckpointMismatchError, ConfigError
from conveyor.options import SplitOptions
from conveyor.runtime.stage.device import to_device
from conveyor.train import corpus, sources
from conveyor.train.config import DataConfig
from conveyor.train.sources import Document, split_documents

# --- corpus ---------------------------------------------------------------------------------

def stdlib_documents(max_bytes: int | None = None) -> list[Document]:
    """The standard library's ``.py`` files as documents, named by their path under the stdlib, sorted.

    ``max_bytes`` caps the total (the last document is cut short to fit).

    Example:
        >>> docs = stdlib_documents(max_bytes=10_000)
        >>> sum(len(d.data) for d in docs), docs[0].name
        (10000, '__future__.py')
    """
    root = sources.stdlib_root()
    documents = (Document(name, (root / name).read_bytes()) for name in sources.stdlib_names())
    return sources.cap_documents(documents, max_bytes)


def file_documents(files: Sequence[Path], fmt: str | None = None, text_key: str = "text",
                   max_bytes: int | None = None) -> list[Document]:
    """The documents of local files: a text file is one document, a JSON line or Parquet row one each.

    ``fmt`` (text | jsonl | parquet) applies to every file; None infers it from each suffix.
    """
    def documents() -> Iterator[Document]:
        for path in files:
            kind = sources.file_format(Path(path), fmt)
            if kind == "text":
                yield Document(str(path), Path(path).read_bytes())
            elif kind == "jsonl":
                yield from _jsonl_documents(Path(path), text_key)
            else:
                yield from _parquet_documents(Path(path), text_key)

    return sources.cap_documents(documents(), max_bytes)


def read_documents(cfg: DataConfig) -> list[Document]:
    """The documents ``cfg.source`` names ("stdlib" or local files), capped at ``cfg.max_bytes``."""
    if sources.built_in(cfg.source) == corpus.SOURCE_NAME:
        return corpus.definition_documents(cfg.max_bytes)
    files = sources.source_files(cfg.source)
    if not files:
        return stdlib_documents(cfg.max_bytes)
    return file_documents(files, cfg.format, cfg.text_key, cfg.max_bytes)


def _jsonl_documents(path: Path, text_key: str) -> Iterator[Document]:
    with path.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{path}:{number} is not JSON ({error}); expected one JSON object per "
                                  f"line, or data.format=text to read the file as plain text") from None
            yield Document(f"{path}:{number}", _text_field(record, text_key, f"{path}:{number}"))


def _parquet_documents(path: Path, text_key: str) -> Iterator[Document]:
    pq = sources.require_pyarrow()
    table = pq.read_table(path)
    if text_key not in table.column_names:
        raise ConfigError(f"{path} has no column data.text_key={text_key!r}; its columns are "
                          f"{', '.join(table.column_names)}; set data.text_key to the one holding the text")
    for row, text in enumerate(table.column(text_key).to_pylist()):
        yield Document(f"{path}:{row}", _as_bytes(text, text_key, f"{path} row {row}"))


def _text_field(record: Any, text_key: str, where: str) -> bytes:
    if not isinstance(record, dict) or text_key not in record:
        keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(f"{where} has no key data.text_key={text_key!r} (it has: {keys}); set "
                          f"data.text_key to the field holding the text")
    return _as_bytes(record[text_key], text_key, where)


def _as_bytes(text: Any, text_key: str, where: str) -> bytes:
    if not isinstance(text, str):
        raise ConfigError(f"{where}: {text_key!r} holds {type(text).__name__}, expected a string of text")
    return text.encode("utf-8")


def fingerprint(documents: Sequence[Document]) -> str:
    """A short hash of the documents' names and bytes: equal fingerprints, equal corpora."""
    digest = hashlib.sha256()
    for doc in documents:
        digest.update(hashlib.sha256(doc.name.encode()).digest() + hashlib.sha256(doc.data).digest())
    return digest.hexdigest()[:16]


# --- tokenizers -----------------------------------------------------------------------------

class ByteTokenizer:
    """Bytes as tokens: vocabulary 256, nothing to download, no end-of-document token."""

    vocab_size = 256
    eos_id: int | None = None

    def encode(self, data: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class PretrainedTokenizer:
    """A local tokenizer directory, via ``transformers.AutoTokenizer`` (never downloads)."""

    def __init__(self, directory: str | Path) -> None:
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except (OSError, ValueError) as error:
            raise ConfigError(
                f"data.tokenizer={str(directory)!r}: cannot load a tokenizer from it ({error}); "
                f"expected a directory with tokenizer.json or the tokenizer's files, or 'bytes'"
            ) from None
        self.vocab_size = len(self.tokenizer)
        self.eos_id = self.tokenizer.eos_token_id

    def encode(self, data: bytes) -> torch.Tensor:
        ids = self.tokenizer(data.decode("utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.int64)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        return self.tokenizer.decode([int(i) for i in ids])


def load_tokenizer(spec: str) -> ByteTokenizer | PretrainedTokenizer:
    """``"bytes"`` or a local tokenizer directory (``data.tokenizer``); both have ``vocab_size``,
    ``eos_id``, ``encode(bytes) -> tensor`` and ``decode(ids) -> str``.

    Example:
        >>> load_tokenizer("bytes").encode(b"hi").tolist()
        [104, 105]
    """
    return ByteTokenizer() if spec == "bytes" else PretrainedTokenizer(spec)


def token_stream(documents: Sequence[Document], tokenizer: Any) -> torch.Tensor:
    """The documents' tokens end to end (each followed by the tokenizer's ``eos_id``, if it has one).

    Held in the narrowest dtype the vocabulary fits (uint8 for bytes): the stdlib corpus is
    ~12 M tokens, 96 MB as int64 on every rank that reads data.
    """
    dtype = torch.uint8 if tokenizer.vocab_size <= 256 else torch.int32
    eos = [] if tokenizer.eos_id is None else [torch.tensor([tokenizer.eos_id], dtype=dtype)]
    parts = [piece for doc in documents for piece in [tokenizer.encode(doc.data).to(dtype), *eos]]
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype)


# --- windows and splits ---------------------------------------------------------------------

class TokenBlocks(Dataset):
    """Fixed windows of ``seq_len + 1`` tokens, ``seq_len`` apart; item i is ``(ids, targets)``,
    both ``seq_len`` long int64, the targets the ids shifted by one.

    Example:
        >>> blocks = TokenBlocks(torch.arange(10), seq_len=4)
        >>> len(blocks), blocks[1]
        (2, (tensor([4, 5, 6, 7]), tensor([5, 6, 7, 8])))
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if seq_len < 1:
            raise ConfigError(f"model.seq_len={seq_len}: expected a value >= 1")
        self.tokens, self.seq_len = tokens, seq_len
        self._count = max(0, (len(tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self._count <= index < self._count:
            raise IndexError(f"block {index} of {self._count}")
        start = (index % self._count) * self.seq_len
        window = self.tokens[start: start + self.seq_len + 1].long()
        return window[:-1], window[1:]


@dataclass
class DataSplits:
    """What a rank that reads data holds: training and validation windows, the tokenizer, the corpus hash."""

    train: TokenBlocks
    val: TokenBlocks | None
    tokenizer: Any
    fingerprint: str


def build_splits(cfg: DataConfig, seq_len: int) -> DataSplits:
    """Read, split, tokenize and window the corpus ``cfg`` names (``val`` is None when
    ``cfg.val_fraction`` is 0). A split too short for one window is a ConfigError."""
    documents = read_documents(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer)
    train_docs, val_docs = split_documents(documents, cfg.val_fraction)
    train = TokenBlocks(token_stream(train_docs, tokenizer), seq_len)
    val = TokenBlocks(token_stream(val_docs, tokenizer), seq_len) if val_docs else None
    for name, blocks in (("training", train), ("validation", val)):
        if blocks is not None and len(blocks) == 0:
            raise ConfigError(f"the {name} split has {len(blocks.tokens)} tokens, fewer than model.seq_len + 1 "
                              f"= {seq_len + 1}; give more data (data.source, data.max_bytes), a smaller "
                              f"model.seq_len, or another data.val_fraction")
    return DataSplits(train, val, tokenizer, fingerprint(documents))


def splits_factory(cfg: DataConfig, seq_len: int) -> Callable[[], DataSplits]:
    """A function that builds the splits on its first call and returns the same ones after,
    so the training and validation loaders of one rank share one read of the corpus."""
    return functools.cache(functools.partial(build_splits, cfg, seq_len))


# --- the resumable loader -------------------------------------------------------------------

class _ReplicaEpochs:
    """What both loaders share: one replica's share of each epoch, drawn as ``DistributedSampler`` draws it,
    and where the loader stands (``epoch``, ``position``), resumable from ``state_dict()``."""

    def __init__(self, seed: int, dp_rank: int, dp_size: int, shuffle: bool, device: torch.device | None) -> None:
        self.seed, self.dp_rank, self.dp_size, self.shuffle, self.device = seed, dp_rank, dp_size, shuffle, device
        self.epoch, self.position = 0, 0
        self._epoch_cache: Any = None  # what the loader drew from the epoch it is in, kept between steps

    def _share(self, count: int, epoch: int) -> list[int]:
        """This replica's indices of ``count`` items in ``epoch``, in the order they are drawn."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(count, generator=generator).tolist()
        else:
            order = list(range(count))
        return order[: count - count % self.dp_size][self.dp_rank:: self.dp_size]

    def __iter__(self) -> _ReplicaEpochs:
        return self

    def restart(self) -> None:
        """Back to the first batch of epoch 0 (e.g. before each validation, to score the same batches)."""
        self.epoch, self.position = 0, 0

    def state_dict(self) -> dict[str, int]:
        """Where the loader stands: ``{"epoch", "position", "seed"}``, plain ints (JSON-able)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`); its seed replaces this loader's."""
        missing = {"epoch", "position", "seed"} - set(state)
        if missing or not all(isinstance(state[k], int) and state[k] >= 0 for k in ("epoch", "position", "seed")):
            raise CheckpointMismatchError(f"data loader state {state!r}: expected non-negative ints under "
                                          f"'epoch', 'position' and 'seed' (from ResumableLoader.state_dict())")
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]
        self._epoch_cache = None


class ResumableLoader(_ReplicaEpochs):
    """Endless batches of one replica's share of ``dataset``, resumable from ``state_dict()``.

    Each epoch orders the samples by a permutation seeded with ``seed + epoch`` (no shuffle:
    in order), drops the last ``len % dp_size`` so the replicas get equal shares, and gives
    replica r every ``dp_size``-th sample from r, as ``DistributedSampler`` does; the share's
    last incomplete batch is dropped and the next epoch begins. A batch is ``(ids, targets)``,
    each ``[batch_size, seq_len]``, on ``device`` (None: where the dataset's tensors are).

    Example:
        >>> loader = ResumableLoader(TokenBlocks(torch.arange(100), 4), batch_size=2, seed=1)
        >>> first = [next(loader) for _ in range(3)]
        >>> again = ResumableLoader(TokenBlocks(torch.arange(100), 4), batch_size=2)
        >>> again.load_state_dict({"epoch": 0, "position": 4, "seed": 1})
        >>> bool((next(again)[0] == first[2][0]).all())
        True
    """

    def __init__(self, dataset: Any, batch_size: int, *, seed: int = 0, dp_rank: int = 0, dp_size: int = 1,
                 shuffle: bool = True, device: torch.device | None = None) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp_rank={dp_rank}: expected 0 <= dp_rank < dp_size={dp_size}")
        super().__init__(seed, dp_rank, dp_size, shuffle, device)
        self.dataset, self.batch_size = dataset, batch_size
        share = len(dataset) // dp_size
        if batch_size < 1 or share < batch_size:
            raise ConfigError(f"a replica's share of the data is {share} sequences ({len(dataset)} over "
                              f"{dp_size} replicas), fewer than its batch of {batch_size}; give more data "
                              f"or a smaller train.batch_size")

    @property
    def batches_per_epoch(self) -> int:
        return (len(self.dataset) // self.dp_size) // self.batch_size

    def epoch_indices(self, epoch: int) -> list[int]:
        """This replica's sample indices in ``epoch``, in the order they are drawn."""
        return self._share(len(self.dataset), epoch)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.position + self.batch_size > len(self.dataset) // self.dp_size:
            self.epoch, self.position = self.epoch + 1, 0
        if self._epoch_cache is None or self._epoch_cache[0] != self.epoch:
            self._epoch_cache = (self.epoch, self.epoch_indices(self.epoch))  # (epoch, its share)
        indices = self._epoch_cache[1][self.position: self.position + self.batch_size]
        self.position += self.batch_size
        samples = [self.dataset[i] for i in indices]
        batch = tuple(torch.stack(parts) for parts in zip(*samples))
        return batch if self.device is None else to_device(batch, self.device)


def resumable_loader(pipe: Any, dataset_factory: Callable[[], Any], batch_size: int, *, seed: int = 0,
                     shuffle: bool = True) -> ResumableLoader | None:
    """A :class:`ResumableLoader` over this replica's share of ``dataset_factory()``, or None on a rank
    that reads no data (the factory is not called there).

    ``pipe`` is a :class:`conveyor.Pipeline` (its ``needs_inputs``, ``needs_target``, ``dp_rank``
    and ``dp_size``); ``batch_size`` is one replica's batch. The first and last rank of a
    replica draw the same batches (same replica, same seed). Batches arrive on the pipeline's
    stage device (``pipe.device``), where its stages and its loss read them.

    Example:
        >>> splits = splits_factory(cfg.data, cfg.model.seq_len)                   # doctest: +SKIP
        >>> train = resumable_loader(pipe, lambda: splits().train, cfg.replica_batch_size,
        ...                          seed=cfg.train.seed)                          # doctest: +SKIP
    """
    if not (pipe.needs_inputs or pipe.needs_target):
        return None
    return ResumableLoader(dataset_factory(), batch_size, seed=seed, dp_rank=pipe.dp_rank,
                           dp_size=pipe.dp_size, shuffle=shuffle, device=getattr(pipe, "device", None))


# --- batching by length (data.batching=by_length) ---------------------------------------------

def document_pieces(documents: Sequence[Any], tokenizer: Any, seq_len: int,
                    progress: Callable[[str], None] | None = None) -> list[torch.Tensor]:
    """Each document's tokens (and its end-of-document token, if the tokenizer has one) cut at its end:
    pieces of at most ``seq_len + 1`` tokens that never hold two documents; pieces under 2 tokens
    (nothing to predict) are left out. ``progress`` hears how far it has come, every 1,000 documents.

    Example:
        >>> [len(p) for p in document_pieces([Document("a", b"x" * 9), Document("b", b"yz")], ByteTokenizer(), 4)]
        [5, 5, 2]
    """
    eos = torch.tensor([] if tokenizer.eos_id is None else [tokenizer.eos_id], dtype=torch.long)
    pieces = []
    for done, doc in enumerate(documents):
        if progress is not None and done % 1000 == 0:
            progress(f"{done:,} of {len(documents):,} documents cut into pieces")
        tokens = torch.cat((tokenizer.encode(doc.data).long(), eos))
        # Consecutive pieces of one document overlap by one token, as windows do: every token is predicted once.
        for start in range(0, max(len(tokens) - 1, 0), seq_len):
            piece = tokens[start: start + seq_len + 1]
            if len(piece) >= 2:
                pieces.append(piece)
    return pieces


def length_microbatches(pieces: Sequence[torch.Tensor], token_budget: int, pad_to: int | None = None,
                        rows: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(ids, targets)`` microbatches of ``pieces`` in the given order.

    By length (``pad_to`` None): as many pieces as fit ``token_budget`` at the longest one's length,
    each microbatch as long as its longest piece; give the pieces sorted by length and the padding
    is what is left between pieces of nearly one length. Padded to ``pad_to`` with ``rows`` pieces
    each: the fixed-shape baseline. Padding is id 0 in ``ids`` and -100 (ignored) in ``targets``.

    Example:
        >>> pieces = [torch.arange(5), torch.arange(4), torch.arange(3)]
        >>> [tuple(ids.shape) for ids, _ in length_microbatches(pieces, token_budget=8)]
        [(2, 4), (1, 2)]
    """
    batches, start = [], 0
    while start < len(pieces):
        if pad_to is None:
            count = 1
            while start + count < len(pieces) and (count + 1) * (len(pieces[start]) - 1) <= token_budget:
                count += 1
        else:
            count = rows or 1
        group = pieces[start: start + count]
        length = pad_to if pad_to is not None else max(len(p) for p in group) - 1
        ids = torch.zeros(len(group), length, dtype=torch.long)
        targets = torch.full((len(group), length), -100, dtype=torch.long)
        for row, piece in enumerate(group):
            ids[row, : len(piece) - 1] = piece[:-1]
            targets[row, : len(piece) - 1] = piece[1:]
        batches.append((ids, targets))
        start += count
    return batches


def padding_share(microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The share of target positions that are padding (-100) in ``microbatches``."""
    total = sum(targets.numel() for _, targets in microbatches)
    padded = sum(int((targets == -100).sum()) for _, targets in microbatches)
    return padded / total if total else 0.0


class LengthBatchLoader(_ReplicaEpochs):
    """Endless steps of ``num_microbatches`` microbatches batched by length, resumable like
    :class:`ResumableLoader` (same ``state_dict`` keys; ``position`` counts microbatches).

    Each epoch shuffles the pieces (seed + epoch), gives replica r every ``dp_size``-th, sorts
    them by length within pools of a few hundred (so a step still mixes the corpus) and cuts
    them into microbatches of at most ``token_budget`` tokens (:func:`length_microbatches`). A step
    is a list of ``(ids, targets)``, one per microbatch, each of its own length and rows.

    Example:
        >>> pieces = document_pieces([Document(str(i), b"x" * (3 + 7 * i)) for i in range(20)], ByteTokenizer(), 16)
        >>> loader = LengthBatchLoader(pieces, token_budget=32, num_microbatches=2, seed=0)
        >>> step = next(loader)
        >>> len(step), all(ids.shape == targets.shape for ids, targets in step)
        (2, True)
    """

    POOL = 512  # pieces sorted together: long enough to group lengths, short enough to mix the corpus

    def __init__(self, pieces: Sequence[torch.Tensor], token_budget: int, num_microbatches: int, *, seed: int = 0,
                 dp_rank: int = 0, dp_size: int = 1, shuffle: bool = True, device: torch.device | None = None) -> None:
        if token_budget < 1 or num_microbatches < 1:
            raise ConfigError(f"batching by length needs a positive token budget and microbatch count; got "
                              f"{token_budget} and {num_microbatches}")
        super().__init__(seed, dp_rank, dp_size, shuffle, device)
        self.pieces, self.token_budget, self.num_microbatches = list(pieces), token_budget, num_microbatches
        first = self._epoch(0)
        if not first.reach(num_microbatches):
            raise ConfigError(f"a replica's share of the data makes {len(first.batches)} microbatches, "
                              f"fewer than one step's {num_microbatches}; give more data or fewer microbatches")

    def epoch_batches(self, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This replica's microbatches in ``epoch``, in the order they are drawn (all of them: a loader
        cuts them a pool at a time, as its steps reach them)."""
        batches = self._epoch(epoch)
        batches.reach(len(self.pieces) + 1)
        return batches.batches

    def _epoch(self, epoch: int) -> _EpochBatches:
        if self._epoch_cache is None or self._epoch_cache.epoch != epoch:
            mine = [self.pieces[i] for i in self._share(len(self.pieces), epoch)]
            self._epoch_cache = _EpochBatches(epoch, mine, self.POOL, self.token_budget)
        return self._epoch_cache

    def __next__(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not self._epoch(self.epoch).reach(self.position + self.num_microbatches):
            self.epoch, self.position = self.epoch + 1, 0
        batches = self._epoch(self.epoch)
        batches.reach(self.position + self.num_microbatches)
        step = batches.batches[self.position: self.position + self.num_microbatches]
        self.position += self.num_microbatches
        return step if self.device is None else to_device(step, self.device)


class _EpochBatches:
    """One epoch's microbatches of a :class:`LengthBatchLoader`, cut a pool at a time as they are reached:
    the first step waits for one pool, not for the whole corpus (seconds on every rank that reads data)."""

    def __init__(self, epoch: int, mine: list[torch.Tensor], pool: int, token_budget: int) -> None:
        self.epoch, self.mine, self.pool, self.token_budget = epoch, mine, pool, token_budget
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.cut = 0  # pieces of ``mine`` cut into batches so far

    def reach(self, count: int) -> bool:
        """Cut pools until at least ``count`` microbatches are there; whether there are (False: the epoch
        holds fewer)."""
        while len(self.batches) < count and self.cut < len(self.mine):
            pool = sorted(self.mine[self.cut: self.cut + self.pool], key=len, reverse=True)
            self.batches += length_microbatches(pool, self.token_budget)
            self.cut += self.pool
        return len(self.batches) >= count


def length_loader(pipe: Any, cfg: DataConfig, seq_len: int, batch_size: int, num_microbatches: int, *,
                  seed: int = 0, progress: Callable[[str], None] | None = None) -> LengthBatchLoader | None:
    """``data.batching=by_length``: a :class:`LengthBatchLoader` over this replica's share of the training
    documents (each cut at its end, microbatches of ``batch_size / num_microbatches x seq_len`` tokens at
    most), or None on a rank that reads no data. The pieces are cut once and then read from a cache on
    disk (:func:`conveyor.train.pieces.cached_pieces`); ``progress`` hears how the cutting goes.

    Example:
        >>> train = length_loader(pipe, cfg.data, cfg.model.seq_len, cfg.replica_batch_size, 4)   # doctest: +SKIP
        >>> [ids.shape for ids, targets in next(train)]                                           # doctest: +SKIP
    """
    if not (pipe.needs_inputs or pipe.needs_target):
        return None
    from conveyor.train.pieces import cached_pieces

    def cut() -> list[torch.Tensor]:
        if progress is not None:
            progress("reading the documents")
        train_docs, _ = split_documents(read_documents(cfg), cfg.val_fraction)
        return document_pieces(train_docs, load_tokenizer(cfg.tokenizer), seq_len, progress)

    pieces = cached_pieces(cfg, seq_len, cut)
    budget = max(1, batch_size // num_microbatches) * seq_len
    return LengthBatchLoader(pieces, budget, num_microbatches, seed=seed, dp_rank=pipe.dp_rank, dp_size=pipe.dp_size,
                             device=getattr(pipe, "device", None))


def by_length_options(model: Any, transfer: Any) -> tuple[Any, Any]:
    """The split and transfer records of a pipeline fed by :func:`length_loader`: the model's first input
    traced with dynamic rows and length (:mod:`conveyor.frontend.dynamic`), and transfers that agree on
    shapes every step (``TransferOptions(variable_shapes=True)``, for the ordered transport)."""
    first = next(iter(inspect.signature(model.forward).parameters))
    split = SplitOptions(method="parameters", dynamic_shapes={first: {0: "rows", 1: "length"}})
    return split, replace(transfer, variable_shapes=True)
