"""Who may see and act on a session, and with what rights its sandbox is built.

A session is its owner's: the same local uid (not through TLS, not from a pod), or the same TLS
principal, or (tenancy by pod) the same pod *and* uid; root and the admin group see every local user's.
Inside a pod the uid boundary holds as on the node: a session runs with its creator's file rights
(uid 0's for a session the pod's root made), so another uid of the pod (a runAsNonRoot sidecar, an
agent that dropped privileges) must not drive it. The pod's uid 0 may see (list, read the audit of)
every session of its pod, as it could become any of its uids anyway, but acts only on its own.
Quotas and the audit budget stay per pod, whatever uid. Someone else's session is NOT_FOUND, never
PERMISSION_DENIED: a caller learns nothing about sessions it may not use. Which paths a caller
may use is the kernel's to say, under the caller's own credentials (``rights_of``), when the
sandbox is built; this module only decides who may ask for what.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Iterable

from sandboxd.audit.store import EventStore
from sandboxd.errors import Forbidden, NotFound
from sandboxd.policy import SandboxPolicy
from sandboxd.policy.sandbox import is_within
from sandboxd.printable import printable
from sandboxd.service.callers import Caller
from sandboxd.service.principals import pod_uid_of
from sandboxd.service.sessions.state import Session

if TYPE_CHECKING:
    from sandboxd.supervisor.fork_client import SessionInfo


def owns(caller: Caller, owner_uid: int, owner_principal: str) -> bool:
    """Whether the caller may act on the session: its owner (same uid and, for TLS or pod callers,
    same certificate or pod), root, or the admin group."""
    if pod_uid_of(caller.principal) is not None:
        return owner_principal == caller.principal and owner_uid == caller.uid
    if caller.principal:
        return owner_principal == caller.principal
    return caller.is_admin or (owner_uid == caller.uid and not owner_principal)


def sees(caller: Caller, owner_uid: int, owner_principal: str) -> bool:
    """Whether the caller may see the session (list it, read its audit log): whoever may act on it,
    and a pod's uid 0 every session of its own pod (module docstring)."""
    if owns(caller, owner_uid, owner_principal):
        return True
    return pod_uid_of(caller.principal) is not None and caller.uid == 0 and owner_principal == caller.principal


def may_use(caller: Caller, session: Session) -> bool:
    return owns(caller, session.owner.uid, session.owner.principal)


def may_see(caller: Caller, session: Session) -> bool:
    return sees(caller, session.owner.uid, session.owner.principal)


def visible_ids(store: EventStore, caller: Caller, session_id: str = "", *, acting: bool = False) -> list[str] | None:
    """The sessions, open or closed, whose audit log the caller may read (None: all of them,
    for an administrator); with ``session_id``, that one or NOT_FOUND. ``acting``: only those
    the caller may act on (owns), not merely see."""
    allowed = owns if acting else sees
    if session_id:
        try:
            row = store.session(session_id)
        except NotFound:
            raise NotFound(f"no session {session_id!r}") from None
        if not allowed(caller, row.owner_uid, row.owner_principal):
            raise NotFound(f"no session {session_id!r}")
        return [session_id]
    if caller.is_admin:
        return None
    seen = owners_seen(caller)
    assert seen is not None                    # every owner's only for an administrator
    principal, uid = seen
    return [found for found, owner in store.session_owners(principal, uid) if allowed(caller, owner.uid, owner.principal)]


def owners_seen(caller: Caller) -> tuple[str, int | None] | None:
    """The owners whose sessions the caller may see, or more (``sees`` decides), as the store finds
    them by index: (principal, uid; None: any uid of it). None: every owner, an administrator's
    view. A TLS or pod caller sees only sessions of its own principal (a pod's uid 0, every uid's
    of it); a local one only its uid's without a principal."""
    if caller.principal:
        return caller.principal, None
    if caller.is_admin:
        return None
    return "", caller.uid


def check_full_access(caller: Caller, policy: SandboxPolicy, owner: Caller | None = None, *,
                      allow_user_full_access: bool = True) -> None:
    """Who may ask for danger-full-access, for a session of ``owner`` (None: the caller's own,
    being created)."""
    if policy.confined:
        return
    owner = owner or caller
    # A non-root owner's danger-full-access runs as that owner with its own rights and no more
    # (sequence._exec_as_caller). A TLS principal is not the local user it is mapped to, nor is a
    # pod the local user its uid names (uid 0 in a pod is not the node's root): principals sharing
    # one uid are kept apart (check_not_shared), so neither it nor anyone for it may.
    for who in (caller, owner):
        if pod_uid_of(who.principal) is not None:
            raise Forbidden(f"a caller in a pod ({who.tenant.display if who.tenant else printable(who.principal)}) never "
                            "may create danger-full-access sessions, whatever uid it runs as, and no session of one "
                            "becomes one (tenancy.mode = \"pod\"; an operator may name the pod in "
                            "tenancy.admin_pods): use workspace-write")
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
    if not allow_user_full_access:
        raise Forbidden("this daemon lets only local root create danger-full-access sessions "
                        "(policy.allow_user_full_access = false): use workspace-write, or ask its operator")


def check_not_shared(owner: Caller, facts: SessionInfo, sessions: Iterable[Session], session_id: str = "") -> None:
    """TLS principals (or pods) that act as the same local user share its file rights; so one may not
    use a workspace or writable root that overlaps one of another principal's open sessions
    (it could read and overwrite that principal's files through it). Judged on what the fork
    server built (``facts``: the real paths as the owner's lookup resolved them), after the build
    and before anyone can use it, against the others' facts: never on paths the daemon resolved."""
    if not owner.principal:
        return
    others = [s for s in sessions if not s.closed and s.id != session_id
              and s.owner.principal and s.owner.principal != owner.principal and s.owner.uid == owner.uid]
    if not others:
        return
    mine = [facts.workspace, *facts.writable_roots]
    for other in others:
        for path in mine:
            for theirs in _paths_of(other):
                if is_within(path, theirs) or is_within(theirs, path):
                    raise Forbidden(f"{printable(path)!r} overlaps {printable(theirs)!r}, which a session of another "
                                    f"TLS principal or pod uses: principals acting as the same local user "
                                    f"(uid {owner.uid}) share its file rights, so their workspaces are kept apart "
                                    "(map each TLS principal to its own user with tls.users; give each pod a "
                                    "workspace of its own)")


def _paths_of(session: Session) -> list[str]:
    """A session's real workspaces and writable roots, as each of its live sandboxes was built (its
    workspace alone, as the store kept it, while it has none: resumed, not built again yet)."""
    with session.lock:
        built, workspace = list(session.built.values()), session.workspace
    return [workspace, *(path for facts in built for path in (facts.workspace, *facts.writable_roots))]


def command_user(owner: Caller, policy: SandboxPolicy) -> tuple[int, int] | None:
    """Who a session's commands run as: a non-root caller's as itself; a root caller's (in a
    confined policy) as the workspace's owner (None, as ``sandboxd run`` does), so that root
    acting on a user's checkout runs that user's commands as that user, and uid 0 remains only
    for a root-owned workspace. danger-full-access runs as its owner: root as root, as before,
    anyone else as itself with no privilege (launcher.sequence._exec_as_caller)."""
    if owner.is_root and policy.confined:
        return None
    return (owner.uid, owner.gid)


def caller_groups(caller: Caller) -> set[int]:
    """The caller's gid and supplementary groups: from SO_PEERGROUPS at connect time (the front
    door), for a TLS caller those of its local user, for a session restored after a restart
    those its owner has now."""
    if caller.groups or caller.pid:
        return {caller.gid, *caller.groups}
    return current_groups(caller)


def current_groups(caller: Caller) -> set[int]:
    """The caller's gid and the groups its user is in now (the group database), whatever its
    connection carried when it was identified: for a grant that must end when root takes the
    user out of the group, even on a session created before."""
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
