"""Sessions of the daemon: who owns which, what each may do, and its sandbox in the fork server.

A session's sandbox is built once in the fork server and every call joins it.
Changing the sandbox axis builds a new one (a new *generation*) for later
calls; the old one is closed when its last running call ends.
"""

from __future__ import annotations

import builtins
import logging
import os
import secrets
import threading
import time
from typing import TYPE_CHECKING, Any

from sandboxd._record import Record
from sandboxd.audit.store import EventStore, EventType, SessionRow
from sandboxd.errors import Exhausted, Forbidden, InvalidPolicy, NotFound
from sandboxd.policy import LaunchSpec, Limits, SandboxPolicy
from sandboxd.policy.decision import ToolRules
from sandboxd.policy.git_config import GIT_GUARD_SUBPATH
from sandboxd.policy.sandbox import WorkspaceWrite, is_within
from sandboxd.policy.spec import policy_from_dict, policy_to_dict
from sandboxd.service.callers import Caller, session_owner
from sandboxd.service.quotas import Quotas, cgroup_owner, owner_key
from sandboxd.supervisor.forkserver import ForkServer
from sandboxd.supervisor.git_guard import GitGuard
from sandboxd.supervisor.git_watch import InotifyHub
from sandboxd.supervisor.publish import check_host_ports

log = logging.getLogger("sandboxd")

if TYPE_CHECKING:
    from sandboxd.supervisor.egress_proxy import EgressProxy
    from sandboxd.supervisor.publish import PublishedPort

SESSION_PLACEHOLDER_ARGV = ("sandboxd-session",)  # a session's spec runs no command itself


class Session:
    """One session. Its mutable fields (policy, approval, generation, running, closed,
    sandbox_ready, workspace, services, extra_env) are read-modified-written only under ``lock``,
    held for a moment; building or closing a sandbox generation (slow: the fork server) happens
    under ``build_lock`` instead, taken first, which orders the session's builders (policy changes,
    a resumed session's rebuild, the fork server's loss, CloseSession) one at a time."""

    def __init__(self, session_id: str, owner: Caller, workspace: str, policy: SandboxPolicy,
                 approval: str, limits: Limits, labels: dict[str, str], rules: ToolRules | None = None,
                 created_at: float | None = None, env: dict[str, str] | None = None) -> None:
        self.id = session_id
        self.owner = owner
        self.workspace = workspace
        self.policy = policy
        self.approval = approval
        self.rules = rules or ToolRules()
        self.limits = limits
        self.labels = labels
        self.env = dict(env or {})            # the session's own variables (service.environment); never changed
        self.created_at = created_at or time.time()
        self.generation = 1
        self.running: dict[int, int] = {}     # generation -> running calls
        self.closed = False
        # False for a session resumed after a daemon restart: its sandbox is rebuilt by its next call.
        self.sandbox_ready = True
        self.lock = threading.Lock()
        self.build_lock = threading.Lock()
        self.services: dict[int, list[PublishedPort | EgressProxy]] = {}   # by sandbox generation
        self.extra_env: dict[str, str] = {}   # added to every call's environment (the proxy variables)
        self.git_guard: GitGuard | None = None  # inspects the writable roots after each call (git_guard.py)
        self.sandbox_builds = 0               # sandboxes built so far (any generation): what was made in one is gone in the next

    def to_row(self, closed_at: float | None = None) -> SessionRow:
        """What the store keeps of it (the caller holds ``lock``, or the session is not shared yet)."""
        return SessionRow(self.id, self.owner.uid, self.owner.gid, self.owner.principal, self.workspace,
                          policy_to_dict(self.policy), self.approval, rules_to_dict(self.rules),
                          self.limits.as_dict(), dict(self.labels), self.created_at, closed_at, dict(self.env))

    def axes(self) -> dict[str, object]:
        """Both policy axes, as events record them."""
        return {"sandbox_policy": policy_to_dict(self.policy), "approval_policy": self.approval,
                "permission_mode": self.rules.mode or None}

    def sandbox_name(self, generation: int | None = None) -> str:
        """The session's name in the fork server, one per sandbox generation."""
        return f"{self.id}#{generation or self.generation}"

    @property
    def running_calls(self) -> int:
        with self.lock:                               # begin_call and end_call change it from other threads
            return sum(self.running.values())


def rules_to_dict(rules: ToolRules) -> dict[str, object]:
    return {"hidden": sorted(rules.hidden), "always_ask": sorted(rules.always_ask), "mode": rules.mode}


def _names(data: dict[str, object], key: str) -> list[str]:
    value = data.get(key) or ()
    return [str(name) for name in value] if isinstance(value, (list, tuple)) else []


def rules_from_dict(data: dict[str, object]) -> ToolRules:
    return ToolRules(hidden=frozenset(_names(data, "hidden")), always_ask=frozenset(_names(data, "always_ask")),
                     mode=str(data.get("mode") or ""))


class OwnPlaces(Record):
    """What of the daemon no sandbox may see or reach: the directories hidden inside every
    sandbox, the Unix sockets and the TCP listeners ("HOST:PORT") connect() is refused for."""

    hidden: tuple[str, ...] = ()
    sockets: tuple[str, ...] = ()
    listeners: tuple[str, ...] = ()


class SessionRegistry:
    def __init__(self, forkserver: ForkServer, store: EventStore, *,
                 max_sessions: int = 10000, dns: tuple[str, ...] = (), network_pool: str = "",
                 own: OwnPlaces | None = None, proxy_connections: int = 256,
                 published_connections: int = 256, published_per_peer: int = 32, quotas: Quotas | None = None) -> None:
        self._fork = forkserver
        self.store = store
        self._git_watch = InotifyHub()     # one inotify instance for every session's git guard
        self.own = own or OwnPlaces()
        self.front_door: "Any" = None                     # service.peercred.FrontDoor, for status counts
        # PID namespaces (inode numbers) of this daemon's live sandboxes: a connection from a
        # process inside one of them is refused (sandboxed_peers).
        self._sandbox_namespaces: dict[str, int] = {}
        self._dns = dns                                   # resolvers for isolated networks (default: the host's)
        self._network_pool = network_pool                 # addresses of isolated networks (default: netns's)
        # Connections at once per sandbox through its egress proxy, and to its published ports.
        self._proxy_connections, self._published_connections = proxy_connections, published_connections
        self._published_per_peer = published_per_peer     # ... per connecting user but the session's owner
        self.metrics: "Any" = None                        # service.metrics.Metrics, when the daemon has it
        self._max = max_sessions
        self.quotas = quotas or Quotas()
        # policy.allow_user_full_access: whether a local non-root caller may have danger-full-access.
        self.allow_user_full_access = True
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}

    # -- access --------------------------------------------------------------------------------

    def sandbox_namespaces(self) -> set[int]:
        """The PID namespaces of this daemon's live sandboxes."""
        with self._lock:
            return set(self._sandbox_namespaces.values())

    def get(self, caller: Caller, session_id: str) -> Session:
        """The session, if the caller may see it. Someone else's is NOT_FOUND, not PERMISSION_DENIED:
        a caller learns nothing about sessions it may not use."""
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None or session.closed or not self._may_use(caller, session):
            raise NotFound(f"no session {session_id!r}")
        return session

    def list(self, caller: Caller) -> list[Session]:
        with self._lock:
            sessions = list(self._sessions.values())
        return [s for s in sessions if not s.closed and self._may_use(caller, s)]

    def open_sessions(self) -> builtins.list[Session]:  # list: the method above
        """Every open session, whoever owns it (for the daemon's own counts)."""
        with self._lock:
            return [s for s in self._sessions.values() if not s.closed]

    def list_closed(self, caller: Caller) -> builtins.list[tuple[Session, float]]:  # list: the method above
        """Closed sessions the caller owns, from the store, with when each was closed."""
        closed = []
        for row in self.store.sessions(include_closed=True):
            if row.closed_at is not None and self._owns(caller, row.owner_uid, row.owner_principal):
                closed.append((self._from_row(row), row.closed_at))
        return closed

    def _from_row(self, row: SessionRow) -> Session:
        owner = session_owner(row.owner_uid, row.owner_gid, row.owner_principal)
        session = Session(row.id, owner, row.workspace, policy_from_dict(row.sandbox_policy), row.approval_policy,
                          Limits(**row.limits), dict(row.labels), rules_from_dict(row.tool_rules),
                          created_at=row.created_at, env=dict(row.env))
        session.sandbox_ready = False
        return session

    def _may_use(self, caller: Caller, session: Session) -> bool:
        return self._owns(caller, session.owner.uid, session.owner.principal)

    def _owns(self, caller: Caller, owner_uid: int, owner_principal: str) -> bool:
        """Its owner (same uid and, for TLS callers, same certificate), root, or the admin group."""
        if caller.principal:
            return owner_principal == caller.principal
        return caller.is_admin or (owner_uid == caller.uid and not owner_principal)

    def visible_ids(self, caller: Caller, session_id: str = "") -> builtins.list[str] | None:
        """The sessions, open or closed, whose audit log the caller may read (None: all of them,
        for an administrator); with ``session_id``, that one or NOT_FOUND."""
        if session_id:
            try:
                row = self.store.session(session_id)
            except NotFound:
                raise NotFound(f"no session {session_id!r}") from None
            if not self._owns(caller, row.owner_uid, row.owner_principal):
                raise NotFound(f"no session {session_id!r}")
            return [session_id]
        if caller.is_admin:
            return None
        return [row.id for row in self.store.sessions(include_closed=True)
                if self._owns(caller, row.owner_uid, row.owner_principal)]

    def check_workspace(self, caller: Caller, workspace: str) -> str:
        """A workspace the caller could write itself (for standing rules); its real path, as the
        caller's own lookup resolved it (asked of the kernel under the caller's credentials)."""
        if not workspace.startswith("/") or "\0" in workspace:
            raise InvalidPolicy(f"workspace {workspace!r} must be an absolute path")
        return self._fork.check_paths(rights_of(caller), [workspace])[0]

    # -- lifecycle -----------------------------------------------------------------------------

    def create(self, caller: Caller, workspace: str, policy: SandboxPolicy, approval: str,
               limits: Limits, labels: dict[str, str], rules: ToolRules | None = None,
               env: dict[str, str] | None = None) -> Session:
        if not workspace.startswith("/"):
            raise InvalidPolicy(f"workspace {workspace!r} must be an absolute path")
        self._check_policy(caller, policy)
        self._check_not_shared(caller, workspace, policy)
        check_host_ports(caller.is_root, getattr(policy, "published_ports", ()))
        real_workspace = os.path.realpath(workspace)      # never under the lock: a lookup may hang (NFS)
        with self._lock:
            if len(self._sessions) >= self._max:
                raise Exhausted(f"the daemon holds its maximum of {self._max} sessions: close some first")
            owner = owner_key(caller)
            self.quotas.check_sessions(caller, sum(1 for s in self._sessions.values() if owner_key(s.owner) == owner))
            session_id = secrets.token_hex(8)
            session = Session(session_id, caller, real_workspace, policy, approval, limits, labels,
                              rules, env=env)
            self._sessions[session_id] = session
        try:
            self._open_sandbox(session, session.generation, policy)
        except BaseException:
            with self._lock:
                self._sessions.pop(session_id, None)
            raise
        self._guard_git(session, policy)
        # Recorded before the caller hears of the session.
        self.store.save_session(session.to_row())
        self.store.append(session.id, EventType.SESSION_CREATED, data={
            **session.axes(), "workspace": session.workspace, "owner_uid": caller.uid, "owner_gid": caller.gid,
            "limits": session.limits.as_dict(), "labels": dict(labels), "env_names": sorted(session.env)})
        return session

    def restore(self) -> int:
        """Sessions a previous daemon left open (it stopped or crashed): listed again, their logs
        readable, and each resumed by its next call, which rebuilds its sandbox. Returns how many."""
        rows = self.store.sessions()
        with self._lock:
            for row in rows:
                self._sessions[row.id] = self._from_row(row)
        return len(rows)

    def update_policy(self, caller: Caller, session_id: str, policy: SandboxPolicy | None,
                      approval: str | None) -> Session:
        session = self.get(caller, session_id)
        with session.build_lock:                      # one builder at a time: generations are consecutive
            with session.lock:
                if session.closed:
                    raise NotFound(f"no session {session_id!r}")
                before, current, ready = session.axes(), session.policy, session.sandbox_ready
            changed = policy is not None and policy != current
            if policy is not None and changed:
                self._check_policy(caller, policy, owner=session.owner)
                self._check_not_shared(caller, session.workspace, policy, session.id)
                check_host_ports(caller.is_root, getattr(policy, "published_ports", ()))
            generation = 0
            if policy is not None and changed and ready:
                with session.lock:
                    generation = session.generation + 1
                self._open_sandbox(session, generation, policy)   # complete before any call can join it
                with session.lock:
                    old = session.generation
                    session.policy, session.generation = policy, generation
                    if approval is not None:
                        session.approval = approval
                    idle = session.running.get(old, 0) == 0
                if idle:                              # calls still running keep the old sandbox
                    self._close_sandbox(session, old)
                self._guard_git(session, policy)
            else:
                with session.lock:
                    if policy is not None and changed:
                        session.policy = policy       # resumed, not rebuilt yet: the next call builds this one
                    if approval is not None:
                        session.approval = approval
            with session.lock:
                after, row, now = session.axes(), session.to_row(), session.generation
            if after != before:
                # Recorded before the caller hears the change took effect, in the order they took effect.
                self.store.save_session(row)
                self.store.append(session.id, EventType.POLICY_CHANGED, data={
                    "before": before, "after": after, "by_uid": caller.uid, "generation": generation or now})
        return session

    def close(self, caller: Caller, session_id: str) -> None:
        session = self.get(caller, session_id)
        with session.build_lock:                      # after a policy change under way: its sandbox too
            with session.lock:
                if session.closed:
                    raise NotFound(f"no session {session_id!r}")
                session.closed = True
                generations = set(session.running) | {session.generation}
                current, ready = session.generation, session.sandbox_ready
            with self._lock:
                self._sessions.pop(session_id, None)
            for generation in generations:
                if ready or generation != current:
                    self._close_sandbox(session, generation)
        self.inspect_git(session)                     # the last look: every process of the session is gone
        if session.git_guard is not None:
            session.git_guard.close()
        self.store.save_session(session.to_row(closed_at=time.time()))
        self.store.append(session.id, EventType.SESSION_CLOSED, data={"by_uid": caller.uid})

    def close_all(self) -> None:
        """The daemon stops: every sandbox goes, but the sessions stay open in the store, to be
        resumed by the next daemon."""
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for session in sessions:
            with session.lock:
                session.closed = True
                generations = set(session.running) | {session.generation}
                current, ready = session.generation, session.sandbox_ready
            for generation in generations:
                if not ready and generation == current:
                    continue
                try:
                    self._close_sandbox(session, generation)
                except Exception:  # noqa: BLE001 - shutting down: the fork server may be gone already
                    pass
            self.inspect_git(session)
            if session.git_guard is not None:
                session.git_guard.close()

    def sandboxes_lost(self) -> None:
        """The fork server died, and every sandbox with it: stop what the daemon served for them
        (published ports, egress proxies), and let each open session's next call rebuild its
        sandbox, as after a daemon restart (``restore``)."""
        with self._lock:
            sessions = list(self._sessions.values())
        for session in sessions:
            with session.build_lock:
                with session.lock:
                    session.sandbox_ready = False
                    lost = [session.services.pop(generation) for generation in list(session.services)]
                for services in lost:
                    for service in services:
                        try:
                            service.close()
                        except Exception:  # noqa: BLE001 - its sandbox is gone: close the rest regardless
                            pass

    # -- calls ---------------------------------------------------------------------------------

    def begin_call(self, session: Session) -> int:
        """Count a call as running on the session's current generation, which is complete: a
        generation becomes current only once its sandbox is built (update_policy)."""
        while True:
            if not session.sandbox_ready:
                self._rebuild(session)
            with session.lock:
                if session.closed:
                    raise NotFound(f"session {session.id!r} was closed")
                if not session.sandbox_ready:         # lost again meanwhile (the fork server died): rebuild
                    continue
                generation = session.generation
                session.running[generation] = session.running.get(generation, 0) + 1
            return generation

    def end_call(self, session: Session, generation: int) -> None:
        with session.lock:
            left = session.running.get(generation, 1) - 1
            if left > 0:
                session.running[generation] = left
                return
            session.running.pop(generation, None)
            retired = generation != session.generation and not session.closed
        if retired:                                   # the last call on a replaced sandbox ended
            self._close_sandbox(session, generation)

    def _open_sandbox(self, session: Session, generation: int, policy: SandboxPolicy) -> None:
        """Build one generation of the session's sandbox in the fork server, and publish its ports."""
        info = self._fork.open_session(session.sandbox_name(generation), self._spec(session, policy))
        with session.lock:
            session.sandbox_builds += 1
        if info.workspace:
            with session.lock:
                session.workspace = info.workspace        # as the caller's own lookup resolved it
        if info.init_pid:
            try:
                namespace = os.stat(f"/proc/{info.init_pid}/ns/pid").st_ino
            except OSError:
                namespace = 0                             # gone already: its first call says so
            with self._lock:
                self._sandbox_namespaces[session.sandbox_name(generation)] = namespace
        entries, domains = getattr(policy, "published_ports", ()), getattr(policy, "allowed_domains", ())
        try:
            services: list[PublishedPort | EgressProxy] = []
            with session.lock:
                session.services[generation] = services
            if entries:
                from sandboxd.supervisor.publish import publish_all

                netns = os.open(f"/proc/{info.init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
                try:
                    services.extend(publish_all(netns, entries, connections=self._published_connections,
                                                per_peer=self._published_per_peer, owners=frozenset({session.owner.uid})))
                finally:
                    os.close(netns)
            if domains and info.host_address and info.sandbox_address:
                from sandboxd.supervisor.egress_proxy import EgressProxy, proxy_environment

                def denied(destination: str, why: str) -> None:
                    if self.metrics is not None:
                        self.metrics.network_denials.inc()
                    self.store.append(session.id, EventType.PERMISSION_DENIED, tool="network", data={
                        "reason": "network_request", "by": "sandbox", "destination": destination, "detail": why,
                        "message": f"network: denied by the sandbox (network_request): {destination}: {why}"})
                netns = os.open(f"/proc/{info.init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
                try:                                      # its upstream connections are made in there
                    services.append(EgressProxy(EgressProxy.listen(info.host_address), domains,
                                                client_address=info.sandbox_address, netns_fd=netns,
                                                resolvers=info.resolvers, on_denied=denied,
                                                connections=self._proxy_connections).start())
                finally:
                    os.close(netns)
                with session.lock:
                    session.extra_env = proxy_environment(info.host_address)
        except BaseException:
            self._close_sandbox(session, generation)
            raise

    def _close_sandbox(self, session: Session, generation: int) -> None:
        """Stop what the daemon serves for one generation (published ports, the egress proxy),
        then have the fork server close the sandbox itself."""
        with session.lock:
            services = session.services.pop(generation, [])
        for service in services:
            service.close()
        self._fork.close_session(session.sandbox_name(generation))
        with self._lock:
            self._sandbox_namespaces.pop(session.sandbox_name(generation), None)

    def _rebuild(self, session: Session) -> None:
        """A resumed session's first call builds its sandbox again (once, whoever comes first)."""
        with session.build_lock:
            if session.sandbox_ready or session.closed:
                return
            with session.lock:
                generation, policy = session.generation, session.policy
            self._open_sandbox(session, generation, policy)
            self._guard_git(session, policy)
            with session.lock:
                session.sandbox_ready = True

    # -- the git guard -------------------------------------------------------------------------

    def _guard_git(self, session: Session, policy: SandboxPolicy) -> None:
        """Watch the policy's writable roots while .git/config is protected (the default); a root
        new to the guard is taken as it is now (what the user had is theirs)."""
        roots: list[str] = []
        if isinstance(policy, WorkspaceWrite) and GIT_GUARD_SUBPATH in policy.protected_subpaths:
            roots = [session.workspace, *(os.path.realpath(r) for r in policy.writable_roots)]
        if session.git_guard is None:
            if roots:
                session.git_guard = GitGuard(roots, hub=self._git_watch)
        else:
            session.git_guard.set_roots(roots)

    def inspect_git(self, session: Session) -> None:
        """After a call: neutralise the git configuration it planted, one event and one log line each.
        Never fails the call: an error here is logged (and is a bug)."""
        guard = session.git_guard
        if guard is None:
            return
        try:
            found = guard.inspect()
            if found:
                self.store.append_many(session.id, [
                    (EventType.GIT_CONFIG_NEUTRALIZED, "", "", {"repo": n.repo, "what": n.what, "key": n.key})
                    for n in found])
            for item in found:
                log.warning("session %s: %s", session.id, item.describe())
        except Exception:  # noqa: BLE001 - logged; the call's own result stands
            log.exception("session %s: the git guard failed", session.id)

    # -- helpers -------------------------------------------------------------------------------

    def _spec(self, session: Session, policy: SandboxPolicy) -> LaunchSpec:
        # The workspace, the writable roots and the allowed sockets are opened and checked by the
        # kernel as the session's owner (kernel.access) when its sandbox is built, every time.
        return LaunchSpec(argv=SESSION_PLACEHOLDER_ARGV, workspace=session.workspace, policy=policy,
                          limits=session.limits, user=command_user(session.owner, policy), dns=self._dns,
                          network_pool=self._network_pool, caller=rights_of(session.owner),
                          hidden_paths=self.own.hidden, denied_sockets=self.own.sockets,
                          denied_listeners=self.own.listeners, owner=cgroup_owner(session.owner))

    def _check_not_shared(self, caller: Caller, workspace: str, policy: SandboxPolicy,
                          session_id: str = "") -> None:
        """TLS principals that act as the same local user share its file rights; so one may not
        use a workspace or writable root that overlaps one of another principal's open sessions
        (it could read and overwrite that principal's files through it)."""
        if not caller.principal:
            return
        mine = _paths_of(workspace, policy)
        with self._lock:
            others = [s for s in self._sessions.values() if not s.closed and s.id != session_id
                      and s.owner.principal and s.owner.principal != caller.principal and s.owner.uid == caller.uid]
        for other in others:
            for path in mine:
                for theirs in _paths_of(other.workspace, other.policy):
                    if is_within(path, theirs) or is_within(theirs, path):
                        raise Forbidden(f"{path!r} overlaps {theirs!r}, which a session of another TLS principal "
                                        f"uses: principals acting as the same local user (uid {caller.uid}) share "
                                        "its file rights, so their workspaces are kept apart (map each principal "
                                        "to its own user with tls.users)")

    def _check_policy(self, caller: Caller, policy: SandboxPolicy, owner: Caller | None = None) -> None:
        """Who may ask for danger-full-access, for a session of ``owner`` (None: the caller's own,
        being created). Whether the caller may use the paths is the kernel's to say, under the
        caller's own credentials, when the sandbox is built (``_spec``)."""
        if policy.name != "danger-full-access":
            return
        owner = owner or caller
        # A non-root owner's danger-full-access runs as that owner with its own rights and no more
        # (sequence._exec_as_caller). A TLS principal is not the local user it is mapped to
        # (principals sharing one user are kept apart: _check_not_shared), so neither it nor
        # anyone for it may.
        if caller.principal or owner.principal:
            raise Forbidden("a TLS caller never may create danger-full-access sessions, whatever user it is "
                            "mapped to, and no session of one becomes one: use workspace-write")
        if caller.is_root:
            return
        if caller.uid != owner.uid:
            # An administrator manages others' sessions, but must not get a way to run anything on
            # the host as their owner.
            raise Forbidden(f"only the session's owner (uid {owner.uid}) or root may make it danger-full-access: "
                            "its commands would run on the host as that owner")
        if not self.allow_user_full_access:
            raise Forbidden("this daemon lets only local root create danger-full-access sessions "
                            "(policy.allow_user_full_access = false): use workspace-write, or ask its operator")


def _paths_of(workspace: str, policy: SandboxPolicy) -> list[str]:
    return [os.path.realpath(p) for p in (workspace, *getattr(policy, "writable_roots", ()))]


def command_user(owner: Caller, policy: SandboxPolicy) -> tuple[int, int] | None:
    """Who a session's commands run as: a non-root caller's as itself; a root caller's (in a
    confined policy) as the workspace's owner (None, as ``sandboxd run`` does), so that root
    acting on a user's checkout runs that user's commands as that user, and uid 0 remains only
    for a root-owned workspace. danger-full-access runs as its owner: root as root, as before,
    anyone else as itself with no privilege (launcher.sequence._exec_as_caller)."""
    if owner.is_root and policy.name != "danger-full-access":
        return None
    return (owner.uid, owner.gid)


def caller_groups(caller: Caller) -> set[int]:
    """The caller's gid and supplementary groups: from SO_PEERGROUPS at connect time (the front
    door), for a TLS caller those of its local user, for a session restored after a restart
    those its owner has now."""
    if caller.groups or caller.pid:
        return {caller.gid, *caller.groups}
    return {caller.gid, *_groups_of_uid(caller.uid, caller.gid)}


def rights_of(caller: Caller) -> tuple[int, int, tuple[int, ...]] | None:
    """The credentials a caller's paths are checked with (None for local root: it may use any)."""
    if caller.is_root:
        return None
    return caller.uid, caller.gid, tuple(sorted(caller_groups(caller)))


def _groups_of_uid(uid: int, gid: int) -> list[int]:
    import pwd

    try:
        return os.getgrouplist(pwd.getpwuid(uid).pw_name, gid)
    except (KeyError, OSError):
        return [gid]


def cwd_inside(workspace: str, cwd: str) -> str:
    """Validate a call's cwd: absolute and inside the workspace (by path, as the sandbox sees it)."""
    if not cwd:
        return workspace
    normal = os.path.normpath(cwd)
    if not cwd.startswith("/") or not is_within(normal, workspace):
        raise InvalidPolicy(f"cwd {cwd!r} must be an absolute path inside the workspace {workspace!r}")
    return normal
