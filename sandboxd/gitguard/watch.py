"""One inotify instance for every git guard of a daemon, its watches tagged per guard.

A git guard (gitguard/guard.py) learns from inotify which directories changed since its
last inspection. With an instance per guard, a daemon holding more sessions than
fs.inotify.max_user_instances (128 for root by default) has guards without one, and each of
those walks its whole tree after every call. An ``InotifyHub`` is one instance (one descriptor)
for all of them: each guard holds a ``Subscription`` with the same interface as
kernel.inotify.Inotify (``watch_fd``, ``drain``, ``close``).

The kernel gives one watch per inode per instance: two sessions on the same workspace get the
same watch descriptor for the same directory. So the hub keeps, per watch, the subscriptions
that asked for it; a drain (by any guard, under the hub's lock) reads every pending event and
hands each fired watch to every subscription holding it, to be taken at that guard's next
inspection. An overflow of the one queue is every subscription's overflow (each then looks at
everything, as a guard of its own instance does). A closing subscription removes the watches
no other subscription holds: no watch outlives the sessions that need it, and the instance
itself goes with the last subscription.

Idle sessions cost nothing: no thread and no polling; events wait in the kernel's queue (and
then in the subscriptions' sets) until some guard inspects.

Every watch is one of root's host-wide fs.inotify.max_user_watches, which the rest of the host
(systemd, file managers, other daemons) also needs. So each subscription names its owner (whom
the session counts against: a uid, a TLS principal) and the hub gives an owner at most
``watches_per_owner`` distinct watches: past it ``watch_fd`` fails with ENOSPC, as the kernel
does when root has none left, and that guard's root falls back to the walk by inode and ctime
(one lstat per directory per inspection: slower, as safe). Other owners are still watched.
"""

from __future__ import annotations

import _thread
import errno

from sandboxd.kernel.inotify import ENTRIES_CHANGED, Inotify


class InotifyHub:
    def __init__(self, watches_per_owner: int = 0) -> None:
        """``watches_per_owner``: the most distinct watches one owner's subscriptions hold together
        (quotas.git_watches_per_uid); 0: no budget, only the kernel's limit."""
        self._lock = _thread.allocate_lock()
        self._inotify: Inotify | None = None          # made by the first subscription
        self._holders: dict[int, set[Subscription]] = {}
        self._subscriptions: set[Subscription] = set()
        self.watches_per_owner = watches_per_owner
        # owner -> {watch: how many of the owner's subscriptions hold it}: its distinct watches
        self._owned: dict[str, dict[int, int]] = {}

    def subscribe(self, owner: str = "") -> "Subscription":
        """A guard's share of the instance, counted against ``owner``; OSError when the instance
        cannot be made (the guard then walks on each inspection, as without inotify)."""
        with self._lock:
            if self._inotify is None:
                self._inotify = Inotify()
            subscription = Subscription(self, owner)
            self._subscriptions.add(subscription)
            return subscription

    @property
    def watches(self) -> int:
        """Watches held by at least one subscription (for tests and metrics)."""
        with self._lock:
            return len(self._holders)

    def watches_of(self, owner: str) -> int:
        """The distinct watches ``owner``'s subscriptions hold."""
        with self._lock:
            return len(self._owned.get(owner, ()))

    def close(self) -> None:
        with self._lock:
            if self._inotify is not None:
                self._inotify.close()
                self._inotify = None
            for subscription in self._subscriptions:
                subscription.overflow = True          # nothing is watched any more: walk everything
            self._holders.clear()
            self._owned.clear()

    # -- for Subscription, under self._lock --------------------------------------------------------

    def _watch(self, subscription: "Subscription", dir_fd: int, mask: int) -> int:
        if self._inotify is None:
            raise OSError(errno.EBADF, "the inotify hub is closed")   # the guard falls back to walking
        owned = self._owned.setdefault(subscription.owner, {})
        if self.watches_per_owner and len(owned) >= self.watches_per_owner:
            raise OSError(errno.ENOSPC, f"{subscription.owner or 'this owner'} holds its whole budget of "
                          f"{self.watches_per_owner} inotify watches (quotas.git_watches_per_uid)")
        wd = self._inotify.watch_fd(dir_fd, mask)
        self._holders.setdefault(wd, set()).add(subscription)
        if wd not in subscription.wds:
            subscription.wds.add(wd)
            owned[wd] = owned.get(wd, 0) + 1
        return wd

    def _drain(self) -> None:
        if self._inotify is None:
            return
        fired, overflow = self._inotify.drain()
        if overflow:
            for subscription in self._subscriptions:
                subscription.overflow = True
        for wd in fired:
            for subscription in self._holders.get(wd, ()):
                subscription.pending.add(wd)

    def _release(self, subscription: "Subscription") -> None:
        self._subscriptions.discard(subscription)
        owned = self._owned.get(subscription.owner, {})
        for wd in subscription.wds:
            if wd in owned:
                owned[wd] -= 1
                if not owned[wd]:
                    del owned[wd]
            holders = self._holders.get(wd)
            if holders is None:
                continue
            holders.discard(subscription)
            if not holders:
                del self._holders[wd]
                if self._inotify is not None:
                    self._inotify.remove_watch(wd)
        subscription.wds.clear()
        if not owned:
            self._owned.pop(subscription.owner, None)
        if not self._subscriptions and self._inotify is not None:
            # No session needs it: a daemon with no session holds no inotify descriptor (the next
            # subscription makes a new one; its queue holds nothing anyone still wants).
            self._inotify.close()
            self._inotify = None


class Subscription:
    """One guard's watches on the hub's instance: the interface of kernel.inotify.Inotify."""

    def __init__(self, hub: InotifyHub, owner: str = "") -> None:
        self.hub = hub
        self.owner = owner                                    # whose budget its watches count against
        self.wds: set[int] = set()
        self.pending: set[int] = set()
        self.overflow = False
        self.closed = False

    def watch_fd(self, dir_fd: int, mask: int = ENTRIES_CHANGED) -> int:
        with self.hub._lock:                                  # noqa: SLF001 - the hub's own helper
            return self.hub._watch(self, dir_fd, mask)        # noqa: SLF001

    def drain(self) -> tuple[set[int], bool]:
        """(this guard's watches that saw an event since its last drain, whether events were lost)."""
        with self.hub._lock:                                  # noqa: SLF001
            self.hub._drain()                                 # noqa: SLF001
            fired, self.pending = self.pending, set()
            overflow, self.overflow = self.overflow, False
            return fired, overflow

    def close(self) -> None:
        with self.hub._lock:                                  # noqa: SLF001
            if not self.closed:
                self.closed = True
                self.hub._release(self)                       # noqa: SLF001
