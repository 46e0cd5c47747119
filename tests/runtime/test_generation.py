"""pipe.generate: greedy and sampled tokens through the pipeline, bitwise to the unsplit model's loop.

The reference (:func:`conveyor.testing.references.generation.reference_generate`) runs the same
windows through the unsplit model, microbatch (lane) by microbatch, and picks with the library's
own formula: tokens are compared with ``torch.equal``. The generated tokens' log-probs must equal
``pipe.logprobs`` of the finished sequences. Cheap for CI: hand-built stages in process, a loop over
schedules; one launch of 2 gloo ranks; a traced GPT-2 against its own ``generate()``, through the key/value
caches ``pipe.generate`` builds for it and through the window loop, in process and on the gloo ranks.
"""

from __future__ import annotations

import pytest
import torch

import conveyor
import conveyor.schedule as cs
from conveyor.errors import PipelineConfigError
from conveyor.pipe.generation import Sampling
from conveyor.testing import run_ranks
from conveyor.testing.models import TinyConfig, build_stage, reference_model
from conveyor.testing.models.cached_lm import VOCAB, CachedReference, build_cached_stage
from conveyor.testing.references.generation import reference_generate

LANES = 2
NEW = 5
PROMPTS = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 4], [8, 8, 0, 0], [1, 2, 3, 4]])
CACHED_PROMPTS = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(0))
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
# Greedy with an eos the model reaches, and sampling with every filter, from a seeded generator.
SAMPLINGS = (Sampling(eos_token_id=None), Sampling(do_sample=True, temperature=0.8, top_k=10, top_p=0.9),
             Sampling(do_sample=True))


def _config(num_stages: int) -> TinyConfig:
    return TinyConfig(num_stages=num_stages, seq_len=PROMPTS.shape[1] + NEW)


def _generate_each(pipe, sampling_list=SAMPLINGS) -> list:
    results = []
    for sampling in sampling_list:
        out = pipe.generate(PROMPTS, NEW, sampling=sampling, attention_mask=MASK,
                            generator=torch.Generator().manual_seed(7), return_logprobs=True)
        results.append(out)
    return results


def _check(case: str, pipe_outputs: list, cfg: TinyConfig, logprobs_of) -> list[str]:
    """What differs from the reference: tokens (torch.equal) and log-probs (torch.equal to pipe.logprobs)."""
    model = reference_model(cfg)
    found = []
    for sampling, out in zip(SAMPLINGS, pipe_outputs, strict=True):
        want = reference_generate(model, PROMPTS, NEW, sampling, torch.Generator().manual_seed(7), MASK, lanes=LANES)
        if not torch.equal(out.tokens, want):
            found.append(f"{case} {sampling.describe()}: tokens {out.tokens.tolist()} != {want.tolist()}")
        every = logprobs_of(out.sequences)
        lengths = MASK.sum(1)
        for row in range(PROMPTS.shape[0]):
            n = int(out.lengths[row])
            expected = every[row, lengths[row] - 1: lengths[row] - 1 + n]
            if not (torch.equal(out.logprobs[row, :n], expected) and torch.isfinite(expected).all()):
                found.append(f"{case} {sampling.describe()}: row {row} log-probs differ from pipe.logprobs")
    return found



def test_every_schedule_in_process_generates_the_unsplit_models_tokens(one_thread):
    found = []
    for name, virtual in (("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2), ("zbv", 2)):
        schedule = cs.build(name, ranks=2, microbatches=LANES, virtual=virtual)
        cfg = _config(schedule.num_stages)
        pipe = conveyor.Pipeline([build_stage(s, cfg) for s in range(schedule.num_stages)], schedule,
                                 layout=conveyor.InProcessLayout())
        found += _check(f"{name} V={virtual}", _generate_each(pipe), cfg, pipe.logprobs)
    assert not found, "\n".join(found)


def test_eos_stops_a_row_and_pads_after_it(one_thread):
    cfg = _config(2)
    pipe = conveyor.Pipeline([build_stage(s, cfg) for s in range(2)], "1f1b", microbatches=LANES,
                             layout=conveyor.InProcessLayout())
    first = pipe.generate(PROMPTS, NEW, attention_mask=MASK).tokens
    eos = int(first[0, 1])  # row 0's second token: it stops there
    out = pipe.generate(PROMPTS, NEW, attention_mask=MASK, sampling=Sampling(eos_token_id=eos, pad_token_id=31))
    assert int(out.lengths[0]) == 2 and out.tokens[0, :2].tolist() == first[0, :2].tolist()
    assert (out.tokens[0, 2:] == 31).all()
    want = reference_generate(reference_model(cfg), PROMPTS, NEW, Sampling(eos_token_id=eos, pad_token_id=31),
                              attention_mask=MASK, lanes=LANES)
    assert torch.equal(out.tokens, want)


def _cached_pipeline(schedule: cs.Schedule, stages: list[int], **options):
    return conveyor.Pipeline([build_cached_stage(s, schedule.num_stages) for s in stages], schedule, **options)


def _cached_generate(pipe) -> tuple:
    """Greedy tokens through the stages' key/value caches, the log-probs, and whether every cache filled."""
    out = pipe.generate(CACHED_PROMPTS, NEW, return_logprobs=True)
    return out, pipe.logprobs(out.sequences, None, 0), all(m.kv_cache for m in pipe.modules)


def _cached_differences(case: str, results: tuple, num_stages: int) -> list[str]:
    out, every, filled = results
    want = reference_generate(CachedReference(num_stages), CACHED_PROMPTS, NEW, Sampling(), lanes=LANES)
    found = [] if filled else [f"{case}: a stage's cache stayed empty (the cached decode did not run)"]
    if not torch.equal(out.tokens, want):
        found.append(f"{case} cached: tokens {out.tokens.tolist()} != the full forward's {want.tolist()}")
    if not torch.equal(out.logprobs, every[:, CACHED_PROMPTS.shape[1] - 1:]):
        found.append(f"{case} cached: log-probs differ from pipe.logprobs")
    return found


def test_stages_with_a_key_value_cache_decode_the_full_forwards_tokens(one_thread):
    found = []
    for name, virtual in (("1f1b", 1), ("zbv", 2)):
        schedule = cs.build(name, ranks=2, microbatches=LANES, virtual=virtual)
        pipe = _cached_pipeline(schedule, list(range(schedule.num_stages)), layout=conveyor.InProcessLayout())
        found += _cached_differences(f"{name} V={virtual}", _cached_generate(pipe), schedule.num_stages)
    assert not found, "\n".join(found)


def test_the_unrolled_decode_stops_each_row_at_its_eos_across_blocks(one_thread):
    # More steps than one block of the unrolled program (UNROLLED_BLOCK): the rows are checked for their eos between
    # blocks, the next block starts from each row's last token (pad after its end).
    from conveyor.pipe.generation import UNROLLED_BLOCK

    steps = UNROLLED_BLOCK + 4
    schedule = cs.build("1f1b", ranks=2, microbatches=LANES)
    pipe = _cached_pipeline(schedule, [0, 1], layout=conveyor.InProcessLayout())
    reference = CachedReference(2)
    free = reference_generate(reference, CACHED_PROMPTS, steps, Sampling(), lanes=LANES)
    eos = int(free[1, 2])  # row 1 ends at its third token; the others where this token first comes, if it does
    sampling = Sampling(eos_token_id=eos, pad_token_id=0)
    out = pipe.generate(CACHED_PROMPTS, steps, sampling=sampling)
    want = reference_generate(reference, CACHED_PROMPTS, steps, sampling, lanes=LANES)
    assert out.kv_cache and torch.equal(out.tokens, want), (out.tokens, want)
    assert int(out.lengths[1]) == 3 and bool((out.tokens[1, 3:] == 0).all())


def _ranks_generate(rank: int, world_size: int, cases: list[tuple[str, int]]) -> list:
    results = []
    for name, virtual in cases:
        schedule = cs.build(name, ranks=world_size, microbatches=LANES, virtual=virtual)
        cfg = _config(schedule.num_stages)
        stages = [build_stage(s, cfg) for s in schedule.stages_of(rank)]
        with conveyor.Pipeline(stages, schedule, transfer=conveyor.TransferOptions(timeout_s=60)) as pipe:
            outputs = _generate_each(pipe)
            results.append((outputs, [pipe.logprobs(out.sequences) for out in outputs]))
    schedule = cs.build("1f1b", ranks=world_size, microbatches=LANES)
    with _cached_pipeline(schedule, schedule.stages_of(rank), transfer=conveyor.TransferOptions(timeout_s=60)) as pipe:
        results.append(_cached_generate(pipe))
    results.append(_traced_ranks_generate())
    return results


def _traced_ranks_generate() -> tuple:
    """A traced GPT-2 over these ranks: its tokens through the key/value caches (decode stages built on each rank
    for its own stages) and through the window loop, and the cached decode's log-probs."""
    from conveyor.testing.references.tensor_parallel import build

    prompts = torch.randint(1, 96, (2, 6), generator=torch.Generator().manual_seed(3))
    example = {"input_ids": torch.zeros(1, prompts.shape[1] + NEW, dtype=torch.long)}
    with conveyor.pipeline(build("gpt2").eval(), example_kwargs=example, schedule="1f1b", microbatches=LANES) as pipe:
        cached = pipe.generate(prompts, NEW, kv_cache=True, return_logprobs=True)
        window = pipe.generate(prompts, NEW, kv_cache=False, return_logprobs=True)
    return cached, window


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_gloo_ranks_generate_the_same_tokens_on_every_rank(one_thread):
    cases = [("1f1b", 1), ("interleaved-1f1b", 2)]
    by_rank = run_ranks(_ranks_generate, 2, args=(cases,), timeout_s=240)
    found = []
    for index, (name, virtual) in enumerate(cases):
        cfg = _config(cs.build(name, ranks=2, microbatches=LANES, virtual=virtual).num_stages)
        for rank, results in enumerate(by_rank):
            outputs, every = results[index]
            by_sequences = dict(zip((id(o.sequences) for o in outputs), every))
            found += _check(f"{name} V={virtual} rank {rank}", outputs, cfg,
                            lambda sequences, table=by_sequences: table[id(sequences)])
    for rank, results in enumerate(by_rank):
        found += _cached_differences(f"1f1b rank {rank}", results[-2], 2)
        cached, window = results[-1]  # the traced GPT-2: cache and window loop agree on every rank
        if not (cached.kv_cache and torch.equal(cached.tokens, window.tokens)
                and torch.equal(cached.tokens, by_rank[0][-1][0].tokens)
                and torch.equal(cached.logprobs, window.logprobs)):
            found.append(f"traced GPT-2 rank {rank}: cached {cached.tokens.tolist()} vs window "
                         f"{window.tokens.tolist()} (rank 0: {by_rank[0][-1][0].tokens.tolist()})")
    assert not found, "\n".join(found)


def test_a_traced_gpt2_generates_what_its_own_generate_does(one_thread):
    from conveyor.testing.references.tensor_parallel import build

    model = build("gpt2").eval()
    prompts = torch.randint(1, 96, (2, 6), generator=torch.Generator().manual_seed(3))
    width = prompts.shape[1] + NEW
    pipe = _in_process(build("gpt2").eval(), width)
    # By default through key/value caches: the model's decode program, traced and cut like the training one at the
    # first call, reading the training stages' weights; kv_cache=False: every step the training forward.
    out = pipe.generate(prompts, NEW, return_logprobs=True)
    window = pipe.generate(prompts, NEW, return_logprobs=True, kv_cache=False)
    assert out.kv_cache and not window.kv_cache
    with torch.no_grad():
        # Its generate() decodes with a key/value cache: other kernels than a full forward, whose logits
        # differ by rounding; the argmax agrees wherever no two logits are that close (this model, these prompts).
        cached = model.generate(prompts, max_new_tokens=NEW, do_sample=False, use_cache=True,
                                attention_mask=torch.ones_like(prompts), pad_token_id=0)[:, prompts.shape[1]:]
    assert torch.equal(out.tokens, cached), (out.tokens, cached)
    # The window loop is bitwise the unsplit model's greedy loop; the log-probs are the training forward's either way.
    assert torch.equal(window.tokens, reference_generate(model, prompts, NEW, Sampling(), lanes=2, keyword=True))
    assert torch.equal(out.tokens, window.tokens) and torch.equal(out.logprobs, window.logprobs)
    # The decode stages read the training stages' weights: a training step changes what the next call decodes.
    with torch.no_grad():
        for param in pipe.parameters():
            param.mul_(1.5)
    again = pipe.generate(prompts, NEW, kv_cache=True)
    assert again.kv_cache and torch.equal(again.tokens, pipe.generate(prompts, NEW, kv_cache=False).tokens)


def test_bad_requests_are_refused_with_the_fix():
    from conveyor.testing.references.tensor_parallel import build

    pipe = _in_process(build("gpt2").eval(), 8)
    prompts = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(PipelineConfigError, match="the model has 32 positions: shorten them"):
        pipe.generate(torch.ones(2, 40, dtype=torch.long), 4)
    with pytest.raises(PipelineConfigError, match="pass max_new_tokens <= 28"):
        pipe.generate(prompts, 30)
    with pytest.raises(PipelineConfigError, match="pass a multiple of 2 prompts"):
        pipe.generate(torch.ones(3, 4, dtype=torch.long), 4)
    with pytest.raises(PipelineConfigError, match="do_sample=False picks the argmax: pass do_sample=True"):
        pipe.generate(prompts, 4, sampling=Sampling(temperature=0.5))
    with pytest.raises(PipelineConfigError, match="pass do_sample=False instead of temperature=0"):
        Sampling(do_sample=True, temperature=0)
    with pytest.raises(PipelineConfigError, match="top_p=1.5 must be in"):
        Sampling(do_sample=True, top_p=1.5)
    with pytest.raises(PipelineConfigError, match="right-padded prompts"):
        pipe.generate(prompts, 4, attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
    with pytest.raises(PipelineConfigError, match="kv_cache='yes': pass None"):
        pipe.generate(prompts, 4, kv_cache="yes")
    with pytest.raises(PipelineConfigError, match="kv_cache=True, but the prompts are of several lengths"):
        pipe.generate(prompts, 4, attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]), kv_cache=True)
    by_hand = conveyor.Pipeline([build_stage(s, _config(2)) for s in range(2)], "1f1b", microbatches=2,
                                layout=conveyor.InProcessLayout())
    with pytest.raises(PipelineConfigError, match="kv_cache=True, but the stages are not a traced model's own"):
        by_hand.generate(PROMPTS, NEW, kv_cache=True)
    cached = _cached_pipeline(cs.build("1f1b", ranks=2, microbatches=LANES), [0, 1], layout=conveyor.InProcessLayout())
    with pytest.raises(PipelineConfigError, match="kv_cache=False, but these stages decode only through their"):
        cached.generate(CACHED_PROMPTS, NEW, kv_cache=False)
    headless = _headless()
    with pytest.raises(PipelineConfigError, match="causal language model's head"):
        headless.generate(prompts, 4)


def _headless():
    from transformers import GPT2Model

    from conveyor.testing.models import gpt2

    _, config = gpt2(num_layers=2)
    torch.manual_seed(0)
    return _in_process(GPT2Model(config).eval(), 8)


def _in_process(model: torch.nn.Module, width: int):
    """A traced model cut in 2 stages in this process, for windows of ``width`` tokens, 2 lanes of 1 row."""
    return conveyor.pipeline(model, example_kwargs={"input_ids": torch.zeros(1, width, dtype=torch.long)},
                             schedule="1f1b", microbatches=2, layout=conveyor.InProcessLayout(ranks=2))


def test_cached_decode_logits_are_within_rounding_of_the_full_forward(one_thread):
    """The cached decode runs other kernel calls than the full forward: attention with one query over the cached
    keys under an explicit mask (the full forward: every query under is_causal), and every projection on [rows, 1]
    instead of [rows, n] (another blocking of the same dot products). Each is a reordered fp32 sum of at most
    2 x DIM = 32 terms (the MLP's second projection; softmax and values sum over at most 12 positions), chained
    through at most 17 of them from the embedding to the logits (per stage: layer norm's two moments, q|k|v, the
    scores, the softmax, the values, the out projection, two MLP projections; then the head): relative to the
    logits' largest magnitude, reordered_sum_bound(32, depth=17) (conveyor.testing.compare, Higham-Mary)."""
    from conveyor.testing.compare import reordered_sum_bound
    from conveyor.testing.models.cached_lm import DIM

    stages = [build_cached_stage(s, 2) for s in range(2)]
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = stages[1](*stages[0](ids, None, 0))
        pieces = [stages[1](*stages[0](ids[:, :6], 0, 0))]  # the prefill, under an explicit mask
        pieces += [stages[1](*stages[0](ids[:, t:t + 1], 0, t)) for t in range(6, 12)]
    cached = torch.cat(pieces, dim=1)
    assert cached.shape == full.shape and torch.isfinite(cached).all()
    bound = reordered_sum_bound(2 * DIM, depth=17) * full.abs().max().item()
    assert (cached - full).abs().max().item() <= bound, ((cached - full).abs().max().item(), bound)
