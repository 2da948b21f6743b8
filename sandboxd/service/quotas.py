"""Per-user quotas, fair shares of the workers and the worker reserve: no local user (or TLS
principal), nor any four of them together, can stop the daemon serving the others, whatever the
RPC.

Every RPC handler holds one of the gRPC server's worker threads until it returns, so every one
takes a slot here first, of one kind (the servicer says which):

* *calls* and *streams*, the long-lived handlers, which may hold their worker for minutes: Exec
  and the built-in tools (a long command, or one held for approval), Authorize (held for
  approval); WatchEvents, a following ReadBackgroundOutput and server reflection (streams);
* *requests*: every other RPC (CreateSession, UpdateSessionPolicy, CloseSession, the standing
  rules, GetStatus ...). Most return in milliseconds, but one that names a path waits on it, as
  its caller, for up to fork_server.wait_seconds: a FUSE mount whose server never answers makes
  every such request last that long, so a flood of them used to hold every worker.

The rules:

* the pool: calls and streams take at most ``workers - reserved_workers`` slots, so
  ``reserved_workers`` threads always remain for requests, whoever holds the rest;
* per owner (a uid; a TLS caller: its certificate's principal; under tenancy by pod, a caller in
  a pod: its pod, uid 0 included; all are owners alike): at most
  ``calls_per_uid`` running calls, ``streams_per_uid`` streams, ``requests_per_uid`` requests in
  progress and ``sessions_per_uid`` open sessions; of its calls, at most ``terminals_per_uid`` on
  a terminal. Start-up refuses per-owner limits with which FAIR_OWNERS (4) owners at their quotas
  would reach into a first-slot share below: any four owners together leave room for a fifth;
* the first-slot shares: the last ``first_slot_share`` slots of the pool (an eighth, at least 1)
  go only to an owner that holds no call or stream, and the last ``first_slot_share`` of all the
  workers only to an owner with no request in progress, so an owner with nothing running is served
  as long as any slot is free, however many owners hold the rest. Local root too is held to them.

Past a limit the call ends at once with RESOURCE_EXHAUSTED naming the limit and its
configuration key. Local root (service.callers decides who that is) is not held to the per-owner
limits, only to the pool and the first-slot shares, and to its own session quota
(``quotas.root_sessions``, larger than an owner's). We bound and reserve rather than grow the
pool or queue: a bigger pool only moves the point where the threads run out, every idle stream
would still cost a thread, and a queued call would hold its worker while it waits.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, TypeVar

from sandboxd.errors import Exhausted
from sandboxd.policy.quota_limits import QuotaLimits
from sandboxd.service.callers import Caller, principal_of

CALLS = "calls"
STREAMS = "streams"
REQUESTS = "requests"
TERMINALS = "terminals"
_WHAT = {CALLS: "running calls (Exec, file tools, approvals)", STREAMS: "open streams",
         REQUESTS: "requests in progress (CreateSession, UpdateSessionPolicy, CloseSession, standing rules ...: "
                   "every call that is not a running command or a stream)"}
_K = TypeVar("_K")
def owner_key(who: Caller) -> str:
    """Whom a quota is counted against: a TLS caller's principal, else its uid."""
    return who.principal or uid_owner(who.uid)


def uid_owner(uid: int) -> str:
    """``owner_key`` of a local caller of ``uid``."""
    return f"uid {uid}"


def cgroup_owner(who: Caller) -> str:
    """The same owner as ``owner_key`` as a cgroup name part (LaunchSpec.owner): ``uid-1000``,
    ``pod-<UID>``, or ``tls-`` and a hash of the principal (which may hold any character). Root's
    own sessions have none: like the quotas, root is held only to the total."""
    if who.principal:
        return principal_of(who).key
    return "" if who.is_root else f"uid-{who.uid}"


class Quotas:
    """Counts every RPC handler per owner and in total (thread-safe; O(1) per call)."""

    def __init__(self, limits: QuotaLimits | None = None) -> None:
        self.limits = limits or QuotaLimits()
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], int] = {}
        self._by_owner: dict[str, int] = {}   # owner -> slots held, calls and streams together
        self._total = 0                       # calls and streams: the pool's slots held
        self._requests = 0
        self._terminals: dict[str, int] = {}

    def _per_owner_limit(self, kind: str) -> tuple[int, str]:
        return {CALLS: (self.limits.calls_per_uid, "quotas.calls_per_uid"),
                STREAMS: (self.limits.streams_per_uid, "quotas.streams_per_uid"),
                REQUESTS: (self.limits.requests_per_uid, "quotas.requests_per_uid")}[kind]

    @contextmanager
    def hold(self, who: Caller, kind: str) -> Iterator[None]:
        """A slot for one handler of ``kind`` (CALLS, STREAMS or REQUESTS) while the block runs;
        Exhausted, naming the limit and its key, when none is free."""
        owner = owner_key(who)
        key = (owner, kind)
        limit, setting = self._per_owner_limit(kind)
        with self._lock:
            held = self._held.get(key, 0)
            if not who.is_root and held >= limit:
                raise Exhausted(f"{owner} already has {limit} {_WHAT[kind]}, its limit ({setting}): "
                                "wait for one to end or end one first")
            if kind == REQUESTS:
                self._admit_request(owner, held)
            else:
                self._admit_long_lived(owner)
            self._held[key] = held + 1
        try:
            yield
        finally:
            with self._lock:
                _decrement(self._held, key)
                if kind == REQUESTS:
                    self._requests -= 1
                else:
                    _decrement(self._by_owner, owner)
                    self._total -= 1

    def _admit_long_lived(self, owner: str) -> None:
        """A call or stream: within the pool, and not from the first-slot share for an owner holding one."""
        if self._total + self._requests >= self.limits.workers:
            raise _all_busy(self.limits.workers)
        if self._total >= self.limits.long_lived_total:
            raise Exhausted(f"the daemon is serving its maximum of {self.limits.long_lived_total} long-lived "
                            "calls and streams (listen.workers minus quotas.reserved_workers): try again later")
        holds = self._by_owner.get(owner, 0)
        if holds and self._total >= self.limits.shared:
            raise Exhausted(f"{owner} already holds {holds} long-lived calls and streams, and the daemon keeps "
                            f"its last {self.limits.first_slot_share} for users that hold none (the first-slot "
                            "share of listen.workers): wait for one of yours to end")
        self._by_owner[owner] = holds + 1
        self._total += 1

    def _admit_request(self, owner: str, held: int) -> None:
        """A request: any worker the calls and streams leave, and not from the last first-slot share of
        them for an owner with a request in progress already."""
        busy = self._total + self._requests
        if busy >= self.limits.workers:
            raise _all_busy(self.limits.workers)
        share = self.limits.first_slot_share
        if held and busy >= self.limits.workers - share:
            raise Exhausted(f"{owner} already has {held} requests in progress, and the daemon keeps its last {share} "
                            "workers for users that have none (the first-slot share of listen.workers): wait for one "
                            "of yours to end")
        self._requests += 1

    @contextmanager
    def terminal(self, who: Caller) -> Iterator[None]:
        """One of ``who``'s calls on a terminal while the block runs (it holds its CALLS slot too);
        Exhausted naming quotas.terminals_per_uid past it."""
        owner = owner_key(who)
        limit = self.limits.terminals_per_uid
        with self._lock:
            held = self._terminals.get(owner, 0)
            if not who.is_root and held >= limit:
                raise Exhausted(f"{owner} already has {limit} calls on a terminal (sandboxctl shell, Exec with a "
                                "terminal), its limit (quotas.terminals_per_uid): end one first")
            self._terminals[owner] = held + 1
        try:
            yield
        finally:
            with self._lock:
                _decrement(self._terminals, owner)

    def check_sessions(self, who: Caller, open_sessions: int) -> None:
        """Refuse a new session when ``who`` already holds ``open_sessions`` at its limit: root's
        own, quotas.root_sessions (a separate, larger one: root's callers are often many agents)."""
        limit, key = ((self.limits.root_sessions, "quotas.root_sessions") if who.is_root
                      else (self.limits.sessions_per_uid, "quotas.sessions_per_uid"))
        if open_sessions >= limit:
            raise Exhausted(f"{owner_key(who)} already has {limit} open sessions, its limit "
                            f"({key}): close some first")

    def usage(self, who: Caller) -> dict[str, int]:
        """The caller's handlers and terminals now; everyone's calls and streams (``long_lived_total``)
        and handlers of every kind (``workers_busy``)."""
        owner = owner_key(who)
        with self._lock:
            return {CALLS: self._held.get((owner, CALLS), 0), STREAMS: self._held.get((owner, STREAMS), 0),
                    REQUESTS: self._held.get((owner, REQUESTS), 0), TERMINALS: self._terminals.get(owner, 0),
                    "long_lived_total": self._total, "workers_busy": self._total + self._requests}


def _all_busy(workers: int) -> Exhausted:
    return Exhausted(f"the daemon is serving its maximum of {workers} calls at once (listen.workers): try again later")


def _decrement(counts: dict[_K, int], key: _K) -> None:
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]
