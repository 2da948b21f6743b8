"""Cloud metadata stays out (issue 26 item 5): every metadata address and name
(policy.network.METADATA_ADDRESSES, METADATA_NAMES) is refused from inside every confined sandbox,
in every network mode, whatever a name resolves to; danger-full-access is unaffected.

On the real kernel, against tests/metadata_world.py: a stand-in host (a network namespace of the
test's own, where `sandboxd run` is started) whose routes lead to a "cloud" namespace holding every
metadata address (and the NAT64 spelling of 169.254.169.254) with HTTP and UDP servers, and a DNS
server that answers test names with them. Each refusal has its control, the same probe reaching
the same server: from danger-full-access, or from a plain process of the stand-in host. And the
cloud counts what reached it, so "refused" means nothing arrived, not just an error inside.

Where each path refuses (docs/networks.md, "Metadata"):
- the egress proxy (--allow-domain): by name before resolving, and by the address a name resolves to;
- init's connect broker (launcher.connect_broker), every confined mode: connect() to any metadata
  address in any spelling (IPv4-mapped, IPv4-compatible, NAT64), TCP and UDP; the seccomp filter
  refuses TCP Fast Open (a connect without connect());
- the isolated network's host table (kernel.nftables): 169.254/16, 100.64/10, 192.0.0.0/24, all IPv6;
- rootless runs: only loopback, and the loopback proxy's own checks.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import BASE_ENV, PY, SANDBOXD, SLOW, describe, make_dir, readable_copy_of_sandboxd
from metadata_world import DNS_SERVER, INTERNET, MAPPED_METADATA, NAT64_METADATA, MetadataWorld
from sandboxd.launcher.connect_broker import _is_metadata
from sandboxd.policy.network import (METADATA_ADDRESSES, METADATA_NAMES, metadata_address, metadata_name,
                                     metadata_resolvers)

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="the test builds network namespaces (root)"),
              pytest.mark.timeout(600)]

V4_METADATA = tuple(a for a in METADATA_ADDRESSES if ":" not in a)
V6_METADATA = tuple(a for a in METADATA_ADDRESSES if ":" in a)
# Every spelling of a metadata address a socket can be given: each address, 169.254.169.254
# IPv4-mapped and through NAT64's well-known prefix.
EVERY_SPELLING = (*METADATA_ADDRESSES, MAPPED_METADATA, NAT64_METADATA)

PROBE = textwrap.dedent('''
    import errno, json, os, socket, sys
    def family(address):
        return socket.AF_INET6 if ":" in address else socket.AF_INET
    def reply(s):
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        return "open: " + data.split(b"\\r\\n\\r\\n", 1)[-1].decode()
    def tcp(address, port):
        with socket.socket(family(address), socket.SOCK_STREAM) as s:
            s.settimeout(20)
            s.connect((address, port))
            s.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
            return reply(s)
    def udp(address, port):
        with socket.socket(family(address), socket.SOCK_DGRAM) as s:
            s.settimeout(20)
            s.connect((address, port))
            s.send(b"ping")
            return "open: " + s.recv(512).decode()
    def tfo(address, port):
        with socket.socket(family(address), socket.SOCK_STREAM) as s:
            s.sendto(b"GET / HTTP/1.0\\r\\n\\r\\n", socket.MSG_FASTOPEN, (address, port))  # blocking: it connects
            s.settimeout(20)
            return reply(s)
    def proxy(request, port=3128):
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            s.sendall(request.encode() + b"\\r\\n\\r\\n")
            return s.recv(4096).split(b"\\r\\n", 1)[0].decode()
    def socks(name, port, proxy_port=3128):
        with socket.create_connection(("127.0.0.1", proxy_port), timeout=20) as s:
            s.sendall(b"\\x05\\x01\\x00")
            s.recv(2)
            s.sendall(b"\\x05\\x01\\x00\\x03" + bytes([len(name)]) + name.encode() + port.to_bytes(2, "big"))
            return f"SOCKS reply {s.recv(10)[1]}"
    def resolve(name):
        return socket.gethostbyname(name)
    def lookup(server, name):
        """An A query to ``server`` (the stand-in host's own resolver is the machine's, out of reach)."""
        query = b"\\x12\\x34\\x01\\x00\\x00\\x01" + bytes(6) + b"".join(
            bytes([len(label)]) + label.encode() for label in name.split(".")) + b"\\x00\\x00\\x01\\x00\\x01"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(20)
            s.connect((server, 53))
            s.send(query)
            answer = s.recv(512)
        return socket.inet_ntoa(answer[-4:]) if answer[7] else "no answer"
    result = {}
    for kind, *args in json.loads(sys.argv[1]):
        key = " ".join([kind, *map(str, args)])
        try:
            result[key] = globals()[kind](*args)
        except OSError as e:
            result[key] = errno.errorcode.get(e.errno, type(e).__name__)
    print(json.dumps(result))
''')


@pytest.fixture(scope="module")
def world() -> Iterator[MetadataWorld]:
    world = MetadataWorld()
    try:
        yield world
    finally:
        world.close()


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    return make_dir(tmp_path / "ws")


def run_in_host(world: MetadataWorld, workspace: Path, options: "list[str]", plan: "list[list[Any]]",
                ) -> "tuple[dict[str, str], str]":
    """PROBE's ``plan`` inside `sandboxd run OPTIONS` started in the stand-in host: (results, stderr)."""
    done = subprocess.run(world.in_host([SANDBOXD, "run", "--workspace", str(workspace), *options, "--",
                                         PY, "-c", PROBE, json.dumps(plan)]),
                          capture_output=True, text=True, timeout=300 * SLOW, env=BASE_ENV, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, describe(done)
    return dict(json.loads(done.stdout.strip().splitlines()[-1])), done.stderr


def probe_host(world: MetadataWorld, plan: "list[list[Any]]") -> dict[str, str]:
    """The control: PROBE's ``plan`` from a plain process of the stand-in host."""
    done = subprocess.run(world.in_host([PY, "-c", PROBE, json.dumps(plan)]), capture_output=True, text=True,
                          timeout=300 * SLOW, env=BASE_ENV, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, describe(done)
    return dict(json.loads(done.stdout))


def opened(address: str) -> str:
    """What the cloud's HTTP server answers on ``address`` (as it names its own address)."""
    if address == MAPPED_METADATA:
        address = "169.254.169.254"
    return f"open: metadata {address}"


# --------------------------------------------------------------------------- the one judgement


@pytest.mark.parametrize("address", [*EVERY_SPELLING, "::169.254.169.254", "::ffff:100.100.100.200",
                                     "64:ff9b::192.0.0.192", "fd00:ec2::254%eth0"])
def test_every_spelling_of_a_metadata_address_is_one(address: str) -> None:
    assert metadata_address(address)


@pytest.mark.parametrize("address", ["169.254.169.253", "169.254.1.1", "::ffff:1.1.1.1", "64:ff9b::101:101",
                                     "fd00:ec2::255", "2600:1f00::a9fe:a9fe", "not an address", ""])
def test_an_address_that_is_not_metadata_is_not(address: str) -> None:
    assert not metadata_address(address)


def test_metadata_names_include_every_subdomain_of_google_s() -> None:
    assert all(metadata_name(name) for name in METADATA_NAMES)
    assert metadata_name("computemetadata.metadata.google.internal")
    assert not metadata_name("metadata.google.internal.example.org") and not metadata_name("google.internal")


def _sockaddr(address: str, port: int) -> bytes:
    import socket

    if ":" in address:
        return struct.pack("=H", socket.AF_INET6) + struct.pack("!HI", port, 0) + socket.inet_pton(
            socket.AF_INET6, address) + bytes(4)
    return struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + socket.inet_aton(address) + bytes(8)


def test_the_broker_keeps_port_53_of_a_resolver_that_is_a_metadata_address_and_nothing_else() -> None:
    """Google's metadata server is its DNS resolver: a sandbox there keeps DNS (port 53 of its own
    resolver), and nothing else of it; a metadata address that is no resolver of the sandbox's is
    refused on port 53 too."""
    resolvers = metadata_resolvers(["169.254.169.254", "8.8.8.8"])
    assert not _is_metadata(_sockaddr("169.254.169.254", 53), resolvers)
    assert not _is_metadata(_sockaddr(MAPPED_METADATA, 53), resolvers)
    assert _is_metadata(_sockaddr("169.254.169.254", 80), resolvers)
    assert _is_metadata(_sockaddr("169.254.169.254", 53), frozenset())
    assert _is_metadata(_sockaddr("100.100.100.200", 53), resolvers)
    assert not _is_metadata(_sockaddr("8.8.8.8", 53), resolvers) and not _is_metadata(_sockaddr("8.8.8.8", 80),
                                                                                      resolvers)
    assert all(_is_metadata(_sockaddr(a, 80), resolvers) for a in EVERY_SPELLING)


# --------------------------------------------------------------------------- the host's network


def test_the_host_network_reaches_no_metadata_address_in_any_spelling(world: MetadataWorld,
                                                                      workspace: Path) -> None:
    """--network=host: with nothing but init's connect broker between the sandbox and the host's
    routes, a TCP or UDP connect() to any metadata address, however spelled, is EACCES, and TCP Fast
    Open (a connect from sendto) is EPERM; nothing reaches the cloud. Controls: the same probe from
    danger-full-access reaches every one, and the confined sandbox reaches the ordinary server."""
    plan = [*(["tcp", a, 80] for a in EVERY_SPELLING), ["udp", "169.254.169.254", 80],
            ["udp", MAPPED_METADATA, 80], ["udp", "fd00:ec2::254", 80],
            ["tfo", "169.254.169.254", 80], ["tcp", INTERNET, 80]]
    world.reached()
    seen, _ = run_in_host(world, workspace, ["--network=host"], plan)
    refused = {key: value for key, value in seen.items() if INTERNET not in key}
    assert refused == {key: "EPERM" if key.startswith("tfo") else "EACCES" for key in refused}, seen
    assert seen[f"tcp {INTERNET} 80"] == f"open: metadata {INTERNET}"
    assert world.reached() == {f"tcp {INTERNET}": 1}

    control, _ = run_in_host(world, workspace, ["--sandbox", "danger-full-access"], plan)
    for address in EVERY_SPELLING:
        assert control[f"tcp {address} 80"] == opened(address), control
    assert control["udp 169.254.169.254 80"] == control[f"udp {MAPPED_METADATA} 80"] == "open: udp 169.254.169.254"
    assert control["udp fd00:ec2::254 80"] == "open: udp fd00:ec2::254"
    assert control["tfo 169.254.169.254 80"] == "open: metadata 169.254.169.254"
    assert world.reached()["tcp 169.254.169.254"] == 3        # itself, IPv4-mapped and by Fast Open


# --------------------------------------------------------------------------- the isolated network


def test_the_isolated_network_reaches_no_metadata_address(world: MetadataWorld, workspace: Path) -> None:
    """--network (no allowed domains): the broker refuses every spelling at once (EACCES; behind it the
    host table drops 169.254/16, 100.64/10, 192.0.0.0/24 and all IPv6); the ordinary server is
    reached (control), and nothing arrives at the cloud's metadata addresses."""
    plan = [*(["tcp", a, 80] for a in EVERY_SPELLING), ["udp", "169.254.169.254", 80], ["tcp", INTERNET, 80]]
    world.reached()
    seen, _ = run_in_host(world, workspace, ["--network", "--dns", DNS_SERVER], plan)
    assert seen.pop(f"tcp {INTERNET} 80") == f"open: metadata {INTERNET}"
    assert seen == {key: "EACCES" for key in seen}, seen
    assert world.reached() == {f"tcp {INTERNET}": 1}


TABLE_ONLY = textwrap.dedent('''
    import json, os, socket, sys, threading
    from sandboxd.kernel import namespaces
    from sandboxd.kernel.netns import create_isolated
    own = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    net = create_isolated(resolvers=[sys.argv[1]])
    results = {}
    def tcp(address):
        try:
            with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
                s.settimeout(3)
                s.connect((address, 80))
                results[f"tcp {address}"] = "open"
        except OSError as e:
            results[f"tcp {address}"] = type(e).__name__
    def udp(address):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"ping", (address, 80))
    try:
        namespaces.setns(net.netns_fd, namespaces.CLONE_NEWNET)   # the sandbox's namespace, no broker
        threads = [threading.Thread(target=tcp, args=(a,)) for a in json.loads(sys.argv[2])]
        for thread in threads:
            thread.start()
        for address in json.loads(sys.argv[3]):
            udp(address)
        for thread in threads:
            thread.join()
    finally:
        namespaces.setns(own, namespaces.CLONE_NEWNET)
        net.close()
    print(json.dumps(results))
''')


def test_the_isolated_network_s_host_table_alone_drops_metadata(world: MetadataWorld) -> None:
    """The wall behind the broker: from inside an isolated network's namespace with nothing but the
    kernel in the way (a root process joined to it, no seccomp, no broker), every IPv4 metadata
    address, 169.254.169.254 IPv4-mapped included, is dropped by the host's `inet sandboxd` table
    (TCP connects time out, no datagram arrives), and the IPv6 ones have no route at all. Control:
    the ordinary server is reached from the same namespace."""
    from conftest import REPO

    v4 = [*V4_METADATA, MAPPED_METADATA]
    world.reached()
    done = subprocess.run(world.in_host([sys.executable, "-c", TABLE_ONLY, DNS_SERVER,
                                         json.dumps([*v4, *V6_METADATA, NAT64_METADATA, INTERNET]),
                                         json.dumps(V4_METADATA)]),
                          capture_output=True, text=True, timeout=120 * SLOW, cwd=REPO, stdin=subprocess.DEVNULL,
                          env={**BASE_ENV, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, describe(done)
    seen = json.loads(done.stdout)
    assert seen.pop(f"tcp {INTERNET}") == "open"
    assert seen == {**{f"tcp {a}": "TimeoutError" for a in v4},
                    **{f"tcp {a}": "OSError" for a in (*V6_METADATA, NAT64_METADATA)}}, seen
    assert world.reached() == {f"tcp {INTERNET}": 1}


def test_a_resolver_that_is_a_metadata_address_answers_dns_and_nothing_else(world: MetadataWorld,
                                                                            workspace: Path) -> None:
    """--dns 169.254.169.254 (as on Google's cloud): the sandbox resolves names through it, and its
    HTTP and UDP port 80 stay refused."""
    plan = [["resolve", "internet.test"], ["tcp", "169.254.169.254", 80], ["udp", "169.254.169.254", 80]]
    world.reached()
    seen, _ = run_in_host(world, workspace, ["--network", "--dns", "169.254.169.254"], plan)
    assert seen == {"resolve internet.test": INTERNET, "tcp 169.254.169.254 80": "EACCES",
                    "udp 169.254.169.254 80": "EACCES"}
    assert set(world.reached()) == {"dns 169.254.169.254"}


# --------------------------------------------------------------------------- the egress proxy


def test_the_proxy_refuses_metadata_by_name_and_by_what_a_name_resolves_to(world: MetadataWorld,
                                                                          workspace: Path) -> None:
    """--allow-domain '*': a name resolving to any metadata address, a metadata name (whatever it
    resolves to: here an ordinary address), and every address spelling in CONNECT are refused with
    a 403, and `sandboxd run` says what and why, printable; nothing reaches the cloud's metadata
    addresses. Controls: internet.test through the same proxy, and the same names resolved and
    reached from the stand-in host."""
    names = ("meta.test", "ecs.test", "alibaba.test", "oracle.test")
    plan = [*(["proxy", f"GET http://{name}/ HTTP/1.1\r\nHost: {name}"] for name in names),
            *(["proxy", f"CONNECT {name}:80 HTTP/1.1"] for name in (*names, "metadata.google.internal")),
            *(["proxy", f"CONNECT [{a}]:80 HTTP/1.1"] for a in (*V6_METADATA, MAPPED_METADATA, NAT64_METADATA)),
            *(["proxy", f"CONNECT {a}:80 HTTP/1.1"] for a in V4_METADATA),
            ["proxy", "CONNECT meta.test\x1b[2J:80 HTTP/1.1"], ["socks", "meta.test", 80],
            ["socks", "metadata.google.internal", 80], ["socks", "internet.test", 80],
            ["proxy", "GET http://internet.test/ HTTP/1.1\r\nHost: internet.test"]]
    world.reached()
    seen, stderr = run_in_host(world, workspace, ["--network", "--dns", DNS_SERVER, "--allow-domain", "*"], plan)
    control = seen.pop(plan[-1][0] + " " + plan[-1][1])
    assert control.startswith("HTTP/1.1 200"), control
    assert seen.pop("socks internet.test 80") == "SOCKS reply 0"             # succeeded
    assert seen.pop("socks meta.test 80") == seen.pop("socks metadata.google.internal 80") == "SOCKS reply 2"
    assert all(status.startswith("HTTP/1.1 403") for status in seen.values()), seen
    reached = world.reached()
    assert not [key for key in reached if key.startswith("tcp") and INTERNET not in key], reached
    for name, address in (("meta.test", "169.254.169.254"), ("ecs.test", "169.254.170.2"),
                          ("alibaba.test", "100.100.100.200"), ("oracle.test", "192.0.0.192")):
        assert f"blocked a connection to {name}:80: it resolves to {address}, a cloud metadata service" in stderr
    for bare in ("metadata.google.internal", *METADATA_ADDRESSES, MAPPED_METADATA, NAT64_METADATA):
        assert f"blocked a connection to {bare}:80: a cloud metadata service is never reachable" in stderr, stderr
    assert "\x1b" not in stderr                          # what the command chose is shown escaped

    direct = probe_host(world, [["lookup", DNS_SERVER, name] for name in names] + [["tcp", "169.254.169.254", 80]])
    assert [direct[f"lookup {DNS_SERVER} {name}"] for name in names] == ["169.254.169.254", "169.254.170.2", "100.100.100.200",
                                                              "192.0.0.192"]
    assert direct["tcp 169.254.169.254 80"] == "open: metadata 169.254.169.254"


TYPED = textwrap.dedent('''
    import json, os, socket, sys, time
    from sandboxd.network.egress_proxy import EgressProxy
    from sandboxd.network.tcp_relay import RelayLoop, listen_tcp
    from sandboxd.policy.network import NetworkRules
    events, loop = [], RelayLoop("test-metadata")
    listener = listen_tcp("127.0.0.1", 0, step="test proxy")
    netns = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    proxy = EgressProxy(listener, NetworkRules(domains=("*",)), netns_fd=netns, resolvers=[sys.argv[1]],
                        on_event=events.append, loop=loop).start()
    answers = {}
    for target in json.loads(sys.argv[2]):
        with socket.create_connection(listener.getsockname(), timeout=30) as s:
            s.sendall(f"CONNECT {target} HTTP/1.1\\r\\n\\r\\n".encode())
            answers[target] = s.recv(4096).split(b"\\r\\n", 1)[0].decode()
    while len(events) < len(answers) - 1:            # reported off the loop (the control is not refused)
        time.sleep(0.01)
    proxy.close()
    loop.close()
    print(json.dumps({"answers": answers, "events": [[e.kind, e.host, e.port, e.detail] for e in events]}))
''')


def test_each_proxy_refusal_is_a_typed_metadata_event(world: MetadataWorld) -> None:
    """The proxy's report of each refusal (what the daemon audits) is a ProxyEvent of kind
    "metadata", naming the destination and why: a name resolving to a metadata address, a metadata
    name, and a metadata address given bare in any spelling. Control: internet.test is relayed, with
    no event. (The proxy in a process of the stand-in host, the daemon's place.)"""
    from conftest import REPO

    targets = ["meta.test:80", "metadata.google.internal:80", "[::ffff:169.254.169.254]:80", "[fd00:ec2::254]:80",
               "[64:ff9b::a9fe:a9fe]:80", "169.254.169.254:80", "internet.test:80"]
    done = subprocess.run(world.in_host([sys.executable, "-c", TYPED, DNS_SERVER, json.dumps(targets)]),
                          capture_output=True, text=True, timeout=120 * SLOW, cwd=REPO, stdin=subprocess.DEVNULL,
                          env={**BASE_ENV, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, describe(done)
    seen = json.loads(done.stdout)
    assert seen["answers"].pop("internet.test:80").startswith("HTTP/1.1 200")
    assert all(answer.startswith("HTTP/1.1 403") for answer in seen["answers"].values()), seen
    events = {host: (kind, port, detail) for kind, host, port, detail in seen["events"]}
    never = ("metadata", 80, "a cloud metadata service is never reachable")
    assert events == {"meta.test": ("metadata", 80, "it resolves to 169.254.169.254, a cloud metadata service"),
                      **{target.rpartition(":")[0].strip("[]"): never for target in targets[1:-1]}}, seen["events"]


# --------------------------------------------------------------------------- rootless runs


@pytest.fixture(scope="module")
def rootless() -> Iterator[dict[str, Any]]:
    """A plain user, a copy of sandboxd it can read, and its workspace."""
    import shutil
    import tempfile

    from daemon_helpers import plain_users

    with plain_users(1) as (user,):
        base = Path(tempfile.mkdtemp(prefix="sbxmeta-", dir="/var/tmp"))
        try:
            os.chmod(base, 0o755)
            code = readable_copy_of_sandboxd(base)
            ws = make_dir(base / "ws", 0o700)
            os.chown(ws, user.uid, user.gid)
            yield {"user": user, "code": code, "ws": ws}
        finally:
            shutil.rmtree(base, ignore_errors=True)


def run_rootless(world: MetadataWorld, r: dict[str, Any], options: "list[str]", plan: "list[list[Any]]",
                 ) -> "tuple[dict[str, str], str]":
    user = r["user"]
    argv = world.in_host(["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups", "--",
                          PY, "-m", "sandboxd.cli.main", "run", "--workspace", str(r["ws"]), *options, "--",
                          PY, "-c", PROBE, json.dumps(plan)])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300 * SLOW, stdin=subprocess.DEVNULL,
                          env={**BASE_ENV, "HOME": str(r["ws"]), "PYTHONPATH": str(r["code"])}, cwd=str(r["ws"]))
    assert done.returncode == 0, describe(done)
    return dict(json.loads(done.stdout.strip().splitlines()[-1])), done.stderr


def test_a_rootless_run_reaches_no_metadata_address(world: MetadataWorld, rootless: dict[str, Any]) -> None:
    """A plain user's `sandboxd run`: without network only loopback (no route at all, and the
    broker refuses metadata before the kernel looks for one); with
    --network=host the broker refuses every spelling; with --allow-domain '*' the loopback proxy
    (no kernel filter behind it) refuses a name that is a metadata address in inet_aton's hex
    spelling, which the host's resolver turns into 169.254.169.254. Controls: the same user's run
    with danger-full-access reaches them, and the ordinary server is reached through the proxy."""
    plan = [["tcp", "169.254.169.254", 80], ["tcp", "fd00:ec2::254", 80], ["tcp", NAT64_METADATA, 80]]
    world.reached()
    none, _ = run_rootless(world, rootless, [], [*plan, ["tcp", INTERNET, 80]])
    assert none.pop(f"tcp {INTERNET} 80") == "ENETUNREACH"          # only loopback: no route anywhere
    assert none == {key: "EACCES" for key in plan_keys(plan)}, none   # and the broker before the route
    host, _ = run_rootless(world, rootless, ["--network=host"], [*plan, ["tcp", INTERNET, 80]])
    assert host.pop(f"tcp {INTERNET} 80") == f"open: metadata {INTERNET}"
    assert host == {key: "EACCES" for key in plan_keys(plan)}, host
    # inet_aton's hex spellings, which getaddrinfo (the loopback proxy's resolver) turns into
    # 169.254.169.254 and, for the control, INTERNET (198.51.100.10): no DNS server is asked.
    proxied, stderr = run_rootless(world, rootless, ["--network", "--allow-domain", "*"],
                                   [["proxy", "CONNECT 0xa9fea9fe:80 HTTP/1.1"], ["proxy", "CONNECT 0xc633640a:80 HTTP/1.1"]])
    assert proxied["proxy CONNECT 0xa9fea9fe:80 HTTP/1.1"].startswith("HTTP/1.1 403"), proxied
    assert proxied["proxy CONNECT 0xc633640a:80 HTTP/1.1"].startswith("HTTP/1.1 200"), proxied
    assert "blocked a connection to 0xa9fea9fe:80: it resolves to 169.254.169.254, a cloud metadata service" in stderr
    assert world.reached() == {f"tcp {INTERNET}": 2}          # the two controls: the host run, the tunnel

    control, _ = run_rootless(world, rootless, ["--sandbox", "danger-full-access"], plan)
    assert control == {f"tcp {a} 80": opened(a) for a in ("169.254.169.254", "fd00:ec2::254", NAT64_METADATA)}


def plan_keys(plan: "list[list[Any]]") -> "list[str]":
    return [" ".join(map(str, step)) for step in plan]


# --------------------------------------------------------------------------- the daemon


def test_daemon_sessions_reach_no_metadata_and_say_why(world: MetadataWorld) -> None:
    """The daemon in the stand-in host: a session with the host's network gets EACCES for every
    spelling, a session with allowed domains gets a 403 for a name resolving to 169.254.169.254 and
    a PermissionDenied event saying what and why; a danger-full-access session reaches the
    metadata service (the control), and so does internet.test through the proxy."""
    from daemon_helpers import Daemon, create_session, make_base_dir, remove_tree, run_exec
    from sandboxd.v1 import sandboxd_pb2 as pb

    base = make_base_dir("sbxd-metadata-")
    workspace = make_dir(base / "ws-1")
    d = Daemon(base, args=["--dns", DNS_SERVER], wrapper=["nsenter", f"--net=/run/netns/{world.host}", "--"])
    plan = [["tcp", a, 80] for a in EVERY_SPELLING]
    try:
        d.start()
        world.reached()
        host = create_session(d.stub, workspace, pb.SandboxPolicy(
            mode=pb.SandboxPolicy.WORKSPACE_WRITE, network_access=True, network_mode="host"))
        seen = json.loads(run_exec(d.stub, host.id, [PY, "-c", PROBE, json.dumps(plan)]).stdout.decode())
        assert seen == {key: "EACCES" for key in plan_keys(plan)}, seen
        proxied = create_session(d.stub, workspace, pb.SandboxPolicy(
            mode=pb.SandboxPolicy.WORKSPACE_WRITE, network_access=True, allowed_domains=["*"]))
        asked = [["proxy", "CONNECT meta.test:80 HTTP/1.1"], ["proxy", "CONNECT internet.test:80 HTTP/1.1"]]
        seen = json.loads(run_exec(d.stub, proxied.id, [PY, "-c", PROBE, json.dumps(asked)]).stdout.decode())
        assert seen["proxy CONNECT meta.test:80 HTTP/1.1"].startswith("HTTP/1.1 403"), seen
        assert seen["proxy CONNECT internet.test:80 HTTP/1.1"].startswith("HTTP/1.1 200"), seen
        denials = [json.loads(e.data_json) for e in d.stub.QueryEvents(pb.QueryEventsRequest(
            session_id=proxied.id, types=["PermissionDenied"])).events]
        assert [(x["destination"], x["detail"]) for x in denials] == [
            ("meta.test:80", "it resolves to 169.254.169.254, a cloud metadata service")], denials
        connections = {key: count for key, count in world.reached().items() if not key.startswith("dns")}
        assert connections == {f"tcp {INTERNET}": 1}                 # the proxy's control only
        full = create_session(d.stub, workspace, pb.SandboxPolicy(mode=pb.SandboxPolicy.DANGER_FULL_ACCESS))
        control = json.loads(run_exec(d.stub, full.id, [PY, "-c", PROBE, json.dumps(plan)]).stdout.decode())
        assert control == {f"tcp {a} 80": opened(a) for a in EVERY_SPELLING}, control
    finally:
        d.close()
        remove_tree(base)
