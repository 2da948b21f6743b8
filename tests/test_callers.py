"""One definition of the caller (service/callers.py), as every consumer sees it, through a real
daemon: local root; a TLS principal mapped to uid 0 ("alice", tls.users); a plain user in the
admin group; a plain user. Each runs the same checks from its own process: danger-full-access (as whom),
the per-owner stream quota, seeing another user's session, listing and removing another user's
standing rules, publishing a privileged host port, and whose file rights its session gets.

The rule: local uid 0 is root; root and the admin group are administrators; a TLS principal is
neither, whatever user it is mapped to; its mapped user only gives its file rights."""

from __future__ import annotations

import grp
import os
import socket
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest

from daemon_helpers import Daemon, DaemonFactory, TlsListener, close_quietly, plain_users, run_client_as, scratch_group
from sandboxd.service.callers import identify
from sandboxd.network.peer_credentials import PeerCredentials
from sandboxd.policy.quota_limits import QuotaLimits
from sandboxd.v1 import sandboxd_pb2 as pb
from test_tls_listener import make_pki

STREAMS = QuotaLimits().streams_per_uid   # the default quotas.streams_per_uid

SETUP = r'''
session = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER), timeout=60)
stub.AddStandingRule(pb.StandingRule(workspace=ARGS["ws"], tool="fs.read"), timeout=60)
print(json.dumps({"session": session.id}))
'''

CHECKS = r'''
import time
if ARGS.get("tls"):                                     # this caller is a certificate's principal
    read = lambda name: open(f"{ARGS['pki']}/{name}", "rb").read()
    stub = pb_grpc.SandboxStub(grpc.secure_channel(ARGS["tls"], grpc.ssl_channel_credentials(
        root_certificates=read("ca.pem"), private_key=read(f"{ARGS['cert']}.key"),
        certificate_chain=read(f"{ARGS['cert']}.pem"))))
def attempt(fn):
    try:
        value = fn()
        return ["OK", value if isinstance(value, (str, int, bool, list)) else ""]
    except grpc.RpcError as error:
        return [error.code().name, error.details()]
def policy(mode, **kwargs):
    return pb.SandboxPolicy(mode=getattr(pb.SandboxPolicy, mode), **kwargs)
def session_running(request, argv):
    session = stub.CreateSession(request, timeout=60)
    try:
        out = b"".join(r.stdout for r in stub.Exec(iter([pb.ExecRequest(start=pb.ExecStart(
            session_id=session.id, argv=argv))]), timeout=60))
        return out.decode().strip()
    finally:
        stub.CloseSession(pb.CloseSessionRequest(session_id=session.id), timeout=60)
result = {}
result["danger"] = attempt(lambda: session_running(pb.CreateSessionRequest(
    workspace=ARGS["ws"], approval_policy=pb.NEVER, sandbox_policy=policy("DANGER_FULL_ACCESS")), ["id", "-u"]))
result["low_port"] = attempt(lambda: session_running(pb.CreateSessionRequest(
    workspace=ARGS["ws"], approval_policy=pb.NEVER, sandbox_policy=policy(
        "WORKSPACE_WRITE", network_access=True, published_ports=[f"{ARGS['low_port']}:8080"])), ["true"]))
result["file_rights"] = attempt(lambda: session_running(pb.CreateSessionRequest(
    workspace=ARGS["private_ws"], approval_policy=pb.NEVER), ["id", "-u"]))
result["sees_other_session"] = ARGS["other_session"] in [
    s.id for s in stub.ListSessions(pb.ListSessionsRequest(), timeout=60).sessions]
result["sees_other_rule"] = ARGS["other_uid"] in [
    r.owner_uid for r in stub.ListStandingRules(pb.ListStandingRulesRequest(), timeout=60).rules]
result["removes_other_rule"] = attempt(lambda: stub.RemoveStandingRule(pb.StandingRule(
    workspace=ARGS["other_ws"], tool="no.such.tool", owner_uid=ARGS["other_uid"]), timeout=60).removed)
streams, outcomes = [], []
for index in range(ARGS["streams"] + 1):                # one past the per-owner quota
    stream = stub.WatchEvents(pb.WatchEventsRequest(), timeout=120)
    streams.append(stream)
    deadline = time.monotonic() + 30
    while not stream.done() and time.monotonic() < deadline:
        if stub.GetStatus(pb.GetStatusRequest(), timeout=30).quota_usage["streams"] == index + 1:
            break
        time.sleep(0.05)
    outcomes.append("held" if not stream.done() else stream.code().name)
result["streams"] = outcomes
for stream in streams:
    stream.cancel()
print(json.dumps(result))
'''


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def low_free_port() -> int:
    """A host port below ip_unprivileged_port_start that nothing listens on."""
    for port in range(1023, 900, -1):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port below 1024")


@pytest.fixture(scope="module")
def world(sandboxd_daemon_module: DaemonFactory) -> Iterator[dict[str, Any]]:
    """The daemon (admin group, TLS with alice mapped to root) and its callers."""
    base = sandboxd_daemon_module.base
    with scratch_group("sbxa-") as group, plain_users(2) as (admin, plain):
        admin_gid = grp.getgrnam(group).gr_gid
        subprocess.run(["usermod", "-g", group, admin.name], check=True, capture_output=True)
        make_pki(base)
        address = f"127.0.0.1:{free_port()}"
        daemon = sandboxd_daemon_module(
            config=f'[listen]\nadmin_group = "{group}"\n[tls]\nusers = {{ "alice" = "root" }}\n',
            tls=TlsListener(address, base / "server.pem", base / "server.key", base / "ca.pem",
                            tcp_user="65534:65534"))
        shared = base / "shared-ws"
        shared.mkdir(mode=0o777)
        os.chmod(shared, 0o777)
        private = base / "root-only-ws"
        private.mkdir(mode=0o700)
        plain_ws = base / "plain-ws"
        plain_ws.mkdir()
        os.chown(plain_ws, plain.uid, plain.gid)
        setup = run_client_as(plain.uid, plain.gid, daemon.socket, SETUP, {"ws": str(plain_ws)})
        args = {"ws": str(shared), "private_ws": str(private), "other_ws": str(plain_ws),
                "other_session": setup["session"], "other_uid": plain.uid, "streams": STREAMS,
                "low_port": low_free_port(), "pki": str(base)}
        try:
            yield {"daemon": daemon, "args": args, "address": address, "admin": (admin.uid, admin_gid),
                   "plain": (plain.uid, plain.gid)}
        finally:
            close_all(daemon)                     # before userdel: their sandboxes go


def close_all(daemon: Daemon) -> None:
    for session in daemon.stub.ListSessions(pb.ListSessionsRequest(), timeout=60).sessions:
        close_quietly(daemon.stub, session.id)


def checks_of(world: dict[str, Any], who: str) -> dict[str, Any]:
    daemon, args = world["daemon"], world["args"]
    if who == "root":
        return run_client_as(0, 0, daemon.socket, CHECKS, args)
    if who in ("alice", "bob"):                       # alice: mapped to root; bob: to tls.user (nobody)
        return run_client_as(0, 0, daemon.socket, CHECKS, {**args, "tls": world["address"], "cert": who})
    uid, gid = world[who]
    return run_client_as(uid, gid, daemon.socket, CHECKS, args)


def test_local_root_is_root_and_administrator(world: dict[str, Any]) -> None:
    seen = checks_of(world, "root")
    assert seen["danger"] == ["OK", "0"], seen                  # danger-full-access, as root
    assert seen["low_port"][0] == "OK", seen                    # a privileged published port
    assert seen["file_rights"] == ["OK", "0"], seen             # any path
    assert seen["sees_other_session"] and seen["sees_other_rule"], seen
    assert seen["removes_other_rule"] == ["OK", False], seen     # allowed (nothing by that name to remove)
    assert seen["streams"] == ["held"] * (STREAMS + 1), seen    # not held to the per-owner quota


def test_a_tls_principal_mapped_to_uid_0_is_neither_root_nor_administrator(world: dict[str, Any]) -> None:
    seen = checks_of(world, "alice")
    assert seen["danger"][0] == "PERMISSION_DENIED" and "TLS caller never" in seen["danger"][1], seen
    assert seen["low_port"][0] == "PERMISSION_DENIED" and "only root may publish" in seen["low_port"][1], seen
    assert not seen["sees_other_session"] and not seen["sees_other_rule"], seen
    assert seen["removes_other_rule"][0] == "PERMISSION_DENIED", seen
    assert seen["streams"] == ["held"] * STREAMS + ["RESOURCE_EXHAUSTED"], seen
    # Its mapped user gives its file rights, and only those: root's own directory, as uid 0;
    # another principal mapped to nobody is refused the same directory (the control).
    assert seen["file_rights"] == ["OK", "0"], seen
    bob = checks_of(world, "bob")
    assert bob["file_rights"][0] == "PERMISSION_DENIED", bob


def test_a_plain_user_in_the_admin_group_administers_but_is_not_root(world: dict[str, Any]) -> None:
    seen = checks_of(world, "admin")
    assert seen["sees_other_session"] and seen["sees_other_rule"], seen
    assert seen["removes_other_rule"] == ["OK", False], seen
    assert seen["danger"] == ["OK", str(world["admin"][0])], seen  # danger-full-access as itself, not root
    assert seen["low_port"][0] == "PERMISSION_DENIED", seen
    assert seen["file_rights"][0] == "PERMISSION_DENIED", seen     # its own rights: not root's directory
    assert seen["streams"] == ["held"] * STREAMS + ["RESOURCE_EXHAUSTED"], seen


def test_a_plain_user_is_neither(world: dict[str, Any]) -> None:
    seen = checks_of(world, "plain")             # the owner of the "other" session and rule
    assert not any(seen[key][0] == "OK" for key in ("low_port", "file_rights")), seen
    assert seen["danger"] == ["OK", str(world["plain"][0])], seen  # as itself (test_full_access_users.py)
    assert seen["sees_other_session"] and seen["sees_other_rule"], seen          # its own, the control
    assert seen["removes_other_rule"] == ["OK", False], seen                      # its own, the control
    assert seen["streams"] == ["held"] * STREAMS + ["RESOURCE_EXHAUSTED"], seen


@pytest.mark.parametrize("who, admin_gid, root, admin", [
    (PeerCredentials(0, 0, 1), None, True, True),
    (PeerCredentials(0, 0, 0, "tls:alice", (0,)), 0, False, False),
    (PeerCredentials(1000, 1000, 1, groups=(1000, 4242)), 4242, False, True),
    (PeerCredentials(1000, 4242, 0, "tls:agent", (4242,)), 4242, False, False),
    (PeerCredentials(1000, 1000, 1), 4242, False, False),
])
def test_the_rule_in_one_place(who: PeerCredentials, admin_gid: int | None, root: bool, admin: bool) -> None:
    caller = identify(who, admin_gid)
    assert (caller.is_root, caller.is_admin) == (root, admin)
    assert caller.mapped_user == ((who.uid, who.gid) if who.principal else None)
    assert (caller.uid, caller.gid, caller.principal, caller.groups) == (who.uid, who.gid, who.principal, who.groups)
