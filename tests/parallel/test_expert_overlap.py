"""Expert parallelism's all-to-alls overlapped with another microbatch's compute, against the plain step.

At pp=2 x dp=2 with ep=2, the traced Mixtral (one decoder layer per stage). With ``expert_overlap=True`` each
rank runs every forward its program pairs with the next backward (a different microbatch) by turns with it:
each MoE layer's counts', tokens' and results' all-to-alls are posted, the other pass computes, then they are
waited for; the backward is cut at the same exchanges. The promise is ``torch.equal`` to the plain pipeline of
the same schedule: losses, the first step's gradients and the parameters after 3 AdamW steps, on every rank.
"""

from __future__ import annotations

import pytest

from conveyor.errors import PipelineConfigError
from conveyor.layout import DistributedLayout
from conveyor.testing import run_ranks
from conveyor.testing.references.expert_overlap import overlapped_against_plain

CI_SCHEDULES = ("zbv",)
PAIRED_SCHEDULES = ("interleaved-1f1b", "zbv", "dualpipev")


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("names", [CI_SCHEDULES, pytest.param(PAIRED_SCHEDULES, marks=pytest.mark.extended)],
                         ids=["ci", "every-paired-schedule"])
def test_overlapped_pairs_train_bitwise_like_the_plain_schedule(names):
    results = run_ranks(overlapped_against_plain, 4, args=(names,), timeout_s=540)
    for rank, by_schedule in enumerate(results):
        for name, result in by_schedule.items():
            where = f"rank {rank}, {name}: {result}"
            assert result["losses equal"] and result["grads equal"] and result["params equal"], where
            assert result["grads"] > 0, where
    for name in names:  # every schedule here pairs forwards with backwards on some rank
        assert sum(by_schedule[name]["pairs"] for by_schedule in results) > 0, name


def test_the_option_needs_expert_parallelism():
    with pytest.raises(PipelineConfigError, match="expert_overlap=True shapes expert parallelism"):
        DistributedLayout(dp=2, expert_overlap=True)
    with pytest.raises(PipelineConfigError, match="expert_overlap takes True or False"):
        DistributedLayout(dp=2, expert_parallel="auto", expert_overlap="yes")


def test_a_schedule_with_one_stage_per_rank_is_refused_and_two_get_their_pairs():
    from conveyor.parallel.experts import ExpertParallel
    from conveyor.parallel.mesh import MeshLayout
    from conveyor.schedule import build, pairs_of

    part = ExpertParallel("auto", 2, MeshLayout(((0, 1), (2, 3)), 0, 0, None), overlap=True)
    with pytest.raises(PipelineConfigError, match="schedule '1f1b' .* has no such pair.*zbv, dualpipev"):
        part.program(build("1f1b", ranks=2, microbatches=8))
    paired = part.program(build("zbv", ranks=2, microbatches=8))
    assert all(pairs_of(paired, rank) for rank in range(2))
    assert ExpertParallel("auto", 2, MeshLayout(((0, 1), (2, 3)), 0, 0, None)).program(paired) is paired
