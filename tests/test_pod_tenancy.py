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


# -- hostile pass A (issue 27): F0, F11 and F7 ---------------------------------------------------------

def _node_root_served(socket_path: str) -> bool:
    """Whether a new connection of this process (the node's root, in no pod) is served."""
    import grpc

    from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc
    channel = grpc.insecure_channel("unix:" + socket_path)
    try:
        pb_grpc.SandboxStub(channel).ListSessions(pb.ListSessionsRequest(), timeout=30)
        return True
    except grpc.RpcError as exc:
        assert exc.code().name == "UNAVAILABLE", exc
        return False
    finally:
        channel.close()


def test_a_pods_orphaned_connections_do_not_spend_the_node_roots(sandboxd_daemon: DaemonFactory) -> None:
    """A root pod connects from children that are gone (reaped) before the door checks them, and keeps
    the sockets: those connections are refused, and counted in uid 0's bucket of refused callers,
    never in uid 0's own (the node's root, the admin pods, the daemon's probes), so 400 of them
    shut nobody else out (those the door saw while their child still lived are the pod's, held to
    its own bound). Control: the same number of connections (root's bound, 4 x 2) held by
    the node's root itself does shut a new one of root's out: the probe below can see a lockout."""
    import socket as sockets
    with pod_node() as node:
        a, b, admin = node.pod(), node.pod("systemd", "besteffort"), node.pod()
        daemon = sandboxd_daemon(config=pod_config(node, admin_pods=(admin.uid,)) + "connections_per_uid = 2\n")
        with a.holding(daemon.socket, 400, orphans=True):
            root_served = _node_root_served(daemon.socket)
            [admin_now] = admin.call(daemon.socket, listed())
            [b_now] = b.call(daemon.socket, listed())
            log = daemon.log()
        assert root_served
        assert "ok" in admin_now and "ok" in b_now, (admin_now, b_now)
        assert "refused callers of uid 0 has 2 connections open" in log, log[-2000:]   # the orphans: bounded
        assert "uid 0 has" not in log.replace("refused callers of uid 0 has", ""), log[-2000:]
        held = []
        try:
            for _ in range(8):                     # control: root's own bound, spent by root
                held.append(sockets.socket(sockets.AF_UNIX))
                held[-1].connect(daemon.socket)
            assert not _node_root_served(daemon.socket)
        finally:
            for conn in held:
                conn.close()


def test_a_pods_sessions_are_its_uids_not_the_whole_pods(sandboxd_daemon: DaemonFactory) -> None:
    """Under pod tenancy a session is (pod, uid)'s: a uid-65534 process of the pod (a runAsNonRoot
    sidecar, an agent that dropped privileges) neither sees nor drives the session the pod's root
    made on a root-only workspace (it would run commands as uid 0 and read root's files); the pod's
    root sees the nobody session but cannot act on it; the session quota stays the pod's, whatever
    uid. Control: the pod's root itself runs as uid 0 there and reads the root-only file."""
    import base64
    nobody = 65534
    with pod_node() as node:
        a = node.pod()
        daemon = sandboxd_daemon(config=pod_config(node, sessions=2))
        os.chmod(Path(daemon.socket).parent, 0o755)            # nobody may reach the socket
        ws_root = sandboxd_daemon.workspace(mode=0o700)
        (ws_root / "root-only.txt").write_text("root's secret\n")
        os.chmod(ws_root / "root-only.txt", 0o600)
        ws_nobody = sandboxd_daemon.workspace()
        os.chown(ws_nobody, nobody, nobody)
        try:
            [made_root] = a.call(daemon.socket, create(ws_root))
            [made_nobody] = a.call(daemon.socket, create(ws_nobody), uid=nobody)
            s_root, s_nobody = made_root["ok"]["id"], made_nobody["ok"]["id"]
            seen, read, *touches = a.call(
                daemon.socket, listed(),
                {"rpc": "ReadFile", "request": {"session_id": s_root, "path": "root-only.txt"}},
                *touch_attempts(s_root), uid=nobody)
            assert ids(seen) == {s_nobody}, seen
            assert refused(read, "NOT_FOUND"), read
            assert all(refused(answer, "NOT_FOUND") for answer in touches), touches
            # The control: the root session does run as uid 0 and read the root-only file, for the pod's root.
            ran, read_root, seen_root, run_nobodys, over = a.call(
                daemon.socket, {"rpc": "Run", "request": {"session_id": s_root, "argv": ["id", "-u"]}},
                {"rpc": "ReadFile", "request": {"session_id": s_root, "path": "root-only.txt"}},
                listed(), {"rpc": "Run", "request": {"session_id": s_nobody, "argv": ["true"]}},
                create(sandboxd_daemon.workspace()))
            stdout = b"".join(base64.b64decode(c["stdout"]) for c in ran["ok"] if "stdout" in c)
            assert stdout.strip() == b"0", ran
            assert b"root's secret" in base64.b64decode(read_root["ok"]["data"]), read_root
            assert ids(seen_root) == {s_root, s_nobody}, seen_root        # its pod's root sees both ...
            assert refused(run_nobodys, "NOT_FOUND"), run_nobodys          # ... but acts only on its own
            assert refused(over, "RESOURCE_EXHAUSTED", f"pod:{a.uid}"), over   # the quota: the pod's
        finally:
            for session in everyone_of(daemon):
                close_quietly(daemon.stub, session)


def test_a_pods_actions_are_exported_as_the_pods_not_the_node_admins(sandboxd_daemon: DaemonFactory) -> None:
    """What a root pod does (its commands; a policy change and a close, which record who acted) is
    exported as a User named by its pod (uid_alt: the pod's UID), never as the node's Admin; the
    node's root closing a session is the Admin (the control: the same event shape, no principal)."""
    from sandboxd.audit.export import ocsf
    from sandboxd.audit.store import Event
    with pod_node() as node:
        a = node.pod()
        daemon = sandboxd_daemon(config=pod_config(node))
        made, other = a.call(daemon.socket, create(sandboxd_daemon.workspace()), create(sandboxd_daemon.workspace()))
        sa, sb = made["ok"]["id"], other["ok"]["id"]
        a.call(daemon.socket, {"rpc": "Run", "request": {"session_id": sa, "argv": ["true"]}},
               {"rpc": "UpdateSessionPolicy", "request": {"session_id": sa, "approval_policy": "ON_REQUEST"}},
               {"rpc": "CloseSession", "request": {"session_id": sa}})
        daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=sb))          # the node's root closes B's
        owner = ocsf.Owner(0, f"pod:{a.uid}")
        actors = {}
        for session in (sa, sb):
            for e in daemon.stub.QueryEvents(pb.QueryEventsRequest(session_id=session)).events:
                event = Event(id=e.id, session_id=e.session_id, sequence=e.sequence, type=e.type, time=e.time,
                              call_id=e.call_id, tool=e.tool, data=json.loads(e.data_json or "{}"))
                actors[(session, e.type)] = ocsf.record(event, owner)["actor"]["user"]
        pods = {"uid": "0", "type_id": 1, "type": "User", "name": f"pod:{a.uid}", "uid_alt": a.uid}
        for kind in ("ToolInvocationStarted", "PolicyChanged", "SessionClosed"):
            assert actors[(sa, kind)] == pods, (kind, actors[(sa, kind)])
        assert actors[(sb, "SessionClosed")] == {"uid": "0", "type_id": 2, "type": "Admin"}
