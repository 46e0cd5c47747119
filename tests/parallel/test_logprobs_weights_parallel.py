"""pipe.logprobs, pipe.generate and pipe.named_weights beside the pipeline's parallelisms, in one launch of 4 ranks.

Tensor parallel (pp=2 x tp=2, ``loss_parallel``: the logits stay vocabulary-sharded, the log-probs
are computed under torch's ``loss_parallel()`` without gathering them) and FSDP replicas (pp=2 x
dp=2, each replica its own prompts), on a traced GPT-2 whose head is tied to its embedding and
whose attention projection is packed (q|k|v). named_weights must give the unsplit model's
``state_dict()`` back, name for name and bit for bit (the tensors are the untrained ones, only
sharded and gathered). generate: each FSDP replica continues its own prompts, bitwise as one device
would; the TP ranks agree on every token.
"""

from __future__ import annotations

import pytest
import torch

from conveyor.pipe.generation import Sampling
from conveyor.pipe.logprobs import token_logprobs
from conveyor.testing import run_ranks
from conveyor.testing.compare import FP32_UNIT_ROUNDOFF
from conveyor.testing.references.generation import reference_generate
from conveyor.testing.references.tensor_parallel import TP_ROUNDING, VOCABULARY, build

MICROBATCHES = 2
LENGTH = 12
NEW = 4  # prompts of LENGTH - NEW tokens: every window is LENGTH long, the traced shape


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCABULARY, (2 * MICROBATCHES, LENGTH), generator=torch.Generator().manual_seed(seed))


def _reference(ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The unsplit model, microbatch by microbatch: the log-probs (the same formula) and the logits."""
    model = build("gpt2").eval()
    with torch.no_grad():
        outputs = [model(input_ids=part) for part in ids.tensor_split(MICROBATCHES)]
        return [token_logprobs(out, part) for out, part in zip(outputs, ids.tensor_split(MICROBATCHES))], \
            [out.logits for out in outputs]


def _pipeline(mesh, **layout):
    import conveyor
    from conveyor.layout import DistributedLayout

    return conveyor.pipeline(build("gpt2").eval(), example_kwargs={"input_ids": _ids(0)[:2]}, schedule="1f1b",
                             microbatches=MICROBATCHES, layout=DistributedLayout(mesh=mesh, **layout))


def _prompts(seed: int) -> torch.Tensor:
    return _ids(seed)[:, :LENGTH - NEW]


def _replica_prompts(replica: int) -> torch.Tensor:
    """Replica 0: four copies of one prompt, whose first greedy token is the eos (all its rows end after one
    token); replica 1: other prompts, which go on. FSDP's forwards are collectives: both must stop together."""
    return _prompts(6)[:1].expand(4, -1).contiguous() if replica == 0 else _prompts(7)


def _until_eos() -> Sampling:
    """Greedy, ending at replica 0's first token (see :func:`_replica_prompts`)."""
    first = reference_generate(build("gpt2").eval(), _prompts(6)[:2], 1, Sampling(), lanes=MICROBATCHES, keyword=True)
    return Sampling(eos_token_id=int(first[0, 0]), pad_token_id=1)


def _weights(pipe) -> dict:
    """This rank's named weights against the unsplit model's state_dict: names, and any that differ."""
    want = build("gpt2").state_dict()
    got = dict(pipe.named_weights())
    return {"names": sorted(got), "differ": [n for n, t in got.items() if not torch.equal(t, want[n])],
            "unknown": sorted(set(got) - set(want))}


def _both_layouts(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    results = {}
    with _pipeline(init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp")), tensor_parallel="auto",
                   loss_parallel=True) as pipe:
        results["tp"] = {"logprobs": pipe.logprobs(input_ids=_ids(1)), "weights": _weights(pipe),
                         "tokens": pipe.generate(_prompts(4), NEW).tokens}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    with _pipeline(mesh, data_parallel="fsdp") as pipe:
        replica = mesh.get_local_rank("dp")
        results["fsdp"] = {"replica": replica, "logprobs": pipe.logprobs(input_ids=_ids(2 + replica)),
                           "weights": _weights(pipe), "tokens": pipe.generate(_prompts(5 + replica), NEW).tokens,
                           "until_eos": pipe.generate(_replica_prompts(replica), NEW, sampling=_until_eos())}
    return results


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_tensor_parallel_and_fsdp_logprobs_and_whole_weights():
    by_rank = run_ranks(_both_layouts, 4, timeout_s=240)
    torch.set_num_threads(1)
    all_names = set(build("gpt2").state_dict())
    for kind in ("tp", "fsdp"):
        results = [r[kind] for r in by_rank]
        assert set().union(*(r["weights"]["names"] for r in results)) == all_names, kind
        for rank, result in enumerate(results):
            assert not result["weights"]["differ"] and not result["weights"]["unknown"], (kind, rank, result)
    # FSDP computes what one device computes, microbatch by microbatch: bitwise, each replica its own prompts.
    for rank, result in enumerate(r["fsdp"] for r in by_rank):
        want = torch.cat(_reference(_ids(2 + result["replica"]))[0])
        assert torch.equal(result["logprobs"], want), (rank, (result["logprobs"] - want).abs().max())
        tokens = reference_generate(build("gpt2").eval(), _prompts(5 + result["replica"]), NEW, Sampling(),
                                    lanes=MICROBATCHES, keyword=True)
        assert torch.equal(result["tokens"], tokens), (rank, result["tokens"], tokens)
        until_eos = result["until_eos"]
        want = reference_generate(build("gpt2").eval(), _replica_prompts(result["replica"]), NEW, _until_eos(),
                                  lanes=MICROBATCHES, keyword=True)
        assert torch.equal(until_eos.tokens, want), (rank, until_eos.tokens, want)
        if result["replica"] == 0:  # every row ended after its first token, while replica 1 went on
            assert until_eos.lengths.tolist() == [1] * 4 and (until_eos.tokens[:, 1:] == 1).all(), until_eos
    # TP: every rank (both stages, both TP positions) holds the same tokens.
    assert all(torch.equal(r["tp"]["tokens"], by_rank[0]["tp"]["tokens"]) for r in by_rank)
    # TP against one device. A log-prob is x_t - logsumexp(x); both terms move by at most the logits' largest
    # difference d (logsumexp is 1-Lipschitz in the max norm), so |difference| <= 2 d + the sharded logsumexp's
    # own rounding: its V positive terms summed per shard then across shards, 2 (V - 1) u, plus the exps'
    # and the log's roundings, 10 u (conveyor.testing.compare.logsumexp_bound's per-token term). d is TP's
    # relative rounding of a forward (TP_ROUNDING: reordered sums of up to V terms) times the largest logit.
    want, logits = _reference(_ids(1))
    want = torch.cat(want)
    largest_logit = max(part.abs().max().item() for part in logits)
    bound = 2 * TP_ROUNDING * largest_logit + (2 * (VOCABULARY - 1) + 10) * FP32_UNIT_ROUNDOFF
    for rank, result in enumerate(r["tp"] for r in by_rank):
        got = result["logprobs"]
        assert got.shape == want.shape and torch.isfinite(got).all(), rank
        difference = (got - want).abs().max().item()
        assert difference <= bound, (rank, difference, bound)
