"""data.batching=by_length: documents cut at their ends, microbatches of similar lengths, resumable."""

from __future__ import annotations

import torch

from conveyor.train.corpus import definition_documents
from conveyor.train.data import (
    ByteTokenizer,
    Document,
    LengthBatchLoader,
    document_pieces,
    length_microbatches,
    padding_share,
)


def _pieces(seq_len=256):
    docs = [Document(*d) for d in definition_documents(max_bytes=60_000)]
    return docs, document_pieces(docs, ByteTokenizer(), seq_len)


def test_pieces_never_hold_two_documents_and_cover_every_token():
    docs, pieces = _pieces(seq_len=32)
    assert all(2 <= len(p) <= 33 for p in pieces)
    # Pieces of one document overlap by one token (the target of one is the input of the next).
    predicted = sum(len(p) - 1 for p in pieces)
    assert predicted == sum(len(d.data) - 1 for d in docs if len(d.data) >= 2)
    joined = torch.cat([p[:-1] for p in document_pieces(docs[:1], ByteTokenizer(), 32)] +
                       [document_pieces(docs[:1], ByteTokenizer(), 32)[-1][-1:]])
    assert bytes(joined.to(torch.uint8).tolist()) == docs[0].data


def test_by_length_microbatches_fit_the_budget_and_pad_far_less_than_padding_to_the_longest():
    _, pieces = _pieces()
    loader = LengthBatchLoader(pieces, token_budget=4 * 256, num_microbatches=4, seed=3)
    steps = [next(loader) for _ in range(3)]
    assert all(len(step) == 4 for step in steps)
    microbatches = loader.epoch_batches(0)  # longest first within each pool: the epoch shows every length
    assert all(ids.shape == targets.shape and ids.numel() <= 4 * 256 for ids, targets in microbatches)
    assert len({ids.shape for ids, _ in microbatches}) > 3  # lengths and rows vary
    padded = length_microbatches(pieces, 4 * 256, pad_to=256, rows=4)
    assert padding_share(microbatches) < 0.1 < padding_share(padded)


def test_a_resumed_loader_draws_what_the_uninterrupted_one_would():
    _, pieces = _pieces()
    loader = LengthBatchLoader(pieces, token_budget=128, num_microbatches=2, seed=1, dp_rank=1, dp_size=2)
    for _ in range(3):
        next(loader)
    state = loader.state_dict()
    want = next(loader)
    again = LengthBatchLoader(pieces, token_budget=128, num_microbatches=2, dp_rank=1, dp_size=2)
    again.load_state_dict(state)
    got = next(again)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want))


def test_a_loader_that_cuts_a_pool_at_a_time_draws_the_whole_epoch_of_sorted_pools():
    _, pieces = _pieces(seq_len=64)
    class SmallPools(LengthBatchLoader):
        POOL = 50  # several pools in this small corpus

    loader = SmallPools(pieces, token_budget=256, num_microbatches=2, seed=5)
    steps = [next(loader) for _ in range(4)]
    order = torch.randperm(len(pieces), generator=torch.Generator().manual_seed(5)).tolist()
    shuffled = [pieces[i] for i in order]
    whole = [batch for start in range(0, len(shuffled), 50)
             for batch in length_microbatches(sorted(shuffled[start: start + 50], key=len, reverse=True), 256)]
    drawn = [batch for step in steps for batch in step]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(drawn, whole[:8]))
    assert loader._epoch_cache.cut < len(pieces)  # only the pools the steps reached were cut
    assert [tuple(ids.shape) for ids, _ in loader.epoch_batches(0)] == [tuple(ids.shape) for ids, _ in whole]


def test_the_pieces_are_cut_once_and_cut_again_when_a_source_file_or_a_setting_changes(tmp_path):
    from conveyor.train.config import DataConfig
    from conveyor.train.pieces import cached_pieces, pieces_key

    text = tmp_path / "a.txt"
    text.write_text("def f():\n    return 1\n" * 20)
    cfg, cuts = DataConfig(source=str(text)), []

    def cut():
        cuts.append(1)
        return document_pieces([Document("a", text.read_bytes())], ByteTokenizer(), 16)

    first = cached_pieces(cfg, 16, cut, folder=tmp_path / "cache")
    again = cached_pieces(cfg, 16, cut, folder=tmp_path / "cache")
    assert len(cuts) == 1 and len(first) == len(again) > 1
    assert all(torch.equal(a.long(), b.long()) for a, b in zip(first, cut()))  # the pieces cut, as they were
    assert again[0].dtype == torch.uint8  # bytes kept narrow: the stdlib's pieces are 11 MB, not 90
    key = pieces_key(cfg, 16)
    assert pieces_key(cfg, 32) != key and pieces_key(DataConfig(source=str(text), val_fraction=0.2), 16) != key
    text.write_text("class C:\n    pass\n" * 30)  # another size and time: another key, cut again
    assert pieces_key(cfg, 16) != key
    changed = cached_pieces(cfg, 16, cut, folder=tmp_path / "cache")
    assert len(cuts) == 3 and bytes(changed[0][:8].tolist()) == b"class C:"
