"""Where a session's sandbox cgroups go: below the daemon's own group, or, for a caller in a
Kubernetes pod with limits.charge_pods on, beside the pod's containers (service.pod_sessions says why
and how a pod's end closes them). The placement is kept in the session's label ``LABEL``, which only
the daemon sets: a caller naming a cgroup could charge another pod, or escape its own."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from sandboxd.errors import InvalidPolicy
from sandboxd.kernel import pod_placement

if TYPE_CHECKING:
    from sandboxd.service.callers import Caller

LABEL = "sandboxd.pod-cgroup"


def placement_for(who: "Caller", labels: dict[str, str],
                  charge_pods: bool) -> tuple[dict[str, str], dict[str, str]]:
    """Where a new session of ``who`` goes: the pod's groups ({}: the daemon's own layout), and the
    labels to create it with (the caller's, plus the placement). A local caller only (a TLS caller,
    ``mapped_user``, has no process here to read)."""
    if LABEL in labels:
        raise InvalidPolicy(f"the label {LABEL} is the daemon's own: it names the calling pod's cgroup "
                            "(limits.charge_pods), which the daemon reads from the kernel")
    if not charge_pods or who.mapped_user is not None or who.pid <= 0:
        return {}, labels
    pod = pod_placement.pod_of(pod_placement.caller_groups(who.pid))
    if pod is None:
        return {}, labels
    tenant = who.tenant
    if tenant is not None and tenant.kind == "pod" and tenant.pod_uid:
        # The pod the session is charged to is the pod the caller is a tenant as (read at accept):
        # a process that changed pods since (it cannot without privileges) is not placed elsewhere.
        spelled = (tenant.pod_uid, tenant.pod_uid.replace("-", "_"))
        if not all(any(word in os.path.basename(path) for word in spelled) for path in pod.values()):
            raise InvalidPolicy("this caller's cgroup no longer names the pod it connected from: reconnect")
    return pod, {**labels, LABEL: pod_placement.encode(pod)}


def placement_of(labels: dict[str, str]) -> dict[str, str]:
    """The pod's groups a session (its ``labels``) goes in ({}: the daemon's own layout)."""
    text = labels.get(LABEL)
    return pod_placement.decode(text) if text else {}
