"""What the fork server's poll loop waits on besides its socket: children it must never block on.

A request that depends on a child (the caller's paths opened in one, a session's build, a
command's start) is a ``Waits`` entry: a descriptor in the loop's poller, a function called when
it is readable (True: done) and one called at its deadline. An entry's failure is its request's
answer, never the loop's end. ``Orphans`` are children given up on (SIGKILLed): reaped when
their pidfd says they are gone, however long a task stuck in the kernel takes, and never waited for.
``Leftovers`` are the sandbox groups of ended calls, closed sessions and dead predecessors: signalled
once, removed when empty, never waited for either. ``Timers`` are what the loop must do at a time.
"""

from __future__ import annotations

import fcntl
import heapq
import itertools
import os
import select
import sys
import time
from typing import TYPE_CHECKING

from sandboxd.printable import printable

if TYPE_CHECKING:
    from collections.abc import Callable

    from sandboxd.kernel.cgroups import CgroupSet


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
        """Give up on the entries past their deadline. One whose descriptor is ready by now is taken
        as ready first: its child answered in time, while the loop was busy with something else, and
        must not be blamed for the loop's lateness (a victim's path is not "a file system that does
        not answer" because the loop was held)."""
        for fd, entry in list(self._entries.items()):
            if entry.deadline <= now:
                if _has_events(fd, entry.events):
                    self.ready(fd, fail)
                    if fd not in self._entries:
                        continue                          # answered (or failed on its own merits)
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

    def add(self, pidfd: int, reap: "Callable[[], bool]") -> None:
        """Call ``reap()`` (True: gone, and ``pidfd`` closed) whenever ``pidfd`` is readable."""
        if reap():
            return
        self._reapers[pidfd] = reap
        self._poller.register(pidfd, select.POLLIN)

    def __len__(self) -> int:
        return len(self._reapers)

    def ready(self, fd: int) -> None:
        reap = self._reapers.pop(fd, None)
        if reap is None:
            return
        # Out of the poller (and this table) before ``reap`` closes ``fd``: what it releases (a
        # session's cgroup, to the leftovers) may open a descriptor of the same number, which must
        # stay in the poller.
        self._poller.unregister(fd)
        if not reap():
            self._reapers[fd] = reap
            self._poller.register(fd, select.POLLIN)


def _has_events(fd: int, events: int) -> bool:
    """Is ``fd`` ready now (``events``, or hung up), without waiting?"""
    probe = select.poll()
    probe.register(fd, events)
    return bool(probe.poll(0))


class Timers:
    """What the loop must do at a time: ``deadline`` is one more bound on its poll, ``run_due`` calls
    what is due. Never cancelled: a callback checks whether it is still wanted."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, "Callable[[], None]"]] = []
        self._order = itertools.count()               # equal times run in the order they were set

    def add(self, when: float, action: "Callable[[], None]") -> None:
        heapq.heappush(self._heap, (when, next(self._order), action))

    def deadline(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)

    def run_due(self, now: float) -> None:
        while self._heap and self._heap[0][0] <= now:
            _, _, action = heapq.heappop(self._heap)
            try:
                action()
            except Exception as exc:  # noqa: BLE001 - one timer's failure must not end the loop
                log(f"a timer of the loop failed: {type(exc).__name__}: {exc}")


# A group that could not be removed at once is tried again after RETRY_FIRST seconds, then after
# twice as long each time up to RETRY_MAX: soon for a tree still being torn down (milliseconds),
# seldom for one held by a process stuck in the kernel (each try is a few system calls).
RETRY_FIRST = 0.005
RETRY_MAX = 5.0


class _Leftover:
    def __init__(self, key: str, group: "CgroupSet", kill: bool, then: "list[Callable[[], None]]",
                 watch: bool) -> None:
        self.key, self.group, self.kill, self.then, self.watch = key, group, kill, then, watch
        self.events: int | None = None                # cgroup.events, in the poller while the group is populated
        self.retry = RETRY_FIRST
        self.done = False


class Leftovers:
    """Sandbox groups on their way out: each is signalled once and removed when it is empty, and the
    loop never waits for that. A group that a process stuck in the kernel keeps busy (D state on a
    FUSE mount its own user never answers) costs one entry here and, on cgroup v2, one descriptor,
    for as long as that process lives, and nobody else's request anything; each such process counts
    against its owner's pids share, which bounds how many a caller can leave.

    On cgroup v2 the group's ``cgroup.events`` is in the loop's poller: POLLPRI when ``populated``
    changes, then one rmdir pass. Without a v2 group (cgroup v1 alone), or when that pass finds a
    group still being torn down, a timer tries again (RETRY_FIRST, doubling to RETRY_MAX), each try
    one pass of SIGKILLs (v1 has no cgroup.kill: a process forked between the read of cgroup.procs and
    the signal escapes one pass) and rmdirs."""

    def __init__(self, poller: "select.poll", timers: Timers) -> None:
        self._poller = poller
        self._timers = timers
        self._held: dict[str, _Leftover] = {}          # by the group's first directory
        self._by_events: dict[int, _Leftover] = {}

    def __len__(self) -> int:
        return len(self._held)

    def dispose(self, group: "CgroupSet", kill: bool = True, then: "Callable[[], None] | None" = None,
                watch: bool = True) -> None:
        """Take ``group`` (the caller lets go of it): SIGKILL what is in it (``kill``; else what is left
        may live on: a danger-full-access call's background jobs, removed with the group once they
        end), and remove it once it is empty; then ``then()``, if given. ``watch``: hold its
        cgroup.events to hear at once when it empties (else the timer alone: for what a sweep
        found, which nobody waits for, so that it costs this process no descriptor)."""
        thens = [then] if then is not None else []
        if not group.dirs:
            for action in thens:
                action()
            return
        key = group.dirs[0]
        held = self._held.get(key)
        if held is not None:                          # handed over again (a sweep finds it twice)
            held.then += thens
            held.kill = held.kill or kill
            return
        entry = _Leftover(key, group, kill, thens, watch)
        self._held[key] = entry
        if not kill:
            try:
                group.release()
            except OSError as exc:
                log(f"releasing the survivors of sandbox group {key} failed: {exc}")
        self._try(entry)

    def _try(self, entry: _Leftover) -> None:
        """One pass: signal (when asked), rmdir; if the group is still there, wait for its events
        (v2) or a timer."""
        group = entry.group
        try:
            if entry.kill:
                group.signal_once()
            gone = group.try_remove()
        except OSError as exc:                        # a cgroup file system gone odd: a later try
            log(f"removing sandbox group {entry.group.name} failed: {exc}")
            gone = False
        if gone:
            self._finish(entry)
            return
        if entry.events is None and entry.watch and group.unified_dir is not None:
            entry.events = group.open_events()
            if entry.events is not None:
                self._by_events[entry.events] = entry
                self._poller.register(entry.events, select.POLLPRI)
        if entry.events is not None and group.populated(entry.events):
            return                                    # POLLPRI once it empties
        self._timers.add(time.monotonic() + entry.retry, lambda: self._retry(entry))
        entry.retry = min(entry.retry * 2, RETRY_MAX)

    def _retry(self, entry: _Leftover) -> None:
        if not entry.done:
            self._try(entry)

    def ready(self, fd: int) -> None:
        """``fd`` (a group's cgroup.events) had events: try its group again if it is empty now."""
        entry = self._by_events.get(fd)
        if entry is not None and not entry.group.populated(fd):
            self._try(entry)

    def _finish(self, entry: _Leftover) -> None:
        entry.done = True
        if entry.events is not None:
            self._poller.unregister(entry.events)
            del self._by_events[entry.events]
            os.close(entry.events)
            entry.events = None
        del self._held[entry.key]
        for action in entry.then:
            try:
                action()
            except Exception as exc:  # noqa: BLE001 - one close's answer must not end the loop
                log(f"after removing sandbox group {entry.group.name}: {type(exc).__name__}: {exc}")


def log(text: str) -> None:
    """The fork server has no logger of its own: its stderr is the daemon's log, so the text is
    printable as the daemon's log lines are (it may quote a caller's path or request)."""
    try:
        sys.stderr.write(f"sandboxd-fork: {printable(text)}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


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
