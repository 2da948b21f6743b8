"""Each owner's path-opening children in the fork server, held to a bound.

A request that names paths has them opened as its caller in a child (kernel.access.PendingOpen).
On a file system that does not answer (a FUSE server of the caller's own that reads requests and
answers none) that child outlives its request: SIGKILLed at the deadline, it stays in D state
until the mount goes, holding a host pid, about 2 MB of memory and a descriptor of the fork server
(its pidfd, in ``Orphans``), and no sandbox cgroup holds it. Unbounded, one user left ~0.8 a
second (~2,900 an hour) until the fork server ran out of descriptors for everyone, or the host out
of pids. So ``Openers`` holds each owner (LaunchSpec.owner: ``uid-N``, ``tls-<hash>``; else the
caller's uid) to ``per_owner`` live openers, opening or stuck (given up on, and still there a
moment after its SIGKILL: ``STUCK_GRACE``), until each is reaped:

* below it, a request's opener starts at once;
* at it, with none given up on (a burst of ordinary requests, each opener done in milliseconds),
  the request waits for a slot, within its own deadline;
* at it, with some given up on, the request is refused at once (Exhausted: RESOURCE_EXHAUSTED),
  naming the paths its earlier requests are stuck on; so are the requests still waiting for a slot.

So an owner never has more than ``per_owner`` stuck openers, and other owners are not counted.
Local root's own requests (no owner, uid 0) are not counted, as the quotas do not count them
(service/quotas.py): what root's own mounts cost is root's to mind. Nothing here waits: a slot
frees when the loop reaps its child (``Slot.release``).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from sandboxd.errors import DeadlineExceeded, Exhausted

if TYPE_CHECKING:
    from collections.abc import Callable

    from sandboxd.supervisor.waits import Timers

# The most stuck paths a refusal names (the count says how many there are).
NAMED_PATHS = 3
# How long after its SIGKILL an opener still there is judged stuck: one waiting on a request its
# file system has not read yet dies at once (the kernel drops the request); one whose request was
# read and never answered cannot (D state) until the mount goes.
STUCK_GRACE = 0.5


class Slot:
    """One live opener of an owner: ``stuck(what)`` when its request gave up on it, ``release()``
    once its child is reaped (or never started)."""

    def __init__(self, openers: "Openers | None", owner: str) -> None:
        self._openers, self.owner = openers, owner        # None: not counted (root's own)
        self.released = False

    def given_up(self, what: str, now: float) -> None:
        """Its request gave up on it at ``what`` (a path it did not get past) and SIGKILLed it: if it
        is still there STUCK_GRACE later, until it is reaped this owner's requests beyond the bound
        are refused, not held."""
        if self._openers is not None:
            openers = self._openers
            openers._timers.add(now + STUCK_GRACE, lambda: openers._stuck(self, what))   # noqa: SLF001

    def release(self) -> None:
        if not self.released and self._openers is not None:
            self.released = True
            self._openers._release(self)                   # noqa: SLF001
        self.released = True


class _Waiting:
    __slots__ = ("start", "refuse", "done")

    def __init__(self, start: "Callable[[Slot], None]", refuse: "Callable[[BaseException], None]") -> None:
        self.start, self.refuse, self.done = start, refuse, False


class _Owner:
    __slots__ = ("live", "stuck", "waiting")

    def __init__(self) -> None:
        self.live = 0
        self.stuck: dict[Slot, str] = {}                   # given up on, not yet reaped -> its path
        self.waiting: deque[_Waiting] = deque()


class Openers:
    def __init__(self, per_owner: int, timers: "Timers") -> None:
        """``per_owner``: fork_server.stuck_openers_per_uid; ``timers``: the loop's (a waiting
        request's deadline)."""
        self.per_owner = max(1, per_owner)
        self._timers = timers
        self._owners: dict[str, _Owner] = {}

    def admit(self, owner: str | None, start: "Callable[[Slot], None]", refuse: "Callable[[BaseException], None]",
              deadline: float) -> None:
        """``start(slot)`` now, or once a slot of ``owner`` frees; ``refuse(error)`` instead if it never
        may (refused, or ``deadline`` passed first). Raises Exhausted at once, calling neither, when
        the owner holds every slot and some of them are stuck. A ``start`` that raises gives its slot
        back (and, started later, is refused with what it raised). ``owner`` None: not counted (local
        root's own requests), started at once."""
        if owner is None:
            start(Slot(None, ""))
            return
        entry = self._owners.setdefault(owner, _Owner())
        if entry.live < self.per_owner:
            self._start(entry, owner, start)
            return
        if entry.stuck:
            raise self._refusal(owner, entry)
        waiting = _Waiting(start, refuse)
        entry.waiting.append(waiting)
        self._timers.add(deadline, lambda: self._expire(owner, waiting))

    def live(self, owner: str) -> int:
        """The owner's openers not yet reaped (for tests and the fork server's log)."""
        entry = self._owners.get(owner)
        return entry.live if entry else 0

    def stuck_count(self, owner: str) -> int:
        entry = self._owners.get(owner)
        return len(entry.stuck) if entry else 0

    def _start(self, entry: _Owner, owner: str, start: "Callable[[Slot], None]") -> None:
        entry.live += 1
        slot = Slot(self, owner)
        try:
            start(slot)
        except BaseException:
            slot.release()
            raise

    def _stuck(self, slot: Slot, what: str) -> None:
        entry = self._owners.get(slot.owner)
        if entry is None or slot.released:
            return
        entry.stuck[slot] = what
        # Whoever waits for a slot now waits behind a stuck opener: refused at once, not at its deadline.
        while entry.waiting:
            waiting = entry.waiting.popleft()
            if not waiting.done:
                waiting.done = True
                waiting.refuse(self._refusal(slot.owner, entry))

    def _release(self, slot: Slot) -> None:
        entry = self._owners.get(slot.owner)
        if entry is None:
            return
        entry.live -= 1
        entry.stuck.pop(slot, None)
        while entry.live < self.per_owner and entry.waiting:
            waiting = entry.waiting.popleft()
            if waiting.done:
                continue
            waiting.done = True
            try:
                self._start(entry, slot.owner, waiting.start)
            except Exception as exc:  # noqa: BLE001 - its request's answer, never the loop's end
                waiting.refuse(exc)
        if not entry.live and not entry.waiting and self._owners.get(slot.owner) is entry:
            del self._owners[slot.owner]

    def _expire(self, owner: str, waiting: _Waiting) -> None:
        if waiting.done:
            return
        waiting.done = True
        entry = self._owners.get(owner)
        if entry is not None:
            entry.waiting.remove(waiting)
        waiting.refuse(DeadlineExceeded(
            f"{self.per_owner} earlier requests of {owner} were still opening their paths when this one's "
            "time ran out (a file system that answers slowly); try again"))

    def _refusal(self, owner: str, entry: _Owner) -> Exhausted:
        paths = list(dict.fromkeys(entry.stuck.values()))
        named = ", ".join(paths[:NAMED_PATHS]) + (f" and {len(paths) - NAMED_PATHS} more" if len(paths) > NAMED_PATHS
                                                  else "")
        return Exhausted(
            f"{len(entry.stuck)} earlier requests of {owner} are still stuck on a file system that does not answer "
            f"({named}), and {owner} may have at most {self.per_owner} path lookups outstanding "
            "(fork_server.stuck_openers_per_uid): requests naming paths are refused until that mount answers or is "
            "released (fusermount3 -u, umount -l)")
