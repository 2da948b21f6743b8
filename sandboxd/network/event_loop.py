"""The one event loop of sandboxd's network services: the front door (network.front_door) and the
TCP relays (network.tcp_relay: the egress proxy, published ports) each run an ``EventLoop``.

One thread, one epoll set of non-blocking descriptors, so an idle connection costs descriptors and
never a thread. It owns what both used to write by hand:

- *timers*: one heap, for "call this in N seconds" (``later``) and for objects with a moving
  ``deadline`` (``add_timed``: a relay idle too long, a connect that takes too long); the loop
  sleeps exactly until the next one is due;
- *work from other threads*: ``post``/``call`` through a wake-up pipe, and blocking work on worker
  threads made on first use (``offload``): name lookups in a pool of their own (``LOOKUP``), the
  rest (a leaf certificate, an event written) in another (``WORK``), so slow DNS never holds up
  the rest. Both are fair between owners (network.fair_pool: one session's proxy holds at most a
  few threads, and waits its turn behind the others);
- *accepting* (``Acceptor``): a burst per wake-up (fairness between listeners and connections),
  and when the process is out of descriptors (or its owner says there is no room) the listener
  leaves the epoll set for a back-off instead of spinning the loop;
- *a failing handler* is logged and closed; the loop goes on serving every other connection.

Everything registered with a loop is touched on its thread only.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import select
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Hashable, TypeVar

from sandboxd.kernel.addresses import SHORT_OF_RESOURCES
from sandboxd.network.fair_pool import FairPool

__all__ = ["LOOKUP", "READ", "WORK", "WRITE", "Acceptor", "EventLoop"]

READ, WRITE = select.EPOLLIN, select.EPOLLOUT
_HANGUP = select.EPOLLERR | select.EPOLLHUP
# Blocking work, per loop, on threads made on first use (offload). A name lookup may take
# dns.TIMEOUT_SECONDS per resolver, and a sandbox chooses the names: lookups have their own pool,
# and an owner (one session's proxy) runs at most LOOKUPS_PER_OWNER of them at once, so one owner
# holds a quarter of the pool at most. The other work (a leaf, an event) is short.
LOOKUP, WORK = "lookup", "work"
LOOKUP_WORKERS, LOOKUPS_PER_OWNER = 16, 4
WORKERS, WORK_PER_OWNER = 4, 2
MAX_QUEUED_PER_OWNER = 1024        # an owner's jobs waiting in one pool; past it, its next is refused
ACCEPT_BURST = 64                  # connections accepted per wake-up of a listener
# Accept errors that mean "the process (or system) is short of something": rest, do not spin.
# Any other (ECONNABORTED, EPROTO...) loses that one connection, not the listener.
ACCEPT_RESOURCE_ERRORS = SHORT_OF_RESOURCES

T = TypeVar("T")
log = logging.getLogger("sandboxd")


class _Timer:
    """Something the loop calls once ``deadline`` (time.monotonic) has passed."""

    __slots__ = ("deadline", "expire")

    def __init__(self, deadline: float, fire: Callable[[], None]) -> None:
        self.deadline, self.expire = deadline, fire


class EventLoop:
    """One thread serving an epoll set. ``on_stop`` runs on the loop's thread when it ends (or in
    ``stop``'s caller, if it never started), before the loop's own descriptors are closed."""

    def __init__(self, name: str, *, on_stop: Callable[[], None] | None = None) -> None:
        self.name = name
        self._on_stop = on_stop
        self._epoll = select.epoll()
        self._handlers: dict[int, Any] = {}             # fd -> object with on_ready(mask) and close()
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._epoll.register(self._wake_read, READ)
        self._posted: deque[Callable[[], None]] = deque()
        # The timers' heap: (deadline, number, item). An item is live while _timed maps it to its
        # entry's number; an entry whose number is not its item's any more is dropped when popped.
        self._heap: list[tuple[float, int, Any]] = []
        self._timed: dict[Any, int] = {}
        self._numbers = itertools.count()
        self._stopping = False
        self._released = False
        self._wake_lock = threading.Lock()              # post's write against _finish's close
        self._pools: dict[str, FairPool] = {}
        self._pool_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # -- for any thread ------------------------------------------------------------------------

    def start(self) -> "EventLoop":
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def post(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread, soon (dropped once the loop has ended: a worker's job
        finishing after ``close`` must not write to a descriptor number reused since)."""
        with self._wake_lock:
            if self._released:
                return
            self._posted.append(fn)
            try:
                os.write(self._wake_write, b"\0")
            except BlockingIOError:
                pass                                    # the pipe is full: the loop is awake anyway

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the loop thread and return its result (at once on the loop thread)."""
        if self.in_loop():
            return fn()
        done = threading.Event()
        results: list[T] = []
        failures: list[BaseException] = []

        def run() -> None:
            try:
                results.append(fn())
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller
                failures.append(exc)
            done.set()
        self.post(run)
        done.wait()
        if failures:
            raise failures[0]
        return results[0]

    def offload(self, work: Callable[[], T], then: "Callable[[Future[T]], None] | None" = None, *,
                owner: Hashable | None = None, lane: str = WORK) -> bool:
        """Run blocking ``work`` on a worker thread of ``lane`` (LOOKUP: a name lookup; WORK: the
        rest) in ``owner``'s turn, then ``then(future)`` on the loop thread. False (and nothing
        runs) when ``owner`` already has MAX_QUEUED_PER_OWNER jobs waiting there, or the loop is
        closed."""
        with self._pool_lock:
            pool = self._pools.get(lane)
            if pool is None:
                workers, per_owner = (LOOKUP_WORKERS, LOOKUPS_PER_OWNER) if lane == LOOKUP else (WORKERS, WORK_PER_OWNER)
                pool = self._pools[lane] = FairPool(f"{self.name}-{lane}", workers, per_owner=per_owner,
                                                    max_queued=MAX_QUEUED_PER_OWNER)
        future = pool.submit(owner, work)
        if future is None:
            return False
        if then is not None:
            future.add_done_callback(lambda f: self.post(lambda: then(f)))
        return True

    def load(self, owner: Hashable | None, lane: str = WORK) -> tuple[int, int]:
        """``owner``'s jobs in ``lane`` running and waiting now."""
        with self._pool_lock:
            pool = self._pools.get(lane)
        return pool.load(owner) if pool is not None else (0, 0)

    def stop(self, timeout: float | None = None) -> bool:
        """End the loop (``on_stop`` runs, then its descriptors close). False if its thread did not
        end within ``timeout`` (a handler that blocks); from the loop's own thread it ends once the
        current handler returns."""
        thread = self._thread
        if thread is None:
            self._stopping = True
            self._finish()
            return True
        self.post(self._set_stopping)
        if thread is threading.current_thread():
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def close(self) -> None:
        """Stop the loop thread and wait for the workers. What is still registered is not closed."""
        self.stop()
        with self._pool_lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown()

    # -- for the loop thread -------------------------------------------------------------------

    def watch(self, target: "socket.socket | int", old: int, new: int, handler: Any) -> None:
        """Change what ``target`` (a socket or descriptor) is watched for, from ``old`` to ``new``
        events (0: not in the set at all, so a hang-up it cannot act on yet does not spin the loop);
        ``handler.on_ready(mask)`` is called when they come."""
        if old == new:
            return
        fd = target if isinstance(target, int) else target.fileno()
        if not old:
            self._epoll.register(fd, new)
            self._handlers[fd] = handler
        elif not new:
            self._epoll.unregister(fd)
            del self._handlers[fd]
        else:
            self._epoll.modify(fd, new)
            self._handlers[fd] = handler

    def add_timed(self, item: Any) -> None:
        """Call ``item.expire()`` once ``item.deadline`` has passed (the deadline may move later
        meanwhile: it is read again when due)."""
        number = next(self._numbers)
        self._timed[item] = number
        heapq.heappush(self._heap, (item.deadline, number, item))

    def discard_timed(self, item: Any) -> None:
        self._timed.pop(item, None)

    def later(self, seconds: float, fn: Callable[[], None]) -> None:
        self.add_timed(_Timer(time.monotonic() + seconds, fn))

    def _set_stopping(self) -> None:
        self._stopping = True

    def _run(self) -> None:
        poll, handlers, wake = self._epoll.poll, self._handlers, self._wake_read
        try:
            while not self._stopping:
                timeout = -1.0
                if self._heap:
                    timeout = max(0.0, self._heap[0][0] - time.monotonic())
                try:
                    events = poll(timeout)
                except InterruptedError:
                    continue
                for fd, mask in events:
                    handler = handlers.get(fd)
                    if handler is not None:
                        if mask & _HANGUP:
                            mask |= READ | WRITE            # the handler finds out by reading or writing
                        try:                                # (inline: this is every byte's path)
                            handler.on_ready(mask)
                        except Exception:  # noqa: BLE001
                            self._failed(handler)
                    elif fd == wake:
                        try:
                            while os.read(wake, 4096):
                                pass
                        except BlockingIOError:
                            pass
                while self._posted:
                    self._guard(self._posted.popleft())
                if self._heap:
                    self._expire_due()
        except Exception:  # noqa: BLE001
            log.exception("%s: the loop failed; its connections are no longer served", self.name)
        finally:
            self._finish()

    def _expire_due(self) -> None:
        now = time.monotonic()
        heap, timed = self._heap, self._timed
        while heap and heap[0][0] <= now:
            _, number, item = heapq.heappop(heap)
            if timed.get(item) != number:
                continue                                # discarded, or added again since
            if item.deadline > now:                     # moved later (traffic since): look again then
                self.add_timed(item)
                continue
            del timed[item]
            self._guard(item.expire)

    def _finish(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            if self._on_stop is not None:
                self._on_stop()
        except Exception:  # noqa: BLE001
            log.exception("%s: stopping failed", self.name)
        finally:
            self._heap.clear()
            self._timed.clear()
            self._handlers.clear()
            self._epoll.close()
            with self._wake_lock:
                os.close(self._wake_read)
                os.close(self._wake_write)

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001
            log.exception("%s: a posted call or timer failed", self.name)

    def _failed(self, handler: Any) -> None:
        """A bug in one connection's handling must not stop the loop that serves all of them: it is
        logged, and that connection is closed."""
        log.exception("%s: a connection handler failed", self.name)
        try:
            handler.close()
        except Exception:  # noqa: BLE001
            pass


class Acceptor:
    """Accepts the connections of one listening socket on a loop and hands each to ``admit`` (on
    the loop thread). At most ``burst`` per wake-up. When ``room()`` says no (the owner's
    descriptor reserve) or accept fails for want of resources, the listener leaves the epoll set
    for ``backoff`` seconds (pending connections wait in the backlog) and ``starved(why)`` is told.
    """

    def __init__(self, loop: EventLoop, listener: socket.socket, admit: Callable[[socket.socket, Any], None], *,
                 name: str, backoff: float, burst: int = ACCEPT_BURST, room: Callable[[], bool] | None = None,
                 starved: Callable[[str], None] | None = None) -> None:
        self._loop, self._listener, self._admit, self.name = loop, listener, admit, name
        self._backoff, self._burst, self._room, self._starved = backoff, burst, room, starved
        self._watched = False
        self._closed = False
        self.paused = False              # resting after a shortage: a timer (or resume) ends it
        listener.setblocking(False)

    def start(self) -> None:
        """Watch the listener (loop thread); also ends a back-off early."""
        self.paused = False
        if not self._watched and not self._closed:
            self._loop.watch(self._listener, 0, READ, self)
            self._watched = True

    def stop(self) -> None:
        """Stop watching for good (before the listener is closed)."""
        self._closed = True
        if self._watched:
            self._loop.watch(self._listener, READ, 0, self)
            self._watched = False

    def resume_if_room(self) -> None:
        """A connection ended: accept again now if the back-off was for want of room."""
        if self.paused and not self._closed and (self._room is None or self._room()):
            self.start()

    def close(self) -> None:
        """A failure escaped: the loop calls this. The listener rests, then accepts again."""
        self._pause()

    def _pause(self) -> None:
        if self._watched:
            self._loop.watch(self._listener, READ, 0, self)
            self._watched = False
        if not self.paused:
            self.paused = True
            self._loop.later(self._backoff, self._resume)

    def _resume(self) -> None:
        if self.paused:
            self.start()

    def on_ready(self, _mask: int) -> None:
        for _ in range(self._burst):
            if self._room is not None and not self._room():
                if self._starved is not None:
                    self._starved("")
                self._pause()
                return
            try:
                conn, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in ACCEPT_RESOURCE_ERRORS:
                    if self._starved is not None:
                        self._starved(os.strerror(exc.errno or 0))
                    self._pause()
                    return
                log.debug("%s: accept failed: %s", self.name, exc)   # that one connection is lost
                continue
            try:
                self._admit(conn, address)
            except Exception:  # noqa: BLE001 - one bad connection must not end the listener
                log.exception("%s: dropping a connection", self.name)
                conn.close()
