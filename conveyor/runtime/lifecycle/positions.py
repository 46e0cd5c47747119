"""Where is every rank? Each rank says where it stands in its program, on request, through the store.

A hang reads at a glance only when every rank's position is on one picture. The data plane
cannot carry that (it is what hangs), so the request and the answers go through the process
group's store: a rank whose receive timed out asks, and each rank's watcher thread (which
runs whatever the rank's main thread is blocked in) answers with its executor's position:
the program it runs, the index of the action it is at and that action (a RECV: it waits). A
rank that does not answer within a few seconds is shown as such (its process is gone, or
its watcher cannot reach the store).

The same picture on request for a running job: when the file named by
``CONVEYOR_WHERE_TRIGGER`` appears, rank 0 of each pipeline asks, logs the picture and writes
it next to the trigger (``<trigger>.txt``), then removes the trigger.

Example (what :class:`~conveyor.runtime.lifecycle.rank.RankLifecycle` sets up)::

    board = PositionBoard(store, "conveyor/where/<group name>", rank, num_ranks, executor.position)
    board.start()
    positions = board.ask()          # one dict per rank, None where no answer came
    board.stop()
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

TRIGGER_ENV = "CONVEYOR_WHERE_TRIGGER"
# A counter each rank's watcher bumps every poll: a peer whose count stops moving has died or
# frozen, which a rank on another host can tell when it cannot look at the peer's process.
HEARTBEAT_KEY = "conveyor/heartbeat/{global_rank}"


def stored(store, key: str) -> bytes | None:
    """The store's value at ``key``: None where it has none, or where the store is gone (with rank 0's process)."""
    try:
        return store.get(key) if store.check([key]) else None
    except Exception:
        return None


class PositionBoard:
    """This rank's side of "where is everyone": answering requests, and asking."""

    def __init__(self, store, prefix: str, rank: int, num_ranks: int, position: Callable[[], dict[str, Any]],
                 *, render: Callable[[list[dict[str, Any] | None]], str] | None = None,
                 poll_s: float = 0.5, global_rank: int | None = None,
                 on_poll: Callable[[], None] | None = None) -> None:
        self.store = store
        self.heartbeat_key = HEARTBEAT_KEY.format(global_rank=rank if global_rank is None else global_rank)
        self.prefix = prefix
        self.rank = rank
        self.num_ranks = num_ranks
        self.position = position
        self.render = render
        self.poll_s = poll_s
        self.on_poll = on_poll  # also run by the watcher each poll (the lifecycle's failure watch)
        self.answered = 0
        self._poll_failed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name=f"conveyor-where-{self.rank}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10 * self.poll_s)
        self._thread = None

    def ask(self, wait_s: float = 3.0) -> list[dict[str, Any] | None]:
        """Every rank's position (None where no answer came within ``wait_s``)."""
        request = self.store.add(f"{self.prefix}/request", 1)
        self._answer(request)
        keys = [self._answer_key(request, rank) for rank in range(self.num_ranks)]
        with contextlib.suppress(Exception):  # whoever has not answered by then is shown as silent
            self.store.wait(keys, datetime.timedelta(seconds=wait_s))
        answers = [stored(self.store, key) for key in keys]
        return [None if answer is None else json.loads(answer) for answer in answers]

    def picture(self, wait_s: float = 3.0) -> str:
        """The rendered positions of every rank ('' when the store cannot be reached)."""
        try:
            positions = self.ask(wait_s)
        except Exception as exc:  # the store went with rank 0's process
            log.debug("where is everyone: %s", exc)
            return ""
        return self.render(positions) if self.render is not None else json.dumps(positions)

    # --- the watcher thread --------------------------------------------------------------------
    def _watch(self) -> None:
        trigger = os.environ.get(TRIGGER_ENV) if self.rank == 0 else None
        with contextlib.suppress(Exception):
            self.store.add(self.heartbeat_key, 1)  # at once: a peer may look before the first poll
        while not self._stop.wait(self.poll_s):
            try:
                try:
                    self.store.add(self.heartbeat_key, 1)
                finally:
                    self._poll()  # beat or no beat: the failure watch still looks
                request = self.store.add(f"{self.prefix}/request", 0)
                if request > self.answered:
                    self._answer(request)
                if trigger and os.path.exists(trigger):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(trigger)
                    text = self.picture()
                    log.warning("conveyor: where is everyone (on request)\n%s", text)
                    with open(f"{trigger}.txt", "w") as out:
                        out.write(text + "\n")
            except Exception as exc:  # the store is gone (its process died): say so once, then stop
                log.debug("where is everyone: watcher stops: %s", exc)
                return

    def _poll(self) -> None:
        """Run ``on_poll``; what it raises is logged, and the next poll runs it again."""
        if self.on_poll is not None:
            try:
                self.on_poll()
            except Exception:  # said once at warning level: it runs every poll
                log.log(logging.DEBUG if self._poll_failed else logging.WARNING,
                        "conveyor: the watcher's poll failed", exc_info=True)
                self._poll_failed = True

    def _answer(self, request: int) -> None:
        self.answered = max(self.answered, request)
        answer = dict(self.position(), time=time.time())
        self.store.set(self._answer_key(request, self.rank), json.dumps(answer))

    def _answer_key(self, request: int, rank: int) -> str:
        return f"{self.prefix}/answer/{request}/{rank}"
