"""Tenancy by pod (tenancy.mode = "pod", issue 27 item 2), from the operator's side: a real daemon,
and agents in fake pods (cgroups named as kubelet names them, under a parent the test owns: see
pod_world), all running as root, as agent pods usually do.

Each pod sees and touches only its own sessions, standing rules and events, has its own session
quota, and is refused danger-full-access; the node's root (a caller in no pod) still sees all and
may use it; a pod tenancy.admin_pods names is the node's root. Controls: the same root agents
under uid tenancy (the switch off) see each other's sessions, escape the quota and get
danger-full-access, as the issue found. Hostile cgroups: a process below kubepods but in no pod
cgroup is refused saying why; one in a sub-cgroup of its own container named like another pod's
stays its own pod."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from daemon_helpers import DaemonFactory, close_quietly
from pod_world import pod_config, pod_node, refused, run_agent
from sandboxd.errors import CallerRefused
from sandboxd.kernel.pod_cgroups import read_cgroups
from sandboxd.network.peer_credentials import PeerCredentials
from sandboxd.service.callers import Caller, Callers
from sandboxd.service.principals import PodReader, Tenancy
from sandboxd.service.quotas import cgroup_owner, owner_key
from sandboxd.v1 import sandboxd_pb2 as pb

FULL = {"mode": "DANGER_FULL_ACCESS"}


def create(workspace: Path, policy: dict[str, Any] | None = None) -> dict[str, Any]:
    request: dict[str, Any] = {"workspace": str(workspace), "approval_policy": "NEVER"}
    if policy:
        request["sandbox_policy"] = policy
    return {"rpc": "CreateSession", "request": request}


def listed() -> dict[str, Any]:
    return {"rpc": "ListSessions", "request": {}}


def ids(answer: dict[str, Any]) -> set[str]:
    return {session["id"] for session in answer["ok"].get("sessions", [])}


def touch_attempts(session_id: str) -> list[dict[str, Any]]:
    """Every way to see or act on a session of someone else's."""
    return [{"rpc": "GetSession", "request": {"session_id": session_id}},
            {"rpc": "Run", "request": {"session_id": session_id, "argv": ["true"]}},
            {"rpc": "WriteFile", "request": {"session_id": session_id, "path": "planted", "data": "eA=="}},
            {"rpc": "UpdateSessionPolicy", "request": {"session_id": session_id, "approval_policy": "NEVER"}},
            {"rpc": "ListPendingApprovals", "request": {"session_id": session_id}},
            {"rpc": "QueryEvents", "request": {"session_id": session_id}},
            {"rpc": "CloseSession", "request": {"session_id": session_id}}]


def test_two_root_pods_are_two_tenants(sandboxd_daemon: DaemonFactory) -> None:
    with pod_node() as node:
        a, b = node.pod("cgroupfs", "besteffort"), node.pod("systemd", "burstable")
        admin = node.pod("cgroupfs", "")
        daemon = sandboxd_daemon(config=pod_config(node, sessions=2, admin_pods=(admin.uid,)))
        ws_a, ws_b = sandboxd_daemon.workspace(), sandboxd_daemon.workspace()

        limited = create(ws_a)
        limited["request"]["limits"] = {"memory_bytes": str(256 << 20), "pids": 256}   # a cgroup named for the pod
        made_a = a.call(daemon.socket, create(ws_a), limited,
                        {"rpc": "AddStandingRule", "request": {"workspace": str(ws_a), "tool": "shell"}})
        assert all("ok" in answer for answer in made_a), made_a
        sa = made_a[0]["ok"]["id"]
        made_b = b.call(daemon.socket, create(ws_b), create(ws_b))
        assert all("ok" in answer for answer in made_b), made_b       # A's two sessions did not spend B's quota
        sb = made_b[0]["ok"]["id"]
        try:
            # Each pod sees its own sessions and nothing of the other's.
            seen_a, *a_touches = a.call(daemon.socket, listed(), *touch_attempts(sb))
            assert ids(seen_a) == {sa, made_a[1]["ok"]["id"]}
            assert all(refused(answer, "NOT_FOUND") for answer in a_touches), a_touches
            seen_b, rules_b, events_b, *b_touches = b.call(
                daemon.socket, listed(), {"rpc": "ListStandingRules", "request": {}},
                {"rpc": "QueryEvents", "request": {}}, *touch_attempts(sa))
            assert ids(seen_b) == {sb, made_b[1]["ok"]["id"]}
            assert rules_b["ok"].get("rules", []) == []                 # A's standing rule is A's
            assert {e["session_id"] for e in events_b["ok"]["events"] if e.get("session_id")} == ids(seen_b)
            assert all(refused(answer, "NOT_FOUND") for answer in b_touches), b_touches
            rules_a, events_a = a.call(daemon.socket, {"rpc": "ListStandingRules", "request": {}},
                                       {"rpc": "QueryEvents", "request": {}})
            assert [(r["tool"], r["owner_principal"]) for r in rules_a["ok"]["rules"]] == [("shell", f"pod:{a.uid}")]
            assert {e["session_id"] for e in events_a["ok"]["events"] if e.get("session_id")} == ids(seen_a)
            created = [e for e in events_a["ok"]["events"] if e["type"] == "SessionCreated"]
            assert created and all(json.loads(e["data_json"])["owner_pod"] == a.uid for e in created), created
            assert all(json.loads(e["data_json"])["owner_cgroup"].endswith(a.directory.name) for e in created)

            [ran] = a.call(daemon.socket, {"rpc": "Run", "request": {"session_id": made_a[1]["ok"]["id"],
                                                                     "argv": ["id", "-u"]}})
            assert any(chunk.get("result", {}).get("exit_code", 0) == 0 and "result" in chunk for chunk in ran["ok"]), ran
            # Root in a pod is held to the quota, and never gets danger-full-access.
            over, full = a.call(daemon.socket, create(ws_a), create(ws_a, FULL))
            assert refused(over, "RESOURCE_EXHAUSTED", f"pod:{a.uid}", "quotas.sessions_per_uid"), over
            assert refused(full, "PERMISSION_DENIED", "pod", "danger-full-access", "tenancy.admin_pods"), full

            # A sub-cgroup of A's own container named like B's pod is still A.
            forged = node.cgroup(str(a.directory.relative_to(node.top)) + f"/kubepods/pod{b.uid}/x")
            [seen_forged] = run_agent(forged, daemon.socket, [listed()])
            assert ids(seen_forged) == ids(seen_a)
            # Below kubepods but in no pod cgroup: refused, saying why.
            [stray] = run_agent(node.cgroup("kubepods/besteffort/not-a-pod"), daemon.socket, [listed()])
            assert refused(stray, "PERMISSION_DENIED", "below kubepods", "tenancy.mode"), stray

            # The node's root (this test, in no pod) and an admin pod see every session.
            owners = {s.id: s.owner_principal for s in daemon.stub.ListSessions(pb.ListSessionsRequest()).sessions}
            assert {owners[s] for s in ids(seen_a)} == {f"pod:{a.uid}"} and {owners[s] for s in ids(seen_b)} == {f"pod:{b.uid}"}
            [seen_admin, admin_full] = admin.call(daemon.socket, listed(), create(sandboxd_daemon.workspace(), FULL))
            assert ids(seen_a) | ids(seen_b) <= ids(seen_admin)
            assert "ok" in admin_full, admin_full
            close_quietly(daemon.stub, admin_full["ok"]["id"])
        finally:
            for session in everyone_of(daemon):
                close_quietly(daemon.stub, session)


def test_each_pod_has_its_own_connections(sandboxd_daemon: DaemonFactory) -> None:
    """quotas.connections_per_uid counts each pod's connections apart: a root pod holding all of its
    own leaves other root pods (and the node's root) served. Control: under uid tenancy they are
    all root's (four times connections_per_uid), and a pod holding those shuts the others out."""
    with pod_node() as node:
        a, b = node.pod(), node.pod("systemd", "besteffort")
        for mode, held in (("pod", 2), ("uid", 8)):
            daemon = sandboxd_daemon(config=pod_config(node, mode=mode) + "connections_per_uid = 2\n")
            with a.holding(daemon.socket, held):
                [a_more] = a.call(daemon.socket, listed())
                [b_call] = b.call(daemon.socket, listed())
                if mode == "pod":
                    assert refused(a_more, "UNAVAILABLE"), a_more          # A's own bound
                    assert "ok" in b_call, b_call
                    assert daemon.stub.ListSessions(pb.ListSessionsRequest()) is not None
                else:
                    assert refused(a_more, "UNAVAILABLE") and refused(b_call, "UNAVAILABLE"), (a_more, b_call)
            daemon.stop()


def everyone_of(daemon: Any) -> list[str]:
    return [s.id for s in daemon.stub.ListSessions(pb.ListSessionsRequest()).sessions]


def test_control_under_uid_tenancy_root_pods_share_root(sandboxd_daemon: DaemonFactory) -> None:
    """The switch off: the same root agents are the daemon's root, as the issue found."""
    with pod_node() as node:
        a, b = node.pod(), node.pod("systemd", "")
        daemon = sandboxd_daemon(config=pod_config(node, mode="uid", sessions=1))
        ws_a, ws_b = sandboxd_daemon.workspace(), sandboxd_daemon.workspace()
        try:
            made_b = b.call(daemon.socket, create(ws_b))
            sb = made_b[0]["ok"]["id"]
            seen, extra, full, touched = a.call(daemon.socket, listed(), create(ws_a), create(ws_a, FULL),
                                                {"rpc": "GetSession", "request": {"session_id": sb}})
            assert sb in ids(seen)                                   # B's session, seen by A
            assert "ok" in extra and "ok" in full, (extra, full)     # past the quota of 1; full access
            assert touched["ok"]["id"] == sb
        finally:
            for session in everyone_of(daemon):
                close_quietly(daemon.stub, session)


# -- who each caller is under pod tenancy (service.callers with a PodReader), without a daemon ------

class _Door:
    """The front door as Callers reads it: the credentials it took at accept, by peer."""

    def __init__(self, who: PeerCredentials) -> None:
        self.who = who

    def identity(self, peer: str) -> PeerCredentials:
        return self.who


class _Context:
    def peer(self) -> str:
        return "unix:/relay/1.sock"


def _caller_in(cgroup: str, uid: int = 0, **tenancy: Any) -> Caller:
    own = read_cgroups("self")
    lines = [f"{line.split(':', 2)[0]}:{line.split(':', 2)[1]}:{cgroup}" for line in own.splitlines()]
    who = PeerCredentials(uid=uid, gid=uid, pid=os.getpid(), cgroups="\n".join(lines) + "\n")
    pods = PodReader(Tenancy(cgroup_root="/node", **tenancy))
    return Callers(_Door(who), pods=pods)(_Context())  # type: ignore[arg-type]


def test_who_a_caller_is_under_pod_tenancy() -> None:
    tenant, admin, own = (str(uuid.uuid4()) for _ in range(3))
    in_pod = _caller_in(f"/node/kubepods/burstable/pod{tenant}/ctr")
    assert (in_pod.principal, in_pod.is_root, in_pod.is_admin) == (f"pod:{tenant}", False, False)
    assert in_pod.tenant is not None and (in_pod.tenant.kind, in_pod.tenant.key) == ("pod", f"pod-{tenant}")
    assert in_pod.tenant.cgroup_path == f"/node/kubepods/burstable/pod{tenant}/ctr"
    assert cgroup_owner(in_pod) == f"pod-{tenant}" and owner_key(in_pod) == f"pod:{tenant}"
    # An admin pod and the daemon's own pod are the node's root (uid 0), still named by their pod.
    for pod, options in ((admin, {"admin_pods": frozenset({admin})}), (own, {"own_pod": own})):
        named = _caller_in(f"/node/kubepods/pod{pod}/ctr", **options)
        assert (named.principal, named.is_root, named.is_admin) == ("", True, True)
        assert named.tenant is not None and (named.tenant.kind, named.tenant.pod_uid) == ("pod", pod)
        # Control: the same pod not named is a tenant.
        assert _caller_in(f"/node/kubepods/pod{pod}/ctr").principal == f"pod:{pod}"
    # In no pod (the node's own processes): uid tenancy as before.
    node_root, node_user = _caller_in("/system.slice/x.service"), _caller_in("/user.slice/u", uid=1000)
    assert (node_root.principal, node_root.is_root, node_user.principal, node_user.is_root) == ("", True, "", False)
    assert node_user.tenant is not None and node_user.tenant.key == "uid-1000"
    # Below kubepods in no pod cgroup: refused, saying why.
    with pytest.raises(CallerRefused, match="below kubepods.*tenancy.mode"):
        _caller_in("/node/kubepods/besteffort/stray")
