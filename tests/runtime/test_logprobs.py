"""pipe.logprobs: the next tokens' log-probs through the pipeline, torch.equal to the unsplit model's.

The reference loops over the same microbatches as the pipeline and applies the same formula
(:func:`conveyor.pipe.logprobs.token_logprobs`) to the unsplit model's logits, so both sides run
the same computation: equality is bitwise. Cheap for CI: every built-in schedule in process in one
loop; one launch of 2 gloo ranks runs every schedule (a minibatch and variable-length microbatches)
and checks that every rank, not only the last stage's, holds the result.
"""

from __future__ import annotations

import pytest
import torch

import conveyor
import conveyor.schedule as cs
from conveyor import Microbatches
from conveyor.errors import PipelineConfigError
from conveyor.pipe.logprobs import token_logprobs
from conveyor.testing import run_ranks
from conveyor.testing.models import TinyConfig, build_stage, reference_model
from conveyor.testing.references.schedule_parity import schedule_grid
from conveyor.testing.references.varlen import varlen_batches

NUM_MICROBATCHES = 4


def _ids(cfg: TinyConfig, batch: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=torch.Generator().manual_seed(seed))


def _reference(cfg: TinyConfig, microbatches: list[torch.Tensor]) -> list[torch.Tensor]:
    """One device, microbatch by microbatch: the same formula on the unsplit model's logits. Called with
    the pipeline's thread count (CPU kernels may reduce in an order that depends on it)."""
    model = reference_model(cfg)
    with torch.no_grad():
        return [token_logprobs(model(ids), ids) for ids in microbatches]



def _cases(ranks: int) -> list[tuple[str, int]]:
    return [(name, virtual) for name, _, virtual in schedule_grid((ranks,))]


def _logprobs_of_each_schedule(rank: int, world_size: int, cases: list[tuple[str, int, str]]):
    """One rank: for each (schedule, V, transport), the log-probs of a minibatch and of variable-length microbatches."""
    results = []
    for name, virtual, transport in cases:
        schedule = cs.build(name, ranks=world_size, microbatches=NUM_MICROBATCHES, virtual=virtual)
        cfg = TinyConfig(num_stages=schedule.num_stages)
        mine = [build_stage(s, cfg) for s in schedule.stages_of(rank)]
        transfer = conveyor.TransferOptions(timeout_s=60, transport=transport,
                                            variable_shapes=transport == "ordered")
        varlen = [ids for (ids,) in varlen_batches(cfg, step=0)[0]]
        with conveyor.Pipeline(mine, schedule=schedule, transfer=transfer) as pipe:
            # Every rank passes the ids: stage 0 reads them as input, the last stage for the next tokens.
            results.append((pipe.logprobs(_ids(cfg)), pipe.logprobs(Microbatches(inputs=[(x,) for x in varlen]))))
    return results


def _differences(case: str, got: torch.Tensor | list, want: list[torch.Tensor]) -> list[str]:
    got = list(got) if isinstance(got, list) else [got]
    want = want if len(got) == len(want) else [torch.cat(want)]
    return [f"{case}: part {i} {tuple(g.shape)} differs by {(g - w).abs().max().item():.3g}"
            for i, (g, w) in enumerate(zip(got, want, strict=True))
            if not (torch.equal(g, w) and torch.isfinite(g).all())]


def test_every_schedule_in_process_is_bitwise_with_variable_lengths(one_thread):
    found = []
    for name, virtual in _cases(2):
        schedule = cs.build(name, ranks=2, microbatches=NUM_MICROBATCHES, virtual=virtual)
        cfg = TinyConfig(num_stages=schedule.num_stages)
        pipe = conveyor.Pipeline([build_stage(s, cfg) for s in range(schedule.num_stages)], schedule,
                                 layout=conveyor.InProcessLayout())
        ids = _ids(cfg)
        got = pipe.logprobs(ids)
        assert got.shape == (8, cfg.seq_len - 1) and got.dtype == torch.float32
        found += _differences(f"{name} V={virtual}", got, _reference(cfg, list(ids.tensor_split(NUM_MICROBATCHES))))
        varlen = [x for (x,) in varlen_batches(cfg, step=0)[0]]
        got = pipe.logprobs(Microbatches(inputs=[(x,) for x in varlen]))
        assert [tuple(g.shape) for g in got] == [(x.shape[0], x.shape[1] - 1) for x in varlen]
        found += _differences(f"{name} V={virtual} varlen", got, _reference(cfg, varlen))
    assert not found, "\n".join(found)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_every_schedule_over_gloo_ranks_is_bitwise_on_every_rank(one_thread):
    cases = [(name, virtual, "process_group") for name, virtual in _cases(2)]
    cases += [("1f1b", 1, "shared_memory"), ("zbv", 2, "ordered")]
    by_rank = run_ranks(_logprobs_of_each_schedule, 2, args=(cases,), timeout_s=240)
    found = []
    for index, (name, virtual, transport) in enumerate(cases):
        cfg = TinyConfig(num_stages=cs.build(name, ranks=2, microbatches=NUM_MICROBATCHES,
                                             virtual=virtual).num_stages)
        whole = _reference(cfg, list(_ids(cfg).tensor_split(NUM_MICROBATCHES)))
        varlen = _reference(cfg, [x for (x,) in varlen_batches(cfg, step=0)[0]])
        for rank, results in enumerate(by_rank):
            got_whole, got_varlen = results[index]
            found += _differences(f"{name} V={virtual} {transport} rank {rank}", got_whole, whole)
            found += _differences(f"{name} V={virtual} {transport} rank {rank} varlen", got_varlen, varlen)
    assert not found, "\n".join(found)


def test_a_stage_without_logits_and_missing_ids_are_refused_with_the_fix():
    pipe = conveyor.Pipeline([torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)], "gpipe", microbatches=2,
                             layout=conveyor.InProcessLayout())
    with pytest.raises(PipelineConfigError, match="causal language model's logits"):
        pipe.logprobs(torch.ones(4, 3, 4))
    cfg = TinyConfig(num_stages=2)
    pipe = conveyor.Pipeline([build_stage(s, cfg) for s in range(2)], "gpipe", microbatches=2,
                             layout=conveyor.InProcessLayout())
    with pytest.raises(PipelineConfigError, match="inputs are missing"):
        pipe.logprobs(None)


def test_a_traced_hugging_face_model_is_bitwise(one_thread):
    from conveyor.frontend import split_model
    from conveyor.train.config import load_config
    from conveyor.train.models import build_model

    torch.manual_seed(0)
    model = build_model(load_config(None, ["model.layers=2", "model.width=32", "model.seq_len=16"]), 64).eval()
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    split = split_model(model, 2, example_args=(ids[:2],))
    pipe = conveyor.Pipeline([split.stage_module(s) for s in range(2)], "1f1b", microbatches=2,
                             layout=conveyor.InProcessLayout())
    with torch.no_grad():
        want = [token_logprobs(model(part), part) for part in ids.tensor_split(2)]
    assert not _differences("traced GPT-2", pipe.logprobs(ids), want)
