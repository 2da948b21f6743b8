"""GetStatus: what the daemon is and what it found on this machine (sandboxctl status)."""

from __future__ import annotations

import os
import shutil
import time
from typing import Protocol

import psutil

from sandboxd import __version__
from sandboxd.kernel.ancestor_limits import limits_above
from sandboxd.policy.session_defaults import SessionDefaults
from sandboxd.service import ancestor_fit
from sandboxd.service.approvals import ApprovalGate
from sandboxd.service.callers import Caller
from sandboxd.service.quotas import CALLS, REQUESTS, STREAMS, TERMINALS, owner_key
from sandboxd.service.sessions.registry import SessionRegistry
from sandboxd.v1 import sandboxd_pb2 as pb


class ConnectionCounts(Protocol):
    """What the status reads of the front door (service.peercred.FrontDoor): a uid's connections."""

    def connections_by_uid(self) -> dict[int | str, int]: ...

    def connection_limit(self, owner: int | str) -> int: ...



def _process_started_at() -> float:
    """When this process started, from the kernel (boot time plus its start in clock ticks): this
    module is imported on the first GetStatus, so the import time would make every daemon look
    freshly started."""
    try:
        return psutil.Process().create_time()
    except psutil.Error:
        return time.time()


STARTED_AT = _process_started_at()


def kernel_features() -> dict[str, str]:
    """Detected once per call; each a short value people can read."""
    from sandboxd.kernel import cgroups, landlock
    from sandboxd.launcher.native_call import check_helper

    try:
        with open("/proc/sys/kernel/seccomp/actions_avail") as f:
            seccomp = "user_notif" if "user_notif" in f.read().split() else "filters only"
    except OSError:
        seccomp = "missing"
    h = cgroups.detect()
    features = {"namespaces": "mount, pid, ipc, uts, cgroup, net", "seccomp": seccomp,
                "landlock": f"ABI {landlock.abi_version()}" if landlock.abi_version() else "missing",
                "nftables": "present" if shutil.which("nft") else "missing (no isolated networks)",
                "call_helper": check_helper().state}     # "stale (...)": built from other constants
    for controller in ("memory", "pids"):
        features[f"cgroup.{controller}"] = ("v2" if controller in h.unified_controllers
                                            else "v1" if controller in h.v1 else "missing")
    return features


def status(registry: SessionRegistry, gate: ApprovalGate, who: Caller,
           door: ConnectionCounts | None = None, defaults: SessionDefaults | None = None) -> pb.DaemonStatus:
    """``defaults``: what a session that sets no limit gets, shown with the caps of the cgroups above
    the sandboxes that lower it (service.ancestor_fit)."""
    features = kernel_features()
    if defaults is not None:
        features.update(ancestor_fit.status_features(defaults.memory_bytes, defaults.pids, limits_above()))
    sessions = registry.list(who)
    quotas = registry.quotas
    limits = quotas.limits
    owner = owner_key(who)
    usage = quotas.usage(who)
    connections: dict[str, int] = {}
    if door is not None and who.mapped_user is None:       # TLS callers do not come through the door
        counted_as = who.principal or who.uid                  # a tenant pod's connections are its own
        connections = {"connections": door.connections_by_uid().get(counted_as, 0)}
        limits_extra = {"connections_per_uid": door.connection_limit(counted_as)}
    else:
        limits_extra = {}
    store = registry.store
    budget = store.limits.owner_budget_bytes                 # what this owner has written to the log lately
    audit_used = min(max(0, int(budget - store.budget_left(who.uid, who.principal))), 2 * budget)
    return pb.DaemonStatus(version=__version__, pid=os.getpid(), started_at=STARTED_AT, features=features,
                           sessions=len(sessions), running_calls=sum(s.running_calls for s in sessions),
                           pending_approvals=sum(len(gate.pending(s.id)) for s in sessions),
                           events=registry.store.last_id(),
                           quota_limits={"sessions_per_uid": limits.sessions_per_uid,
                                         "calls_per_uid": limits.calls_per_uid,
                                         "streams_per_uid": limits.streams_per_uid,
                                         "requests_per_uid": limits.requests_per_uid,
                                         "terminals_per_uid": limits.terminals_per_uid,
                                         "reserved_workers": limits.reserved_workers, "workers": limits.workers,
                                         "long_lived_total": limits.long_lived_total,
                                         "first_slot_share": limits.first_slot_share,
                                         "audit_owner_budget": budget, **limits_extra},
                           quota_usage={"sessions": sum(1 for s in sessions if owner_key(s.owner) == owner),
                                        "calls": usage[CALLS], "streams": usage[STREAMS],
                                        "requests": usage[REQUESTS], "terminals": usage[TERMINALS],
                                        "long_lived": usage["long_lived_total"], "audit_bytes": audit_used,
                                        "workers_busy": usage["workers_busy"], **connections})
