"""sessions.idle_expiry_seconds: a session with no call for that long is closed, with a
SessionClosed event whose reason is ``idle_expiry``, so a crashed agent's sessions do not hold
their sandboxes (and their owner's session quota) for good.

Idle means: no call began or ended for that long (Session.last_active), none runs now, and no
background process of it runs. One thread of the daemon's looks every CHECK_SECONDS (less for a
short expiry), not a timer per session; the close is judged under the session's lock, which a
call takes to begin, so a call that begins meanwhile is never cut (lifecycle.close's only_if).
The clock is this daemon's: a session resumed after a restart counts from the restart.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from sandboxd.errors import NotFound

if TYPE_CHECKING:
    from sandboxd.service.sessions.registry import SessionRegistry
    from sandboxd.service.sessions.state import Session

log = logging.getLogger("sandboxd")

REASON = "idle_expiry"
CHECK_SECONDS = 60.0
MIN_CHECK_SECONDS = 0.5


class IdleExpiry:
    """Closes idle sessions from a thread of its own (``start``, ``stop``), or once (``sweep``).
    ``idle_seconds`` 0: never (the thread is not started)."""

    def __init__(self, registry: "SessionRegistry", idle_seconds: float) -> None:
        self._registry, self.idle_seconds = registry, idle_seconds
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sandboxd-idle-expiry", daemon=True)

    def start(self) -> None:
        if self.idle_seconds > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        interval = max(MIN_CHECK_SECONDS, min(CHECK_SECONDS, self.idle_seconds / 4))
        while not self._stopping.wait(interval):
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - a close that failed: logged, the next sweep tries again
                log.exception("closing idle sessions failed")

    def idle(self, session: "Session", now: float) -> bool:
        """Whether ``session`` is idle past the expiry (the caller holds its lock)."""
        return (not any(session.running.values()) and not any(job.result is None for job in session.jobs.values())
                and now - session.last_active >= self.idle_seconds)

    def sweep(self) -> list[str]:
        """Close every session idle past the expiry; their ids."""
        closed = []
        now = time.monotonic()
        for session in self._registry.open_sessions():
            with session.lock:
                candidate = self.idle(session, now)
            if not candidate:
                continue
            try:
                if self._registry.close(session.owner, session.id, reason=REASON,
                                        only_if=lambda s: self.idle(s, time.monotonic())):
                    closed.append(session.id)
                    log.info("closed an idle session", extra={"fields": {"session_id": session.id,
                                                                         "idle_seconds": self.idle_seconds}})
            except NotFound:
                pass                                    # closed meanwhile
        return closed
