"""Under NCCL, the watch for a failure that no wait of the host would notice.

NCCL waits are the GPU streams': a rank waiting for a peer that failed blocks in a kernel until
the communicator is aborted. So the rank's watcher thread (the one that answers "where is
everyone", :mod:`conveyor.runtime.lifecycle.positions`) asks the :class:`FailureWatch` each poll,
which aborts every communicator of the pipeline together once the store names a failure, a
peer's process is gone or its heartbeat stopped, or a call (or the GPU work it queued) has run
longer than ``timeout_s``. What it saw becomes :attr:`FailureWatch.abort_error`, which the
waiting call raises. Under gloo the watch does nothing: a failed peer's closed sockets end the
waits.

Example (what :class:`~conveyor.runtime.lifecycle.rank.RankLifecycle` does)::

    watch = FailureWatch(rank, "nccl", timeout_s=300.0, peers=peers)
    watch.poll(groups.made)           # the watcher thread, each poll
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

from conveyor.errors import CommTimeout, ConveyorError
from conveyor.runtime.lifecycle.aborts import GroupAborter
from conveyor.runtime.lifecycle.peers import PeerHealth

log = logging.getLogger(__name__)


class FailureWatch:
    """What this rank's watcher found, and the calls it times (see the module docstring).

    ``abort_on_failure``: whether the watch acts (under NCCL). ``call_started``: when the running
    pipeline call began (monotonic), ``in_flight``: (began, its end's CUDA event) of each call
    whose GPU work may still run, oldest first. ``aborter`` aborts each group once, whether the
    watcher or a failing call gets there first.
    """

    def __init__(self, rank: int, backend: str, timeout_s: float, peers: PeerHealth) -> None:
        self.rank, self.timeout_s, self.peers = rank, timeout_s, peers
        self.abort_on_failure = backend == "nccl"
        self.aborted_because: str | None = None
        self.abort_error: ConveyorError | None = None
        self.aborter = GroupAborter(rank)
        self.call_started: float | None = None
        self.in_flight: collections.deque[tuple[float, Any]] = collections.deque()

    def poll(self, groups: list) -> None:
        """Abort ``groups`` (every group of the pipeline) once a peer failed or a call waited too long.

        A killed peer publishes nothing, and a rank waiting for it waits in a kernel that only
        an abort ends (else NCCL's watchdog ends the process).
        """
        if not self.abort_on_failure or self.abort_error is not None:
            return
        error = self.peers.verdict() or self.timeout_verdict()
        if error is None:
            return
        self.abort_error, self.aborted_because = error, str(error)
        log.warning("conveyor: rank %d aborts its communicators: %s", self.rank, error)
        self.aborter.abort(list(groups))

    def timeout_verdict(self) -> CommTimeout | None:
        """A pipeline call, or the GPU work it queued, running longer than timeout_s."""
        while self.in_flight and self.in_flight[0][1].query():  # the host returned, the kernels too
            self.in_flight.popleft()
        oldest = self.in_flight[0][0] if self.in_flight else None
        began = [b for b in (self.call_started, oldest) if b is not None]
        if not began or time.monotonic() - min(began) <= self.timeout_s:
            return None
        return CommTimeout(
            f"rank {self.rank}: a pipeline call has waited more than timeout_s={self.timeout_s:g} s for its "
            "peers (NCCL waits on the GPU's streams, so this rank's watcher aborted the pipeline's "
            "communicators); a peer is slow, stuck or running another schedule (raise timeout_s= if the "
            "step is legitimately that slow)"
        )
