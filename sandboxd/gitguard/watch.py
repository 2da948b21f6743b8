"""The git guards' inotify instances: one per owner, within a budget, their watches tagged per guard.

A git guard (gitguard/guard.py) learns from inotify which directories changed since its
last inspection. With an instance per guard, a daemon holding more sessions than
fs.inotify.max_user_instances (128 for root by default) has guards without one, and each of
those walks its whole tree after every call. An ``InotifyHub`` gives each owner (whom a session
counts against: a uid, a TLS principal) one instance, shared by all of that owner's guards: each
guard holds a ``Subscription`` with the same interface as kernel.inotify.Inotify (``watch_fd``,
``drain``, ``close``).

One instance per owner, not one for all: an instance's queue holds at most
fs.inotify.max_queued_events (16,384) events, and when it overflows every guard on it must look at
everything (a walk of its whole tree). With one queue for all, one user's sandbox creating and
removing a file in a loop overflowed it for every user: each other user's next call paid a walk of
its whole tree (the second hostile pass of round 4: 8 ms became 59 ms for a 10,111-directory
workspace). Now an overflow is its owner's only. The instances come out of root's host-wide
fs.inotify.max_user_instances, which systemd, other daemons, `sandboxd run` and other sandboxd
daemons also use, so the hub holds at most ``instances`` (quotas.git_inotify_instances): past
``instances - 1`` owners, the newer owners' guards share the last one (an overflow there is theirs
together, as before for everyone), and so do owners whose own instance the kernel refused.

The kernel gives one watch per inode per instance: two sessions of an owner on the same workspace
get the same watch descriptor for the same directory. So each instance keeps, per watch, the
subscriptions that asked for it; a drain (by any of its guards, under its lock) reads every pending
event and hands each fired watch to every subscription holding it, to be taken at that guard's next
inspection. A closing subscription removes the watches no other subscription holds: no watch
outlives the sessions that need it, and an instance goes with its last subscription.

Idle sessions cost nothing: no thread and no polling; events wait in the kernel's queue (and
then in the subscriptions' sets) until some guard of that instance inspects.

Every watch is one of root's host-wide fs.inotify.max_user_watches, which the rest of the host
(systemd, file managers, other daemons) also needs. So the hub gives an owner at most
``watches_per_owner`` distinct watches: past it ``watch_fd`` fails with ENOSPC, as the kernel
does when root has none left, and that guard's root falls back to the walk by inode and ctime
(one lstat per directory per inspection: slower, as safe). Other owners are still watched.
"""

from __future__ import annotations

import _thread
import errno

from sandboxd.kernel.inotify import ENTRIES_CHANGED, Inotify

# The instances a hub holds when the host's limit cannot be read: kernel.host_limits.git_instances of
# the default fs.inotify.max_user_instances (128).
DEFAULT_INSTANCES = 16


def default_instances() -> int:
    """kernel.host_limits.git_instances: an eighth of root's fs.inotify.max_user_instances."""
    from sandboxd.kernel.host_limits import git_instances
    try:
        return git_instances()
    except (OSError, ValueError):
        return DEFAULT_INSTANCES


class _Queue:
    """One inotify instance and the subscriptions on it (one owner's, or the shared one's)."""

    def __init__(self, inotify: Inotify, shared: bool) -> None:
        self.lock = _thread.allocate_lock()
        self.inotify: Inotify | None = inotify
        self.shared = shared
        self.holders: dict[int, set[Subscription]] = {}
        self.subscriptions: set[Subscription] = set()
        # owner -> {watch: how many of the owner's subscriptions hold it}: its distinct watches
        # (watch numbers are per instance; all of an owner's subscriptions are on one)
        self.owned: dict[str, dict[int, int]] = {}


class InotifyHub:
    def __init__(self, watches_per_owner: int = 0, instances: int = 0) -> None:
        """``watches_per_owner``: the most distinct watches one owner's subscriptions hold together
        (quotas.git_watches_per_uid); 0: no budget, only the kernel's limit. ``instances``: the most
        inotify instances held (quotas.git_inotify_instances): one per owner for the first
        ``instances - 1`` owners, the last shared by the others (1: all owners share one); 0:
        ``default_instances()``."""
        self._lock = _thread.allocate_lock()               # the owners' queues; taken before a queue's own
        self.watches_per_owner = watches_per_owner
        self.instances = instances if instances > 0 else default_instances()
        self._own: dict[str, _Queue] = {}                  # owner -> its own instance
        self._shared: _Queue | None = None                 # past the budget: the owners' shared instance
        self._queue_of: dict[str, _Queue] = {}             # owner -> where its subscriptions are (one place)
        self._subscribed: dict[str, int] = {}              # owner -> how many subscriptions it holds

    def subscribe(self, owner: str = "") -> "Subscription":
        """A guard's share of ``owner``'s instance (made for its first guard, within the budget, else
        the shared one), its watches counted against ``owner``; OSError when no instance can be made
        (the guard then walks on each inspection, as without inotify)."""
        with self._lock:
            queue = self._queue_of.get(owner) or self._place(owner)
            subscription = Subscription(self, owner, queue)
            with queue.lock:
                queue.subscriptions.add(subscription)
            self._queue_of[owner] = queue
            self._subscribed[owner] = self._subscribed.get(owner, 0) + 1
            return subscription

    def _place(self, owner: str) -> _Queue:
        """A new owner's queue: an instance of its own while the budget allows and the kernel gives one,
        else the shared one (under the lock)."""
        if len(self._own) < self.instances - 1:
            try:
                queue = _Queue(Inotify(), shared=False)
            except OSError:                                 # root's instances are out: share
                pass
            else:
                self._own[owner] = queue
                return queue
        if self._shared is None:
            self._shared = _Queue(Inotify(), shared=True)   # OSError: that guard walks
        return self._shared

    @property
    def watches(self) -> int:
        """Watches held by at least one subscription, on every instance (for tests and metrics)."""
        with self._lock:
            return sum(len(queue.holders) for queue in self._queues())

    def watches_of(self, owner: str) -> int:
        """The distinct watches ``owner``'s subscriptions hold."""
        with self._lock:
            queue = self._queue_of.get(owner)
            if queue is None:
                return 0
            with queue.lock:
                return len(queue.owned.get(owner, ()))

    def instances_held(self) -> int:
        """Inotify instances open now (one per owner within the budget, and the shared one)."""
        with self._lock:
            return sum(1 for queue in self._queues() if queue.inotify is not None)

    def shares(self, owner: str) -> bool:
        """Whether ``owner``'s guards are on the shared instance (past the budget)."""
        with self._lock:
            queue = self._queue_of.get(owner)
            return queue is not None and queue.shared

    def close(self) -> None:
        with self._lock:
            for queue in self._queues():
                with queue.lock:
                    if queue.inotify is not None:
                        queue.inotify.close()
                        queue.inotify = None
                    for subscription in queue.subscriptions:
                        subscription.overflow = True      # nothing is watched any more: walk everything
                    queue.holders.clear()
                    queue.owned.clear()

    def _queues(self) -> list[_Queue]:
        return [*self._own.values(), *([self._shared] if self._shared is not None else [])]

    # -- for Subscription, under its queue's lock --------------------------------------------------

    def _watch(self, subscription: "Subscription", dir_fd: int, mask: int) -> int:
        queue = subscription.queue
        if queue.inotify is None:
            raise OSError(errno.EBADF, "the inotify hub is closed")   # the guard falls back to walking
        owned = queue.owned.setdefault(subscription.owner, {})
        if self.watches_per_owner and len(owned) >= self.watches_per_owner:
            raise OSError(errno.ENOSPC, f"{subscription.owner or 'this owner'} holds its whole budget of "
                          f"{self.watches_per_owner} inotify watches (quotas.git_watches_per_uid)")
        wd = queue.inotify.watch_fd(dir_fd, mask)
        queue.holders.setdefault(wd, set()).add(subscription)
        if wd not in subscription.wds:
            subscription.wds.add(wd)
            owned[wd] = owned.get(wd, 0) + 1
        return wd

    def _drain(self, queue: _Queue) -> None:
        if queue.inotify is None:
            return
        fired, overflow = queue.inotify.drain()
        if overflow:
            for subscription in queue.subscriptions:        # this instance's guards only
                subscription.overflow = True
        for wd in fired:
            for subscription in queue.holders.get(wd, ()):
                subscription.pending.add(wd)

    def _release(self, subscription: "Subscription") -> Inotify | None:
        """Under the hub's lock: the subscription's watches go (those no other holds); with its last
        subscription its instance is taken out, and returned for the caller to close outside every
        lock: closing an instance waits for the kernel's fsnotify mark reaper (up to tens of ms)."""
        closing = None
        queue, owner = subscription.queue, subscription.owner
        with queue.lock:
            queue.subscriptions.discard(subscription)
            owned = queue.owned.get(owner, {})
            for wd in subscription.wds:
                if wd in owned:
                    owned[wd] -= 1
                    if not owned[wd]:
                        del owned[wd]
                holders = queue.holders.get(wd)
                if holders is None:
                    continue
                holders.discard(subscription)
                if not holders:
                    del queue.holders[wd]
                    if queue.inotify is not None:
                        queue.inotify.remove_watch(wd)
            subscription.wds.clear()
            if not owned:
                queue.owned.pop(owner, None)
            if not queue.subscriptions and queue.inotify is not None:
                # No session needs it: an owner with no session holds no inotify descriptor (the next
                # subscription makes a new one; its queue holds nothing anyone still wants).
                closing, queue.inotify = queue.inotify, None
        self._subscribed[owner] -= 1
        if not self._subscribed[owner]:
            del self._subscribed[owner]
            del self._queue_of[owner]
            if self._own.get(owner) is queue:
                del self._own[owner]
        if queue is self._shared and queue.inotify is None:
            self._shared = None
        return closing


class Subscription:
    """One guard's watches on its owner's instance: the interface of kernel.inotify.Inotify."""

    def __init__(self, hub: InotifyHub, owner: str, queue: _Queue) -> None:
        self.hub = hub
        self.owner = owner                                    # whose budget its watches count against
        self.queue = queue
        self.wds: set[int] = set()
        self.pending: set[int] = set()
        self.overflow = False
        self.closed = False

    def watch_fd(self, dir_fd: int, mask: int = ENTRIES_CHANGED) -> int:
        with self.queue.lock:
            return self.hub._watch(self, dir_fd, mask)        # noqa: SLF001 - the hub's own helper

    def drain(self) -> tuple[set[int], bool]:
        """(this guard's watches that saw an event since its last drain, whether events were lost)."""
        with self.queue.lock:
            self.hub._drain(self.queue)                       # noqa: SLF001
            fired, self.pending = self.pending, set()
            overflow, self.overflow = self.overflow, False
            return fired, overflow

    def close(self) -> None:
        closing = None
        with self.hub._lock:                                  # noqa: SLF001
            if not self.closed:
                self.closed = True
                closing = self.hub._release(self)             # noqa: SLF001
        if closing is not None:                               # its owner's last: the reaper's wait is its own
            closing.close()
