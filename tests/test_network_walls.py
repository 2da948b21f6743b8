"""Network walls between tenants: the connect broker's "this host" rule, and published ports' caps.

One daemon with a TLS listener and a metrics listener, both on 127.0.0.1, small published-port caps,
and two plain users made here (an attacker and an owner).

- Broker: from a host-network sandbox of the attacker, every spelling of this host (127/8, 0.0.0.0,
  ::, ::1, IPv4-mapped and -compatible IPv6, every interface's address, link-local ones with their
  scope) is tried against the daemon's two listeners: the broker answers EACCES for each (before,
  0.0.0.0 and [::ffff:0.0.0.0] reached them). Controls: the same spellings reach an unrelated host
  listener from the same sandbox, and the attack spellings reach the daemon's listeners from the
  host, so the EACCES can only be the broker's.
- Published ports: another local user holds idle connections to the owner's published port up to
  its cap; its further ones, from any of its processes, are refused; a third user gets none once the
  others hold everything but the owner's reserve; the owner's own connections are served; and a
  closed connection gives its slot back.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import BASE_ENV, PY, SLOW
from daemon_helpers import DaemonFactory, PlainUser, TlsListener, plain_users, run_client_as
from test_tls_listener import make_pki
from sandboxd.kernel import addresses, inet_diag
from sandboxd.network.publish import PeerCaps
from sandboxd.v1 import sandboxd_pb2 as pb

PER_SESSION, PER_PEER = 12, 4                       # the caps the daemon gets here (config below)
NOBODY = (65534, 65534)


@pytest.fixture(scope="module")
def users() -> Iterator[list[PlainUser]]:
    """An attacker and an owner."""
    with plain_users(2) as made:
        yield made


def free_port(family: int = socket.AF_INET, host: str = "127.0.0.1") -> int:
    with socket.socket(family) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def world(users: list[PlainUser], sandboxd_daemon_module: DaemonFactory) -> dict[str, Any]:
    base = sandboxd_daemon_module.base
    pki = base / "pki"
    pki.mkdir()
    make_pki(pki)
    tls_port, metrics_port = free_port(), free_port()
    tls = TlsListener(f"127.0.0.1:{tls_port}", pki / "server.pem", pki / "server.key", pki / "ca.pem", "65534:65534")
    daemon = sandboxd_daemon_module(tls=tls, args=["--metrics", f"127.0.0.1:{metrics_port}"], config=(
        f"[quotas]\npublished_connections_per_session = {PER_SESSION}\n"
        f"published_connections_per_peer = {PER_PEER}\n"))
    return {"daemon": daemon, "base": base, "tls": tls_port, "metrics": metrics_port,
            "attacker": users[0], "owner": users[1]}


def workspace_for(world: dict[str, Any], owner: PlainUser) -> Path:
    path = world["base"] / f"ws-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    os.chown(path, owner.uid, owner.gid)
    return path


# --------------------------------------------------------------------------- the connect broker

def this_hosts_spellings() -> dict[str, tuple[int, tuple[Any, ...]]]:
    """name -> (family, address without the port) for every spelling of this host that the kernel
    delivers locally: loopback ones, the unspecified ones, mapped ones, every interface's address."""
    forms: dict[str, tuple[int, tuple[Any, ...]]] = {
        host: (socket.AF_INET, (host,)) for host in ("127.0.0.1", "127.0.0.2", "127.255.255.254", "0.0.0.0")}
    forms.update({host: (socket.AF_INET6, (host, 0, 0)) for host in (
        "::1", "::", "::ffff:127.0.0.1", "::ffff:127.9.8.7", "::ffff:0.0.0.0")})
    shown = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
    for line in shown.splitlines():
        fields = line.split()
        index, kind, address = int(fields[0].rstrip(":")), fields[2], fields[3].split("/")[0]
        if "tentative" in fields or "dadfailed" in fields:
            # Not yet (or never) an address the kernel delivers to: a connect gets EADDRNOTAVAIL,
            # whatever the wall says. Another test's or daemon's new veth here has one for a moment.
            continue
        if kind == "inet":
            forms[address] = (socket.AF_INET, (address,))
            forms[f"::ffff:{address}"] = (socket.AF_INET6, (f"::ffff:{address}", 0, 0))
        elif kind == "inet6" and address != "::1":
            scope = index if address.startswith("fe80:") else 0
            forms[f"{address}%{index}" if scope else address] = (socket.AF_INET6, (address, 0, scope))
    return forms


# Spellings the kernel does not deliver locally (deprecated IPv4-compatible IPv6): the broker must
# still refuse them for the daemon's ports; no control is asked of them.
COMPATIBLE = {host: (socket.AF_INET6, (host, 0, 0)) for host in ("::127.0.0.1", "::127.0.0.2")}

CONNECT_PROBE = r'''
import errno, json, socket, sys
out = {}
for name, (family, address, port) in json.loads(sys.argv[1]).items():
    s = socket.socket(family)
    s.settimeout(5)
    try:
        s.connect((address[0], port, *address[1:]) if family == socket.AF_INET6 else (address[0], port))
        out[name] = "REACHED"
    except OSError as exc:
        out[name] = errno.errorcode.get(exc.errno or 0, str(exc))
    finally:
        s.close()
print(json.dumps(out))
'''


def targets(ports: dict[str, int], forms: dict[str, tuple[int, tuple[Any, ...]]]) -> dict[str, Any]:
    return {f"{what} {name}": (family, address, port) for what, port in ports.items()
            for name, (family, address) in forms.items()}


def sandboxed_probe(world: dict[str, Any], user: PlainUser, spec: dict[str, Any]) -> dict[str, str]:
    body = r'''
policy = pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, network_access=True, network_mode="host")
s = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], sandbox_policy=policy, approval_policy=pb.NEVER))
out, code = run(s.id, ARGS["argv"])
events = [str(e) for e in stub.ListEvents(pb.ListEventsRequest(session_id=s.id)).events] if hasattr(pb, "ListEventsRequest") else []
stub.CloseSession(pb.CloseSessionRequest(session_id=s.id))
print(json.dumps({"out": out, "code": code, "events": events[-5:]}))
'''
    reply = run_client_as(user.uid, user.gid, world["daemon"].socket, body, {
        "ws": str(workspace_for(world, user)), "argv": [PY, "-c", CONNECT_PROBE, json.dumps(spec)]})
    assert reply["code"] == 0 and reply["out"], reply
    return dict(json.loads(reply["out"]))


@pytest.fixture
def unrelated_listener() -> Iterator[int]:
    """A host service on every address, IPv4 and IPv6 (dual stack): what the host network is for."""
    server = socket.socket(socket.AF_INET6)
    server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    server.bind(("::", 0))
    server.listen(128)
    try:
        yield int(server.getsockname()[1])
    finally:
        server.close()


def test_every_spelling_of_this_host_is_refused_for_the_daemons_listeners(
        world: dict[str, Any], unrelated_listener: int) -> None:
    forms = this_hosts_spellings()
    daemon_ports = {"tls": world["tls"], "metrics": world["metrics"]}
    spec = {**targets(daemon_ports, {**forms, **COMPATIBLE}), **targets({"unrelated": unrelated_listener}, forms)}
    got = sandboxed_probe(world, world["attacker"], spec)
    # An address of a link that went away meanwhile (another test's or daemon's veth on this
    # machine) is no address of this host any more: nothing to judge.
    still = this_hosts_spellings()
    gone = {key for key, verdict in got.items()
            if verdict == "EADDRNOTAVAIL" and key.partition(" ")[2] in forms and key.partition(" ")[2] not in still}
    got = {key: verdict for key, verdict in got.items() if key not in gone}
    assert {k: v for k, v in got.items() if not k.startswith("unrelated") and v != "EACCES"} == {}
    # Control, same sandbox: each spelling reaches a host service on another port.
    assert {k: v for k, v in got.items() if k.startswith("unrelated") and v != "REACHED"} == {}


def test_control_the_attack_spellings_reach_the_daemon_from_the_host(world: dict[str, Any]) -> None:
    """Outside any sandbox the kernel delivers 0.0.0.0 and [::ffff:0.0.0.0] (and 127.0.0.1) to the
    daemon's loopback listeners: in the sandbox it is the broker that said EACCES."""
    forms = {name: form for name, form in this_hosts_spellings().items()
             if name in ("127.0.0.1", "0.0.0.0", "::ffff:127.0.0.1", "::ffff:0.0.0.0")}
    spec = targets({"tls": world["tls"], "metrics": world["metrics"]}, forms)
    attacker = world["attacker"]
    result = subprocess.run([PY, "-c", CONNECT_PROBE, json.dumps(spec)], capture_output=True, text=True, env=BASE_ENV,
                            timeout=60, user=attacker.uid, group=attacker.gid, extra_groups=[])
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout).values()) == {"REACHED"}, result.stdout


# --------------------------------------------------------------------------- published ports

SERVER = r'''
import socket, threading
def serve(c):
    c.sendall(b"hi\n")
    while c.recv(4096):
        pass
    c.close()                         # the client's close reaches here: the relay's slot is freed
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 8000))
s.listen(128)
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
'''

# Opens N connections one after another, says for each whether it was served (the greeting came) or
# refused (closed at once), then holds them all until its stdin closes.
HOLDER = r'''
import json, socket, sys
port, count = int(sys.argv[1]), int(sys.argv[2])
held, verdicts = [], []
for _ in range(count):
    s = socket.socket()
    s.settimeout(30)
    try:
        s.connect(("127.0.0.1", port))
        verdicts.append("served" if s.recv(3) == b"hi\n" else "refused")
    except OSError:
        verdicts.append("refused")
    held.append(s)
print(json.dumps(verdicts), flush=True)
sys.stdin.read()
'''


class Holder:
    """A process of ``uid`` holding ``count`` connections to ``port`` (released by ``release``)."""

    def __init__(self, uid: int, gid: int, port: int, count: int) -> None:
        self.proc = subprocess.Popen([PY, "-c", HOLDER, str(port), str(count)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=BASE_ENV, user=uid, group=gid,
                                     extra_groups=[])
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "the holder died"
        self.verdicts: list[str] = json.loads(line)

    def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0


@pytest.fixture
def published(world: dict[str, Any]) -> Iterator[int]:
    """The owner's session publishing a server that greets each connection and keeps it: the host port."""
    owner: PlainUser = world["owner"]
    port = free_port()
    body = r'''
policy = pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, published_ports=[ARGS["publish"]])
s = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], sandbox_policy=policy, approval_policy=pb.NEVER))
stub.StartBackground(pb.StartBackgroundRequest(session_id=s.id, argv=ARGS["argv"]))
print(json.dumps({"id": s.id}))
'''
    session = run_client_as(owner.uid, owner.gid, world["daemon"].socket, body, {
        "ws": str(workspace_for(world, owner)), "publish": f"{port}:8000", "argv": [PY, "-c", SERVER]})["id"]
    try:
        assert served_within(owner, port, 30 * SLOW), "the published server never answered"   # it listens
        yield port
    finally:
        world["daemon"].stub.CloseSession(pb.CloseSessionRequest(session_id=session))


def served_within(user: PlainUser, port: int, seconds: float) -> bool:
    """Whether a connection of ``user`` is served before ``seconds`` pass (the relay loop frees a
    closed connection's slot once it sees the close)."""
    deadline = time.monotonic() + seconds
    while True:
        probe = Holder(user.uid, user.gid, port, 1)
        probe.release()
        if probe.verdicts == ["served"]:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def test_other_users_cannot_take_the_owners_published_port_offline(world: dict[str, Any], published: int) -> None:
    attacker, owner = world["attacker"], world["owner"]
    holders = []
    try:
        first = Holder(attacker.uid, attacker.gid, published, PER_PEER + 2)
        holders.append(first)
        assert first.verdicts == ["served"] * PER_PEER + ["refused"] * 2      # its cap, then refused at once
        again = Holder(attacker.uid, attacker.gid, published, 1)            # another process, the same user
        holders.append(again)
        assert again.verdicts == ["refused"]
        root = Holder(0, 0, published, PER_PEER)                            # a second user at its cap
        holders.append(root)
        assert root.verdicts == ["served"] * PER_PEER
        third = Holder(*NOBODY, published, 1)      # everything but the owner's reserve is held: a third gets none
        holders.append(third)
        assert third.verdicts == ["refused"]
        mine = Holder(owner.uid, owner.gid, published, PER_PEER + 1)        # the owner: its reserve, then the cap
        holders.append(mine)
        assert mine.verdicts == ["served"] * PER_PEER + ["refused"]
        first.release()                                                      # closed connections give slots back
        holders.remove(first)
        assert served_within(attacker, published, 30 * SLOW)
    finally:
        for holder in holders:
            holder.release()


# --------------------------------------------------------------------------- the rules, generated

@settings(max_examples=300, deadline=None, database=None)
@given(v4=st.ip_addresses(v=4), pick=st.sampled_from(["127.", "0.", "own", "any"]), scope=st.integers(0, 3))
def test_every_ipv6_spelling_of_an_ipv4_address_is_judged_alike(v4: ipaddress.IPv4Address, pick: str,
                                                               scope: int) -> None:
    """The mapped and compatible IPv6 spellings of an IPv4 address are this host exactly when the
    address is (all of 127/8 and 0/8 and this host's own are), whatever the scope id."""
    own = [a for a in this_hosts_spellings() if "." in a and ":" not in a]
    if pick == "own":
        v4 = ipaddress.IPv4Address(own[int(v4) % len(own)])
    elif pick != "any":
        v4 = ipaddress.IPv4Address(f"{pick}{int(v4) % 256}.{int(v4) // 256 % 256}.{int(v4) // 65536 % 256}")
    expected = addresses.is_this_host(v4)
    if v4.is_loopback or v4 in addresses.THIS_NETWORK or str(v4) in own:
        assert expected, v4                 # (others may be too: the kernel binds broadcast addresses)
    mapped, compatible = ipaddress.IPv6Address(f"::ffff:{v4}"), ipaddress.IPv6Address(f"::{v4}")
    assert addresses.is_this_host(mapped, scope) == expected
    if int(v4) > 1:                                   # ::0 and ::1 are IPv6's own unspecified and loopback
        assert addresses.is_this_host(compatible, scope) == expected


@settings(max_examples=200, deadline=None, database=None)
@given(limit=st.integers(1, 40), per_peer=st.integers(1, 40),
       steps=st.lists(st.tuples(st.booleans(), st.sampled_from([1001, 1002, 1003, "address 10.0.0.1"])),
                      max_size=120))
def test_the_owner_always_keeps_its_reserve(limit: int, per_peer: int, steps: list[tuple[bool, Any]]) -> None:
    """Whatever other peers take and give back, none holds more than its share, all together never
    more than the cap, and the owner (uid 1000, holding nothing) can still take the whole reserve."""
    caps = PeerCaps(limit, per_peer, owners=frozenset({1000}))
    held: list[Any] = []
    for take, peer in steps:
        if take:
            if caps.take(peer):
                held.append(peer)
        elif peer in held:
            held.remove(peer)
            caps.release(peer)
        assert caps.active == len(held) <= limit
        assert all(held.count(p) <= caps.per_peer for p in set(held))
    assert caps.reserve >= min(per_peer, limit // 2)
    assert all(caps.take(1000) for _ in range(caps.reserve))


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_the_connecting_user_is_named_by_the_kernel_and_by_proc_alike(world: dict[str, Any], host: str) -> None:
    """The uid behind a loopback connection: the inet_diag lookup names the plain user that connected,
    and /proc/net/tcp (the fallback for kernels without inet_diag) names the same one."""
    attacker: PlainUser = world["attacker"]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as server:
        server.bind((host, 0))
        server.listen(1)
        client = subprocess.Popen([PY, "-c", "import socket, sys\ns = socket.socket(int(sys.argv[1]))\n"
                                   "s.connect((sys.argv[2], int(sys.argv[3])))\nsys.stdin.read()",
                                   str(int(family)), host, str(server.getsockname()[1])],
                                  stdin=subprocess.PIPE, user=attacker.uid, group=attacker.gid, extra_groups=[])
        try:
            conn, peer = server.accept()
            with conn:
                local = conn.getsockname()
                assert inet_diag.tcp_peer_uid(peer[:2], local[:2]) == attacker.uid
                from_proc = inet_diag._socket_from_proc(ipaddress.ip_address(peer[0]), peer[1],
                                                        ipaddress.ip_address(local[0]), local[1])
                assert from_proc == inet_diag.tcp_peer_socket(peer[:2], local[:2]) and from_proc[0] == attacker.uid
                assert inet_diag.tcp_peer_uid((peer[0], peer[1] ^ 1), local[:2]) is None   # control: no such socket
        finally:
            assert client.stdin is not None
            client.stdin.close()
            client.wait(timeout=30)
