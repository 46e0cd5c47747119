"""Random ops (dropout) in a pipeline: one random stream per (stage, microbatch).

Left alone, every rank draws from its own global generator in its schedule's order. Ranks
seeded alike (the usual ``torch.manual_seed(seed)`` on every rank, or no seed at all) then
draw the same numbers on every stage: the dropout masks of stage 3 repeat those of stage 0,
microbatch by microbatch, and nothing says so. One device draws fresh numbers for each layer.

So each step draws one number from the user's CPU generator (every rank draws the same when
they are seeded alike), and before each forward of stage ``s`` on microbatch ``m`` the
generators are seeded from (that number, s, m). Masks are then independent across stages
and microbatches, reproducible under ``torch.manual_seed``, and the same for every schedule
and placement of the same stages. After the step the generators are put back where the one
draw left them, so the user's own stream (data shuffling, ...) advances by one number per
step whatever the schedule. They are not the numbers a one-device loop would draw: that loop
draws stage after stage, microbatch after microbatch, which no pipeline can follow without
running one stage at a time. With dropout active, results are therefore not bitwise those of
one device (without random ops they are, and this changes nothing).

``torch.utils.checkpoint`` (``recompute=True``) saves and restores the generator
state around its recomputation, so the recomputed forward draws the same masks.

Example:
    >>> import torch
    >>> with StepRandomness() as streams:
    ...     streams.seed_for(stage=0, microbatch=0)
    ...     a = torch.rand(2)
    ...     streams.seed_for(stage=1, microbatch=0)
    ...     b = torch.rand(2)
    >>> bool((a != b).all())
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

_MASK64 = (1 << 64) - 1


def stream_seed(base: int, stage: int, microbatch: int) -> int:
    """A 63-bit seed for (stage, microbatch) of a step: splitmix64 over the three numbers."""
    z = (base + 0x9E3779B97F4A7C15 * (1 + (stage << 24) + microbatch)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class StepRandomness:
    """One step's random streams; a context manager that restores the generators on exit."""

    def __init__(self) -> None:
        self.base = 0
        self._cpu_state: torch.Tensor | None = None
        self._cuda_states: list[torch.Tensor] | None = None  # None: CUDA's generators are left alone

    def __enter__(self) -> StepRandomness:
        self.base = int(torch.randint(0, 2**62, (1,)).item())  # one draw from the user's stream
        self._cpu_state = torch.get_rng_state()
        # torch.manual_seed costs ~0.3 ms (it queues every device's seeding); the generators
        # themselves take microseconds. CUDA generators count only once CUDA is in use.
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self._cuda_states = torch.cuda.get_rng_state_all() if cuda else None
        return self

    def seed_for(self, stage: int, microbatch: int) -> None:
        """Seed the generators for the forward of ``stage`` on ``microbatch``."""
        seed = stream_seed(self.base, stage, microbatch)
        torch.default_generator.manual_seed(seed)
        if self._cuda_states is not None:
            for generator in torch.cuda.default_generators:
                generator.manual_seed(seed)

    def __exit__(self, *exc_info) -> None:
        torch.set_rng_state(self._cpu_state)
        if self._cuda_states is not None:
            torch.cuda.set_rng_state_all(self._cuda_states)


@contextlib.contextmanager
def step_random_streams(runners: Iterable, enabled: bool = True) -> Iterator[None]:
    """One step's random streams for every stage runner of this process (a no-op when not ``enabled``).

    Example:
        >>> with step_random_streams([], enabled=True):
        ...     pass
    """
    if not enabled:
        yield
        return
    runners = list(runners)
    with StepRandomness() as streams:
        for runner in runners:
            runner.randomness = streams
        try:
            yield
        finally:
            for runner in runners:
                runner.randomness = None
