"""The daemon's sessions by id: the registry's one global lock, and what it guards.

The lock is held only to look up, insert or remove entries and to read the counts, never across
I/O, a build, a fork-server request or a hook: nothing here calls out. A session's own state is
under its own lock (sessions.state); one session's slow build or close cannot make another's
lookup wait. Counts are kept as sessions come and go, so creating one costs the same at any fill.
"""

from __future__ import annotations

import threading

from sandboxd.errors import Exhausted
from sandboxd.service.quotas import Quotas, owner_key
from sandboxd.service.sessions.state import Session


class SessionTable:
    def __init__(self, max_sessions: int, quotas: Quotas) -> None:
        self._max = max_sessions
        self._quotas = quotas
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._by_owner: dict[str, int] = {}        # owner_key -> sessions held (building ones included)
        # PID namespaces (inode numbers) of the live sandboxes, by fork-server name: a connection
        # from a process inside one of them is refused (sandboxed_peers).
        self._namespaces: dict[str, int] = {}

    def add(self, session: Session, *, check: bool = True) -> None:
        """Insert a new session (ids are random: never one already held). With ``check``, refused
        when the daemon or its owner holds the maximum (RESOURCE_EXHAUSTED saying which)."""
        owner = owner_key(session.owner)
        with self._lock:
            if check:
                if len(self._sessions) >= self._max:
                    raise Exhausted(f"the daemon holds its maximum of {self._max} sessions: close some first")
                self._quotas.check_sessions(session.owner, self._by_owner.get(owner, 0))
            self._sessions[session.id] = session
            self._by_owner[owner] = self._by_owner.get(owner, 0) + 1

    def remove(self, session_id: str) -> Session | None:
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is not None:
                owner = owner_key(session.owner)
                left = self._by_owner[owner] - 1
                if left:
                    self._by_owner[owner] = left
                else:
                    del self._by_owner[owner]
            return session

    def find(self, session_id: str) -> Session | None:
        with self._lock:
            return self._sessions.get(session_id)

    def all(self) -> list[Session]:
        """Every session held, building and closing ones included (callers filter)."""
        with self._lock:
            return list(self._sessions.values())

    def take_all(self) -> list[Session]:
        """Every session, removed (the daemon stops)."""
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
            self._by_owner.clear()
            return sessions

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def held_by(self, owner: str) -> int:
        """Sessions counted against ``owner`` (an ``owner_key``)."""
        with self._lock:
            return self._by_owner.get(owner, 0)

    # -- sandboxes' PID namespaces -------------------------------------------------------------

    def set_namespace(self, sandbox: str, namespace: int) -> None:
        with self._lock:
            self._namespaces[sandbox] = namespace

    def drop_namespace(self, sandbox: str) -> None:
        with self._lock:
            self._namespaces.pop(sandbox, None)

    def namespaces(self) -> set[int]:
        with self._lock:
            return set(self._namespaces.values())
