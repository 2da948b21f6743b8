"""Draining: the daemon stops starting work and lets what runs finish, before a restart or an
upgrade (`sandboxd drain`, the Drain RPC; SIGTERM with drain.shutdown = "drain").

``DrainGate`` is what the servicer asks before it starts a session or a call: while draining, the
answer is Draining (UNAVAILABLE, trailing metadata ``sandboxd-retry-after``), and nothing started,
so a client may try again on the next daemon (sandboxd.client.drain_retry). Reads (GetSession,
ListSessions, QueryEvents, WaitCall ...) and the ends of what runs (CloseSession,
StopBackground, ResolveApproval) keep being served. ``stop_running`` is the end of a drain that ran
out of time: each call still running gets an audit event naming why (CallStopped, before it is
killed) and its result says so; each background process still running when the daemon stops gets
one too (``stop_background``).
"""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING

from sandboxd.errors import Draining

if TYPE_CHECKING:
    from collections.abc import Iterable

    from sandboxd.audit.store import EventStore
    from sandboxd.service.call_results import CallResults
    from sandboxd.service.sessions.state import Session

# The hint a refused client gets: the drain's time left, within these bounds (the next daemon
# serves within a second or two of the old one's exit; a client backs off on its own after).
MIN_RETRY_SECONDS = 1
MAX_RETRY_SECONDS = 5


class DrainGate:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deadline: float | None = None      # time.monotonic() when the drain runs out; None: serving

    @property
    def draining(self) -> bool:
        with self._lock:
            return self._deadline is not None

    def begin(self, timeout: float) -> bool:
        """Start refusing new work; False if a drain had begun already (its deadline stays)."""
        with self._lock:
            if self._deadline is not None:
                return False
            self._deadline = time.monotonic() + timeout
            return True

    def refuse_new(self, what: str) -> None:
        """Draining (UNAVAILABLE with the retry hint) while draining: ``what`` (a new session, a
        new call) is not started."""
        with self._lock:
            deadline = self._deadline
        if deadline is None:
            return
        left = math.ceil(deadline - time.monotonic())
        raise Draining(f"no {what} starts until the next daemon serves",
                       max(MIN_RETRY_SECONDS, min(MAX_RETRY_SECONDS, left)))


def running_calls_but_jobs(session: "Session") -> int:
    """The session's running calls, its running background processes left out."""
    with session.lock:
        jobs = sum(1 for job in session.jobs.values() if job.result is None)
        return max(0, sum(session.running.values()) - jobs)


def stop_background(sessions: "Iterable[Session]", store: "EventStore", reason: str) -> int:
    """Record a CallStopped event (``background``: its id and name) for every background process
    still running, before the caller kills them with their sandboxes: a drain does not wait for
    them (they run until stopped), and without a supervisor that outlives the daemon they end
    with it. How many."""
    from sandboxd.audit.store import EventType

    stopped = 0
    for session in sessions:
        with session.lock:
            running = [job for job in session.jobs.values() if job.result is None]
        for job in running:
            try:
                store.append(session.id, EventType.CALL_STOPPED, data={
                    "reason": reason, "background": job.id, "name": job.name, "argv": job.argv})
            except Exception:  # noqa: BLE001 - the store failed: the kill still happens
                continue
            stopped += 1
    return stopped


def stop_running(results: "CallResults", store: "EventStore", reason: str, **detail: object) -> int:
    """Mark every tracked running call as ended by the daemon for ``reason`` (its result says so)
    and record a CallStopped event for each, before the caller kills them. How many."""
    from sandboxd.audit.store import EventType

    stopped = 0
    for call_id, session_id in results.running():
        if not results.end_reason(call_id, reason):
            continue                                    # marked already (a drain that ran out, then the stop)
        try:
            store.append(session_id, EventType.CALL_STOPPED, call_id=call_id, data={"reason": reason, **detail})
        except Exception:  # noqa: BLE001 - the store failed: the kill still happens, the result still says why
            pass
        stopped += 1
    return stopped
