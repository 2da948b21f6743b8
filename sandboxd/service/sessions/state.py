"""One session's state, and the one lock that guards it.

A session's mutable fields are read-modified-written only under its own ``lock``, held for a
moment and never across I/O; building or closing one of its sandbox generations (slow: the fork
server) happens under its ``build_lock`` instead, taken first, which orders that session's
builders (policy changes, a resumed session's rebuild, the fork server's loss, CloseSession) one
at a time. Neither lock is ever taken for another session: one session's slow build or close
holds no one else's lookup or call (the registry's own lock covers only its map: sessions.table).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from sandboxd.audit.store import SessionRow
from sandboxd.policy import Limits, SandboxPolicy
from sandboxd.policy.decision import ApprovalPolicy, ToolRules, approval_policy
from sandboxd.policy.spec import policy_from_dict, policy_to_dict
from sandboxd.service.callers import Caller, session_owner

if TYPE_CHECKING:
    from sandboxd.service.background import BackgroundJob
    from sandboxd.service.sandbox_hooks import Service
    from sandboxd.gitguard.guard import GitGuard
    from sandboxd.network.interception.ca import SessionCA
    from sandboxd.service.credential_vault import SessionCredentials
    from sandboxd.service.sessions.network_live import LiveNetwork
    from sandboxd.supervisor.fork_client import SessionInfo


class Session:
    """One session. Its mutable fields (policy, approval, generation, running, closed, building,
    sandbox_ready, workspace, services, extra_env, git_guard, sandbox_builds, jobs) change only
    under ``lock``; see the module's docstring for ``build_lock``."""

    def __init__(self, session_id: str, owner: Caller, workspace: str, policy: SandboxPolicy,
                 approval: ApprovalPolicy, limits: Limits, labels: dict[str, str], rules: ToolRules | None = None,
                 created_at: float | None = None, env: dict[str, str] | None = None, review: bool = False) -> None:
        self.id = session_id
        self.owner = owner
        self.workspace = workspace
        self.policy = policy
        self.approval = approval
        self.rules = rules or ToolRules()
        self.limits = limits
        self.labels = labels
        self.env = dict(env or {})            # the session's own variables (service.environment); never changed
        # Review mode: its roots are overlays whose change set is kept in review_dir (under the state
        # directory, per session): fixed at creation, kept across restarts.
        self.review = review
        self.created_at = created_at or time.time()
        self.generation = 1
        self.running: dict[int, int] = {}     # generation -> running calls
        # time.monotonic() of its last call's start or end (or its making, or this daemon's start for
        # a resumed one): sessions.idle_expiry_seconds counts from it (service.idle_expiry).
        self.last_active = time.monotonic()
        self.closed = False
        # True while CreateSession builds its first sandbox: counted (quotas) but not found by
        # anyone yet, so no call can start on a sandbox that does not exist.
        self.building = False
        # False for a session resumed after a daemon restart: its sandbox is rebuilt by its next call.
        self.sandbox_ready = True
        self.lock = threading.Lock()
        self.build_lock = threading.Lock()
        # What the daemon serves for each sandbox generation (published ports, the egress proxy),
        # from the hooks (sandbox_hooks); closed with that generation.
        self.services: dict[int, list[Service]] = {}
        self.extra_env: dict[str, str] = {}   # added to every call's environment (the proxy variables)
        self.git_guard: GitGuard | None = None  # set by git_guard_hook: inspects the writable roots after each call
        self.sandbox_builds = 0               # sandboxes built so far (any generation): what was made in one is gone in the next
        # What the fork server built for each live generation (its real workspace and writable roots,
        # resolved as the owner by descriptor; its addresses), from the build until the generation
        # closes: every check of a path against the session's roots uses these, never a lookup of the
        # policy's names by the daemon (``facts``).
        self.built: dict[int, SessionInfo] = {}
        self.jobs: dict[str, BackgroundJob] = {}  # its background processes by id (service.background)
        # The execution contexts of its commands running now (Exec's execution_context_id -> how
        # many; "" counts the untagged ones): a network question is shown to the one asking client
        # when there is one.
        self.exec_contexts: dict[str, int] = {}
        # Its credentials' secrets and phantoms, in daemon memory only (service.credential_vault),
        # replaced whole by a change; wiped when it closes.
        self.credentials: SessionCredentials | None = None
        self.daemon_secrets: dict[str, str] = {}  # as the store kept them: VAR -> [network.secrets] NAME
        self.ca: SessionCA | None = None      # the CA its proxy ends TLS with (a proxied session): its key stays here
        self.live_network: LiveNetwork | None = None  # how its network policy changes live (network_live)

    @contextlib.contextmanager
    def running_in(self, context_id: str) -> Iterator[None]:
        """While a command of the execution context ``context_id`` ("" for none) runs."""
        self.context_began(context_id)
        try:
            yield
        finally:
            self.context_ended(context_id)

    def context_began(self, context_id: str) -> None:
        """A command of ``context_id`` runs, until ``context_ended`` (running_in; a call a new
        daemon adopted, counted as untagged: handover.adopt)."""
        with self.lock:
            self.exec_contexts[context_id] = self.exec_contexts.get(context_id, 0) + 1

    def context_ended(self, context_id: str) -> None:
        with self.lock:
            left = self.exec_contexts.pop(context_id, 1) - 1
            if left:
                self.exec_contexts[context_id] = left

    def only_context(self) -> str:
        """The execution context of every command running now, when there is exactly one (else "").
        An untagged command or a background process running beside it (whose connections may be the
        ones asking) makes it none: the question is then another client's as likely as this one's."""
        with self.lock:
            if len(self.exec_contexts) != 1 or any(job.result is None for job in self.jobs.values()):
                return ""
            return next(iter(self.exec_contexts))

    def to_row(self, closed_at: float | None = None) -> SessionRow:
        """What the store keeps of it (the caller holds ``lock``, or the session is not shared yet)."""
        return SessionRow(self.id, self.owner.uid, self.owner.gid, self.owner.principal, self.workspace,
                          policy_to_dict(self.policy), self.approval, rules_to_dict(self.rules),
                          self.limits.as_dict(), dict(self.labels), self.created_at, closed_at, dict(self.env),
                          self.review, self.credentials.daemon_sources() if self.credentials is not None
                          else dict(self.daemon_secrets))

    def axes(self) -> dict[str, object]:
        """Both policy axes, as events record them."""
        return {"sandbox_policy": policy_to_dict(self.policy), "approval_policy": self.approval,
                "permission_mode": self.rules.mode or None}

    def sandbox_name(self, generation: int | None = None) -> str:
        """The session's name in the fork server, one per sandbox generation."""
        return f"{self.id}#{generation or self.generation}"

    @property
    def facts(self) -> SessionInfo | None:
        """What the fork server built for the current generation; None while it has no sandbox (a
        session resumed after a restart or the fork server's loss, until its next build:
        SessionRegistry.ready)."""
        with self.lock:
            return self.built.get(self.generation)

    @property
    def running_calls(self) -> int:
        with self.lock:                               # begin_call and end_call change it from other threads
            return sum(self.running.values())

    @property
    def usable(self) -> bool:
        """Whether callers may find it: built, and not closed."""
        with self.lock:
            return not self.closed and not self.building


def session_from_row(row: SessionRow) -> Session:
    """A session as the store kept it: its sandbox is rebuilt by its next call."""
    owner = session_owner(row.owner_uid, row.owner_gid, row.owner_principal)
    session = Session(row.id, owner, row.workspace, policy_from_dict(row.sandbox_policy),
                      approval_policy(row.approval_policy),
                      Limits(**row.limits), dict(row.labels), rules_from_dict(row.tool_rules),
                      created_at=row.created_at, env=dict(row.env), review=row.review)
    session.sandbox_ready = False
    session.daemon_secrets = dict(row.daemon_secrets)
    return session


def rules_to_dict(rules: ToolRules) -> dict[str, object]:
    return {"hidden": sorted(rules.hidden), "always_ask": sorted(rules.always_ask), "mode": rules.mode}


def _names(data: dict[str, object], key: str) -> list[str]:
    value = data.get(key) or ()
    return [str(name) for name in value] if isinstance(value, (list, tuple)) else []


def rules_from_dict(data: dict[str, object]) -> ToolRules:
    return ToolRules(hidden=frozenset(_names(data, "hidden")), always_ask=frozenset(_names(data, "always_ask")),
                     mode=str(data.get("mode") or ""))
