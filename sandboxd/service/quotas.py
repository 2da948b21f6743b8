"""Per-user quotas and the worker reserve: one local user (or TLS principal) cannot stop the
daemon serving the others.

Every RPC handler holds one of the gRPC server's worker threads until it returns. Most return
in milliseconds; some may hold their worker for minutes: Exec and the built-in tools (a long
command, or one held for approval), Authorize (held for approval), WatchEvents and a following
ReadBackgroundOutput (streams). Those *long-lived* handlers take a slot here first:

* per owner (a uid; a TLS caller: its certificate's principal): at most ``calls_per_uid``
  running calls and ``streams_per_uid`` streams, and ``sessions_per_uid`` open sessions;
* in total: at most ``workers - reserved_workers`` long-lived handlers, so ``reserved_workers``
  threads always remain for the short calls (CreateSession, GetSession, CloseSession,
  ResolveApproval, GetStatus ...) whoever holds the rest.

Past a limit the call ends at once with RESOURCE_EXHAUSTED naming the limit and its
configuration key. Root (uid 0, local) is not held to the per-owner limits, only to the total.
We bound and reserve rather than grow the pool: a bigger pool only moves the point where the
threads run out, and every idle stream would still cost a thread.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from sandboxd._record import Record
from sandboxd.errors import Exhausted, InvalidPolicy
from sandboxd.service.peercred import PeerCredentials

CALLS = "calls"
STREAMS = "streams"


class QuotaLimits(Record):
    """The ``[quotas]`` settings (sandboxd.config documents each)."""

    sessions_per_uid: int = 64
    calls_per_uid: int = 16
    streams_per_uid: int = 8
    reserved_workers: int = 0             # 0: a quarter of the workers, at least 1
    workers: int = 64                     # listen.workers: the pool the reserve is taken from

    def __post_init__(self) -> None:
        if self.reserved_workers == 0:
            object.__setattr__(self, "reserved_workers", max(1, self.workers // 4))
        if self.workers < 2:
            raise InvalidPolicy("listen.workers must be at least 2: one for running calls, one kept for short calls")
        if not 1 <= self.reserved_workers < self.workers:
            raise InvalidPolicy(f"quotas.reserved_workers ({self.reserved_workers}) must be at least 1 and below "
                                f"listen.workers ({self.workers}): raise listen.workers or lower the reserve")

    @property
    def long_lived_total(self) -> int:
        return self.workers - self.reserved_workers


def owner_key(who: PeerCredentials) -> str:
    """Whom a quota is counted against: a TLS caller's principal, else its uid."""
    return who.principal or f"uid {who.uid}"


def cgroup_owner(who: PeerCredentials) -> str:
    """The same owner as ``owner_key`` as a cgroup name part (LaunchSpec.owner): ``uid-1000``, or
    ``tls-`` and a hash of the principal (which may hold any character). Root's own sessions have
    none: like the quotas, root is held only to the total."""
    if who.principal:
        import hashlib

        return "tls-" + hashlib.sha256(who.principal.encode(errors="surrogateescape")).hexdigest()[:20]
    return "" if who.uid == 0 else f"uid-{who.uid}"


class Quotas:
    """Counts long-lived handlers per owner and in total (thread-safe; O(1) per call)."""

    def __init__(self, limits: QuotaLimits | None = None) -> None:
        self.limits = limits or QuotaLimits()
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], int] = {}
        self._total = 0

    def _per_owner_limit(self, kind: str) -> tuple[int, str]:
        if kind == CALLS:
            return self.limits.calls_per_uid, "quotas.calls_per_uid"
        return self.limits.streams_per_uid, "quotas.streams_per_uid"

    @contextmanager
    def hold(self, who: PeerCredentials, kind: str) -> Iterator[None]:
        """A slot for one long-lived handler of ``kind`` (CALLS or STREAMS) while the block runs;
        Exhausted, naming the limit and its key, when none is free."""
        key = (owner_key(who), kind)
        limit, setting = self._per_owner_limit(kind)
        exempt = who.uid == 0 and not who.principal
        with self._lock:
            if not exempt and self._held.get(key, 0) >= limit:
                what = "running calls (Exec, file tools, approvals)" if kind == CALLS else "open streams"
                raise Exhausted(f"{key[0]} already has {limit} {what}, its limit ({setting}): "
                                "wait for one to end or end one first")
            if self._total >= self.limits.long_lived_total:
                raise Exhausted(f"the daemon is serving its maximum of {self.limits.long_lived_total} long-lived "
                                "calls and streams (listen.workers minus quotas.reserved_workers): try again later")
            self._held[key] = self._held.get(key, 0) + 1
            self._total += 1
        try:
            yield
        finally:
            with self._lock:
                left = self._held[key] - 1
                if left:
                    self._held[key] = left
                else:
                    del self._held[key]
                self._total -= 1

    def check_sessions(self, who: PeerCredentials, open_sessions: int) -> None:
        """Refuse a new session when ``who`` already holds ``open_sessions`` at its limit."""
        if who.uid == 0 and not who.principal:
            return
        limit = self.limits.sessions_per_uid
        if open_sessions >= limit:
            raise Exhausted(f"{owner_key(who)} already has {limit} open sessions, its limit "
                            "(quotas.sessions_per_uid): close some first")

    def usage(self, who: PeerCredentials) -> dict[str, int]:
        """The caller's long-lived handlers now, and the total."""
        owner = owner_key(who)
        with self._lock:
            return {CALLS: self._held.get((owner, CALLS), 0), STREAMS: self._held.get((owner, STREAMS), 0),
                    "long_lived_total": self._total}
