"""The folds that tests compare two computations with see a NaN wherever it is, and the derived bounds hold.

Every fold is fed a NaN as a parameter, a loss and a gradient, in the first place and in a later one,
and the check that reads it (``<= bound`` or ``== 0.0``) must fail: Python's ``max`` would keep
only a NaN that comes first.
"""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.testing.compare import (
    FP32_UNIT_ROUNDOFF,
    adam_direction_bound,
    logsumexp_bound,
    relative_difference,
    reordered_sum_bound,
    worst,
    worst_relative,
)
from conveyor.testing.references.data_parallel import _worst

BOUND = 1e-5
NAN, INF = float("nan"), float("inf")


def _fails(measured: float) -> bool:
    """Whether both ways the tests read a difference reject it."""
    return not (measured <= BOUND) and measured != 0.0


def _tensors(count: int, poisoned: int | None, value: float = NAN, numel: int = 6) -> list[torch.Tensor]:
    tensors = [torch.linspace(-1.0, 1.0, numel) + index for index in range(count)]
    if poisoned is not None:
        tensors[poisoned] = tensors[poisoned].clone()
        tensors[poisoned][numel // 2] = value
    return tensors


@pytest.mark.parametrize("position", [0, 1, 3])
@pytest.mark.parametrize("side", ["got", "want"])
@pytest.mark.parametrize("value", [NAN, INF])
def test_worst_relative_sees_a_non_finite_value_anywhere(position, side, value):
    clean = _tensors(4, None)
    poisoned = _tensors(4, position, value)
    pairs = list(zip(poisoned, clean, strict=True)) if side == "got" else list(zip(clean, poisoned, strict=True))
    assert worst_relative(list(zip(clean, clean, strict=True))) == 0.0
    assert _fails(worst_relative(pairs))
    assert _fails(worst_relative(iter(pairs)))  # a generator, as the supports pass them


def test_relative_difference_is_nan_where_both_sides_hold_the_same_nan():
    # torch.equal is False for NaNs too; a difference of 0 would read as bitwise.
    both = torch.tensor([1.0, NAN])
    assert math.isnan(relative_difference(both, both.clone()))
    assert relative_difference(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 + 2.0**-22])) > 0


def test_relative_difference_refuses_tensors_of_different_shapes():
    with pytest.raises(ValueError, match=r"shape \(2,\) with one of \(3,\)"):
        relative_difference(torch.zeros(2), torch.zeros(3))


@pytest.mark.parametrize("values", [[NAN, 1e-7, 2e-7], [1e-7, NAN, 2e-7], [1e-7, 2e-7, NAN], [0.0, NAN]])
def test_worst_keeps_a_nan_in_any_place(values):
    assert math.isnan(worst(values)) and _fails(worst(values))


def test_worst_of_nothing_raises_rather_than_passing():
    with pytest.raises(ValueError, match="compared nothing"):
        worst([])
    with pytest.raises(ValueError, match="compared nothing"):
        worst_relative([])


def _replica_results(poison: str | None, position: int) -> tuple[list, tuple]:
    """What :func:`conveyor.testing.references.data_parallel._worst` reads: per rank (losses, norms, params, _)."""
    losses, norms = [torch.tensor(2.5), torch.tensor(2.25), torch.tensor(2.0)], [torch.tensor(1.5)] * 3
    params = {0: {"w": torch.ones(3), "b": torch.zeros(2) + 0.5}, 1: {"head": torch.full((2, 2), 0.25)}}
    want = ([t.clone() for t in losses], [t.clone() for t in norms],
            {s: {n: v.clone() for n, v in named.items()} for s, named in params.items()})
    ranks = []
    for rank in range(2):
        mine = ([t.clone() for t in losses], [t.clone() for t in norms],
                {s: {n: v.clone() for n, v in named.items()} for s, named in params.items()}, None)
        if rank == 1 and poison == "loss":
            mine[0][position] = torch.tensor(NAN)
        elif rank == 1 and poison == "norm":
            mine[1][position] = torch.tensor(NAN)
        elif rank == 1 and poison == "param":
            name = ["w", "b"][position % 2]
            mine[2][0][name] = mine[2][0][name].clone()
            mine[2][0][name][-1] = NAN
        ranks.append(mine)
    return ranks, want


@pytest.mark.parametrize("poison", ["loss", "norm", "param"])
@pytest.mark.parametrize("position", [0, 2])
def test_the_data_parallel_fold_reports_a_nan_replica_as_not_bitwise(poison, position):
    results, want = _replica_results(None, 0)
    assert _worst(results, *want) == 0.0
    results, want = _replica_results(poison, position)
    measured = _worst(results, *want)
    assert math.isnan(measured) and _fails(measured), measured


@pytest.mark.parametrize("kind", ["loss", "grads", "params"])
@pytest.mark.parametrize("position", [0, 2])
def test_a_support_result_with_a_nan_fails_its_bound(kind, position):
    # The shape of the TP/MoE/SP supports' result dicts: one fold per kind over named tensors.
    want = {f"layer{i}.{kind}": torch.randn(4, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)}
    got = {name: value.clone() for name, value in want.items()}
    assert worst_relative((got[n], want[n]) for n in want) == 0.0
    name = list(got)[position]
    got[name][1, 1] = NAN
    assert _fails(worst_relative((got[n], want[n]) for n in want))


def test_a_vocabulary_parallel_cross_entropy_stays_within_its_derived_bound():
    # The computation test_tensor_parallel_traced compares: the mean cross-entropy of whole logits
    # against torch's loss_parallel recipe done by hand on two vocabulary shards (max, then the sums of
    # exp per shard, added). 200 draws of a 22-token, 96-word step, logits at init-like scale and 10x.
    vocabulary, tokens = 96, 22
    differences, bound = [], math.inf
    for seed in range(200):
        generator = torch.Generator().manual_seed(seed)
        logits = torch.randn(tokens, vocabulary, generator=generator) * (1.0 if seed % 2 else 10.0)
        target = torch.randint(vocabulary, (tokens,), generator=generator)
        whole = torch.nn.functional.cross_entropy(logits, target)
        shards = logits.chunk(2, dim=1)
        top = torch.stack([s.max(dim=1).values for s in shards]).max(dim=0).values
        sums = sum((s - top[:, None]).exp().sum(dim=1) for s in shards)
        picked = logits.gather(1, target[:, None]).squeeze(1)
        sharded = (top + sums.log() - picked).mean()
        differences.append(relative_difference(sharded, whole))
        bound = min(bound, logsumexp_bound(vocabulary, tokens, whole.item()))
    worst_seen = worst(differences)  # NaN-propagating: max(0.0, nan) would read a NaN loss as equal
    assert 0.0 <= worst_seen <= bound, (worst_seen, bound)


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_adam_moves_an_element_by_at_most_its_derived_direction_bound(steps):
    # lr=1, no decay, from 0: each step's move is Adam's direction m_hat / (sqrt(v_hat) + eps). Gradients
    # of every size and sign, and the sequence that attains the bound (Cauchy-Schwarz: g_j ~ a_j / b_j).
    generator = torch.Generator().manual_seed(steps)
    grads = torch.randn(steps, 4096, generator=generator) * torch.logspace(-6, 2, 4096)
    bound = adam_direction_bound(steps)
    first = [0.1 * 0.9 ** (steps - j) / (1 - 0.9**steps) for j in range(1, steps + 1)]
    second = [0.001 * 0.999 ** (steps - j) / (1 - 0.999**steps) for j in range(1, steps + 1)]
    grads[:, 0] = torch.tensor([a / b for a, b in zip(first, second, strict=True)])
    parameter = torch.zeros(4096, requires_grad=True)
    optimizer = torch.optim.AdamW([parameter], lr=1.0, weight_decay=0.0)
    for step in range(steps):
        before = parameter.detach().clone()
        parameter.grad = grads[step].clone()
        optimizer.step()
        moved = (parameter.detach() - before).abs().max().item()
        assert moved <= bound * (1 + 4 * FP32_UNIT_ROUNDOFF), (step, moved, bound)
    assert (parameter.detach()[0] - before[0]).abs().item() == pytest.approx(bound, rel=1e-5)


def test_the_rounding_bound_grows_as_sqrt_n_and_holds_for_a_reordered_fp32_sum():
    assert reordered_sum_bound(400) == pytest.approx(2 * reordered_sum_bound(100))
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        terms = torch.randn(96, generator=generator)
        forward, backward = terms.sum(), terms.flip(0).sum()  # another kernel order: pairwise vs reversed
        halves = terms[:48].sum() + terms[48:].sum()  # what a 2-way split then all-reduce computes
        magnitude = terms.abs().sum().item()
        for other in (backward, halves):
            assert abs((other - forward).item()) <= reordered_sum_bound(96) * magnitude
