"""What the daemon serves a session beside its sandbox, wired once.

Each service (published ports, the egress proxy, the git guard, what the environment and the
servicer remember of a session) is a ``SandboxHooks`` registered with the registry at start;
the lifecycle calls the hooks at three points, and nothing else calls a service:

- ``sandbox_ready(session, sandbox)``: a sandbox generation was built (CreateSession, a policy
  change, a resumed session's rebuild), before any call can join it. It returns what it serves
  for that generation; the lifecycle closes those when the generation closes (its last call
  ended after a policy change, CloseSession, the fork server's loss, the daemon's stop). A hook
  that raises fails the build, and what the hooks before it started is closed.
- ``call_ended(session)``: a call (or background process) ended, before its caller hears so.
- ``session_closed(session, stopping)``: every sandbox of the session is gone, after its last
  call: CloseSession, or (``stopping``) the daemon stops, and the session stays open in the
  store, to be resumed by the next daemon.

The last two never fail the call or the close: an error there is logged (and is a bug). Hooks
run in the order registered, never under the registry's lock nor the session's ``lock``;
``sandbox_ready`` and CloseSession's ``session_closed`` run under the session's ``build_lock``
(one builder per session at a time, so a hook sees a session's generations in order).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable, Iterable, Protocol

from sandboxd._record import Record
from sandboxd.policy import SandboxPolicy

if TYPE_CHECKING:
    from sandboxd.service.sessions.state import Session
    from sandboxd.supervisor.fork_client import SessionInfo

log = logging.getLogger("sandboxd")


class Service(Protocol):
    """Something served for one sandbox generation (a published port, an egress proxy)."""

    def close(self) -> None: ...


class Sandbox(Record):
    """One sandbox generation as the fork server built it."""

    generation: int
    policy: SandboxPolicy
    info: "SessionInfo"


class SandboxHooks:
    """A service's hooks; each does nothing unless the service overrides it."""

    def sandbox_ready(self, session: Session, sandbox: Sandbox) -> Iterable[Service]:
        return ()

    def call_ended(self, session: Session) -> None:
        pass

    def session_closed(self, session: Session, stopping: bool) -> None:
        pass


class WhenClosed(SandboxHooks):
    """Forget a closed session: ``forget(session_id)`` (a cache, held approvals, background
    processes' records). Not when the daemon stops: the session is not closed then."""

    def __init__(self, forget: Callable[[str], None]) -> None:
        self._forget = forget

    def session_closed(self, session: Session, stopping: bool) -> None:
        if not stopping:
            self._forget(session.id)


class HookList:
    """The registered hooks, called in order. Registered at start; adding later is safe too."""

    def __init__(self, hooks: Iterable[SandboxHooks] = ()) -> None:
        self._lock = threading.Lock()
        self._hooks: tuple[SandboxHooks, ...] = tuple(hooks)

    def add(self, hooks: SandboxHooks) -> None:
        with self._lock:
            self._hooks = (*self._hooks, hooks)

    def sandbox_ready(self, session: Session, sandbox: Sandbox) -> list[Service]:
        served: list[Service] = []
        try:
            for hooks in self._hooks:
                served.extend(hooks.sandbox_ready(session, sandbox))
        except BaseException:
            close_all(served)
            raise
        return served

    def call_ended(self, session: Session) -> None:
        for hooks in self._hooks:
            try:
                hooks.call_ended(session)
            except Exception:  # noqa: BLE001 - logged; the call's own result stands
                log.exception("session %s: %s failed after a call", session.id, type(hooks).__name__)

    def session_closed(self, session: Session, stopping: bool = False) -> None:
        for hooks in self._hooks:
            try:
                hooks.session_closed(session, stopping)
            except Exception:  # noqa: BLE001 - logged; the session is closed regardless
                log.exception("session %s: %s failed at its close", session.id, type(hooks).__name__)


def close_all(services: Iterable[Service]) -> None:
    """Close each, whatever the others do (their sandbox may be gone already)."""
    for service in services:
        try:
            service.close()
        except Exception:  # noqa: BLE001 - the rest are closed regardless; logged
            log.exception("closing %s failed", type(service).__name__)
