"""conveyor.train.data_check: the launcher's sizes of the splits equal what the ranks build, and a short
split stops `conveyor train` (exit 2) before any process starts."""

from __future__ import annotations

import json

import pytest

from conveyor.errors import ConfigError
from conveyor.train import data_check
from conveyor.train.config import load_config
from conveyor.train.data import (
    build_splits,
    load_tokenizer,
    read_documents,
    split_documents,
    token_stream,
)
from conveyor.train.data_check import check_data

SMALL = ["model.seq_len=4", "train.batch_size=2", "parallel.microbatches=1", "train.eval_interval=1"]


def built_tokens(cfg) -> tuple[int, int]:
    splits = build_splits(cfg.data, cfg.model.seq_len)
    return len(splits.train.tokens), len(splits.val.tokens) if splits.val is not None else 0


def checked_tokens(cfg) -> tuple[int, int]:
    sizes = check_data(cfg)
    return sizes["training"].tokens, sizes["validation"].tokens if sizes["validation"] else 0


@pytest.mark.parametrize("extra", [["data.max_bytes=150000", "data.val_fraction=0.2"],
                                   ["data.max_bytes=9000", "data.val_fraction=0.3"]])
def test_the_stdlib_sizes_equal_the_built_splits(extra):
    cfg = load_config(None, SMALL + extra)
    assert checked_tokens(cfg) == built_tokens(cfg)


def test_text_files_capped_and_split_equal_the_built_splits(tmp_path):
    for i, size in enumerate([300, 5000, 70, 1200, 999]):
        (tmp_path / f"f{i}.txt").write_bytes(bytes(range(97, 123)) * (size // 26) + b"x" * (size % 26))
    for extra in (["data.max_bytes=6000", "data.val_fraction=0.4"], ["data.val_fraction=0.25"]):
        cfg = load_config(None, SMALL + [f"data.source={tmp_path}/*.txt", *extra])
        assert checked_tokens(cfg) == built_tokens(cfg), extra
    one = load_config(None, SMALL + [f"data.source={tmp_path}/f1.txt", "data.val_fraction=0.25"])
    assert checked_tokens(one) == built_tokens(one) == (3750, 1250)  # one document: cut at its end


def test_json_lines_are_read_when_small_and_left_to_the_ranks_when_large(tmp_path, monkeypatch):
    for name in ("a", "b"):
        lines = [json.dumps({"text": f"{name} record {i} " * (i + 3)}) for i in range(20)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    cfg = load_config(None, SMALL + [f"data.source={tmp_path}/*.jsonl", "data.val_fraction=0.2"])
    assert checked_tokens(cfg) == built_tokens(cfg)
    monkeypatch.setattr(data_check, "READ_BUDGET", 100)
    assert check_data(cfg) == {"training": None, "validation": None}


def write_tokenizer(path) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", eos_token="</s>").save_pretrained(path)
    return str(path)


def test_a_tokenizer_directory_counts_short_splits_exactly_and_leaves_long_ones_unread(tmp_path, monkeypatch):
    tokenizer = write_tokenizer(tmp_path / "tok")
    (tmp_path / "d").mkdir()
    for i in range(6):
        (tmp_path / "d" / f"{i}.txt").write_text("hello world " * 20 * (i + 1))  # 40 (i + 1) tokens + </s>
    cfg = load_config(None, SMALL + [f"data.source={tmp_path}/d/*.txt", f"data.tokenizer={tokenizer}",
                                     "data.val_fraction=0.2", "model.seq_len=512"])
    train, val = split_documents(read_documents(cfg.data), 0.2)
    tok = load_tokenizer(tokenizer)
    with pytest.raises(ConfigError) as error:
        check_data(cfg)
    message = str(error.value)
    assert f"training split of data.source={cfg.data.source!r} holds {len(token_stream(train, tok))} tokens" in message
    assert f"validation split of data.source={cfg.data.source!r} holds {len(token_stream(val, tok))} tokens" in message
    assert f"data.tokenizer={tokenizer!r}" in message

    def never(spec):
        raise AssertionError("a split of many bytes per needed token was tokenized")

    monkeypatch.setattr("conveyor.train.data.load_tokenizer", never)
    small = load_config(None, SMALL + [f"data.source={tmp_path}/d/*.txt", f"data.tokenizer={tokenizer}",
                                       "data.val_fraction=0.2", "model.seq_len=1"])
    assert check_data(small)["training"].tokens is None  # >= 240 bytes for 3 tokens: no tokenizer needed


def test_a_tiny_corpus_exits_2_naming_keys_and_sizes_before_any_process(tmp_path, capsys, no_launch):
    from conveyor.cli import main
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("print('hello')\n" * 20)  # 300 bytes
    code = main(["train", f"data.source={tiny}", "model.seq_len=512", f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("conveyor: error: data: 2 splits are too short"), err
    assert "the training split" in err and "holds 285 tokens (285 bytes in 1 document)" in err
    assert "the validation split" in err and "holds 15 tokens" in err
    for key in ("data.source", "data.val_fraction", "model.seq_len + 1 = 513", "train.batch_size=16",
                "16 x 512 + 1 = 8193 tokens", "train.eval_interval=0"):
        assert key in err, key
    assert not (tmp_path / "run").exists()  # and no_launch: no rank started


def test_the_default_corpus_is_checked_from_file_sizes_without_reading_a_byte(monkeypatch):
    # What keeps the check quick on the 10M-byte stdlib corpus: bytes are tokens, so its sizes suffice.
    reads = []
    real_reader = data_check._reader

    def counting_reader(path):
        read = real_reader(path)
        return lambda start, stop: reads.append(path) or read(start, stop)

    monkeypatch.setattr(data_check, "_reader", counting_reader)
    sizes = check_data(load_config(None, []))
    assert sizes["training"].tokens > 10_000_000 and sizes["validation"].tokens > 100_000
    assert reads == []


def test_stdlib_definitions_are_measured_as_the_definitions_the_ranks_read():
    # Each top-level definition is a document (conveyor.train.corpus), not each file, and the one crossing
    # data.max_bytes is left out, not cut: measured as whole files, this validation split was 1 file of
    # 97 bytes and the check refused a config whose ranks hold out 4 definitions (1870 bytes, Python 3.12).
    cfg = load_config(None, ["data.source=stdlib-definitions", "data.max_bytes=200000", "model.seq_len=64"])
    train, val = split_documents(read_documents(cfg.data), cfg.data.val_fraction)
    sizes = check_data(cfg)
    assert (sizes["training"].documents, sizes["validation"].documents) == (len(train), len(val))
    assert (sizes["training"].bytes, sizes["validation"].bytes) == (sum(d.size for d in train),
                                                                  sum(d.size for d in val))
    assert checked_tokens(cfg) == built_tokens(cfg)
    small = load_config(None, SMALL + ["data.source=stdlib-definitions", "data.max_bytes=9000",
                                       "data.val_fraction=0.3"])
    assert checked_tokens(small) == built_tokens(small)


def test_stdlib_definitions_as_a_list_of_one_is_the_same_corpus_for_the_ranks_and_the_check():
    # data.source=[stdlib-definitions] passes the config checks (a built-in name alone in a list); it read
    # whole stdlib files, not definitions, in the ranks and in the check alike.
    listed = load_config(None, SMALL + ["data.source=[stdlib-definitions]", "data.max_bytes=9000",
                                        "data.val_fraction=0.3"])
    named = load_config(None, SMALL + ["data.source=stdlib-definitions", "data.max_bytes=9000",
                                       "data.val_fraction=0.3"])
    assert read_documents(listed.data) == read_documents(named.data)
    assert checked_tokens(listed) == built_tokens(listed) == built_tokens(named)
    assert check_data(listed) == check_data(named)
