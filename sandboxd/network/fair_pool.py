"""Worker threads shared by many owners, fairly: the blocking work of an event loop
(network.event_loop ``offload``) when its owners do not trust each other.

Every session's egress proxy runs on the process's one relay loop, and its blocking work (a DNS
lookup, up to dns.TIMEOUT_SECONDS per resolver; a leaf certificate; an event written to the
store) goes to a few threads. In one FIFO pool a sandbox that asks for names its own DNS never
answers fills every thread and the queue behind them, and no other session gets a name resolved
for minutes. Here each owner (a proxy, a session's CA) has its own queue:

- an owner has at most ``per_owner`` jobs running at once, so with fewer than ``workers / per_owner``
  owners busy there is always a free thread for another;
- the threads take the owners with waiting work in turn (round robin, one job each), so a long
  queue of one owner waits behind everybody else's next job, not the other way round;
- an owner with ``max_queued`` jobs waiting has its next one refused (``submit`` returns None):
  its own work, never another's. Owner ``None`` (work nobody in particular asked for) is capped by
  the pool's size only.

Threads are made on demand up to ``workers``, and are daemon threads: one stuck in a lookup that
never returns does not hold up the process's exit.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Hashable, TypeVar

__all__ = ["FairPool"]

T = TypeVar("T")


class FairPool:
    def __init__(self, name: str, workers: int, *, per_owner: int, max_queued: int) -> None:
        self.name, self.workers, self.per_owner, self.max_queued = name, workers, per_owner, max_queued
        self._cond = threading.Condition()
        self._queues: dict[Hashable | None, deque[tuple[Future[Any], Callable[[], Any]]]] = {}
        self._running: dict[Hashable | None, int] = {}
        self._turns: deque[Hashable | None] = deque()    # owners with waiting work and room, each once
        self._in_turns: set[Hashable | None] = set()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._stopping = False

    def submit(self, owner: Hashable | None, work: Callable[[], T]) -> "Future[T] | None":
        """Run ``work`` on a worker thread in ``owner``'s turn; its Future. None when ``owner``
        already has ``max_queued`` jobs waiting, or the pool is shut down: nothing will run."""
        future: Future[T] = Future()
        with self._cond:
            queue = self._queues.get(owner)
            if self._stopping or (owner is not None and queue is not None and len(queue) >= self.max_queued):
                return None
            if queue is None:
                queue = self._queues[owner] = deque()
            queue.append((future, work))
            self._offer(owner)
            if self._idle == 0 and len(self._threads) < self.workers:
                thread = threading.Thread(target=self._serve, name=f"{self.name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        return future

    def load(self, owner: Hashable | None) -> tuple[int, int]:
        """``owner``'s jobs running and waiting now."""
        with self._cond:
            return self._running.get(owner, 0), len(self._queues.get(owner, ()))

    def shutdown(self) -> None:
        """Run what is waiting, then end the threads (waits for them)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join()

    # -- under the lock ------------------------------------------------------------------------

    def _has_room(self, owner: Hashable | None) -> bool:
        return owner is None or self._running.get(owner, 0) < self.per_owner

    def _offer(self, owner: Hashable | None) -> None:
        """Give ``owner`` a turn if it has work waiting and room to run it (and has no turn yet)."""
        if self._queues.get(owner) and self._has_room(owner) and owner not in self._in_turns:
            self._turns.append(owner)
            self._in_turns.add(owner)
            self._cond.notify()

    def _forget_if_done(self, owner: Hashable | None) -> None:
        if not self._queues.get(owner) and not self._running.get(owner):
            self._queues.pop(owner, None)
            self._running.pop(owner, None)

    # -- the workers ---------------------------------------------------------------------------

    def _serve(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while not self._turns and not self._stopping:
                    self._idle += 1
                    cond.wait()
                    self._idle -= 1
                if not self._turns:
                    return                              # stopping, and nothing left that may run
                owner = self._turns.popleft()
                self._in_turns.discard(owner)
                future, work = self._queues[owner].popleft()
                self._running[owner] = self._running.get(owner, 0) + 1
                self._offer(owner)                      # its next job goes to the back of the line
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(work())
                except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                    future.set_exception(exc)
            with cond:
                self._running[owner] -= 1
                self._offer(owner)
                self._forget_if_done(owner)
