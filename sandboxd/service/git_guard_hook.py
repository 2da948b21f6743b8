"""The git guard as a session's hooks: it watches the session's writable roots while
.git/config is protected (the default), and after each call neutralises the git configuration
the call planted (gitguard/guard.py), one event and one log line each."""

from __future__ import annotations

import logging
from typing import Iterable

from sandboxd.audit.store import EventStore, EventType
from sandboxd.policy.git_config import GIT_GUARD_SUBPATH
from sandboxd.service.quotas import owner_key
from sandboxd.service.sandbox_hooks import Sandbox, SandboxHooks, Service
from sandboxd.service.sessions.state import Session
from sandboxd.gitguard.guard import GitGuard
from sandboxd.gitguard.watch import InotifyHub

log = logging.getLogger("sandboxd")


class GitGuardHook(SandboxHooks):
    def __init__(self, store: EventStore, watches_per_owner: int = 0, instances: int = 0) -> None:
        self._store = store
        # An inotify instance per owner, shared by that owner's guards (at most ``instances``:
        # quotas.git_inotify_instances, then a shared one); each owner's guards together hold at most
        # watches_per_owner of root's watches (quotas.git_watches_per_uid), then walk instead.
        self._watch = InotifyHub(watches_per_owner, instances)

    def sandbox_ready(self, session: Session, sandbox: Sandbox) -> Iterable[Service]:
        """The generation's roots, as the fork server built them (their real paths, resolved as the
        owner by descriptor: never looked up again here, as root, where a swapped symlink would make
        the guard watch and rewrite someone else's repository): a root new to the guard is taken as
        it is now (what the user had is theirs). The baseline walk runs under the session's
        build_lock only."""
        policy, info = sandbox.policy, sandbox.info
        roots: list[str] = []
        # In review mode nothing a call writes reaches the host: what the guard would remove is
        # flagged in the change set instead (review.rules), and nothing has to run after a call.
        if policy.workspace_writable and GIT_GUARD_SUBPATH in policy.protected_subpaths and not session.review:
            roots = [info.workspace, *info.writable_roots]
        guard = session.git_guard
        if guard is None:
            if roots:
                guard = GitGuard(roots, hub=self._watch, owner=owner_key(session.owner))
                with session.lock:
                    session.git_guard = guard
        else:
            guard.set_roots(roots)
        return ()

    def call_ended(self, session: Session) -> None:
        guard = session.git_guard
        if guard is None:
            return
        lost = guard.overflows
        found = guard.inspect()
        if guard.overflows != lost:
            log.debug("session %s: git guard: inotify events were lost (its owner's queue overflowed): it looked "
                      "at every directory of its roots", session.id)
        if found:
            self._store.note(session.id, [      # the call chose how many: counted past its owner's budget
                (EventType.GIT_CONFIG_NEUTRALIZED, "", "", {"repo": n.repo, "what": n.what, "key": n.key})
                for n in found])
        for item in found:
            log.warning("session %s: %s", session.id, item.describe())

    def session_closed(self, session: Session, stopping: bool) -> None:
        """The last look (every process of the session is gone), then the guard stops."""
        try:
            self.call_ended(session)
        finally:
            with session.lock:
                guard, session.git_guard = session.git_guard, None
            if guard is not None:
                guard.close()
