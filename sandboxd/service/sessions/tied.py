"""Sessions that end with the process that created them (CreateSessionRequest.close_with_caller).

`sandboxd mcp` opens a session per MCP connection and closes it when the connection ends; killed
(SIGKILL, the OOM killer) it closes nothing, and each session it leaves counts against its
user's quota until nothing works. A session asked for with close_with_caller is closed by the
daemon itself when that process exits (service.process_ties), like a CloseSession from its owner
(the SessionClosed event says why). The process is kept with the session (the label
``sandboxd.closes-with``: boot, pid, start time), so a daemon that starts after a crash closes
the sessions whose process is gone and ties the others again.
"""

from __future__ import annotations

import logging
import threading

from sandboxd.errors import InvalidPolicy, NotFound
from sandboxd.kernel import peers
from sandboxd.service.callers import Caller
from sandboxd.service.process_ties import ProcessTies
from sandboxd.service.quotas import owner_key
from sandboxd.service.sandbox_hooks import WhenClosed
from sandboxd.service.sessions.registry import Session, SessionRegistry

log = logging.getLogger("sandboxd")
LABEL = "sandboxd.closes-with"
REASON = "the process that created it exited (close_with_caller)"


class TiedSessions:
    def __init__(self, registry: SessionRegistry, ties: ProcessTies) -> None:
        self._registry, self._ties = registry, ties
        self._lock = threading.Lock()
        self._handles: dict[str, int] = {}          # session id -> its tie
        registry.add_hooks(WhenClosed(self._closed))

    @staticmethod
    def labels(who: Caller, labels: dict[str, str], close_with_caller: bool) -> dict[str, str]:
        """The labels to create a session with: the caller's, plus the process to end with."""
        if LABEL in labels:
            raise InvalidPolicy(f"the label {LABEL} is the daemon's own: ask for close_with_caller instead")
        if not close_with_caller:
            return labels
        if who.principal or who.pid <= 0:
            raise InvalidPolicy("close_with_caller needs a local caller on the daemon's Unix socket (a TLS "
                                "caller's process is not known; a pod's is not offered: its ties would be "
                                "counted with every other pod of its uid)")
        key = peers.process_key(who.pid)
        if key is None:
            raise InvalidPolicy(f"close_with_caller: the calling process (pid {who.pid}) has exited")
        return {**labels, LABEL: key}

    def tie(self, session: Session) -> None:
        """End ``session`` with its process (its label), or now if that process is gone."""
        key = session.labels.get(LABEL)
        if not key:
            return
        session_id = session.id
        handle = self._ties.tie(key, lambda: self._end(session_id, session.owner), owner_key(session.owner))
        if handle is None:
            self._end(session_id, session.owner)
            return
        with self._lock:
            self._handles[session_id] = handle
        with session.lock:
            ended = session.closed
        if ended:                                   # closed before the handle was kept: let it go
            self._closed(session_id)

    def restore(self) -> int:
        """After a restart: tie every resumed session again; those whose process is gone are
        closed now. Returns how many were closed."""
        closed = 0
        for session in self._registry.open_sessions():
            if session.labels.get(LABEL):
                before = self._registry.count_open()
                self.tie(session)
                closed += before - self._registry.count_open()
        return closed

    def _end(self, session_id: str, owner: Caller) -> None:
        try:
            self._registry.close(owner, session_id, reason=REASON)
        except NotFound:
            pass                                    # closed meanwhile by its owner

    def _closed(self, session_id: str) -> None:
        with self._lock:
            handle = self._handles.pop(session_id, None)
        if handle is not None:
            self._ties.untie(handle)
