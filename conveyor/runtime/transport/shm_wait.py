"""Waiting over shared memory without burning a core: spin, then sleep on the doorbell.

A wait polls (spins) for a short while, then says it sleeps (a flag in each ring it reads) and
sleeps on its doorbell until a sender rings it. Every wait has the pipeline's timeout and
notices a failed peer within :data:`HEALTH_EVERY_S`: through the failure message the peer
writes into its rings, through the store, or because its process is gone (the transport's
``check_health``, which the :class:`Waiter` is given).

Example (what the transport's ``wait`` does when the message is not there yet)::

    waiter.wait_until(lambda: inbox.has(handle), src, "stage 2's input, microbatch 5")
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from conveyor.runtime.transport.shm_handshake import RingHandshake
from conveyor.runtime.transport.shm_ring import full_fence
from conveyor.runtime.transport.transport import receive_timeout

HEALTH_EVERY_S = 0.5  # how often a waiting rank looks whether its peers failed


class Waiter:
    """Every wait of one shared-memory transport, and how long it spins.

    ``poll`` takes in what arrived and moves waiting sends along; ``check_health(src, what)``
    raises if a peer failed. ``spin_s``: how long a wait polls before it sleeps (None: adapt, see
    :func:`_default_spin_s`; ``local_ranks`` are the processes of this pipeline on this host).
    ``last_wait_s``: how long the last receive that had to wait waited, which the spin reads.
    """

    def __init__(self, rank: int, rings: RingHandshake, timeout_s: float, spin_s: float | None, local_ranks: int,
                 poll: Callable[[], None], check_health: Callable[[int, str], None]) -> None:
        self.rank, self.rings, self.timeout_s = rank, rings, timeout_s
        self.poll, self.check_health = poll, check_health
        # An explicit spin (argument or CONVEYOR_SHM_SPIN_US) is kept as given; the default adapts.
        self.adaptive_spin = spin_s is None and not os.environ.get("CONVEYOR_SHM_SPIN_US")
        self.spin_s = _default_spin_s(local_ranks) if spin_s is None else spin_s
        self.last_wait_s = 0.0

    def next_spin_s(self) -> float:
        """How long the next wait polls before it sleeps."""
        if self.adaptive_spin and self.last_wait_s > self.spin_s:
            # The last receive waited longer than a spin (a peer busy for milliseconds); the
            # next likely will too: poll briefly, then leave the core to whoever computes.
            return min(self.spin_s, _SHORT_SPIN_S)
        return self.spin_s

    def wait_until(self, done: Callable[[], bool], src: int, what: str, *, receive: bool = True) -> None:
        """Return once ``done()``; raise CommTimeout past the timeout, PeerFailure when a peer failed."""
        clock = time.perf_counter
        start = clock()
        spin_until = start + self.next_spin_s()
        deadline = start + self.timeout_s
        next_health = start + HEALTH_EVERY_S
        try:
            while True:
                self.poll()
                if done():
                    return
                now = clock()
                if now < spin_until:
                    continue
                if now >= next_health:
                    self.check_health(src, what)
                    next_health = now + HEALTH_EVERY_S
                if now >= deadline:
                    raise receive_timeout(self.rank, self.timeout_s, what, src)
                # Say we sleep, then look once more: a sender that published before seeing the
                # flag is found by this look, one that publishes after sees the flag and rings.
                self.rings.say_asleep(1)
                full_fence()
                self.poll()
                if done():
                    self.rings.say_asleep(0)
                    return
                self.rings.sleep(min(next_health, deadline) - now)
                self.rings.say_asleep(0)
        finally:
            if receive:
                self.last_wait_s = clock() - start


_SHORT_SPIN_S = 50e-6


def _default_spin_s(num_ranks: int) -> float:
    """How long a waiting rank polls before it sleeps on its doorbell.

    Measured on a 2-core VM, each figure an A/B in the same processes:

    - every rank has a core (P=2): polling 1 ms instead of 50 µs took tiny-stage 1F1B
      (M=64) from 58-60 to 42-46 ms a step and ZBV from 182 to 138 ms; the receiver's
      core stays awake, so a message is seen when it lands, not after a wake-up. A
      small GPT and 5 ms emulated stages did not change;
    - more ranks than cores (P=4 on 2): 1 ms was no better and slightly worse than
      50 µs, since a poller takes the core from a rank with work to do.

    After a wait longer than this, the next wait polls 50 µs only (see :meth:`Waiter.next_spin_s`).

    ``CONVEYOR_SHM_SPIN_US`` overrides both.
    """
    override = os.environ.get("CONVEYOR_SHM_SPIN_US")
    if override:
        return float(override) / 1e6
    # Every process on this host counts (torchrun's LOCAL_WORLD_SIZE), not just this
    # pipeline's ranks: data-parallel replicas compete for the same cores.
    try:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE") or 0)
    except ValueError:
        local_world_size = 0
    local_processes = max(num_ranks, local_world_size)
    return 1e-3 if local_processes <= _usable_cpus() else _SHORT_SPIN_S


def _usable_cpus() -> float:
    """CPUs this process may run on: its affinity, capped by a cgroup v2 CPU quota if set."""
    try:
        cpus: float = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as limit:
            quota, period = limit.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, int(quota) / int(period))
    except (OSError, ValueError):
        pass
    return cpus
