"""Sessions of the daemon: the registry the servicer talks to.

``SessionRegistry`` only puts together the modules that own each concern:

- state: one session's state and its own locks;
- table: the map of sessions by id, with the registry's only global lock (map only);
- access: who may see or act on a session, and with which rights its sandbox is built;
- lifecycle: create, build, change, close, restore, and each call's generation;
- sandbox_hooks: what is served beside each sandbox, wired once (sandbox_network: published
  ports and the egress proxy; git_guard_hook: the git guard; environment and the servicer
  forget a closed session through them too).
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Callable, TypeVar

from sandboxd.audit.store import EventStore
from sandboxd.errors import InvalidPolicy, NotFound
from sandboxd.policy import Limits, SandboxPolicy
from sandboxd.policy.decision import ApprovalPolicy, ToolRules
from sandboxd.policy.sandbox import is_within
from sandboxd.service.sessions import access
from sandboxd.service.callers import Caller
from sandboxd.service.git_guard_hook import GitGuardHook
from sandboxd.service.quotas import Quotas, cgroup_owner
from sandboxd.service.sandbox_hooks import HookList, SandboxHooks
from sandboxd.config.settings import SecretSource
from sandboxd.policy.network import DaemonSecret
from sandboxd.service.credential_vault import CredentialVault
from sandboxd.service.sandbox_network import EgressProxies, PublishedPorts, network_environment
from sandboxd.service.sessions.network_live import LiveNetwork
from sandboxd.service.sessions.access import caller_groups, command_user, rights_of
from sandboxd.service.sessions.lifecycle import SESSION_PLACEHOLDER_ARGV, OwnPlaces, SandboxPlaces, SessionLifecycle
from sandboxd.service.sessions.state import Session, rules_from_dict, rules_to_dict, session_from_row
from sandboxd.service.sessions.table import SessionTable
from sandboxd.supervisor.fork_client import ForkServer, SessionInfo
from sandboxd.network.publish import check_host_ports

if TYPE_CHECKING:
    from sandboxd.service.network_questions import NetworkQuestions
    from sandboxd.service.sessions.lifecycle import SessionCounts

T = TypeVar("T")
__all__ = ["SESSION_PLACEHOLDER_ARGV", "OwnPlaces", "Session", "SessionRegistry", "caller_groups", "command_user",
           "cwd_inside", "rights_of", "rules_from_dict", "rules_to_dict"]


class SessionRegistry:
    def __init__(self, forkserver: ForkServer, store: EventStore, *,
                 max_sessions: int = 10000, dns: tuple[str, ...] = (), network_pool: str = "",
                 own: OwnPlaces | None = None, proxy_connections: int = 256,
                 published_connections: int = 256, published_per_peer: int = 32, quotas: Quotas | None = None,
                 allow_user_full_access: bool = True, count_network_denial: Callable[[], None] | None = None,
                 review_dir: str = "", review_bytes: tuple[int, int] = (0, 0), review_stores: int = 0,
                 secrets: "Mapping[str, SecretSource] | None" = None, upstream_ca_pem: bytes = b"",
                 allowed_ranges: tuple[str, ...] = (), upstream_proxy: tuple[str, int] | None = None,
                 intercepted_connections: int = 64) -> None:
        """``allow_user_full_access``: policy.allow_user_full_access, whether a local non-root caller
        may have danger-full-access. ``count_network_denial``: called for each connection an egress
        proxy refuses (the daemon's metrics count them). ``review_dir``: where review sessions'
        change sets go, one directory each (STATE/review; "": review mode is not available);
        ``review_bytes``: review.session_bytes and review.owner_bytes, the bounds of their stores;
        ``review_stores``: review.owner_stores, how many stores one owner keeps at most.
        ``secrets``: network.secrets; ``upstream_ca_pem``: network.upstream_ca_file's certificates;
        ``allowed_ranges``: network.allowed_ranges (the egress proxies'); ``upstream_proxy``:
        network.upstream_proxy; ``intercepted_connections``: quotas.intercepted_connections_per_session."""
        self._fork = forkserver
        self.store = store
        self.own = own or OwnPlaces()
        self.quotas = quotas or Quotas()
        self.allow_user_full_access = allow_user_full_access
        self._table = SessionTable(max_sessions, self.quotas)
        # The order their sandbox_ready runs in: the network first, the git guard's baseline last.
        self._egress = EgressProxies(store, proxy_connections, count_network_denial, upstream_ca_pem=upstream_ca_pem,
                                     allowed_ranges=allowed_ranges, upstream_proxy=upstream_proxy,
                                     intercepted_connections=intercepted_connections)
        self.vault = CredentialVault(secrets)
        self.hooks = HookList([PublishedPorts(published_connections, published_per_peer), self._egress,
                               GitGuardHook(store, self.quotas.limits.git_watches_per_uid,
                                            self.quotas.limits.git_inotify_instances)])
        self._life = SessionLifecycle(forkserver, store, self._table, self.hooks,
                                      SandboxPlaces(own=self.own, dns=dns, network_pool=network_pool,
                                                    review_dir=review_dir, review_session_bytes=review_bytes[0],
                                                    review_owner_bytes=review_bytes[1],
                                                    review_owner_stores=review_stores),
                                      check_built=lambda session, facts: access.check_not_shared(
                                          session.owner, facts, self._table.all(), session.id),
                                      vault=self.vault, live=LiveNetwork(store, self.vault, network_environment))

    def count_with(self, counts: "SessionCounts") -> None:
        """The daemon's metrics: sessions created, closed (by reason) and built (lifecycle.SessionCounts)."""
        self._life.counts = counts

    def answer_network_with(self, questions: "NetworkQuestions") -> None:
        """Who answers the egress proxies' questions (unlisted = ask) of sandboxes built from now."""
        self._egress.questions = questions

    def add_hooks(self, hooks: SandboxHooks) -> None:
        """Another service's hooks (sandbox_hooks), called after the registry's own."""
        self.hooks.add(hooks)

    # -- access --------------------------------------------------------------------------------

    def get(self, caller: Caller, session_id: str, *, seeing: bool = False) -> Session:
        """The session, if the caller may act on it (``seeing``: only look at it, access.sees).
        Someone else's is NOT_FOUND, not PERMISSION_DENIED: a caller learns nothing about sessions
        it may not use."""
        session = self._table.find(session_id)
        allowed = access.may_see if seeing else access.may_use
        if session is None or not session.usable or not allowed(caller, session):
            raise NotFound(f"no session {session_id!r}")
        return session

    def list(self, caller: Caller) -> builtins.list[Session]:
        return [s for s in self._table.all() if s.usable and access.may_see(caller, s)]

    def open_sessions(self) -> builtins.list[Session]:
        """Every open session, whoever owns it (for the daemon's own counts)."""
        return [s for s in self._table.all() if s.usable]

    def count_open(self) -> int:
        """How many sessions are open, whoever owns them (the daemon's gauge and stop log)."""
        return sum(1 for s in self._table.all() if s.usable)

    def count(self) -> int:
        """Sessions held (being built ones included): what the limits count."""
        return len(self._table)

    def list_closed(self, caller: Caller) -> builtins.list[tuple[Session, float]]:
        """Closed sessions the caller owns, from the store, with when each was closed. One whose
        policy this sandboxd refuses (an older one took it: restore closed it) is left out; its
        events stay readable."""
        closed = []
        for row in self.store.sessions(include_closed=True, owner=access.owners_seen(caller)):
            if row.closed_at is None or not access.sees(caller, row.owner_uid, row.owner_principal):
                continue
            try:
                closed.append((session_from_row(row), row.closed_at))
            except InvalidPolicy:
                continue
        return closed

    def visible_ids(self, caller: Caller, session_id: str = "") -> builtins.list[str] | None:
        """The sessions, open or closed, whose audit log the caller may read (None: all of them,
        for an administrator); with ``session_id``, that one or NOT_FOUND."""
        return access.visible_ids(self.store, caller, session_id)

    def sandbox_namespaces(self) -> set[int]:
        """The PID namespaces of this daemon's live sandboxes."""
        return self._table.namespaces()

    def check_workspace(self, caller: Caller, workspace: str) -> str:
        """A workspace the caller could write itself (for standing rules); its real path, as the
        caller's own lookup resolved it (asked of the kernel under the caller's credentials)."""
        if not workspace.startswith("/") or "\0" in workspace:
            raise InvalidPolicy(f"workspace {workspace!r} must be an absolute path")
        return self._fork.check_paths(rights_of(caller), [workspace], cgroup_owner(caller))[0]

    def _check_policy(self, caller: Caller, policy: SandboxPolicy, workspace: str, owner: Caller | None = None,
                      session_id: str = "") -> None:
        access.check_full_access(caller, policy, owner, allow_user_full_access=self.allow_user_full_access)
        check_host_ports(caller.is_root, policy.published_ports)

    # -- lifecycle -----------------------------------------------------------------------------

    def create(self, caller: Caller, workspace: str, policy: SandboxPolicy, approval: ApprovalPolicy,
               limits: Limits, labels: dict[str, str], rules: ToolRules | None = None,
               env: dict[str, str] | None = None, review: bool = False,
               secrets: "Mapping[str, bytes | DaemonSecret] | None" = None,
               limit_notes: "Sequence[str]" = ()) -> Session:
        """``limit_notes``: how its limits were fitted to the cgroups above it (service.ancestor_fit),
        for its SessionCreated event."""
        if not workspace.startswith("/"):
            raise InvalidPolicy(f"workspace {workspace!r} must be an absolute path")
        if review and not policy.workspace_writable:
            raise InvalidPolicy(f"review mode keeps a sandbox's writes for review: it needs the workspace-write "
                                f"policy, not {policy.mode} (danger-full-access writes the host directly)")
        self._check_policy(caller, policy, workspace)
        # As given: the fork server opens it as the caller and the session keeps the real path that
        # lookup found (SessionInfo.workspace), never one the daemon looked up itself as root.
        return self._life.create(caller, os.path.normpath(workspace), policy, approval, limits, labels, rules, env,
                                 review, secrets, limit_notes)

    def restore(self) -> int:
        return self._life.restore()

    def adopt_sandbox(self, session: Session, generation: int, info: SessionInfo, current: bool) -> bool:
        """A sandbox a surviving supervisor kept, served again from its facts (lifecycle)."""
        return self._life.adopt_sandbox(session, generation, info, current)

    def adopt_call(self, session: Session, generation: int) -> None:
        self._life.adopt_call(session, generation)

    def find(self, session_id: str) -> Session | None:
        """The open session ``session_id``, whoever owns it (the daemon's own use: adoption)."""
        session = self._table.find(session_id)
        return session if session is not None and session.usable else None

    def update_policy(self, caller: Caller, session_id: str, policy: SandboxPolicy | None,
                      approval: ApprovalPolicy | None,
                      secrets: "Mapping[str, bytes | DaemonSecret] | None" = None) -> Session:
        session = self.get(caller, session_id)
        return self._life.update_policy(caller, session, policy, approval, lambda new: self._check_policy(
            caller, new, session.workspace, owner=session.owner, session_id=session.id), secrets)

    def close(self, caller: Caller, session_id: str, reason: str = "",
              only_if: "Callable[[Session], bool] | None" = None) -> bool:
        """``reason``: why the daemon closed it itself (the SessionClosed event says so); ``only_if``:
        closed only if it says so of the session, under the session's lock (lifecycle.close)."""
        return self._life.close(caller, self.get(caller, session_id), reason, only_if)

    def close_all(self, keep_sandboxes: bool = False) -> None:
        self._life.close_all(keep_sandboxes)

    def sandboxes_lost(self) -> None:
        self._life.sandboxes_lost()

    def between_calls(self, session: Session, work: "Callable[[], T]") -> "T":
        """``work`` with the session's sandbox closed, rebuilt by its next call (lifecycle)."""
        return self._life.between_calls(session, work)

    def review_dir(self, session: Session) -> str:
        return self._life.review_dir(session)

    def review_dir_of(self, session_id: str) -> str:
        """Where the review session ``session_id`` (open or closed) keeps its change set."""
        return self._life.review_dir_of(session_id)

    # -- calls ---------------------------------------------------------------------------------

    def ready(self, session: Session) -> None:
        """Build a resumed session's sandbox now, if it has none, so that what is judged on its
        paths (file_calls.write_scope) is judged on what the fork server built."""
        self._life.ready(session)

    def begin_call(self, session: Session) -> int:
        return self._life.begin_call(session)

    def end_call(self, session: Session, generation: int) -> None:
        self._life.end_call(session, generation)

    def call_ended(self, session: Session) -> None:
        """After a call, before its caller hears it ended: the hooks look (the git guard).
        Never fails the call: an error here is logged (and is a bug)."""
        self._life.call_ended(session)


def cwd_inside(workspace: str, cwd: str) -> str:
    """Validate a call's cwd: absolute and inside the workspace (by path, as the sandbox sees it)."""
    if not cwd:
        return workspace
    normal = os.path.normpath(cwd)
    if not cwd.startswith("/") or not is_within(normal, workspace):
        raise InvalidPolicy(f"cwd {cwd!r} must be an absolute path inside the workspace {workspace!r}")
    return normal
