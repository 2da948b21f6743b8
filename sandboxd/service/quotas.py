"""Per-user quotas, fair shares of the pool and the worker reserve: no local user (or TLS
principal), nor any four of them together, can stop the daemon serving the others.

Every RPC handler holds one of the gRPC server's worker threads until it returns. Most return
in milliseconds; some may hold their worker for minutes: Exec and the built-in tools (a long
command, or one held for approval), Authorize (held for approval), WatchEvents and a following
ReadBackgroundOutput (streams). Those *long-lived* handlers take a slot of the *pool* here first:

* the pool: ``workers - reserved_workers`` slots, so ``reserved_workers`` threads always remain
  for the short calls (CreateSession, GetSession, CloseSession, ResolveApproval, GetStatus ...)
  whoever holds the rest;
* per owner (a uid; a TLS caller: its certificate's principal; both are owners alike): at most
  ``calls_per_uid`` running calls and ``streams_per_uid`` streams, and ``sessions_per_uid`` open
  sessions. Start-up refuses per-owner limits with which FAIR_OWNERS (4) owners at their quotas
  would reach into the first-slot share below: any four owners together leave room for a fifth;
* the first-slot share: the last ``first_slot_share`` slots of the pool (an eighth, at least 1)
  go only to an owner that holds no slot at all, so an owner with nothing running is served as
  long as any slot is free, however many owners hold the rest. Local root too is held to it.

Past a limit the call ends at once with RESOURCE_EXHAUSTED naming the limit and its
configuration key. Local root (service.callers decides who that is) is not held to the per-owner
limits, only to the pool and the first-slot share. We bound and reserve rather than grow the
pool or queue: a bigger pool only moves the point where the threads run out, every idle stream
would still cost a thread, and a queued call would hold its worker while it waits.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, TypeVar

from sandboxd.errors import Exhausted
from sandboxd.policy.quota_limits import QuotaLimits
from sandboxd.service.callers import Caller

CALLS = "calls"
STREAMS = "streams"
_K = TypeVar("_K")
def owner_key(who: Caller) -> str:
    """Whom a quota is counted against: a TLS caller's principal, else its uid."""
    return who.principal or f"uid {who.uid}"


def cgroup_owner(who: Caller) -> str:
    """The same owner as ``owner_key`` as a cgroup name part (LaunchSpec.owner): ``uid-1000``, or
    ``tls-`` and a hash of the principal (which may hold any character). Root's own sessions have
    none: like the quotas, root is held only to the total."""
    if who.principal:
        import hashlib

        return "tls-" + hashlib.sha256(who.principal.encode(errors="surrogateescape")).hexdigest()[:20]
    return "" if who.is_root else f"uid-{who.uid}"


class Quotas:
    """Counts long-lived handlers per owner and in total (thread-safe; O(1) per call)."""

    def __init__(self, limits: QuotaLimits | None = None) -> None:
        self.limits = limits or QuotaLimits()
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], int] = {}
        self._by_owner: dict[str, int] = {}   # owner -> slots held, calls and streams together
        self._total = 0

    def _per_owner_limit(self, kind: str) -> tuple[int, str]:
        if kind == CALLS:
            return self.limits.calls_per_uid, "quotas.calls_per_uid"
        return self.limits.streams_per_uid, "quotas.streams_per_uid"

    @contextmanager
    def hold(self, who: Caller, kind: str) -> Iterator[None]:
        """A slot for one long-lived handler of ``kind`` (CALLS or STREAMS) while the block runs;
        Exhausted, naming the limit and its key, when none is free."""
        owner = owner_key(who)
        key = (owner, kind)
        limit, setting = self._per_owner_limit(kind)
        with self._lock:
            if not who.is_root and self._held.get(key, 0) >= limit:
                what = "running calls (Exec, file tools, approvals)" if kind == CALLS else "open streams"
                raise Exhausted(f"{owner} already has {limit} {what}, its limit ({setting}): "
                                "wait for one to end or end one first")
            if self._total >= self.limits.long_lived_total:
                raise Exhausted(f"the daemon is serving its maximum of {self.limits.long_lived_total} long-lived "
                                "calls and streams (listen.workers minus quotas.reserved_workers): try again later")
            holds = self._by_owner.get(owner, 0)
            if holds and self._total >= self.limits.shared:
                raise Exhausted(f"{owner} already holds {holds} long-lived calls and streams, and the daemon keeps "
                                f"its last {self.limits.first_slot_share} for users that hold none (the first-slot "
                                "share of listen.workers): wait for one of yours to end")
            self._held[key] = self._held.get(key, 0) + 1
            self._by_owner[owner] = holds + 1
            self._total += 1
        try:
            yield
        finally:
            with self._lock:
                _decrement(self._held, key)
                _decrement(self._by_owner, owner)
                self._total -= 1

    def check_sessions(self, who: Caller, open_sessions: int) -> None:
        """Refuse a new session when ``who`` already holds ``open_sessions`` at its limit."""
        if who.is_root:
            return
        limit = self.limits.sessions_per_uid
        if open_sessions >= limit:
            raise Exhausted(f"{owner_key(who)} already has {limit} open sessions, its limit "
                            "(quotas.sessions_per_uid): close some first")

    def usage(self, who: Caller) -> dict[str, int]:
        """The caller's long-lived handlers now, and the total."""
        owner = owner_key(who)
        with self._lock:
            return {CALLS: self._held.get((owner, CALLS), 0), STREAMS: self._held.get((owner, STREAMS), 0),
                    "long_lived_total": self._total}


def _decrement(counts: dict[_K, int], key: _K) -> None:
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]
