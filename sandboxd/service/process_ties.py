"""What ends when a client's process ends: a session created with close_with_caller, an approval
channel's registration. However the process ends (SIGKILL included), the kernel says so: a
pidfd becomes readable when its process exits, and one thread waits on all of them (epoll).

A process is named by ``peers.process_key`` (boot, pid, start time), never by its pid alone:
the pidfd is opened from the pid and then checked to be that very process, so a pid reused by
another process is never watched in its place. Each process costs one pidfd, however many
things are tied to it; what is tied is bounded by what its owner may hold (sessions, channels).

The callbacks never run on the watch thread: each tie names its owner (whom the tied thing counts
against: quotas.owner_key), and each owner's callbacks run in order on a thread of that owner's,
started when it has some and ended when it has none left. A callback may take long: closing a
session takes its build_lock, which an UpdateSessionPolicy of its owner holds while it waits (up to
fork_server.wait_seconds, once per queued update) on a path of a file system that does not answer.
That costs only its owner: with one thread for all, every user's close-with-caller cleanup and
channel unregistration waited behind it (a victim's session still open 40 s after its process
exited). At most one thread per owner with something ending, each for as long as its callbacks take.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import threading
import time
from collections import deque
from typing import Callable

from sandboxd.kernel import peers

log = logging.getLogger("sandboxd")
CLOSE_SECONDS = 5.0          # what ``close`` waits for the watch thread, and for running callbacks


Callback = Callable[[], None]


class _Watched:
    __slots__ = ("pidfd", "key", "callbacks")

    def __init__(self, pidfd: int, key: str) -> None:
        self.pidfd, self.key = pidfd, key
        self.callbacks: dict[int, tuple[str, Callback]] = {}      # handle -> (owner, what to run)


class ProcessTies:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[str, _Watched] = {}
        self._by_fd: dict[int, _Watched] = {}
        self._handles: dict[int, _Watched] = {}
        self._numbers = itertools.count(1)
        self._queues: dict[str, deque[Callback]] = {}             # owner -> its callbacks not yet run
        self._runners: dict[str, threading.Thread] = {}           # owner -> the thread running them
        self._stopping = False
        self._epoll = select.epoll()
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._epoll.register(self._stop_r, select.EPOLLIN)
        self._thread = threading.Thread(target=self._run, name="sandboxd-ties", daemon=True)
        self._thread.start()

    def tie(self, key: str, callback: Callback, owner: str = "") -> int | None:
        """Run ``callback`` once the process ``key`` (peers.process_key) exits, on ``owner``'s thread
        (after that owner's earlier ones, beside every other owner's); its handle (for ``untie``), or
        None when that process is gone already (nothing is kept: act now)."""
        with self._lock:
            watched = self._by_key.get(key)
            if watched is None:
                watched = self._watch(key)
                if watched is None:
                    return None
            handle = next(self._numbers)
            watched.callbacks[handle] = (owner, callback)
            self._handles[handle] = watched
            return handle

    def untie(self, handle: int) -> None:
        """Forget one tie (what it kept ended some other way); the pidfd goes with its last tie."""
        with self._lock:
            watched = self._handles.pop(handle, None)
            if watched is None:
                return
            watched.callbacks.pop(handle, None)
            if not watched.callbacks:
                self._drop(watched)

    def watched(self) -> int:
        """How many processes are watched (descriptors held)."""
        with self._lock:
            return len(self._by_key)

    def running(self) -> int:
        """How many owners' threads are running callbacks now."""
        with self._lock:
            return len(self._runners)

    def close(self) -> None:
        """Stop watching (the daemon stops: what is tied stays as it is, for the next daemon, which
        ends what it finds ended). Callbacks not started yet are dropped; those running get up to
        CLOSE_SECONDS together (one held by a path that does not answer is not waited for)."""
        os.write(self._stop_w, b"x")
        self._thread.join(timeout=CLOSE_SECONDS)
        with self._lock:
            self._stopping = True
            for queue in self._queues.values():
                queue.clear()
            runners = list(self._runners.values())
            for watched in list(self._by_key.values()):
                self._drop(watched)
        deadline = time.monotonic() + CLOSE_SECONDS
        for runner in runners:
            runner.join(timeout=max(0.0, deadline - time.monotonic()))
        self._epoll.close()
        os.close(self._stop_r)
        os.close(self._stop_w)

    def _watch(self, key: str) -> _Watched | None:
        """A pidfd on the process ``key`` names, checked to be it (under the lock)."""
        try:
            pid = int(key.split(":")[1])
            pidfd = os.pidfd_open(pid)
        except (IndexError, ValueError, OSError):
            return None
        if peers.process_key(pid) != key:          # the pid is another process's now
            os.close(pidfd)
            return None
        watched = _Watched(pidfd, key)
        self._by_key[key] = watched
        self._by_fd[pidfd] = watched
        self._epoll.register(pidfd, select.EPOLLIN)
        return watched

    def _drop(self, watched: _Watched) -> None:
        if self._by_key.get(watched.key) is not watched:
            return
        del self._by_key[watched.key]
        del self._by_fd[watched.pidfd]
        for handle in watched.callbacks:
            self._handles.pop(handle, None)
        self._epoll.unregister(watched.pidfd)
        os.close(watched.pidfd)

    def _run(self) -> None:
        while True:
            try:
                ready = self._epoll.poll()
            except InterruptedError:
                continue
            except (OSError, ValueError):              # closed under us
                return
            with self._lock:
                for fd, _mask in ready:
                    if fd == self._stop_r:
                        return
                    watched = self._by_fd.get(fd)
                    if watched is not None:
                        for owner, callback in watched.callbacks.values():
                            self._dispatch(owner, callback)
                        self._drop(watched)

    def _dispatch(self, owner: str, callback: Callback) -> None:
        """Queue ``callback`` on ``owner``'s thread, started if it has none (under the lock)."""
        self._queues.setdefault(owner, deque()).append(callback)
        if owner not in self._runners:
            runner = threading.Thread(target=self._run_owner, args=(owner,), name="sandboxd-ties-owner",
                                      daemon=True)
            self._runners[owner] = runner
            runner.start()

    def _run_owner(self, owner: str) -> None:
        """``owner``'s callbacks, in order, until it has none left (then the thread ends)."""
        while True:
            with self._lock:
                queue = self._queues.get(owner)
                if not queue or self._stopping:
                    self._queues.pop(owner, None)
                    self._runners.pop(owner, None)
                    return
                callback = queue.popleft()
            try:
                callback()
            except Exception:  # noqa: BLE001 - one failure must not keep the others
                log.exception("what was tied to an ended process could not be ended")
