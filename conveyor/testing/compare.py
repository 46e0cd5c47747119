"""Comparing two computations in tests: NaN-propagating differences and bounds derived from the math.

Python's ``max`` drops a NaN unless it comes first (``max(0.0, nan)`` is ``0.0``), so a fold of
differences with ``max`` can report a NaN run as bitwise. Every fold here propagates a non-finite
value instead, and every comparison against a bound (``<=``) then fails on it.

- :func:`relative_difference`: ``max|got - want| / max|want|`` in float64; NaN when either side holds a
  NaN or an infinity.
- :func:`absolute_difference`: ``max|got - want|``, NaN likewise.
- :func:`worst`, :func:`worst_relative`, :func:`worst_absolute`: the largest of several; NaN if any is NaN.
- :func:`reordered_sum_bound`, :func:`logsumexp_bound`, :func:`adamw_difference_bound`: the bounds that tests
  comparing two *different* computations (tensor parallel against one device, a vocabulary-parallel loss
  against the gathered logits, AdamW after a rounding difference) derive, so that a bound holds on every
  CPU's kernels rather than on the one it was measured on.

Example:
    >>> import torch
    >>> worst_relative([(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))])
    0.0
    >>> worst([0.0, float("nan"), 1e-7])
    nan
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

# fp32's unit roundoff: one rounding of a real x gives x(1 + d) with |d| <= 2**-24.
FP32_UNIT_ROUNDOFF = 2.0**-24
# The probabilistic rounding bound (Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019, Theorem 3.1): a sum
# of n terms computed in any order is within LAMBDA * sqrt(n) * u * sum|terms| of the exact one with
# probability at least 1 - 2 exp(-LAMBDA**2 / 2); LAMBDA = 6 leaves 3e-8 per sum (the deterministic
# bound, n * u, is the same with sqrt(n) -> n and holds always, but overstates real rounding by sqrt(n)).
ROUNDING_LAMBDA = 6.0


def _as_doubles(got: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Both sides whole and in float64, or None when either holds a NaN or an infinity."""
    if got.shape != want.shape:
        raise ValueError(f"cannot compare a tensor of shape {tuple(got.shape)} with one of {tuple(want.shape)}: "
                         "pass the whole tensors (full_tensor() of a DTensor) of the same parameter")
    got, want = whole(got).detach().double(), whole(want).detach().double()
    if not (bool(torch.isfinite(got).all()) and bool(torch.isfinite(want).all())):
        return None
    return got, want


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want| / max|want|`` in float64 (0.0: bitwise); NaN if either side is not finite.

    Example:
        >>> relative_difference(torch.tensor([1.0, 4.0]), torch.tensor([1.0, 2.0]))
        1.0
        >>> relative_difference(torch.tensor([float("nan")]), torch.tensor([1.0]))
        nan
    """
    pair = _as_doubles(got, want)
    if pair is None:
        return math.nan
    got, want = pair
    if got.numel() == 0:
        return 0.0
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def absolute_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want|`` in float64 (0.0: bitwise); NaN if either side is not finite.

    Example:
        >>> absolute_difference(torch.tensor([1.0, 4.0]), torch.tensor([1.0, 2.0]))
        2.0
    """
    pair = _as_doubles(got, want)
    if pair is None:
        return math.nan
    got, want = pair
    return (got - want).abs().max().item() if got.numel() else 0.0


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value (a collective: every rank of its mesh compares the same tensors in turn)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def worst(values: Iterable[float]) -> float:
    """The largest of ``values``, NaN if any is NaN; an empty fold raises (it would check nothing).

    Example:
        >>> worst([1e-7, 3e-7])
        3e-07
        >>> worst([float("nan"), 1.0]), worst([1.0, float("nan")])
        (nan, nan)
    """
    found = None
    for value in values:
        value = float(value)
        if math.isnan(value):
            return math.nan
        found = value if found is None else max(found, value)
    if found is None:
        raise ValueError("worst() of no values: the comparison it folds compared nothing "
                         "(an empty parameter list or no steps), which would pass any check")
    return found


def worst_absolute(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The largest :func:`absolute_difference` over ``(got, want)`` pairs; NaN if any side holds a NaN.

    Example:
        >>> worst_absolute([(torch.ones(2), torch.ones(2)), (torch.zeros(1), torch.ones(1))])
        1.0
    """
    return worst(absolute_difference(got, want) for got, want in pairs)


def worst_relative(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The largest :func:`relative_difference` over ``(got, want)`` pairs; NaN if any side holds a NaN.

    Example:
        >>> worst_relative([(torch.ones(2), torch.ones(2)), (torch.zeros(1), torch.ones(1))])
        1.0
    """
    return worst(relative_difference(got, want) for got, want in pairs)


def reordered_sum_bound(num_terms: int, depth: int = 1, condition: float = 1.0) -> float:
    """How far two computations that sum the same ``num_terms`` fp32 terms in different orders may differ.

    Relative to the sum of the terms' magnitudes (``condition``: that sum over the largest result the
    test divides by), over ``depth`` such sums chained (layers: each one's error passes to the next
    at most once more); both computations round, hence the factor 2. Probabilistic, with the
    certainty :data:`ROUNDING_LAMBDA` gives.

    Example:
        >>> f"{reordered_sum_bound(96, depth=2):.2e}"
        '1.40e-05'
    """
    return 2 * depth * condition * ROUNDING_LAMBDA * math.sqrt(num_terms) * FP32_UNIT_ROUNDOFF


def logsumexp_bound(vocabulary: int, tokens: int, loss: float, microbatches: int = 1) -> float:
    """Relative bound on a mean cross-entropy computed once on whole logits and once shard by shard.

    Per token, logsumexp is ``m + log(sum_j exp(x_j - m))``; the terms are positive and at most 1, so
    summing them in another order (per shard, then across shards) moves the sum by at most
    ``2 (V - 1) u`` of itself (deterministic, Higham's gamma), and each ``exp`` (another kernel,
    another vector width: up to 1 ulp each, 2 between two) by ``2u`` more; ``log`` turns that
    relative error into an absolute one, plus the roundings of ``log``, ``+ m`` and ``- x_target``
    (``3u`` of a value below the loss's largest term, taken as ``8u`` with the mean's own). The mean
    over ``tokens`` positive losses then adds ``2 (tokens - 1) u`` relative, and the sum of
    ``microbatches`` such means ``2 (microbatches - 1) u``. Divided by the (positive) ``loss``, the
    result is relative.

    Example:
        >>> f"{logsumexp_bound(96, 22, 4.5):.2e}"
        '5.15e-06'
    """
    if not loss > 0:
        raise ValueError(f"a cross-entropy is positive; got {loss!r} (a NaN or a wrong loss)")
    per_token = (2 * (vocabulary - 1) + 2 + 8) * FP32_UNIT_ROUNDOFF
    return per_token / loss + 2 * (tokens - 1 + microbatches - 1) * FP32_UNIT_ROUNDOFF


def adam_direction_bound(steps: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """The largest ``|m_hat / sqrt(v_hat)|`` Adam can take in its first ``steps`` steps, any gradients.

    ``m_hat = sum_j a_j g_j`` and ``v_hat = sum_j b_j g_j**2`` (bias-corrected weights of the gradients
    so far); by Cauchy-Schwarz ``|m_hat| <= sqrt(sum a_j**2 / b_j) sqrt(v_hat)``, attained. So an
    element moves by at most ``lr`` times this per step (plus the decay of its own value), and two runs
    whose gradients differ by rounding can differ by twice that where a gradient is at rounding level.

    Example:
        >>> f"{adam_direction_bound(3):.4f}"
        '1.0036'
    """
    beta1, beta2 = betas
    worst_ratio = 0.0
    for step in range(1, steps + 1):
        first = [(1 - beta1) * beta1 ** (step - j) / (1 - beta1**step) for j in range(1, step + 1)]
        second = [(1 - beta2) * beta2 ** (step - j) / (1 - beta2**step) for j in range(1, step + 1)]
        worst_ratio = max(worst_ratio, math.sqrt(sum(a * a / b for a, b in zip(first, second, strict=True))))
    return worst_ratio


def adamw_difference_bound(lr: float, steps: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """How far one element may end up in two AdamW runs from the same start whose gradients differ, any way.

    Each step moves an element by ``lr`` times Adam's direction (at most :func:`adam_direction_bound`)
    plus the decoupled decay ``lr * weight_decay * p``, which shrinks a difference of the two ``p``
    rather than growing it. Where a gradient is at rounding level its sign and size are the rounding's,
    so two runs may move it in opposite directions: twice the direction's bound, summed over the
    steps. This holds for any two gradient sequences, so it catches a NaN, a wrong learning rate or a
    diverging run, not a rounding-sized error: a test compares the losses of the steps after the
    first as well, which carry the trajectory.

    Example:
        >>> f"{adamw_difference_bound(1e-2, 3):.4f}"
        '0.0601'
    """
    return 2 * lr * sum(adam_direction_bound(step, betas) for step in range(1, steps + 1))
