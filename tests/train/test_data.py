"""conveyor.train.data: the corpus, local files, tokenizers, windows, and the resumable loader."""

from __future__ import annotations

import json
import random
import sys
from types import SimpleNamespace

import pytest
import torch

from conveyor.errors import CheckpointMismatchError, ConfigError
from conveyor.train.config import DataConfig, load_config
from conveyor.train.data import (
    ByteTokenizer,
    Document,
    ResumableLoader,
    TokenBlocks,
    build_splits,
    file_documents,
    fingerprint,
    load_tokenizer,
    read_documents,
    resumable_loader,
    split_documents,
    splits_factory,
    stdlib_documents,
    token_stream,
)

# --- the stdlib corpus --------------------------------------------------------------------

def test_the_stdlib_corpus_is_sorted_deterministic_and_only_the_stdlib():
    first, second = stdlib_documents(), stdlib_documents()
    assert first == second and fingerprint(first) == fingerprint(second)
    names = [doc.name for doc in first]
    assert names == sorted(names) and len(names) > 100
    assert all(name.endswith(".py") for name in names)
    parts = {part for name in names for part in name.split("/")[:-1]}
    assert not parts & {"site-packages", "dist-packages", "test", "tests", "__pycache__"}
    assert "os.py" in names and "json/decoder.py" in names


def test_the_byte_cap_cuts_the_corpus_in_order():
    capped = stdlib_documents(max_bytes=50_000)
    assert sum(len(doc.data) for doc in capped) == 50_000
    full = stdlib_documents()
    assert capped[:-1] == full[: len(capped) - 1]
    assert full[len(capped) - 1].data.startswith(capped[-1].data)


def test_the_split_is_by_document_deterministic_and_independent_of_order():
    docs = [Document(f"f{i}.py", bytes([i])) for i in range(40)]
    train, val = split_documents(docs, 0.1)
    assert len(val) == 4 and len(train) == 36
    assert {d.name for d in train} | {d.name for d in val} == {d.name for d in docs}
    assert not {d.name for d in train} & {d.name for d in val}
    shuffled = docs[:]
    random.Random(3).shuffle(shuffled)
    assert {d.name for d in split_documents(shuffled, 0.1)[1]} == {d.name for d in val}
    assert split_documents(docs, 0.0) == (docs, [])
    assert len(split_documents(docs[:2], 0.01)[1]) == 1  # a positive fraction holds out at least one


def test_a_single_document_is_cut_at_its_end():
    train, val = split_documents([Document("one.txt", b"0123456789")], 0.2)
    assert train == [Document("one.txt", b"01234567")] and val == [Document("one.txt#validation", b"89")]


def test_default_splits_of_the_stdlib():
    splits = build_splits(DataConfig(max_bytes=300_000), seq_len=32)
    assert splits.tokenizer.vocab_size == 256 and splits.val is not None
    assert len(splits.train) > 10 * len(splits.val) > 0
    assert splits.fingerprint == build_splits(DataConfig(max_bytes=300_000), seq_len=32).fingerprint


# --- local files --------------------------------------------------------------------------

def test_text_files_and_globs(tmp_path):
    (tmp_path / "a.txt").write_text("alpha\n")
    (tmp_path / "b.md").write_text("beta\n")
    cfg = load_config(None, [f"data.source={tmp_path}/*", "train.eval_interval=0", "data.val_fraction=0"]).data
    docs = read_documents(cfg)
    assert [d.data for d in docs] == [b"alpha\n", b"beta\n"]


def test_jsonl_records_are_documents(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"body": "héllo"}) + "\n\n" + json.dumps({"body": "world"}) + "\n")
    docs = file_documents([path], None, "body")
    assert [d.data for d in docs] == ["héllo".encode(), b"world"]
    assert docs[0].name.endswith("c.jsonl:1")
    with pytest.raises(ConfigError, match=r"no key data.text_key='text' \(it has: body\)"):
        file_documents([path], None, "text")
    path.write_text("not json\n")
    with pytest.raises(ConfigError, match="is not JSON"):
        file_documents([path], "jsonl", "text")


def test_parquet_rows_are_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["one", "two", "three"], "id": [1, 2, 3]}), path)
    assert [d.data for d in file_documents([path])] == [b"one", b"two", b"three"]
    with pytest.raises(ConfigError, match="has no column data.text_key='body'; its columns are text, id"):
        file_documents([path], None, "body")


def test_parquet_without_pyarrow_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "d.parquet").write_bytes(b"")
    with pytest.raises(ConfigError, match="pip install pyarrow"):
        load_config(None, [f"data.source={tmp_path}/d.parquet"])


# --- tokenizers and windows ---------------------------------------------------------------

def test_the_bytes_tokenizer():
    tokenizer = load_tokenizer("bytes")
    assert isinstance(tokenizer, ByteTokenizer) and tokenizer.vocab_size == 256
    ids = tokenizer.encode("héllo".encode())
    assert ids.dtype == torch.uint8 and ids.tolist() == list("héllo".encode())
    assert tokenizer.decode(ids) == "héllo"
    assert token_stream([Document("a", b"ab"), Document("b", b"c")], tokenizer).tolist() == [97, 98, 99]


def test_a_local_tokenizer_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", eos_token="</s>").save_pretrained(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path))
    assert (tokenizer.vocab_size, tokenizer.eos_id) == (4, 1)
    stream = token_stream([Document("a", b"hello world"), Document("b", b"world")], tokenizer)
    assert stream.tolist() == [2, 3, 1, 3, 1]


def test_blocks_are_overlapping_windows_of_seq_len_plus_one():
    blocks = TokenBlocks(torch.arange(23, dtype=torch.uint8), seq_len=5)
    assert len(blocks) == 4  # (23 - 1) // 5
    ids, targets = blocks[3]
    assert ids.dtype == torch.int64 and ids.tolist() == [15, 16, 17, 18, 19]
    assert targets.tolist() == [16, 17, 18, 19, 20]
    with pytest.raises(IndexError):
        blocks[4]


def test_too_little_data_for_one_window_is_refused():
    with pytest.raises(ConfigError, match="fewer than model.seq_len"):
        build_splits(DataConfig(max_bytes=100), seq_len=128)


# --- the resumable loader -----------------------------------------------------------------

def _blocks(count: int = 37, seq_len: int = 3) -> TokenBlocks:
    return TokenBlocks(torch.arange(count * seq_len + 1), seq_len)


def test_a_resumed_loader_draws_what_an_uninterrupted_one_would():
    whole = ResumableLoader(_blocks(), batch_size=4, seed=7)
    expected = [next(whole) for _ in range(25)]  # 9 batches an epoch: crosses two epoch ends
    first = ResumableLoader(_blocks(), batch_size=4, seed=7)
    for _ in range(11):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))
    assert state == {"epoch": 1, "position": 8, "seed": 7}
    resumed = ResumableLoader(_blocks(), batch_size=4, seed=0)  # the state's seed wins
    resumed.load_state_dict(state)
    for want in expected[11:]:
        got = next(resumed)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_epochs_are_shuffled_differently_and_restart_rewinds():
    loader = ResumableLoader(_blocks(), batch_size=4, seed=0)
    assert loader.epoch_indices(0) != loader.epoch_indices(1)
    first = next(loader)
    next(loader)
    loader.restart()
    assert torch.equal(next(loader)[0], first[0])
    plain = ResumableLoader(_blocks(), batch_size=4, shuffle=False)
    assert plain.epoch_indices(0) == list(range(37))


def test_replica_shares_are_disjoint_and_cover_the_data():
    count, dp = 37, 3
    loaders = [ResumableLoader(_blocks(count), batch_size=2, seed=5, dp_rank=r, dp_size=dp) for r in range(dp)]
    shares = [set(loader.epoch_indices(0)) for loader in loaders]
    assert all(len(share) == count // dp for share in shares)
    assert not (shares[0] & shares[1] or shares[0] & shares[2] or shares[1] & shares[2])
    assert len(set.union(*shares)) == count - count % dp
    drawn = [torch.cat([next(loader)[0] for _ in range(loader.batches_per_epoch)]) for loader in loaders]
    firsts = [set(batch[:, 0].div(3, rounding_mode="floor").tolist()) for batch in drawn]
    assert all(first <= share for first, share in zip(firsts, shares))


def test_bad_loader_state_and_sizes_are_refused():
    loader = ResumableLoader(_blocks(), batch_size=4)
    with pytest.raises(CheckpointMismatchError, match="'epoch', 'position' and 'seed'"):
        loader.load_state_dict({"epoch": 0, "position": 3})
    with pytest.raises(ConfigError, match="fewer than its batch of 64"):
        ResumableLoader(_blocks(), batch_size=64)
    with pytest.raises(ConfigError, match="dp_rank=2"):
        ResumableLoader(_blocks(), batch_size=4, dp_rank=2, dp_size=2)


def test_a_rank_that_reads_no_data_never_builds_the_dataset():
    def factory():
        raise AssertionError("a middle rank built the dataset")

    middle = SimpleNamespace(needs_inputs=False, needs_target=False, dp_rank=0, dp_size=1)
    assert resumable_loader(middle, factory, batch_size=4) is None
    last = SimpleNamespace(needs_inputs=False, needs_target=True, dp_rank=1, dp_size=2)
    loader = resumable_loader(last, lambda: _blocks(), batch_size=4, seed=3)
    assert (loader.dp_rank, loader.dp_size, loader.seed) == (1, 2, 3)


def test_the_splits_factory_reads_the_corpus_once(monkeypatch):
    import conveyor.train.data as data

    calls, original = [], data.build_splits
    monkeypatch.setattr(data, "build_splits", lambda *args: calls.append(args) or original(*args))
    splits = splits_factory(DataConfig(max_bytes=20_000), seq_len=16)
    assert splits() is splits() and len(calls) == 1
