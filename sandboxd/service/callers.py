"""Who is calling: the one place that turns a gRPC call into the caller's credentials.

- On the Unix socket, the front door saw the caller's SO_PEERCRED and SO_PEERGROUPS when it
  connected (network.front_door).
- On the optional TLS listener, the verified client certificate names the caller (its
  *principal*): by its common name, or by one configured subject alternative name (a URI, as
  SPIFFE IDs are, or a DNS name). A certificate without a usable identity is refused, never
  mapped to a shared principal. The principal acts as the local user ``tls.users`` maps it to,
  else as ``tls.user`` (default nobody): principals mapped to the same local user share its file
  rights, so the daemon refuses one a workspace another principal's open session uses.
- Either way, a caller whose process runs inside a sandbox is refused (service.sandboxed_peers).

What the caller may do beyond its own sessions is decided here too, once per call, into a
:class:`Caller` that every check reads (quotas, the admin checks, danger-full-access, privileged
published ports, standing-rule ownership, path checks): nothing else asks ``uid == 0``.

The rule: **local root** is a caller on the Unix socket whose SO_PEERCRED uid is 0; an
**administrator** is local root or a Unix-socket caller in ``listen.admin_group``. A TLS caller
is neither, whatever local user it is mapped to, uid 0 included: a certificate proves who holds a
key, not that they are this host's root, so it never escapes quotas, never sees or removes
others' sessions and rules, never gets danger-full-access or a privileged published port. Its
uid and gid (its mapped user) only decide the file rights its commands run with.

Under ``tenancy.mode = "pod"`` a local caller inside a Kubernetes pod is held the same way, as
its pod (service.principals): its owner string is ``pod:<UID>``, uid 0 in a pod included; a
caller whose pod cannot be told from its cgroup is refused.
"""

from __future__ import annotations

import os
from typing import Any

from sandboxd._record import Factory, Record
from sandboxd.errors import CallerRefused
from sandboxd.network.front_door import FrontDoor, caller
from sandboxd.kernel import pod_cgroups
from sandboxd.network.peer_credentials import PeerCredentials
from sandboxd.service.principals import (PodReader, Principal, pod_owner, pod_principal, pod_uid_of, tls_principal,
                                         uid_principal)
from sandboxd.service.sandboxed_peers import SandboxedPeers, parse_peer

IDENTITIES = ("common-name", "uri", "dns")
# The auth_context key gRPC fills for each identity, and the principal's prefix. A common name
# keeps the plain "tls:" prefix that sessions of earlier versions were stored with.
_AUTH_KEYS = {"common-name": ("x509_common_name", "tls:"), "uri": ("peer_uri", "tls-uri:"),
              "dns": ("peer_dns", "tls-dns:")}


class Caller(PeerCredentials):
    """Who is calling and what that makes it, decided once per call (by :func:`identify`)."""

    # A TLS caller: the local (uid, gid) its principal acts as (tls.users, else tls.user); None
    # for a local caller.
    mapped_user: tuple[int, int] | None = None
    is_root: bool = False         # local root: exempt from per-owner quotas, its danger-full-access runs as root
    is_admin: bool = False        # local root or the admin group: sees and manages every owner's sessions and rules
    # Whose the call is, for other layers to read (service.principals): its kind, owner key,
    # pod and cgroup. The checks here read is_root, is_admin and the owner string (principal).
    tenant: Principal | None = None


def identify(who: PeerCredentials, admin_gid: int | None = None, cgroup_path: str | None = None) -> Caller:
    """The one rule (module docstring): local uid 0 is root; root and local members of
    ``admin_gid`` are administrators; a TLS principal or a pod is neither."""
    local = not who.principal
    is_root = local and who.uid == 0
    is_admin = is_root or (local and admin_gid is not None and admin_gid in (who.gid, *who.groups))
    pod = pod_uid_of(who.principal)
    if local:
        tenant = uid_principal(who.uid, is_admin, cgroup_path)
    elif pod is not None:
        tenant = pod_principal(pod, cgroup_path)
    else:
        tenant = tls_principal(who.principal)
    is_tls = not local and pod is None
    return Caller(who.uid, who.gid, who.pid, who.principal, who.groups, who.refusal, who.cgroups,
                  mapped_user=(who.uid, who.gid) if is_tls else None, is_root=is_root, is_admin=is_admin,
                  tenant=tenant)


def acted_by(who: Caller) -> dict[str, object]:
    """Who acted, as an audit event records it: ``by_uid``, and ``by_principal`` for a TLS caller or a
    pod (the export names the pod, not uid 0 as the node's root: audit.export.ocsf)."""
    return {"by_uid": who.uid, **({"by_principal": who.principal} if who.principal else {})}


def principal_of(who: Caller) -> Principal:
    """``who``'s principal (service.principals): as identified, or as its credentials make it."""
    if who.tenant is not None:
        return who.tenant
    tenant = identify(who).tenant
    assert tenant is not None
    return tenant


def session_owner(uid: int, gid: int, principal: str) -> Caller:
    """The owner of a session read back from the store (after a restart): as it was identified
    when it created the session, but for the admin group (which no owner check needs)."""
    return identify(PeerCredentials(uid, gid, 0, principal))


class TlsIdentity(Record):
    """How TLS callers are named and which local user each acts as."""

    identity: str = "common-name"                              # one of IDENTITIES
    default_user: tuple[int, int] = (65534, 65534)             # tls.user
    users: dict[str, tuple[int, int]] = Factory(dict)          # tls.users: identity -> (uid, gid)
    port: int = 0                                              # the listener's port

    def principal(self, auth: dict[str, list[bytes]]) -> str:
        """The caller's principal from its verified certificate; CallerRefused when it has none."""
        key, prefix = _AUTH_KEYS[self.identity]
        values = [v.decode(errors="replace") for v in auth.get(key, []) if v]
        if len(values) != 1:
            found = "none" if not values else f"{len(values)} ({', '.join(values)})"
            raise CallerRefused(
                f"the client certificate has no usable identity: sandboxd names TLS callers by their "
                f"{self.identity} (tls.identity) and this certificate has {found}; issue it with exactly one, "
                "or set tls.identity to the field your certificates carry (common-name, uri, dns)")
        return prefix + values[0]

    def user_of(self, principal: str) -> tuple[int, int]:
        name = principal.split(":", 1)[1]
        return self.users.get(name, self.default_user)


class Callers:
    """Callable: the credentials of the caller of a gRPC call, or CallerRefused saying why not."""

    def __init__(self, door: FrontDoor, tls: "TlsIdentity | tuple[int, int] | None" = None,
                 sandboxed: SandboxedPeers | None = None, admin_gid: int | None = None,
                 pods: PodReader | None = None) -> None:
        """``pods``: tenancy by pod (None: by uid)."""
        self._door = door
        self._admin_gid = admin_gid
        self._pods = pods
        self._tls = TlsIdentity(default_user=tls) if isinstance(tls, tuple) else tls
        self._sandboxed = sandboxed
        self._groups: dict[tuple[int, int], tuple[int, ...]] = {}

    def __call__(self, context: Any) -> Caller:
        peer = context.peer()
        if peer.startswith("unix:") or self._tls is None:
            who = caller(self._door, context)
            if who.refusal:
                raise CallerRefused(who.refusal)
            if self._pods is not None:
                return self._by_pod(self._pods, who)
            return identify(who, self._admin_gid)
        if self._sandboxed is not None:
            address = parse_peer(peer)
            if address is not None:
                reason = self._sandboxed.reason_for_tcp(address[0], address[1], self._tls.port)
                if reason:
                    raise CallerRefused(reason)
        principal = self._tls.principal(context.auth_context())
        uid, gid = self._tls.user_of(principal)
        return identify(PeerCredentials(uid, gid, 0, principal, self._groups_of(uid, gid)), self._admin_gid)

    def _by_pod(self, pods: PodReader, who: PeerCredentials) -> Caller:
        """A local caller under pod tenancy: its pod's, or (in no pod, in the daemon's own, or in
        one tenancy.admin_pods names) its uid's, as under uid tenancy."""
        try:
            pod = pods.pod_of(who.cgroups)
        except pod_cgroups.CgroupRefused as exc:
            raise CallerRefused(f"{exc}; this daemon tells tenants apart by their pod (tenancy.mode = \"pod\")") from None
        if pod is None:
            return identify(who, self._admin_gid, _own_line(who.cgroups))
        if not pods.is_tenant(pod):
            local = identify(who, self._admin_gid, pod.cgroup_path)
            return local.replace(tenant=pod_principal(pod.uid, pod.cgroup_path, is_admin=local.is_admin))
        pod_caller = PeerCredentials(who.uid, who.gid, who.pid, pod_owner(pod.uid), who.groups, "", who.cgroups)
        return identify(pod_caller, None, pod.cgroup_path)

    def _groups_of(self, uid: int, gid: int) -> tuple[int, ...]:
        groups = self._groups.get((uid, gid))
        if groups is None:
            import pwd

            try:
                groups = tuple(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid))
            except (KeyError, OSError):
                groups = (gid,)
            self._groups[(uid, gid)] = groups
        return groups


def _own_line(cgroups: str) -> str | None:
    """The v2 cgroup path of a /proc/PID/cgroup text (None on a machine whose processes have none)."""
    for line in cgroups.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None
