"""A session's life: created and built, its calls counted per sandbox generation, its policy
changed (a new generation), closed, restored after a daemon restart, rebuilt after the fork
server's loss.

A session's sandbox is built once in the fork server and every call joins it. Changing the
sandbox axis builds a new one (a new *generation*) for later calls; the old one is closed when
its last running call ends. What the daemon serves beside a sandbox (ports, proxy, git guard)
is the hooks' (sandbox_hooks), called here and nowhere else. Locks: the table's only for its map
(sessions.table), the session's ``lock`` for a moment, its ``build_lock`` across its builds and
closes (sessions.state); none of them is ever held for another session's sake.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Callable, Protocol, TypeVar

from sandboxd import defaults
from sandboxd._record import Record
from sandboxd.audit.store import EventStore, EventType
from sandboxd.errors import InvalidPolicy, NotFound, WrongState
from sandboxd.kernel import overlay, review_space
from sandboxd.launcher.homes import Uncoverable, other_mounts, owner_home, runtime_dir, session_home
from sandboxd.policy import LaunchSpec, Limits, SandboxPolicy
from sandboxd.policy.decision import ApprovalPolicy, ToolRules
from sandboxd.policy.sandbox import is_within
from sandboxd.policy.network import DaemonSecret
from sandboxd.service.callers import Caller, acted_by
from sandboxd.service.principals import pod_uid_of
from sandboxd.service.credential_vault import CredentialVault, SessionCredentials
from sandboxd.service.quotas import cgroup_owner
from sandboxd.service.sandbox_hooks import HookList, Sandbox, close_all
from sandboxd.service.sessions.access import command_user, rights_of
from sandboxd.service.sessions.network_live import LiveNetwork, live_changeable
from sandboxd.service.sessions.placement import placement_of
from sandboxd.service.sessions.state import Session, session_from_row
from sandboxd.service.sessions.table import SessionTable
from sandboxd.supervisor.fork_client import ForkServer, SessionInfo

T = TypeVar("T")
log = logging.getLogger("sandboxd")
SESSION_PLACEHOLDER_ARGV = ("sandboxd-session",)  # a session's spec runs no command itself


# What a closed session's sealed store keeps free for the conflict baselines its applies save.
SEAL_SLACK = 1 << 20


class OwnPlaces(Record):
    """What of the daemon no sandbox may see or reach: the directories hidden inside every
    sandbox, the Unix sockets and the TCP listeners ("HOST:PORT") connect() is refused for."""

    hidden: tuple[str, ...] = ()
    sockets: tuple[str, ...] = ()
    listeners: tuple[str, ...] = ()
    channels: tuple[str, ...] = ()      # the registries of approval channels (launcher.channel_registry)


class SandboxPlaces(Record):
    """What every sandbox of this daemon gets besides its session's own settings."""

    own: OwnPlaces = OwnPlaces()
    dns: tuple[str, ...] = ()           # resolvers for isolated networks (default: the host's)
    review_dir: str = ""                # where review sessions' change sets are, one directory each (STATE/review)
    review_session_bytes: int = 0       # each a bounded store (kernel.review_space): review.session_bytes (0: none)
    review_owner_bytes: int = 0         # and review.owner_bytes
    review_owner_stores: int = 0        # review.owner_stores: stores one owner keeps at most (0: no cap)
    network_pool: str = ""              # addresses of isolated networks (default: netns's)


class SessionCounts(Protocol):
    """What the daemon's metrics count of sessions (service.metrics.Metrics)."""

    def session_created(self) -> None: ...
    def session_closed(self, reason: str) -> None: ...
    def session_built(self, seconds: float) -> None: ...


class SessionLifecycle:
    # The daemon's metrics, when it keeps them (SessionRegistry sets it).
    counts: "SessionCounts | None" = None

    def __init__(self, fork: ForkServer, store: EventStore, table: SessionTable, hooks: HookList,
                 places: SandboxPlaces, check_built: Callable[[Session, SessionInfo], None] | None = None,
                 vault: CredentialVault | None = None, live: LiveNetwork | None = None) -> None:
        """``check_built(session, facts)``: whether a sandbox the fork server built for ``session``
        may serve it (raises if not: the sandbox is closed), before its services start or anyone
        can use it: what is judged on the real paths is judged here, on the facts. ``vault``: the
        credentials' secrets (credential_vault); ``live``: network-only changes (network_live)."""
        self._fork, self._store, self._table, self._hooks, self._places = fork, store, table, hooks, places
        self._check_built = check_built
        self._vault = vault or CredentialVault()
        self._live = live or LiveNetwork(store, self._vault, lambda session: dict(session.extra_env))

    # -- create, restore, change, close ----------------------------------------------------------

    def create(self, owner: Caller, workspace: str, policy: SandboxPolicy, approval: ApprovalPolicy,
               limits: Limits, labels: dict[str, str], rules: ToolRules | None, env: dict[str, str] | None,
               review: bool = False,
               credential_secrets: "Mapping[str, bytes | DaemonSecret] | None" = None,
               limit_notes: "Sequence[str]" = ()) -> Session:
        """Counted at once (quotas), found by no one until its sandbox and services are up; not
        begun at all when the store will not take the owner's events (EventStore.admit).
        ``credential_secrets``: its credentials' (credential_vault), wiped if it is not made."""
        self._store.admit(owner.uid, owner.principal)
        if review and not self._places.review_dir:
            raise InvalidPolicy("this daemon keeps no change sets (no state directory): review mode is not available")
        session = Session(secrets.token_hex(8), owner, workspace, policy, approval, limits, labels, rules, env=env,
                          review=review)
        session.building = True
        session.live_network = self._live
        session.credentials = self._vault.resolve(owner, owner, None, policy.network_rules.credentials,
                                                   credential_secrets or {})
        try:
            self._table.add(session)
        except BaseException:
            _forget_secrets(session)
            raise
        built = False
        try:
            with session.build_lock:
                self._open_sandbox(session, session.generation, policy)
                built = True
                # Recorded before the caller hears of the session.
                self._store.save_session(session.to_row())
                self._store.append(session.id, EventType.SESSION_CREATED, data={
                    **session.axes(), "workspace": session.workspace, "owner_uid": owner.uid,
                    "owner_gid": owner.gid, "limits": session.limits.as_dict(), "labels": dict(labels),
                    "env_names": sorted(session.env), **({"review": True} if review else {}),
                    **({"limit_notes": list(limit_notes)} if limit_notes else {}),
                    **_pod_of(owner)})
        except BaseException:
            self._table.remove(session.id)
            if built:                                 # the store failed: nothing of it may stay
                with session.build_lock:
                    self._close_sandbox(session, session.generation)
                    self._hooks.session_closed(session)
            _forget_secrets(session)
            raise
        with session.lock:
            session.building = False
        if self.counts is not None:
            self.counts.session_created()
        return session

    def restore(self) -> int:
        """Sessions a previous daemon left open (it stopped or crashed): listed again, their logs
        readable, and each resumed by its next call, which rebuilds its sandbox. Returns how many."""
        rows = self._store.sessions()
        resumed = 0
        for row in rows:
            try:
                session = session_from_row(row)
            except InvalidPolicy as exc:
                # A policy an older sandboxd took and this one refuses (an allowed domain not in
                # ASCII, say): closed, saying why, rather than resumed with a narrower or wider one.
                self._store.save_session(row.replace(closed_at=time.time()))
                self._store.append(row.id, EventType.SESSION_CLOSED,
                                   data={"by_uid": 0, "reason": f"its policy is refused now: {exc}"})
                if self.counts is not None:
                    self.counts.session_closed("its policy is refused now")
                continue
            session.live_network = self._live
            session.credentials = self._vault.restored(session.owner, session.policy.network_rules.credentials,
                                                       session.daemon_secrets)
            self._table.add(session, check=False)
            resumed += 1
        return resumed

    def adopt_sandbox(self, session: Session, generation: int, info: SessionInfo, current: bool) -> bool:
        """A sandbox generation a surviving supervisor kept for ``session`` (restored just now):
        taken as it is, from the facts it answered at its build (no rebuild). The ``current``
        one becomes the session's generation and its services (the egress proxy on the listener
        ``info`` passes again, published ports, the git guard) start as after a build; an older
        one is kept only for the calls still running in it (``adopt_call``), closed after the
        last. The listeners in ``info`` are closed here. False if its services could not start:
        the sandbox is closed then, and the session's next call builds a new one."""
        try:
            with session.build_lock:
                with session.lock:
                    session.built[generation] = info.replace(proxy_listener=-1, transparent_listener=-1)
                    if current:
                        session.generation = generation
                if not current:
                    if info.pid_namespace:
                        self._table.set_namespace(session.sandbox_name(generation), info.pid_namespace)
                    return True
                try:
                    self._serve_sandbox(session, generation, session.policy, info)
                except Exception as exc:  # noqa: BLE001 - closed by _serve_sandbox; rebuilt by the next call
                    log.warning("session %s: its adopted sandbox could not be served again (%s): a new one is "
                                "built by its next call", session.id, exc)
                    return False
                with session.lock:
                    session.sandbox_ready = True
                return True
        finally:
            for listener in (info.proxy_listener, info.transparent_listener):
                if listener >= 0:
                    os.close(listener)

    def adopt_call(self, session: Session, generation: int) -> None:
        """A call a surviving supervisor kept running in ``generation``: counted as running there
        (its sandbox stays while it runs), until ``end_call``."""
        with session.lock:
            session.running[generation] = session.running.get(generation, 0) + 1

    def update_policy(self, caller: Caller, session: Session, policy: SandboxPolicy | None,
                      approval: ApprovalPolicy | None, check: Callable[[SandboxPolicy], None],
                      secrets: "Mapping[str, bytes | DaemonSecret] | None" = None) -> Session:
        """``check(policy)``: whether the caller may have it (raises), asked only if it changes.
        The change is recorded, so the store must admit the session's owner first. A change of
        the network lists alone (or new ``secrets`` for its credentials) goes to the running proxy
        (network_live); any other builds a new sandbox generation."""
        self._store.admit(session.owner.uid, session.owner.principal)
        with session.build_lock:                      # one builder at a time: generations are consecutive
            with session.lock:
                if session.closed:
                    raise NotFound(f"no session {session.id!r}")
                before, current, ready = session.axes(), session.policy, session.sandbox_ready
            if policy is not None and current.hide_home and not policy.hide_home:
                policy = policy.replace(hide_home=True)   # kept for the session's life (SandboxPolicy.hide_home)
            changed = policy is not None and policy != current
            if policy is not None and (changed or secrets) and live_changeable(current, policy):
                if changed:
                    check(policy)
                self._live.apply(session, policy, by="caller", caller=caller, secrets=secrets)
                if approval is not None:
                    self._change_approval(caller, session, approval)
                return session
            if changed and session.review:
                # Its sandbox is built over its change set: another one (other roots) would not match
                # it, and two generations would share one upper layer.
                raise WrongState(f"session {session.id} is in review mode: its sandbox policy cannot change; apply or "
                                 "discard its changes and create a new session (the approval policy may change)")
            if policy is not None and changed:
                check(policy)
            generation = 0
            old_credentials = session.credentials
            if policy is not None and changed:
                # Its sandbox's spec and proxy are made from these (the previous ones, if it fails).
                new_credentials = self._vault.resolve(caller, session.owner, old_credentials,
                                                      policy.network_rules.credentials, secrets or {})
                with session.lock:
                    session.credentials = new_credentials
            if policy is not None and changed and ready:
                with session.lock:
                    generation = session.generation + 1
                try:
                    self._open_sandbox(session, generation, policy)   # complete before any call can join it
                except BaseException:
                    with session.lock:
                        session.credentials = old_credentials
                    new_credentials.wipe_unused(old_credentials or SessionCredentials())
                    raise
                with session.lock:
                    old = session.generation
                    session.policy, session.generation = policy, generation
                    if approval is not None:
                        session.approval = approval
                    idle = session.running.get(old, 0) == 0
                if idle:                              # calls still running keep the old sandbox
                    self._close_sandbox(session, old)
            else:
                with session.lock:
                    if policy is not None and changed:
                        session.policy = policy       # resumed, not rebuilt yet: the next call builds this one
                    if approval is not None:
                        session.approval = approval
            if policy is not None and changed and old_credentials is not None:
                old_credentials.wipe_unused(new_credentials)
            with session.lock:
                after, row, now = session.axes(), session.to_row(), session.generation
            if after != before:
                # Recorded before the caller hears the change took effect, in the order they took effect.
                self._store.save_session(row)
                self._store.append(session.id, EventType.POLICY_CHANGED, data={
                    "before": before, "after": after, **acted_by(caller), "generation": generation or now})
        return session

    def _change_approval(self, caller: Caller, session: Session, approval: ApprovalPolicy) -> None:
        """The approval axis alone (after a live network change), recorded as its own change."""
        with session.lock:
            before = session.axes()
            session.approval = approval
            after, row, generation = session.axes(), session.to_row(), session.generation
        if after != before:
            self._store.save_session(row)
            self._store.append(session.id, EventType.POLICY_CHANGED, data={
                "before": before, "after": after, **acted_by(caller), "generation": generation})

    def close(self, caller: Caller, session: Session, reason: str = "",
              only_if: "Callable[[Session], bool] | None" = None) -> bool:
        """Close it (False, nothing done, when ``only_if(session)``, judged under its lock, says no:
        a call that begins takes the same lock, so it is never cut by a close judged idle)."""
        with session.build_lock:                      # after a policy change under way: its sandbox too
            with session.lock:
                if session.closed:
                    raise NotFound(f"no session {session.id!r}")
                if only_if is not None and not only_if(session):
                    return False
                session.closed = True
                generations = set(session.running) | {session.generation}
                current, ready = session.generation, session.sandbox_ready
            self._table.remove(session.id)
            for generation in generations:
                if ready or generation != current:
                    self._close_sandbox(session, generation)
            self._hooks.session_closed(session)
            _forget_secrets(session)
            self._drop_empty_change_set(session)
        self._store.save_session(session.to_row(closed_at=time.time()))
        self._store.append(session.id, EventType.SESSION_CLOSED,
                           data={**acted_by(caller), **({"reason": reason} if reason else {})})
        if self.counts is not None:
            self.counts.session_closed(reason)
        return True

    def _drop_empty_change_set(self, session: Session) -> None:
        """A closed review session's directory goes when it holds no change (its sandbox is gone); a
        change set with changes stays, its store shrunk to what it holds (review_space.seal: the
        rest of its bound goes back to the owner's share) and SEAL_SLACK, which the daemon's own
        records of later applies (their conflict baselines, review.conflicts) are written into."""
        if not session.review:
            return
        try:
            if not overlay.remove_if_unchanged(self.review_dir(session)) and \
                    review_space.is_store(self.review_dir(session)):
                review_space.seal(self.review_dir(session), SEAL_SLACK)
        except OSError as exc:
            log.warning("session %s: its empty change set could not be removed: %s", session.id, exc)

    def close_all(self, keep_sandboxes: bool = False) -> None:
        """The daemon stops: every sandbox goes, but the sessions stay open in the store, to be
        resumed by the next daemon. ``keep_sandboxes`` (a handover to a surviving supervisor):
        only what the daemon serves for them stops; the next daemon adopts the sandboxes."""
        for session in self._table.take_all():
            with session.lock:
                session.closed = True
                generations = set(session.running) | {session.generation}
                current, ready = session.generation, session.sandbox_ready
                kept = [session.services.pop(generation) for generation in list(session.services)] \
                    if keep_sandboxes else []
            for services in kept:
                close_all(services)
            for generation in generations if not keep_sandboxes else ():
                if not ready and generation == current:
                    continue
                try:
                    self._close_sandbox(session, generation)
                except Exception:  # noqa: BLE001 - shutting down: the fork server may be gone already
                    pass
            self._hooks.session_closed(session, stopping=True)
            _forget_secrets(session)

    def sandboxes_lost(self) -> None:
        """The fork server died, and every sandbox with it: stop what the daemon served for them
        (published ports, egress proxies), and let each open session's next call rebuild its
        sandbox, as after a daemon restart (``restore``)."""
        for session in self._table.all():
            with session.build_lock:
                with session.lock:
                    session.sandbox_ready = False
                    session.built.clear()
                    lost = [session.services.pop(generation) for generation in list(session.services)]
                for services in lost:
                    close_all(services)

    def between_calls(self, session: Session, work: "Callable[[], T]") -> "T":
        """``work`` with the session's sandbox closed (a review session's discard: overlayfs forbids
        changing a layer while it is mounted); the next call rebuilds it over the changed layers, so
        the sandbox then sees the host where changes were dropped. Between calls only: with a call
        or a background process running, WrongState naming it, and nothing is closed."""
        with session.build_lock:
            with session.lock:
                if session.closed:
                    raise NotFound(f"no session {session.id!r}")
                running = sum(session.running.values())
                jobs = [job for job in session.jobs.values() if job.result is None]
                if not running and not jobs:
                    generation, ready = session.generation, session.sandbox_ready
                    session.sandbox_ready = False     # a call that begins now waits for the rebuild
            if jobs:
                raise WrongState(f"session {session.id} has a background process running ({jobs[0].id}, "
                                 f"{jobs[0].name!r}): stop it first (changes are applied or dropped between calls only)")
            if running:
                raise WrongState(f"session {session.id} has {running} call(s) running: changes are applied or dropped between "
                                 "calls only, try again when they end")
            if ready:
                self._close_sandbox(session, generation)   # its services too, as when the fork server is lost
            return work()

    # -- calls -----------------------------------------------------------------------------------

    def ready(self, session: Session) -> None:
        """A resumed session's sandbox built (as its first call would), if it has none."""
        if not session.sandbox_ready:
            self._rebuild(session)

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
                session.last_active = time.monotonic()
            return generation

    def end_call(self, session: Session, generation: int) -> None:
        with session.lock:
            session.last_active = time.monotonic()
            left = session.running.get(generation, 1) - 1
            if left > 0:
                session.running[generation] = left
                return
            session.running.pop(generation, None)
            retired = generation != session.generation and not session.closed
        if retired:                                   # the last call on a replaced sandbox ended
            self._close_sandbox(session, generation)

    def call_ended(self, session: Session) -> None:
        """A call's command ended: the hooks look (the git guard), before its caller hears so."""
        self._hooks.call_ended(session)

    # -- sandbox generations ---------------------------------------------------------------------

    def _open_sandbox(self, session: Session, generation: int, policy: SandboxPolicy) -> None:
        """Build one generation of the session's sandbox in the fork server, keep what it built
        (``session.built``, without the proxy's listener, which is closed here), judge it
        (``check_built``), then start its services (the hooks). The caller holds the session's
        build_lock."""
        started = time.monotonic()
        info = self._fork.open_session(session.sandbox_name(generation), self._spec(session, policy),
                                       self.review_dir(session), session_bytes=self._places.review_session_bytes,
                                       owner_bytes=self._places.review_owner_bytes,
                                       owner_stores=self._owner_stores(session),
                                       owner_stores_max=self._places.review_owner_stores)
        if self.counts is not None:
            self.counts.session_built(time.monotonic() - started)
        try:
            with session.lock:                        # before the check: a concurrent build's check sees it
                session.built[generation] = info.replace(proxy_listener=-1, transparent_listener=-1)
            if self._check_built is not None:
                try:
                    self._check_built(session, info)
                except BaseException:
                    self._fork.close_session(session.sandbox_name(generation))
                    with session.lock:
                        session.built.pop(generation, None)
                    raise
            self._serve_sandbox(session, generation, policy, info)
        finally:
            for listener in (info.proxy_listener, info.transparent_listener):
                if listener >= 0:                     # the egress proxy serves its own copy (sandbox_network)
                    os.close(listener)

    def _serve_sandbox(self, session: Session, generation: int, policy: SandboxPolicy, info: SessionInfo) -> None:
        """What ``_open_sandbox`` does once the fork server built the sandbox: count it, then the hooks."""
        with session.lock:
            session.sandbox_builds += 1
            if info.workspace:
                session.workspace = info.workspace    # as the caller's own lookup resolved it
        if info.pid_namespace:                        # read by the fork server, while the init was surely its
            self._table.set_namespace(session.sandbox_name(generation), info.pid_namespace)
        try:
            served = self._hooks.sandbox_ready(session, Sandbox(generation, policy, info))
            with session.lock:
                session.services[generation] = served
        except BaseException:
            self._close_sandbox(session, generation)
            raise

    def _close_sandbox(self, session: Session, generation: int) -> None:
        """Stop what the daemon serves for one generation, then have the fork server close the
        sandbox itself."""
        with session.lock:
            services = session.services.pop(generation, [])
            session.built.pop(generation, None)
        close_all(services)
        self._fork.close_session(session.sandbox_name(generation))
        self._table.drop_namespace(session.sandbox_name(generation))

    def _rebuild(self, session: Session) -> None:
        """A resumed session's first call builds its sandbox again (once, whoever comes first)."""
        with session.build_lock:
            if session.sandbox_ready or session.closed:
                return
            with session.lock:
                generation, policy = session.generation, session.policy
            self._open_sandbox(session, generation, policy)
            with session.lock:
                session.sandbox_ready = True

    def review_dir(self, session: Session) -> str:
        """Where a review session's change set is (made by the fork server); "" for one in direct mode."""
        return self.review_dir_of(session.id) if session.review else ""

    def review_dir_of(self, session_id: str) -> str:
        return os.path.join(self._places.review_dir, session_id)

    def _owner_stores(self, session: Session) -> list[str]:
        """The review directories of the owner's other review sessions, which its new store's share
        is what they leave of (the fork server reads their bounds from the kernel): the open ones
        and those being built (the table), and the closed ones whose change set is kept (the
        store's records: what a restarted daemon knows too)."""
        if not session.review or not self._places.review_session_bytes:
            return []
        mine = (session.owner.uid, session.owner.principal)
        ids = {other.id for other in self._table.all() if other.review and (other.owner.uid, other.owner.principal) == mine}
        ids.update(self._store.review_session_ids(*mine))
        ids.discard(session.id)
        return sorted(self.review_dir_of(other) for other in ids)

    def _spec(self, session: Session, policy: SandboxPolicy) -> LaunchSpec:
        # The workspace, the writable roots and the allowed sockets are opened and checked by the
        # kernel as the session's owner (kernel.access) when its sandbox is built, every time.
        own = self._places.own
        placement = placement_of(session.labels)        # a pod's session: its groups go in the pod
        with session.lock:
            workspace = session.workspace
        return LaunchSpec(argv=SESSION_PLACEHOLDER_ARGV, workspace=workspace, policy=policy,
                          limits=session.limits, user=command_user(session.owner, policy), dns=self._places.dns,
                          network_pool=self._places.network_pool, caller=rights_of(session.owner),
                          hidden_paths=own.hidden, owner_hidden=_owner_places(session.owner.uid),
                          hidden_homes=_hidden_homes(session, policy, workspace, own.hidden),
                          denied_sockets=own.sockets, denied_listeners=own.listeners,
                          approval_channels=own.channels,
                          owner=cgroup_owner(session.owner), placement=placement,
                          trust_pem=session_ca_pem(session) if policy.proxied else "")


def session_ca_pem(session: Session) -> str:
    """The certificate of the session's CA (made with its first proxied sandbox, kept for its life:
    a live change may add an intercepted host, and the sandbox already trusts it). The key never
    leaves the daemon: only this PEM goes to the fork server and the sandbox."""
    from sandboxd.network.interception.ca import SessionCA

    with session.lock:
        ca = session.ca
    if ca is None:
        ca = SessionCA.generate(session.id)           # off the session's lock: a key is made
        with session.lock:
            ca = session.ca = session.ca or ca
    return ca.cert_pem().decode("ascii")


def _forget_secrets(session: Session) -> None:
    """Every path a session ends by: its secrets wiped, its CA dropped (its key with it)."""
    with session.lock:
        credentials, session.credentials, session.ca = session.credentials, None, None
    if credentials is not None:
        credentials.wipe()


def _hidden_homes(session: Session, policy: SandboxPolicy, workspace: str,
                  own_places: tuple[str, ...] = ()) -> tuple[str, ...]:
    """With ``hide_home``: the homes to cover: the owner's, whoever owns that directory (a
    root-owned home is still theirs to hide; launcher.homes.session_home), refused when it cannot
    be covered rather than reported hidden, and at every other mount of its directory; their runtime directory /run/user/UID (registry
    credentials, agent sockets); and for a root owner's confined session also the home of the
    workspace's owner, whom its commands run as (access.command_user, launcher.plan), so that root
    acting on a user's checkout hides that user's keys too (when that home is coverable)."""
    if not policy.hide_home:
        return ()
    uid = session.owner.uid
    try:
        found = [session_home(uid, own_places)]
    except Uncoverable as why:
        raise InvalidPolicy(f"hide_home: {why}: it cannot be hidden, so the session is refused rather than "
                            "shown it; leave hide_home out (or fix the home in the user database)") from None
    found.extend((*other_mounts(found[0]), *runtime_dir(uid)))
    if command_user(session.owner, policy) is None:
        try:
            other = os.stat(workspace).st_uid
        except OSError:
            other = uid                               # the launch says what is wrong with it
        if other != uid:
            found.extend((*owner_home(other), *runtime_dir(other)))
    homes = tuple(dict.fromkeys(found))
    # A root that holds a home is attached over its cover (rootfs step 7b): the home would show,
    # keys and all, while the policy says hidden. Said, not done silently.
    for what, root in (("workspace", workspace), *(("writable root", root) for root in policy.writable_roots)):
        real = os.path.realpath(root)
        for home in homes:
            if is_within(home, real):
                raise InvalidPolicy(f"hide_home: the {what} {root!r} holds the home {home!r} it would hide: pick "
                                    "a directory inside the home (or elsewhere), or leave hide_home out")
    return homes


def _owner_places(uid: int) -> tuple[str, ...]:
    """The owner's places each sandbox of theirs hides (defaults.owner_hidden_paths: their kept
    `sandboxd run --review` change sets), by their home in the user database; the launch hides only
    those that are their directories (launcher.plan)."""
    import pwd
    try:
        home = pwd.getpwuid(uid).pw_dir
    except KeyError:
        home = ""
    return tuple(path for path in defaults.owner_hidden_paths(uid, home or "/nonexistent") if path.startswith("/"))


def _pod_of(owner: Caller) -> dict[str, str]:
    """Under tenancy by pod, the owner's pod (its UID, and the cgroup its call came from) for the
    SessionCreated event; nothing for any other owner (their events stay as they were)."""
    pod = pod_uid_of(owner.principal)
    if pod is None:
        return {}
    cgroup = owner.tenant.cgroup_path if owner.tenant is not None else None
    return {"owner_pod": pod, **({"owner_cgroup": cgroup} if cgroup else {})}
