"""Hostile tenants: nothing gets from a sandbox or a local user to the daemon, the host or another user.

One daemon serves a root caller and two plain users made here with useradd (removed afterwards),
with a TLS listener and a metrics listener. Each case is tried from the attacker's side, with real
commands inside real sandboxes, and checked on the host afterwards; each has a control showing the
legitimate use still works.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from conftest import BASE_ENV, PY
from daemon_helpers import (PYTHON, Daemon, DaemonFactory, PlainUser, create_session, daemon_factory, plain_users,
                            rpc_error, run_client_as, run_exec, workspace_write)
from test_tls_listener import make_pki
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def users() -> Iterator[list[PlainUser]]:
    """Two plain users (attacker, victim), made here and removed afterwards."""
    with plain_users(2) as made:
        yield made


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def world(users: list[PlainUser], sandboxd_daemon_module: DaemonFactory) -> dict[str, Any]:
    """One daemon with a TLS listener (127.0.0.1) and a metrics listener (every address)."""
    base = sandboxd_daemon_module.base
    pki = base / "pki"
    pki.mkdir()
    make_pki(pki)
    tls_port, metrics_port = free_port(), free_port()
    daemon = sandboxd_daemon_module(args=[
        "--tcp", f"127.0.0.1:{tls_port}", "--tls-cert", str(pki / "server.pem"), "--tls-key",
        str(pki / "server.key"), "--tls-client-ca", str(pki / "ca.pem"), "--tcp-user", "65534:65534",
        "--metrics", f"0.0.0.0:{metrics_port}"])
    return {"daemon": daemon, "base": base, "pki": pki, "tls_port": tls_port, "metrics_port": metrics_port,
            "users": users}


def workspace_of(world: dict[str, Any], owner: PlainUser | None, mode: int = 0o755) -> Path:
    path = world["base"] / f"ws-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=mode)
    os.chmod(path, mode)
    if owner is not None:
        os.chown(path, owner.uid, owner.gid)
    return path


def host_address() -> str:
    """A non-loopback address of this host (the daemon's wildcard listeners answer there too)."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        address = line.split()[3].split("/")[0]
        if not address.startswith("127."):
            return address
    return "127.0.0.2"


# --------------------------------------------------------------------------- reaching the daemon

# Runs inside the sandbox: every way to the daemon it can think of, one verdict each.
PROBE = r'''
import json, os, socket, sys
args = json.loads(sys.argv[1])
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "REACHED"
    except OSError as exc:
        out[name] = "blocked: " + (exc.strerror or str(exc))
def unix(path):
    def go():
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(5)
        s.connect(path)
        s.close()
    return go
def tcp(host, port):
    def go():
        s = socket.create_connection((host, port), timeout=5)
        s.close()
    return go
attempt("public socket", unix(args["socket"]))
for path in args["private"]:
    attempt("private socket " + os.path.basename(path), unix(path))
for host in args["hosts"]:
    attempt(f"tls {host}", tcp(host, args["tls_port"]))
    attempt(f"metrics {host}", tcp(host, args["metrics_port"]))
try:
    out["socket dir"] = sorted(os.listdir(os.path.dirname(args["socket"])))
except OSError as exc:
    out["socket dir"] = "blocked: " + exc.strerror
def read_store():
    open(os.path.join(args["state"], "events.db"), "rb").read(16)
attempt("audit log", read_store)
print(json.dumps(out))
'''

MODES = {
    "no-network": {},
    "isolated": {"network_access": True},
    "host": {"network_access": True, "network_mode": "host"},
}


def probe_args(world: dict[str, Any]) -> dict[str, Any]:
    daemon: Daemon = world["daemon"]
    private = sorted(str(p) for p in daemon.private.glob("grpc-*.sock"))
    assert private, "the daemon's private socket was expected in " + str(daemon.private)
    return {"socket": daemon.socket, "private": private, "tls_port": world["tls_port"],
            "metrics_port": world["metrics_port"], "hosts": ["127.0.0.1", host_address()],
            "state": str(world["base"] / "state")}


def check_blocked(verdicts: dict[str, Any]) -> None:
    for name, verdict in verdicts.items():
        if name == "socket dir":
            assert not isinstance(verdict, list) or verdict == [], f"the daemon's socket directory shows {verdict}"
        else:
            assert verdict != "REACHED", f"{name} was reached from inside the sandbox: {verdicts}"


@pytest.mark.parametrize("mode", list(MODES))
def test_a_root_callers_sandbox_cannot_reach_the_daemon(world: dict[str, Any], mode: str) -> None:
    daemon: Daemon = world["daemon"]
    ws = workspace_of(world, None)
    session = create_session(daemon.stub, ws, workspace_write(**MODES[mode]))
    try:
        outcome = run_exec(daemon.stub, session.id, [PY, "-c", PROBE, json.dumps(probe_args(world))])
        assert outcome.result is not None and outcome.result.exit_code == 0, outcome.describe()
        check_blocked(json.loads(outcome.stdout))
    finally:
        daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=session.id))
    control = probe_from_host(world)                  # the same attempts from the host all work
    loopback_only = f"tls {host_address()}"            # (the TLS listener is on 127.0.0.1 alone)
    assert all(v == "REACHED" for k, v in control.items() if k not in ("socket dir", loopback_only)), control


def probe_from_host(world: dict[str, Any]) -> dict[str, Any]:
    result = subprocess.run([PY, "-c", PROBE, json.dumps(probe_args(world))], capture_output=True, text=True,
                            env=BASE_ENV, timeout=60)
    return json.loads(result.stdout)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_plain_users_sandbox_cannot_reach_the_daemon(world: dict[str, Any], mode: str) -> None:
    attacker = world["users"][0]
    ws = workspace_of(world, attacker)
    body = r'''
policy = pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, **ARGS["mode"])
s = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], sandbox_policy=policy, approval_policy=pb.NEVER))
out, code = run(s.id, ARGS["argv"])
stub.CloseSession(pb.CloseSessionRequest(session_id=s.id))
print(json.dumps({"out": out, "code": code}))
'''
    reply = run_client_as(attacker.uid, attacker.gid, world["daemon"].socket, body, {
        "mode": MODES[mode], "ws": str(ws), "argv": [PY, "-c", PROBE, json.dumps(probe_args(world))]})
    assert reply["code"] == 0, reply
    check_blocked(json.loads(reply["out"]))


def test_a_hard_link_to_the_socket_is_refused_even_with_the_host_network(world: dict[str, Any]) -> None:
    """A hard link to the daemon's socket lies in a workspace (made by root here: with
    fs.protected_hardlinks a plain user may not link a socket it does not own), and a host-network
    sandbox whose policy names it connects to it: the broker knows the socket by its inode, not its
    name, and refuses it whatever the policy names."""
    attacker = world["users"][0]
    ws = workspace_of(world, attacker)
    link = ws / "door.sock"
    os.link(world["daemon"].socket, link)
    other = ws / "own.sock"                              # control: another host socket the policy names is reached
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(other))
    os.chmod(other, 0o666)
    server.listen(4)
    try:
        body = r'''
policy = pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, network_access=True, network_mode="host",
                          allowed_unix_sockets=[ARGS["link"], ARGS["other"]])
s = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], sandbox_policy=policy, approval_policy=pb.NEVER))
script = "import socket,sys\nfor p in sys.argv[1:]:\n  s=socket.socket(socket.AF_UNIX)\n  try:\n    s.connect(p); print(p, 'REACHED')\n  except OSError as e:\n    print(p, 'blocked', e.strerror)"
out, code = run(s.id, ["/usr/bin/python3", "-c", script, ARGS["link"], ARGS["other"]])
stub.CloseSession(pb.CloseSessionRequest(session_id=s.id))
print(json.dumps({"out": out, "code": code}))
'''
        reply = run_client_as(attacker.uid, attacker.gid, world["daemon"].socket, body,
                              {"ws": str(ws), "link": str(link), "other": str(other)})
    finally:
        server.close()
    lines = dict(line.split(" ", 1) for line in reply["out"].splitlines())
    assert lines[str(link)].startswith("blocked"), reply
    assert lines[str(other)] == "REACHED", reply


# --------------------------------------------------------------------------- the second wall

CLIENT_IN_NAMESPACE = r'''
import json, sys, ssl, socket, urllib.request
import grpc
from sandboxd.v1 import sandboxd_pb2 as pb, sandboxd_pb2_grpc as pb_grpc
args = json.loads(sys.argv[1])
out = {}
try:
    pb_grpc.SandboxStub(grpc.insecure_channel("unix:" + args["socket"])).ListSessions(pb.ListSessionsRequest(), timeout=30)
    out["unix"] = "OK"
except grpc.RpcError as e:
    out["unix"] = e.code().name + ": " + (e.details() or "")
creds = grpc.ssl_channel_credentials(open(args["ca"], "rb").read(), open(args["key"], "rb").read(),
                                     open(args["cert"], "rb").read())
try:
    pb_grpc.SandboxStub(grpc.secure_channel(args["tls"], creds)).ListSessions(pb.ListSessionsRequest(), timeout=30)
    out["tls"] = "OK"
except grpc.RpcError as e:
    out["tls"] = e.code().name + ": " + (e.details() or "")
try:
    urllib.request.urlopen(args["metrics"], timeout=30).read()
    out["metrics"] = "OK"
except urllib.error.HTTPError as e:
    out["metrics"] = f"HTTP {e.code}: " + e.read().decode()
print(json.dumps(out))
'''


def test_a_process_inside_a_sandbox_namespace_is_refused_by_the_daemon(world: dict[str, Any]) -> None:
    """Past the first wall (a client started from the host straight into a session's PID
    namespace, with the host's files and network): every listener refuses it, with the reason."""
    daemon: Daemon = world["daemon"]
    ws = workspace_of(world, None)
    before = set(daemon.session_inits())
    session = create_session(daemon.stub, ws)
    try:
        init = next(iter(set(daemon.session_inits()) - before))
        pki = world["pki"]
        args = json.dumps({"socket": daemon.socket, "tls": f"127.0.0.1:{world['tls_port']}",
                           "metrics": f"http://127.0.0.1:{world['metrics_port']}/metrics",
                           "ca": str(pki / "ca.pem"), "key": str(pki / "alice.key"), "cert": str(pki / "alice.pem")})
        inside = subprocess.run(["nsenter", "--target", str(init), "--pid", "--", PYTHON, "-c", CLIENT_IN_NAMESPACE,
                                 args], capture_output=True, text=True, timeout=120, env=BASE_ENV)
        outside = subprocess.run([PYTHON, "-c", CLIENT_IN_NAMESPACE, args], capture_output=True, text=True,
                                 timeout=120, env=BASE_ENV)
    finally:
        daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=session.id))
    refused, allowed = json.loads(inside.stdout), json.loads(outside.stdout)
    assert allowed == {"unix": "OK", "tls": "OK", "metrics": "OK"}, outside.stderr[-2000:]
    for listener in ("unix", "tls"):
        assert refused[listener].startswith("PERMISSION_DENIED") and "inside a sandboxd sandbox" in refused[listener], refused
    assert refused["metrics"].startswith("HTTP 403") and "inside a sandboxd sandbox" in refused["metrics"], refused


# --------------------------------------------------------------------------- checking what is used


def set_acl(path: Path, entries: list[tuple[int, int, int]]) -> None:
    """system.posix_acl_access by hand (no acl package needed): (tag, perm, id) entries."""
    ordered = sorted(entries, key=lambda e: (e[0], e[2]))
    os.setxattr(path, "system.posix_acl_access",
                struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, ident) for tag, perm, ident in ordered))


USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
ANY = 0xFFFFFFFF


CREATE = r'''
from sandboxd.v1 import sandboxd_pb2 as pb
def attempt():
    s = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER), timeout=60)
    stub.CloseSession(pb.CloseSessionRequest(session_id=s.id))
print(json.dumps({"code": code(attempt)}))
'''


def test_acls_count_in_the_reach_check(world: dict[str, Any]) -> None:
    """The kernel decides, as the caller: an ACL that grants write lets a user in although the
    mode bits do not; an ACL entry that denies it keeps the user out although "other" may write."""
    attacker, victim = world["users"]
    granted = workspace_of(world, None, 0o755)
    set_acl(granted, [(USER_OBJ, 7, ANY), (USER, 7, victim.uid), (GROUP_OBJ, 5, ANY), (MASK, 7, ANY), (OTHER, 5, ANY)])
    denied = workspace_of(world, None, 0o777)
    set_acl(denied, [(USER_OBJ, 7, ANY), (USER, 5, attacker.uid), (GROUP_OBJ, 7, ANY), (MASK, 7, ANY), (OTHER, 7, ANY)])
    sock = world["daemon"].socket
    assert run_client_as(victim.uid, victim.gid, sock, CREATE, {"ws": str(granted)})["code"] == "OK"
    assert run_client_as(attacker.uid, attacker.gid, sock, CREATE, {"ws": str(granted)})["code"] == "PERMISSION_DENIED"
    assert run_client_as(attacker.uid, attacker.gid, sock, CREATE, {"ws": str(denied)})["code"] == "PERMISSION_DENIED"
    assert run_client_as(victim.uid, victim.gid, sock, CREATE, {"ws": str(denied)})["code"] == "OK"


def test_a_swapped_symlink_never_yields_another_users_directory(world: dict[str, Any]) -> None:
    """The attacker's workspace path is a symlink it flips between its own directory and the
    victim's private one while asking for sessions: each session it gets is its own directory."""
    attacker, victim = world["users"]
    mine = workspace_of(world, attacker, 0o755)
    private = workspace_of(world, victim, 0o700)
    (private / "secret").write_text("victim's\n")
    os.chown(private / "secret", victim.uid, victim.gid)
    play = workspace_of(world, attacker, 0o755)
    link = play / "ws"
    stop = threading.Event()

    def flip() -> None:
        temp = play / "ws.new"
        while not stop.is_set():
            for target in (mine, private):
                try:
                    os.symlink(target, temp)
                    os.rename(temp, link)
                except OSError:
                    pass
    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    body = r'''
from sandboxd.v1 import sandboxd_pb2 as pb
got, refused = [], 0
for _ in range(ARGS["tries"]):
    try:
        s = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["link"], approval_policy=pb.NEVER), timeout=60)
    except grpc.RpcError as e:
        refused += 1
        continue
    got.append(s.workspace)
    stub.CloseSession(pb.CloseSessionRequest(session_id=s.id))
print(json.dumps({"got": got, "refused": refused}))
'''
    try:
        reply = run_client_as(attacker.uid, attacker.gid, world["daemon"].socket, body,
                              {"link": str(link), "tries": 120}, timeout=600)
    finally:
        stop.set()
        flipper.join()
    assert reply["got"], f"no session at all: {reply}"                  # control: its own directory works
    assert set(reply["got"]) == {str(mine)}, reply


def test_an_allowed_unix_socket_must_be_one_the_caller_could_connect_to(world: dict[str, Any]) -> None:
    attacker = world["users"][0]
    ws = workspace_of(world, attacker)
    root_only = world["base"] / f"root-{uuid.uuid4().hex[:6]}.sock"
    public = world["base"] / f"public-{uuid.uuid4().hex[:6]}.sock"
    servers = []
    for path, mode in ((root_only, 0o600), (public, 0o666)):
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        os.chmod(path, mode)
        server.listen(4)
        servers.append(server)
    body = r'''
from sandboxd.v1 import sandboxd_pb2 as pb
def make(path):
    policy = pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, allowed_unix_sockets=[path])
    s = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], sandbox_policy=policy, approval_policy=pb.NEVER), timeout=60)
    return s
result = {"root": code(lambda: make(ARGS["root"]))}
s = make(ARGS["public"])
script = "import socket,sys\ns=socket.socket(socket.AF_UNIX)\ns.connect(sys.argv[1])\nprint('REACHED')"
result["public"], _ = run(s.id, ["/usr/bin/python3", "-c", script, ARGS["public"]])
stub.CloseSession(pb.CloseSessionRequest(session_id=s.id))
print(json.dumps(result))
'''
    try:
        reply = run_client_as(attacker.uid, attacker.gid, world["daemon"].socket, body,
                              {"ws": str(ws), "root": str(root_only), "public": str(public)})
    finally:
        for server in servers:
            server.close()
    assert reply["root"] == "PERMISSION_DENIED", reply
    assert reply["public"].strip() == "REACHED", reply


# --------------------------------------------------------------------------- TLS identities


def tls_stub(world: dict[str, Any], port: int, key: Path, cert: Path) -> pb_grpc.SandboxStub:
    credentials = grpc.ssl_channel_credentials((world["pki"] / "ca.pem").read_bytes(), key.read_bytes(),
                                               cert.read_bytes())
    return pb_grpc.SandboxStub(grpc.secure_channel(f"127.0.0.1:{port}", credentials))


def san_only_certificate(pki: Path, name: str, san: str) -> tuple[Path, Path]:
    """A client certificate with no common name, only a subject alternative name (SPIFFE style)."""
    (pki / f"{name}.ext").write_text(f"subjectAltName={san}\n")
    run = lambda *a: subprocess.run(["openssl", *a], cwd=pki, check=True, capture_output=True)  # noqa: E731
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", "/O=workloads")
    run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    return pki / f"{name}.key", pki / f"{name}.pem"


def test_a_certificate_without_a_common_name_is_refused(world: dict[str, Any]) -> None:
    key, cert = san_only_certificate(world["pki"], f"spiffe-{uuid.uuid4().hex[:4]}", "URI:spiffe://example.org/a")
    stub = tls_stub(world, world["tls_port"], key, cert)
    error = rpc_error(lambda: stub.ListSessions(pb.ListSessionsRequest(), timeout=30))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "no usable identity" in (error.details() or "")
    alice = tls_stub(world, world["tls_port"], world["pki"] / "alice.key", world["pki"] / "alice.pem")
    alice.ListSessions(pb.ListSessionsRequest(), timeout=30)           # control: a named certificate works


@pytest.fixture(scope="module")
def uri_daemon(world: dict[str, Any]) -> Iterator[tuple[Daemon, int]]:
    """A second daemon naming TLS callers by their URI SAN, with one principal mapped to a local user."""
    victim = world["users"][1]
    pki = world["pki"]
    port = free_port()
    with daemon_factory("sbxh-uri-") as factory:
        daemon = factory(config=f'[tls]\nidentity = "uri"\nusers = {{ "spiffe://example.org/mapped" = "{victim.name}" }}\n',
                         args=["--tcp", f"127.0.0.1:{port}", "--tls-cert", str(pki / "server.pem"), "--tls-key",
                               str(pki / "server.key"), "--tls-client-ca", str(pki / "ca.pem"),
                               "--tcp-user", "65534:65534"])
        yield daemon, port


def test_uri_identities_are_distinct_principals_and_map_to_users(world: dict[str, Any],
                                                                  uri_daemon: tuple[Daemon, int]) -> None:
    daemon, port = uri_daemon
    victim = world["users"][1]
    one = tls_stub(world, port, *san_only_certificate(world["pki"], "w-one", "URI:spiffe://example.org/one"))
    two = tls_stub(world, port, *san_only_certificate(world["pki"], "w-two", "URI:spiffe://example.org/two"))
    mapped = tls_stub(world, port, *san_only_certificate(world["pki"], "w-mapped", "URI:spiffe://example.org/mapped"))
    shared = daemon.base / f"ws-{uuid.uuid4().hex[:6]}"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    session = one.CreateSession(pb.CreateSessionRequest(workspace=str(shared), approval_policy=pb.NEVER), timeout=60)
    try:
        assert session.owner_uid == 65534
        assert list(two.ListSessions(pb.ListSessionsRequest(), timeout=30).sessions) == []
        for call in (lambda: two.GetSession(pb.GetSessionRequest(session_id=session.id), timeout=30),
                     lambda: two.CloseSession(pb.CloseSessionRequest(session_id=session.id), timeout=30)):
            assert rpc_error(call).code() == grpc.StatusCode.NOT_FOUND
        # Same local user (nobody): the other principal may not use a workspace the first one uses.
        overlap = rpc_error(lambda: two.CreateSession(pb.CreateSessionRequest(workspace=str(shared)), timeout=60))
        assert overlap.code() == grpc.StatusCode.PERMISSION_DENIED and "another TLS principal" in overlap.details()
        own = daemon.base / f"ws-{uuid.uuid4().hex[:6]}"
        own.mkdir(mode=0o777)
        os.chmod(own, 0o777)
        two.CloseSession(pb.CloseSessionRequest(session_id=two.CreateSession(
            pb.CreateSessionRequest(workspace=str(own), approval_policy=pb.NEVER), timeout=60).id), timeout=30)
        # A mapped principal acts as its own local user: the kernel keeps the others out of its files.
        home = daemon.base / f"ws-{uuid.uuid4().hex[:6]}"
        home.mkdir(mode=0o700)
        os.chown(home, victim.uid, victim.gid)
        mine = mapped.CreateSession(pb.CreateSessionRequest(workspace=str(home), approval_policy=pb.NEVER), timeout=60)
        assert mine.owner_uid == victim.uid
        mapped.CloseSession(pb.CloseSessionRequest(session_id=mine.id), timeout=30)
        assert rpc_error(lambda: one.CreateSession(pb.CreateSessionRequest(workspace=str(home)), timeout=60)
                         ).code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        one.CloseSession(pb.CloseSessionRequest(session_id=session.id), timeout=30)
