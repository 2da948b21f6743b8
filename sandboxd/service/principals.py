"""Whose a call is: the caller's *principal* (a local uid, a TLS certificate, or a Kubernetes pod),
decided once per call beside the rest of the caller (service.callers).

Under ``tenancy.mode = "uid"`` (the default) a local caller's principal is its uid, exactly as
before this module existed. Under ``tenancy.mode = "pod"`` (a DaemonSet serving a node's pods) a
caller inside a pod is that pod, whatever uid it runs as: the pod's UID, read from the caller's
cgroup at accept (kernel.pod_cgroups says why that is unforgeable for a pod that is not
privileged). A pod's name and namespace are not known: nothing a pod says about itself
(its environment, a token the daemon cannot verify without the API server) is believed, and
the daemon does not call the API server (TokenReview) at all, so one node's daemon does not need
its credentials or reachability.

Everything per owner (sessions and their visibility, quotas, the audit budget, approvals,
standing rules, events) keys on the owner string a session is stored with (``Caller.principal``:
"" for a local uid, ``tls:...`` for a certificate, ``pod:<UID>`` for a pod) and the uid. A pod
caller is held like a TLS caller: never local root, never an administrator, never
danger-full-access, each pod its own quotas and budget, uid 0 in it included. The exceptions:
a pod ``tenancy.admin_pods`` names, and a caller in the daemon's own pod (its probes,
an operator's ``kubectl exec``), are local callers of their uid (uid 0: the node's root).
A caller on the node that is in no pod (the node's root, the kubelet, a node user) is a local
caller of its uid, as under uid tenancy.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Literal

from sandboxd.kernel import pod_cgroups
from sandboxd.network.front_door import refused_owner
from sandboxd.network.peer_credentials import PeerCredentials
from sandboxd.printable import printable

POD_PREFIX = "pod:"                 # (audit.export.ocsf keeps the same word: it is below this layer)
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a caller is, for everything counted or kept per owner.

    ``key`` is the owner as a cgroup-name-safe word (``uid-1000``, ``tls-<hash>``, ``pod-<UID>``);
    ``display`` is what a person reads (escaped); ``cgroup_path`` is the caller's own cgroup as read
    at accept (the v2 line's when it names the pod, relative to the cgroup2 mount), or None for a
    TLS caller or when the daemon did not read it (uid tenancy)."""

    kind: Literal["uid", "tls", "pod"]
    key: str
    display: str
    pod_uid: str | None = None
    pod_namespace: str | None = None        # never filled: not verifiable here (module docstring)
    pod_name: str | None = None
    cgroup_path: str | None = None
    is_admin: bool = False


@dataclass(frozen=True, slots=True)
class Tenancy:
    """How pods are told apart under ``tenancy.mode = "pod"`` (the other ``tenancy.*`` keys)."""

    admin_pods: frozenset[str] = frozenset()  # pod UIDs whose callers are local callers of their uid
    cgroup_root: str = "/"                   # the cgroup kubelet's kubepods sits in (kubelet --cgroup-root)
    own_pod: str | None = None               # the daemon's own pod's UID (None: PodReader.enter_node_view finds it)


def pod_owner(pod_uid: str) -> str:
    """The owner string a pod's sessions, rules and budget are kept under."""
    return POD_PREFIX + pod_uid


def pod_uid_of(owner_principal: str) -> str | None:
    """The pod UID of an owner string (None: not a pod's)."""
    return owner_principal[len(POD_PREFIX):] if owner_principal.startswith(POD_PREFIX) else None


def uid_principal(uid: int, is_admin: bool, cgroup_path: str | None = None) -> Principal:
    return Principal(kind="uid", key=f"uid-{uid}", display=f"uid {uid}", cgroup_path=cgroup_path, is_admin=is_admin)


def tls_principal(name: str) -> Principal:
    import hashlib

    key = "tls-" + hashlib.sha256(name.encode(errors="surrogateescape")).hexdigest()[:20]
    return Principal(kind="tls", key=key, display=printable(name))


def pod_principal(pod_uid: str, cgroup_path: str | None, is_admin: bool = False) -> Principal:
    return Principal(kind="pod", key=f"pod-{pod_uid}", display=f"pod {pod_uid}", pod_uid=pod_uid,
                     cgroup_path=cgroup_path, is_admin=is_admin)


class PodReader:
    """Reads callers' pods under ``tenancy`` (pod mode): for the front door's connection counts and
    for the caller of each call (service.callers), the same way."""

    def __init__(self, tenancy: Tenancy) -> None:
        self.tenancy = tenancy
        self.own_pod = tenancy.own_pod
        # Every caller's /proc/PID/cgroup must list exactly the hierarchies ours does (pod_cgroups).
        self._hierarchies = pod_cgroups.hierarchy_ids(pod_cgroups.read_cgroups("self"))

    def enter_node_view(self) -> None:
        """On the thread that reads callers' cgroups (the front door's), before the first: join the
        node's cgroup namespace if the daemon runs in one of its own, then find the daemon's own
        pod as the node sees it. A thread that cannot join reads "/.."-relative paths, and every
        caller outside the daemon's own cgroup is refused saying so (pod_cgroups)."""
        try:
            if pod_cgroups.join_node_cgroup_namespace():
                log.info("tenancy by pod: joined the node's cgroup namespace to read callers' pods")
        except OSError as exc:
            log.warning("tenancy by pod: cannot join the node's cgroup namespace (%s): callers outside the "
                        "daemon's own cgroup will be refused; run the daemon with the node's PID namespace (hostPID) and CAP_SYS_ADMIN", exc)
        if self.own_pod is None:
            try:
                found = self.pod_of(pod_cgroups.read_cgroups(os.getpid()))
            except (OSError, pod_cgroups.CgroupRefused):
                found = None
            self.own_pod = found.uid if found else None

    def pod_of(self, cgroups: str) -> pod_cgroups.PodCgroup | None:
        """The caller's pod (None: in none); CgroupRefused saying why it cannot be told."""
        return pod_cgroups.pod_of(cgroups, self._hierarchies, self.tenancy.cgroup_root)

    def is_tenant(self, pod: pod_cgroups.PodCgroup) -> bool:
        """Whether callers in ``pod`` are its tenants (not an admin pod, not the daemon's own)."""
        return pod.uid not in self.tenancy.admin_pods and pod.uid != self.own_pod

    def connection_owner(self, who: PeerCredentials) -> int | str:
        """Whom the front door counts a connection against: a tenant pod (``pod:<UID>``), else the
        uid (a caller in no pod, an admin pod); one whose pod cannot be told, which every call of
        will refuse, in its uid's bucket of refused callers (never the uid's own: uid 0's is the
        node root's)."""
        try:
            pod = self.pod_of(who.cgroups)
        except pod_cgroups.CgroupRefused:
            return refused_owner(who.uid)
        return pod_owner(pod.uid) if pod is not None and self.is_tenant(pod) else who.uid
