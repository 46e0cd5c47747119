"""Pipeline over real gloo processes: bitwise parity for every built-in schedule, and every failure path.

The parity grid runs every schedule of one rank count and transport one after the other inside one
rank group (5 groups for 46 cases, not 46): each case builds its own pipeline, and an exception in
a rank, or a failed assertion here, names the case.
"""

from __future__ import annotations

import datetime

import pytest
import torch

import conveyor
import conveyor.schedule as cs
from conveyor.schedule.passes import executable
from conveyor.testing import RankFailure, run_ranks
from conveyor.testing.models import build_stage, lm_loss, make_batch
from conveyor.testing.references.schedule_parity import (
    BATCH_SIZE,
    NUM_MICROBATCHES,
    NUM_STEPS,
    assert_same,
    config_for,
    reference_run,
    schedule_grid,
)
from conveyor.testing.rigs.silent_peer import silent_until_answered

TRANSPORTS = ("shared_memory", "process_group")


def _train(rank, world_size, name, virtual, fixed_shapes, transport="auto"):
    schedule = cs.build(name, ranks=world_size, microbatches=NUM_MICROBATCHES, virtual=virtual)
    cfg = config_for(schedule)
    mine = schedule.stages_of(rank)
    stages = {s: build_stage(s, cfg) for s in mine}
    pipe = conveyor.Pipeline([stages[s] for s in mine], schedule=schedule, loss_fn=lm_loss,
                             transfer=conveyor.TransferOptions(timeout_s=60, fixed_shapes=fixed_shapes,
                                                               transport=transport))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses, grads = [], None
    for step in range(NUM_STEPS):
        ids, targets = make_batch(cfg, BATCH_SIZE, seed=step)
        first, last = schedule.placement.rank_of(0), schedule.placement.rank_of(schedule.num_stages - 1)
        losses.append(pipe.step(ids if rank == first else None, target=targets if rank == last else None))
        if step == 0:
            grads = {s: {n: p.grad.clone() for n, p in stages[s].named_parameters()} for s in mine}
        optimizer.step()
        optimizer.zero_grad()
    timeline = pipe.timeline()
    params = {s: {n: p.detach().clone() for n, p in stages[s].named_parameters()} for s in mine}
    ran = [[str(span.action) for span in sorted(timeline.spans, key=lambda span: span.start)
            if span.rank == r and span.action.kind.is_compute]
           for r in range(world_size)]
    return losses, grads, params, ran


def _train_each(rank, world_size, cases, fixed_shapes, transport):
    results = []
    for name, virtual in cases:
        try:
            results.append(_train(rank, world_size, name, virtual, fixed_shapes, transport))
        except Exception as exc:
            exc.add_note(f"while rank {rank} ran {name} (virtual={virtual}, transport={transport})")
            raise
    return results


# Every schedule over the default transport (shared memory: run_ranks puts every rank on this
# host), and a V=1 and a V=2 family over the process group's gloo point-to-point as well.
_GRID = [(*case, "auto") for case in schedule_grid((1, 2, 4))] + [
    ("1f1b", 4, 1, "process_group"), ("interleaved-1f1b", 2, 2, "process_group"), ("zbv", 2, 2, "process_group"),
    ("dualpipev", 4, 2, "process_group"),
]
_GROUPS = sorted({(num_ranks, transport) for _, num_ranks, _, transport in _GRID})


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("num_ranks", "transport"), _GROUPS)
def test_every_schedule_is_bitwise_equal_to_one_device_across_processes(num_ranks, transport):
    cases = [(name, virtual) for name, ranks, virtual, how in _GRID if (ranks, how) == (num_ranks, transport)]
    by_rank = run_ranks(_train_each, num_ranks, args=(cases, False, transport), timeout_s=60 + 30 * len(cases))
    for index, (name, virtual) in enumerate(cases):
        _check_schedule(f"{name} virtual={virtual} on {num_ranks} ranks over {transport}",
                        cs.build(name, ranks=num_ranks, microbatches=NUM_MICROBATCHES, virtual=virtual),
                        [results[index] for results in by_rank])


def _check_schedule(case, schedule, results):
    want_losses, want_grads, want_params = reference_run(schedule)
    # The measured timeline holds, rank by rank and in order, the compute actions of the
    # program the pass chain made (an I directly followed by its W runs as one B), and the
    # simulator times that very program.
    num_ranks = len(results)
    runs = executable(schedule)
    planned = [[str(a) for a in runs.train_program(r) if a.kind.is_compute] for r in range(num_ranks)]
    simulated = cs.simulate(runs.train)
    assert [[str(span.action) for span in simulated.spans if span.rank == r and span.action.kind.is_compute]
            for r in range(num_ranks)] == planned, case
    for rank, (losses, grads, params, ran) in enumerate(results):
        for step, (got, want) in enumerate(zip(losses, want_losses)):
            assert torch.equal(got, want), f"{case}: rank {rank} loss of step {step}: {got.item()} vs {want.item()}"
        for stage in schedule.stages_of(rank):
            assert_same(f"{case}: stage {stage} grads", grads[stage], want_grads[stage])
            assert_same(f"{case}: stage {stage} params after {NUM_STEPS} AdamW steps", params[stage],
                        want_params[stage])
        assert ran == planned, f"{case}: rank {rank} ran another program than the one simulated"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fixed_shapes_mode_is_bitwise_equal_too(transport):
    schedule = cs.build("1f1b", ranks=2, microbatches=NUM_MICROBATCHES)
    want_losses, want_grads, want_params = reference_run(schedule)
    results = run_ranks(_train, 2, args=("1f1b", 1, True, transport), timeout_s=120)
    for rank, (losses, grads, params, _) in enumerate(results):
        assert len(losses) == len(want_losses) and all(torch.equal(g, w) for g, w in zip(losses, want_losses))
        for stage in schedule.stages_of(rank):
            assert_same(f"stage {stage} grads", grads[stage], want_grads[stage])
            assert_same(f"stage {stage} params", params[stage], want_params[stage])


class _VariableLength(torch.nn.Module):
    """Mean over a sequence whose length changes per microbatch and step."""

    def __init__(self, last: bool):
        super().__init__()
        self.last = last
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = torch.tanh(self.proj(x))
        return y.mean(dim=(1, 2)) if self.last else y


def _variable_length(rank, world_size, name, virtual, transport="auto"):
    schedule = cs.build(name, ranks=world_size, microbatches=2, virtual=virtual)
    torch.manual_seed(0)
    modules = [_VariableLength(s == schedule.num_stages - 1) for s in range(schedule.num_stages)]
    pipe = conveyor.Pipeline([modules[s] for s in schedule.stages_of(rank)], schedule=schedule,
                             loss_fn=lambda y, t: (y - t).pow(2).mean(),
                             transfer=conveyor.TransferOptions(timeout_s=60, transport=transport))
    losses = []
    for seq_len in (3, 7, 5):
        x = torch.randn(4, seq_len, 4, generator=torch.Generator().manual_seed(seq_len))
        losses.append(pipe.step(x, target=torch.zeros(4)))
    return losses, [p.grad.clone() for p in pipe.parameters()]


@pytest.mark.parametrize(("name", "virtual", "transport"), [
    ("1f1b", 1, "auto"), ("zbv", 2, "auto"), ("zb-h1", 1, "auto"), ("dualpipev", 2, "auto"),
    ("zbv", 2, "process_group"), ("dualpipev", 2, "process_group"),
])
def test_sequence_length_may_change_between_steps(name, virtual, transport):
    if name not in cs.available():
        pytest.fail(f"built-in schedule {name} is missing")
    results = run_ranks(_variable_length, 2, args=(name, virtual, transport), timeout_s=60)
    torch.manual_seed(0)
    schedule = cs.build(name, ranks=2, microbatches=2, virtual=virtual)
    model = torch.nn.Sequential(*[_VariableLength(s == schedule.num_stages - 1) for s in range(schedule.num_stages)])
    want = []
    for seq_len in (3, 7, 5):
        x = torch.randn(4, seq_len, 4, generator=torch.Generator().manual_seed(seq_len))
        total = None
        for xi in torch.tensor_split(x, 2):
            loss = (model(xi) - torch.zeros(2)).pow(2).mean() / 2
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        want.append(total)
    for rank, (losses, grads) in enumerate(results):
        assert len(losses) == len(want) and all(torch.equal(g, w) for g, w in zip(losses, want)), rank
        # The gradients of the three steps, accumulated (no optimizer): each rank's stages in order.
        want_grads = [p.grad for s in schedule.stages_of(rank) for p in model[s].parameters()]
        assert len(grads) == len(want_grads) == 2 * len(schedule.stages_of(rank)), (rank, len(grads))
        unequal = [i for i, (g, w) in enumerate(zip(grads, want_grads)) if not torch.equal(g, w)]
        assert unequal == [], f"rank {rank}: gradients {unequal} (weight, bias per stage) differ from one device's"


def _mismatch(rank, world_size, transport):
    schedule = cs.build("1f1b", ranks=2, microbatches=2)
    module = torch.nn.Linear(4, 4) if rank == 0 else torch.nn.Linear(4, 1)
    pipe = conveyor.Pipeline([module], schedule=schedule, loss_fn=lambda y, t: y.sum(),
                             transfer=conveyor.TransferOptions(timeout_s=30, fixed_shapes=True, transport=transport))
    pipe.step(torch.ones(2, 4))
    pipe.step(torch.ones(4, 4))  # microbatches of 2 rows, not 1: breaks the promise


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fixed_shapes_violation_names_rank_stage_microbatch_and_tensor(transport):
    with pytest.raises(RankFailure) as info:
        run_ranks(_mismatch, 2, args=(transport,), timeout_s=60)
    text = str(info.value)
    assert "rank 0, stage 0, microbatch 0" in text
    assert "(2, 4) float32" in text and "(1, 4) float32" in text
    assert "SpecMismatchError" in text


def _mismatch_after_an_evaluation(rank, world_size, transport):
    schedule = cs.build("1f1b", ranks=2, microbatches=2)
    module = torch.nn.Linear(4, 4) if rank == 0 else torch.nn.Linear(4, 1)
    pipe = conveyor.Pipeline([module], schedule=schedule, loss_fn=lambda y, t: y.sum(),
                             transfer=conveyor.TransferOptions(timeout_s=30, fixed_shapes=True, transport=transport))
    pipe.forward(torch.ones(2, 4))  # an evaluation first: its channels are not the training ones
    pipe.step(torch.ones(2, 4))
    pipe.step(torch.ones(4, 4))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fixed_shapes_hold_when_an_evaluation_comes_before_the_first_step(transport):
    with pytest.raises(RankFailure) as info:
        run_ranks(_mismatch_after_an_evaluation, 2, args=(transport,), timeout_s=60)
    assert "SpecMismatchError" in str(info.value) and "(2, 4) float32" in str(info.value)


class _Boom(torch.nn.Module):
    def forward(self, x):
        raise ValueError("boom inside stage 2")


def _pipeline_with_a_failing_stage(rank, world_size, transport):
    schedule = cs.build("1f1b", ranks=world_size, microbatches=4)
    module = _Boom() if rank == 2 else torch.nn.Linear(4, 4)
    return conveyor.Pipeline([module], schedule=schedule, loss_fn=lambda y, t: y.sum(),
                             transfer=conveyor.TransferOptions(timeout_s=120, transport=transport))


def _raise_uncaught(rank, world_size, transport):
    _pipeline_with_a_failing_stage(rank, world_size, transport).step(torch.ones(4, 4))


def _raise_in_stage(rank, world_size, transport):
    pipe = _pipeline_with_a_failing_stage(rank, world_size, transport)
    try:
        pipe.step(torch.ones(4, 4))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_exception_in_one_rank_stops_every_rank_with_its_message(transport):
    # run_ranks gives up after 60 s, before the 120 s receive timeout: a RankFailure carrying the
    # stage's error (not a RankTimeout) shows every rank stopped on its failure, not on a timeout.
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_uncaught, 4, args=(transport,), timeout_s=60)
    text = str(info.value)
    assert "boom inside stage 2" in text and "rank 2, stage 2, microbatch 0" in text
    assert "CommTimeout" not in text


def _peer_messages(rank, world_size, transport):
    # Each rank catches its own error so the test can read what every rank saw.
    return _raise_in_stage(rank, world_size, transport)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_peers_report_the_failing_ranks_message_not_a_bare_connection_error(transport):
    results = run_ranks(_peer_messages, 4, args=(transport,), timeout_s=60)
    messages = results
    assert "StageExecutionError" in messages[2] and "boom inside stage 2" in messages[2]
    for rank in (0, 1, 3):
        assert "PeerFailure" in messages[rank], messages[rank]
        assert "rank 2 failed" in messages[rank] and "boom inside stage 2" in messages[rank]
        # PeerFailure, not CommTimeout: each peer stopped on rank 2's message, not at the 120 s timeout.


def _failing_rank_lingers(rank, world_size, transport):
    """Rank 2 catches its own failure and lives on, holding the exception, until every peer has reported."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    pipe = _pipeline_with_a_failing_stage(rank, world_size, transport)
    try:
        pipe.step(torch.ones(4, 4))
    except Exception as exc:
        if rank == 2:
            held = exc  # as a script's `except` block would, while it logs and cleans up
            store.wait([f"reported {peer}" for peer in (0, 1, 3)], datetime.timedelta(seconds=60))
            try:
                pipe.step(torch.ones(4, 4))
            except Exception as again:
                store.set("done", "1")
                return f"{type(held).__name__}: {held}", f"{type(again).__name__}: {again}", dist.is_initialized()
        store.set(f"reported {rank}", "1")
        store.wait(["done"], datetime.timedelta(seconds=60))
        # Rank 0 serves the store: it leaves last, or a peer still reading the answer to its
        # wait loses the connection ("Failed to recv, got 0 bytes").
        if rank == 0:
            store.wait(["left 1", "left 3"], datetime.timedelta(seconds=60))
        else:
            store.set(f"left {rank}", "1")
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_peers_stop_fast_while_the_failing_rank_lives_on(transport):
    """Its connections close at once, not when its process ends: peers do not wait out timeout_s (120 s)."""
    results = run_ranks(_failing_rank_lingers, 4, args=(transport,), timeout_s=90)
    held, again, initialized = results[2]
    assert "boom inside stage 2" in held
    assert again.startswith("PipelineStopped") and "boom inside stage 2" in again, again
    assert initialized  # the pipeline closed its own groups; the user's default group is untouched
    for rank in (0, 1, 3):
        # Each peer reported while rank 2 was still alive (rank 2 waited for every report before it went
        # on), with rank 2's message rather than a CommTimeout: its connections closed as it raised.
        message = results[rank]
        assert "PeerFailure" in message and "rank 2 failed" in message and "boom inside stage 2" in message


def _silent_peer(rank, world_size, transport):
    schedule = cs.build("1f1b", ranks=2, microbatches=2)
    pipe = conveyor.Pipeline([torch.nn.Linear(4, 4)], schedule=schedule, loss_fn=lambda y, t: y.sum(),
                             transfer=conveyor.TransferOptions(timeout_s=2, transport=transport))

    def step() -> str:
        try:
            pipe.step(torch.ones(2, 4))
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    # Rank 1 never joins the step: alive and silent until rank 0 has its answer, not a fixed time past the timeout.
    answer = silent_until_answered(rank, "silent peer", step)
    return answer if rank == 0 else "slept"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_receive_that_never_comes_times_out_naming_rank_stage_microbatch_action_and_peer(transport):
    results = run_ranks(_silent_peer, 2, args=(transport,), timeout_s=60)
    message = results[0]
    assert message.startswith("CommTimeout"), message
    assert "rank 0 waited 2 s" in message and "from rank 1" in message
    assert "stage 0, microbatch 0" in message and "0RECV_B0" in message


def _bad_setup(rank, world_size, case):
    schedule = cs.build("1f1b", ranks=world_size, microbatches=2)
    try:
        if case == "world":
            conveyor.Pipeline([torch.nn.Linear(2, 2)], schedule=cs.build("1f1b", ranks=3, microbatches=2))
        elif case == "modules":
            conveyor.Pipeline([torch.nn.Linear(2, 2)] * 2, schedule=schedule)
        elif case == "loss":
            pipe = conveyor.Pipeline([torch.nn.Linear(2, 2)], schedule=schedule, loss_fn=lambda y, t: y,
                                     transfer=conveyor.TransferOptions(timeout_s=20))
            pipe.step(torch.ones(2, 2) if rank == 0 else None)
        elif case == "inputs":
            pipe = conveyor.Pipeline([torch.nn.Linear(2, 2)], schedule=schedule, loss_fn=lambda y, t: y.sum(),
                                     transfer=conveyor.TransferOptions(timeout_s=20))
            pipe.step(None)
        elif case == "batch":
            pipe = conveyor.Pipeline([torch.nn.Linear(2, 2)], schedule=schedule, loss_fn=lambda y, t: y.sum(),
                                     transfer=conveyor.TransferOptions(timeout_s=20))
            pipe.step(torch.ones(3, 2))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize(("case", "rank", "expected"), [
    ("world", 0, "has 3 ranks but the process group has 2"),
    ("modules", 1, "places stages [1] on rank 1, so pass 1 module(s) in that order; got 2"),
    ("loss", 1, "loss_fn must return a scalar tensor; it returned a tensor of shape (1, 2) on rank 1, stage 1, "
                "microbatch 0"),
    ("inputs", 0, "inputs are missing on the rank that runs stage 0"),
    ("batch", 0, "batch size 3 on dim 0, which 2 microbatches do not divide"),
])
def test_bad_setup_gets_a_clear_error(case, rank, expected):
    results = run_ranks(_bad_setup, 2, args=(case,), timeout_s=60)
    assert expected in results[rank], results[rank]


class _DataDependentWidth(torch.nn.Module):
    """Stage 0 keeps a number of columns read from the data, so shapes change per microbatch."""

    def __init__(self, first: bool):
        super().__init__()
        self.first = first
        self.scale = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x, keep=None):
        if self.first:
            keep = int(x[0, 0].abs().item() * 10) % 3 + 2
            return (x[:, :keep] * self.scale, keep)
        return (x * self.scale).sum(dim=1) / keep


def _data_dependent(rank, world_size):
    schedule = cs.build("1f1b", ranks=2, microbatches=4)
    pipe = conveyor.Pipeline([_DataDependentWidth(rank == 0)], schedule=schedule,
                             loss_fn=lambda y, t: (y - t).pow(2).mean(),
                             transfer=conveyor.TransferOptions(timeout_s=60))
    losses = []
    for step in range(4):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        losses.append(pipe.step(x, target=torch.zeros(8)))
    return losses, pipe.modules[0].scale.grad.clone()


def test_shapes_may_change_from_one_microbatch_to_the_next():
    results = run_ranks(_data_dependent, 2, timeout_s=60)
    first, second = _DataDependentWidth(True), _DataDependentWidth(False)
    want = []
    for step in range(4):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        total = None
        for xi in torch.tensor_split(x, 4):
            loss = (second(*first(xi)) - torch.zeros(2)).pow(2).mean() / 4
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        want.append(total)
    widths = {int(x[0, 0].abs().item() * 10) % 3 + 2 for step in range(4)
              for x in torch.tensor_split(torch.randn(8, 6, generator=torch.Generator().manual_seed(step)), 4)}
    assert len(widths) > 1  # the test really changes shapes between microbatches
    for losses, _ in results:
        assert len(losses) == len(want) and all(torch.equal(g, w) for g, w in zip(losses, want))
    assert torch.equal(results[0][1], first.scale.grad) and torch.equal(results[1][1], second.scale.grad)


def _given_shapes(rank, world_size, fixed_shapes, example_rows):
    torch.manual_seed(0)
    modules = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)]
    schedule = cs.build("1f1b", ranks=2, microbatches=4)
    pipe = conveyor.Pipeline([modules[rank]], schedule=schedule, loss_fn=lambda y, t: (y - t).pow(2).mean(),
                             transfer=conveyor.TransferOptions(
                                 timeout_s=30, fixed_shapes=fixed_shapes,
                                 shapes={0: torch.zeros(example_rows, 4, requires_grad=True)}))
    losses = []
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        losses.append(pipe.step(x, target=torch.zeros(8, 1)))
    evaluation = pipe.forward(torch.ones(8, 4))
    return losses, modules[rank].weight.grad.clone(), pipe.ranks.transport.structures_sent, evaluation


@pytest.mark.parametrize("fixed_shapes", [True, False])
def test_shapes_given_up_front_skip_every_exchange_and_stay_bitwise(fixed_shapes):
    results = run_ranks(_given_shapes, 2, args=(fixed_shapes, 2), timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    want = []
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        total = None
        for xi in torch.tensor_split(x, 4):
            loss = (model(xi) - torch.zeros(2, 1)).pow(2).mean() / 4
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        want.append(total)
    for rank, (losses, grad, structures_sent, _) in enumerate(results):
        assert all(torch.equal(g, w) for g, w in zip(losses, want))
        assert torch.equal(grad, model[rank].weight.grad)
        assert structures_sent == 0, f"rank {rank} sent {structures_sent} structures"
    with torch.no_grad():  # evaluation runs microbatch by microbatch, as a single-device loop would
        want_eval = torch.cat([model(x) for x in torch.tensor_split(torch.ones(8, 4), 4)])
    assert torch.equal(results[1][3], want_eval)


def test_a_wrong_shape_given_up_front_fails_on_the_first_step():
    with pytest.raises(RankFailure) as info:
        run_ranks(_given_shapes, 2, args=(True, 3), timeout_s=60)
    text = str(info.value)
    assert "rank 0, stage 0, microbatch 0" in text
    assert "is (2, 4) float32 (requires grad), but the receiver was told (3, 4) float32 (requires grad)" in text


def _bad_shapes_key(rank, world_size):
    schedule = cs.build("1f1b", ranks=2, microbatches=2)
    try:
        conveyor.Pipeline([torch.nn.Linear(2, 2)], schedule=schedule,
                          transfer=conveyor.TransferOptions(shapes={1: torch.zeros(1, 2)}))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_shapes_keyed_by_a_stage_whose_output_crosses_no_boundary_is_refused():
    results = run_ranks(_bad_shapes_key, 2, timeout_s=60)
    assert all("shapes= names stage 1, but only the outputs of stages 0..0 cross" in r for r in results)
