"""``compile=``: stages compiled with torch.compile train as the same stages compiled and run one after another.

The reference is one device: each stage module compiled on its own (``torch.compile(stage)``,
the graphs the pipeline compiles) and run stage after stage per microbatch, with
``(loss / M).backward()``. Under ``aot_eager`` the pipeline is bitwise that run (every
schedule's I/W, fused or split, gives exactly B's gradients); under inductor, within 1e-6.
Compiles are slow on small machines: ``aot_eager`` everywhere but one inductor test. Across
processes: dualpipev over gloo, and zbv with FSDP2 replicas (pp=2 x dp=2).
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch

import conveyor
import conveyor.schedule as cs
from conveyor.errors import PipelineConfigError
from conveyor.layout import InProcessLayout
from conveyor.pipe import Pipeline
from conveyor.testing import run_ranks
from conveyor.testing.compare import relative_difference
from conveyor.testing.models import TinyConfig, build_stage, lm_loss, make_batch
from conveyor.testing.references.data_parallel import max_relative_difference

AOT = {"backend": "aot_eager"}
M, BATCH, STEPS = 4, 8, 3
FUSED = "holds a compiled region"


pytestmark = pytest.mark.usefixtures("one_thread")  # the ranks' thread count: same reduction order


def _schedule(name: str) -> cs.Schedule:
    return cs.build(name, ranks=2, microbatches=M, virtual=cs.available()[name].default_virtual)


def _train(step, params, batches):
    """Losses and parameters after len(batches) AdamW steps of ``step(ids, targets)``."""
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for ids, targets in batches:
        losses.append(step(ids, targets))
        optimizer.step()
        optimizer.zero_grad()
    return losses, [p.detach().clone() for p in params]


def _reference(stages, batches, options, autocast=None):
    """Each stage compiled on its own, run stage after stage: gradient accumulation over M microbatches.

    ``dynamic=False``: the static graphs the pipeline compiles (a code object per stage). Stages of one class
    share ``forward``'s code object here, so without it the second stage's new input shape made torch mark
    them dynamic and compile other graphs (under inductor, 3 more kernels for the pipeline to build)."""
    compiled = [torch.compile(stage, **{"dynamic": False, **options}) for stage in stages]

    def step(ids, targets):
        total = None
        for x, y in zip(torch.tensor_split(ids, M), torch.tensor_split(targets, M)):
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                value = compiled[0](x)
                for stage in compiled[1:]:
                    value = stage(*value) if isinstance(value, tuple) else stage(value)
                loss = lm_loss(value, y) / M
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total

    return _train(step, [p for s in stages for p in s.parameters()], batches)


def _local(stages, schedule, batches, options):
    pipe = Pipeline(stages, schedule, lm_loss, stage=options, layout=InProcessLayout())
    return _train(lambda ids, y: pipe.step(ids, target=y), [p for s in stages for p in s.parameters()], batches)


def _assert_equal(got, want, rel=0.0):
    assert len(got[0]) == len(want[0]) and len(got[1]) == len(want[1]), (len(got[0]), len(got[1]))
    for step, (g, w) in enumerate(zip(got[0], want[0])):
        assert (g - w).abs() <= rel * w.abs(), f"loss of step {step}: {g.item()!r} vs {w.item()!r}"
    for i, (g, w) in enumerate(zip(got[1], want[1])):
        err = relative_difference(g, w)
        assert err <= rel, f"parameter {i} after {STEPS} AdamW steps: relative difference {err:.3g} > {rel}"


def _tiny(schedule, **cfg):
    cfg = TinyConfig(num_stages=schedule.num_stages, **cfg)
    return cfg, [make_batch(cfg, BATCH, seed=step) for step in range(STEPS)]


def _fallback_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if FUSED in r.getMessage()]


# CI compiles zbv (V=2, the I/W split and its fallback to B); 1f1b, whose compiled stages run no I/W, is the
# extended tier (its stages also compile in CI, in the varying-length test below).
@pytest.mark.parametrize("name", [pytest.param("1f1b", marks=pytest.mark.extended), "zbv"])
def test_compiled_stages_train_bitwise_as_the_compiled_stages_run_in_turn(name, caplog):
    """CI twin of ``[1f1b]``: ``[zbv]`` (bitwise, same assertions) and, for 1f1b's "nothing falls back",
    test_a_varying_sequence_length_recompiles_once_per_stage_not_per_step (1f1b stages compiled in CI)."""
    schedule = _schedule(name)
    cfg, batches = _tiny(schedule)
    want = _reference([build_stage(s, cfg) for s in range(schedule.num_stages)], batches, AOT)
    with caplog.at_level(logging.WARNING, logger="conveyor"):
        got = _local([build_stage(s, cfg) for s in range(schedule.num_stages)], schedule, batches,
                     conveyor.StageOptions(compile=AOT))
    _assert_equal(got, want)
    lines = _fallback_lines(caplog)
    if name == "1f1b":
        assert lines == []  # no I/W: nothing falls back
    else:
        # Every stage whose inputs carry a gradient runs I as B, said once over 3 steps x 4 microbatches;
        # stage 0 keeps its split (an empty I, then W).
        assert sorted(line.split(" (rank")[0] for line in lines) == [
            f"conveyor: stage {s}" for s in range(1, schedule.num_stages)]


def test_checkpointing_and_autocast_compose_with_compile():
    schedule = _schedule("zb-h1")
    cfg, batches = _tiny(schedule)
    want = _reference([build_stage(s, cfg) for s in range(2)], batches, AOT, autocast=torch.bfloat16)
    got = _local([build_stage(s, cfg) for s in range(2)], schedule, batches,
                 conveyor.StageOptions(compile=AOT, autocast="bf16", recompute=True))
    _assert_equal(got, want)


class _Counting:
    """An aot_eager backend that counts the graphs it compiles."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs += 1
        return aot_eager(gm, example_inputs)


def test_a_varying_sequence_length_recompiles_once_per_stage_not_per_step(caplog):
    schedule = _schedule("1f1b")
    cfg = TinyConfig(num_stages=2, seq_len=12)
    backend = _Counting()
    pipe = Pipeline([build_stage(s, cfg) for s in range(2)], schedule, lm_loss,
                    stage=conveyor.StageOptions(compile={"backend": backend}), layout=InProcessLayout())
    graphs = []
    with caplog.at_level(logging.WARNING, logger="conveyor"):
        for step, length in enumerate((12, 9, 11, 7, 12, 10)):
            ids, targets = make_batch(cfg, BATCH, seed=step)
            pipe.step(ids[:, :length].contiguous(), target=targets[:, :length].contiguous())
            graphs.append(backend.graphs)
    assert _fallback_lines(caplog) == []  # 1f1b runs no I/W: no stage falls back to B
    # Per stage: a graph for the first shapes; at most one more, with the length dynamic, at the first
    # new length (none where torch already knows the stage's length varies: its automatic-dynamic
    # profile of conveyor_stage_<s> outlives a pipeline); then none, whatever the length.
    assert graphs[0] == 2 and graphs[1] <= 4 and set(graphs[1:]) == {graphs[1]}, graphs


def test_the_default_inductor_backend_trains_within_1e_6_of_the_compiled_stages(tmp_path, monkeypatch):
    # Two small stages on a zero-bubble schedule, one fused pointwise op each: each kernel costs gcc 1-2 s
    # (3x that beside CI's other worker), and the first build adds inductor's ISA probe (about 4 s).
    # Embedding+Linear+Tanh and Linear+GELU+Linear built 13 kernels; these build 5 for the same checks (the
    # reference compiles the static graphs the pipeline compiles, which finds them built).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a cold cache, as on CI
    # Compile in this process: on 2 cores inductor's pool of compile workers (fresh interpreters that
    # import torch) cost more CPU than it saved (this test: 67 s or more with it, 51 s without). The
    # kernels are the same.
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "compile_threads", 1)
    schedule = _schedule("zb-h2")

    def stages():
        torch.manual_seed(0)
        return [torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Tanh()),
                torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU())]

    _, batches = _tiny(schedule)
    want = _reference(stages(), batches, {})
    got = _local(stages(), schedule, batches, conveyor.StageOptions(compile=True))
    # Inductor's fused kernels against ATen's: the same math, sums of at most 32 terms in other orders
    # (reordered_sum_bound(32) = 4.0e-6 of the terms' magnitudes a gradient element), which AdamW turns
    # into parameter steps that differ by ~lr times that relative error per step: 3 steps x 1e-2 x 2 x 4e-6
    # over the largest entry of the smallest tensor (Linear(16, 32)'s bias,
    # uniform in +-1/4) is 1e-6 with conditioning 1: the bound kept here.
    _assert_equal(got, want, rel=1e-6)


def _train_ranks(rank, world_size, name):
    schedule = _schedule(name)
    cfg, batches = _tiny(schedule)
    mine = schedule.stages_of(rank)
    stages = [build_stage(s, cfg) for s in mine]
    pipe = conveyor.Pipeline(stages, schedule, lm_loss, stage=conveyor.StageOptions(compile=AOT),
                             transfer=conveyor.TransferOptions(timeout_s=60))
    first, last = schedule.placement.rank_of(0), schedule.placement.rank_of(schedule.num_stages - 1)
    losses, _ = _train(lambda ids, y: pipe.step(ids if rank == first else None,
                                                     target=y if rank == last else None),
                            [p for s in stages for p in s.parameters()], batches)
    pipe.close()
    return losses, dict(zip(mine, [[p.detach().clone() for p in s.parameters()] for s in stages]))


@pytest.mark.distributed
def test_compiled_dualpipev_across_processes_is_bitwise_the_compiled_stages_in_turn():
    schedule = _schedule("dualpipev")
    cfg, batches = _tiny(schedule)
    want_losses, want_params = _reference([build_stage(s, cfg) for s in range(schedule.num_stages)], batches, AOT)
    sizes = [sum(1 for _ in build_stage(s, cfg).parameters()) for s in range(schedule.num_stages)]
    starts = [sum(sizes[:s]) for s in range(schedule.num_stages)]
    for losses, per_stage in run_ranks(_train_ranks, 2, args=("dualpipev",), timeout_s=120):
        assert all(torch.equal(g, w) for g, w in zip(losses, want_losses))
        for stage, params in per_stage.items():
            for i, p in enumerate(params):
                assert torch.equal(p, want_params[starts[stage] + i]), f"stage {stage} parameter {i}"


@pytest.mark.distributed
def test_compiled_stages_under_fsdp_replicas_stay_bitwise_the_per_replica_reference(monkeypatch):
    # pp=2 x dp=2, zbv, FSDP2 per stage: the MLP stages' aot_eager graphs run eager's kernels.
    monkeypatch.setattr(conveyor, "Pipeline", functools.partial(conveyor.Pipeline,
                                                                   stage=conveyor.StageOptions(compile=AOT)))
    assert max_relative_difference("zbv", 2, "fsdp", orders=("per_replica",)) == {"per_replica": 0.0}


@pytest.mark.parametrize(("spec", "fragment"), [("yes", "takes True, False or a dict"),
                                                 ({"backend": "aot_eager", "modes": "x"}, "['modes']")])
def test_a_compile_argument_torch_cannot_take_is_refused_naming_it(spec, fragment):
    with pytest.raises(PipelineConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        Pipeline([torch.nn.Linear(2, 2)], "gpipe", microbatches=1, stage=conveyor.StageOptions(compile=spec),
                 layout=InProcessLayout())
