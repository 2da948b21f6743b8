"""What the fork server's poll loop waits on besides its socket: children it must never block on.

A request that depends on a child (the caller's paths opened in one, a session's build, a
command's start) is a ``Waits`` entry: a descriptor in the loop's poller, a function called when
it is readable (True: done) and one called at its deadline. An entry's failure is its request's
answer, never the loop's end. ``Orphans`` are children given up on (SIGKILLed): reaped when
their pidfd says they are gone, however long a task stuck in the kernel takes, and never waited for.
"""

from __future__ import annotations

import fcntl
import os
import select
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable


class _Entry:
    def __init__(self, call_id: int, deadline: float, ready: "Callable[[], bool]",
                 expire: "Callable[[], None]", events: int) -> None:
        self.call_id, self.deadline, self.ready, self.expire = call_id, deadline, ready, expire
        self.events = events


class Waits:
    """Requests waiting on a descriptor, each with a deadline."""

    def __init__(self, poller: "select.poll") -> None:
        self._poller = poller
        self._entries: dict[int, _Entry] = {}

    def add(self, fd: int, call_id: int, deadline: float, ready: "Callable[[], bool]",
            expire: "Callable[[], None]", events: int = select.POLLIN) -> None:
        """Wait on ``fd``: ``ready()`` when it is readable (or has ``events``), until it returns
        True; ``expire()`` at ``deadline`` if that has not happened. Either may raise: the
        request's error answer."""
        self._entries[fd] = _Entry(call_id, deadline, ready, expire, events)
        self._poller.register(fd, events)

    def deadlines(self) -> list[float]:
        return [entry.deadline for entry in self._entries.values()]

    def __len__(self) -> int:
        return len(self._entries)

    def ready(self, fd: int, fail: "Callable[[int, BaseException], None]") -> None:
        entry = self._entries.pop(fd, None)
        if entry is None:
            return
        # Out of the poller before ``ready`` runs: once done it may close ``fd``, and the next
        # request may be given the same number.
        self._poller.unregister(fd)
        try:
            if entry.ready():
                return
        except Exception as exc:  # noqa: BLE001 - one request's failure is its answer
            fail(entry.call_id, exc)
            return
        self._entries[fd] = entry
        self._poller.register(fd, entry.events)

    def expire(self, now: float, fail: "Callable[[int, BaseException], None]") -> None:
        for fd, entry in list(self._entries.items()):
            if entry.deadline <= now:
                self._poller.unregister(fd)
                del self._entries[fd]
                try:
                    entry.expire()
                except Exception as exc:  # noqa: BLE001 - one request's failure is its answer
                    fail(entry.call_id, exc)


class Orphans:
    """Children nobody waits for any more, reaped when their pidfd becomes readable."""

    def __init__(self, poller: "select.poll") -> None:
        self._poller = poller
        self._reapers: dict[int, "Callable[[], bool]"] = {}

    def add(self, pidfd: int, reap: "Callable[[], bool]", events: int = select.POLLIN) -> None:
        """Call ``reap()`` (True: gone, and ``pidfd`` closed) whenever ``pidfd`` is readable (or
        has ``events``: a cgroup's events file, POLLPRI)."""
        if reap():
            return
        self._reapers[pidfd] = reap
        self._poller.register(pidfd, events)

    def __len__(self) -> int:
        return len(self._reapers)

    def ready(self, fd: int) -> None:
        reap = self._reapers.get(fd)
        if reap is not None and reap():
            self._poller.unregister(fd)
            del self._reapers[fd]


class ReportReader:
    """A setup report pipe read as far as it goes without blocking, to its EOF."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._chunks: list[bytes] = []
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)

    def read(self) -> bool:
        """Take what is there; True at EOF."""
        while True:
            try:
                data = os.read(self.fd, 65536)
            except (BlockingIOError, InterruptedError):
                return False
            if not data:
                return True
            self._chunks.append(data)

    @property
    def data(self) -> bytes:
        return b"".join(self._chunks)
