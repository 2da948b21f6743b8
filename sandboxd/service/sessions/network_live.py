"""A network policy change on a live session: applied to its running egress proxy, no rebuild.

A change that touches only what the proxy enforces (allowed_domains, allowed_endpoints, unlisted,
credentials: SandboxPolicy.without_network_rules is the rest), on a session whose sandbox is
proxied before and after (its own namespace lets out only the proxy: the kernel's ruleset stays
right), is given to every live generation's EgressProxy (``update``: the next connection or
request obeys; open connections to a host no longer allowed, or whose credential changed, are
cut) and to the sandbox's environment (the phantoms of the next calls). Audited as PolicyChanged
with ``live: true`` and ``by`` ("caller": UpdateSessionPolicy; "approval": an answered network
question). Anything else needs a new sandbox generation (lifecycle.update_policy).

``apply_network_policy`` is the one entry other service code uses (track ask's "allow for the
session"); lifecycle.update_policy calls ``LiveNetwork.apply`` itself, under the session's
build_lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

from sandboxd.audit.store import EventStore, EventType
from sandboxd.errors import NotFound, WrongState
from sandboxd.policy import SandboxPolicy
from sandboxd.policy.network import DaemonSecret
from sandboxd.service.callers import Caller, acted_by
from sandboxd.service.credential_vault import CredentialVault
from sandboxd.service.sessions.state import Session

BY = ("caller", "approval")


def live_changeable(current: SandboxPolicy, new: SandboxPolicy) -> bool:
    """Whether ``new`` differs from ``current`` only in what a running proxy takes (both proxied)."""
    return current.proxied and new.proxied and current.without_network_rules() == new.without_network_rules()


def apply_network_policy(session: Session, change: "SandboxPolicy | Callable[[SandboxPolicy], SandboxPolicy]", *,
                         by: str, caller: Caller | None = None) -> None:
    """Give ``change`` (a network-only change: a new policy, or a function of the current one,
    called under the build lock with the policy current then, so that no concurrent change is
    lost) to ``session``'s running proxy now, audited as ``caller``'s (None: the owner's).
    NotFound for a closed session, WrongState for a change that needs a new sandbox."""
    live = session.live_network
    if live is None:
        raise WrongState(f"session {session.id} has no egress proxy to change")
    live.admit(session)
    with session.build_lock:
        if callable(change):
            with session.lock:
                current = session.policy
            new_policy = change(current)
            if new_policy is current:
                return                                  # nothing to add: the rule is there already
        else:
            new_policy = change
        live.apply(session, new_policy, by=by, caller=caller)


class LiveNetwork:
    """Applies network-only changes (one per daemon; sessions reach it as ``session.live_network``)."""

    def __init__(self, store: EventStore, vault: CredentialVault,
                 environment: Callable[[Session], dict[str, str]]) -> None:
        """``environment(session)``: the variables its proxy's sandbox gets (sandbox_network), read
        again after a change (the credentials' phantoms)."""
        self._store, self._vault, self._environment = store, vault, environment

    def admit(self, session: Session) -> None:
        """Whether the store takes the owner's change (EventStore.admit: Exhausted if not)."""
        self._store.admit(session.owner.uid, session.owner.principal)

    def apply(self, session: Session, new_policy: SandboxPolicy, *, by: str, caller: Caller | None = None,
              secrets: "Mapping[str, bytes | DaemonSecret] | None" = None) -> None:
        """The caller holds ``session.build_lock`` (one builder at a time). ``caller``: who asked
        (None: the daemon on the owner's behalf, for an approval); ``secrets``: what it sent for
        the credentials (credential_vault's rules)."""
        from sandboxd.network.egress_proxy import EgressProxy

        if by not in BY:
            raise ValueError(f"by must be one of {BY}")
        with session.lock:
            if session.closed:
                raise NotFound(f"no session {session.id!r}")
            current, before, old = session.policy, session.axes(), session.credentials
            generation = session.generation
        if not live_changeable(current, new_policy):
            raise WrongState(f"session {session.id}: this change needs a new sandbox, not only its proxy's rules")
        owner = session.owner
        credentials = self._vault.resolve(caller or owner, owner, old, new_policy.network_rules.credentials,
                                          secrets or {})
        rules, swap = new_policy.network_rules, credentials.credential_set()
        with session.lock:
            proxies = [service for services in session.services.values() for service in services
                       if isinstance(service, EgressProxy)]
        for proxy in proxies:
            proxy.update(rules, credentials=swap)
        with session.lock:
            session.policy, session.credentials = new_policy, credentials
            if proxies:
                session.extra_env = self._environment(session)
            after, row = session.axes(), session.to_row()
        if old is not None:
            old.wipe_unused(credentials)
        # Recorded before the caller hears the change took effect.
        self._store.save_session(row)
        self._store.append(session.id, EventType.POLICY_CHANGED, data={
            "before": before, "after": after, **acted_by(caller if caller is not None else owner),
            "generation": generation, "live": True, "by": by,
            **({"credential_states": [state.as_dict() for state in credentials.states()]} if credentials.held
               else {})})
