"""Isolated networks, against a small world built here from network namespaces and veths:

- a "gateway" namespace stands in for the internet: an HTTP server on 198.51.100.10, a DNS
  server on 198.51.100.53 (internet.test, private.test), and a fake cloud metadata service on
  169.254.169.254; the host routes 198.51.100.0/24 and the metadata address to it;
- a "private" namespace is a service on a private range (10.77.0.10);
- the host itself listens on 127.0.0.1 and on all its addresses, and has one more address of its
  own, HOST_ONLY (198.51.100.200, on the host's side of the world's link), which the world's DNS gives for
  host.test: a name that resolves to the host (uplink.test resolves to the host's side of the
  world's link, 203.0.113.1).

Nothing is sent anywhere but loopback and these namespaces. Every probe runs a real program
(/usr/bin/python3) inside a real sandbox, and each blocked destination has a control that
reaches it: from the host, or with --network=host.
"""

from __future__ import annotations

import errno
import json
import os
import random
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import PY, SANDBOXD, SLOW
from daemon_helpers import descendants, free_pool, sandbox_links
from sandboxd.kernel import netns as kernel_netns
from sandboxd.policy import LaunchSpec, WorkspaceWrite
from sandboxd.supervisor.fork_client import ForkServer

pytestmark = pytest.mark.timeout(300)

INTERNET, OTHER, DNS, METADATA, PRIVATE = ("198.51.100.10", "198.51.100.11", "198.51.100.53", "169.254.169.254",
                                           "10.77.0.10")
HOST_ONLY, UPLINK = "198.51.100.200", "203.0.113.1"          # addresses of the host itself

SERVERS = textwrap.dedent('''
    import http.server, socket, socketserver, struct, sys, threading
    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"hello from " + self.server.name)
        def log_message(self, *a): pass
    def http_on(address, port, name):
        server = socketserver.ThreadingTCPServer((address, port), Hello)
        server.name = name.encode()
        threading.Thread(target=server.serve_forever, daemon=True).start()
    def dns_on(address, names):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); sock.bind((address, 53))
        while True:
            query, peer = sock.recvfrom(512)
            labels, i = [], 12
            while query[i]:
                labels.append(query[i + 1:i + 1 + query[i]].decode()); i += 1 + query[i]
            name, question = ".".join(labels), query[12:i + 5]
            ip = names.get(name)
            flags, answers = (0x8180, 1) if ip else (0x8183, 0)
            reply = query[:2] + struct.pack(">HHHHH", flags, 1, answers, 0, 0) + question
            if ip:
                reply += b"\\xc0\\x0c" + struct.pack(">HHIH", 1, 1, 60, 4) + socket.inet_aton(ip)
            sock.sendto(reply, peer)
    role = sys.argv[1]
    if role == "gateway":
        http_on("198.51.100.10", 8080, "internet")
        http_on("198.51.100.11", 8080, "other")
        http_on("169.254.169.254", 80, "metadata")
        print("ready", flush=True)
        dns_on("198.51.100.53", {"internet.test": "198.51.100.10", "private.test": "10.77.0.10",
                                 "other.test": "198.51.100.11", "api.internet.test": "198.51.100.10",
                                 "host.test": "198.51.100.200", "uplink.test": "203.0.113.1",
                                 "xn--bcher-kva.test": "198.51.100.10"})
    else:
        http_on("10.77.0.10", 8080, "private")
        print("ready", flush=True)
        threading.Event().wait()
''')

PROBE = textwrap.dedent('''
    import json, socket, sys
    def gateway():
        for line in open("/proc/net/route").read().splitlines()[1:]:
            fields = line.split()
            if fields[1] == "00000000":
                return socket.inet_ntoa(bytes.fromhex(fields[2])[::-1])
    result = {}
    for target in sys.argv[1:]:
        host, port = target.rsplit(":", 1)
        try:
            address = gateway() if host == "GATEWAY" else socket.gethostbyname(host)
            with socket.create_connection((address, int(port)), timeout=1.5) as s:
                s.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
                reply = b""
                try:
                    while chunk := s.recv(4096):
                        reply += chunk
                except OSError:
                    pass                  # connected, but it says nothing (the host's bare listeners)
                result[target] = "open: " + reply.split(b"\\r\\n\\r\\n", 1)[-1].decode()
        except OSError as e:
            result[target] = type(e).__name__
    print(json.dumps(result))
''')


def sh(*commands: str) -> None:
    for command in commands:
        subprocess.run(command, shell=True, check=True, capture_output=True, text=True, timeout=30)


# The world's routes and addresses are the host's (198.51.100.0/24, the metadata address, 203.0.113.1):
# one world at a time on a machine, whichever checkout's test run builds it. A second one waits.
WORLD_LOCK = "/run/lock/sandboxd-test-world.lock"
WORLD_WAIT = 240.0 * SLOW


def clear_dead_worlds() -> None:
    """What a world killed before its teardown left: its namespaces (no process left in them: a live
    world's servers run there, and a run without the lock may have one up), the host links that went
    into them, and the routes when no world lives."""
    def ip(*args: str) -> str:
        return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30).stdout

    namespaces = [line.split()[0] for line in ip("netns", "list").splitlines() if line.startswith(("tgw", "tpv"))]
    dead = [name for name in namespaces if not ip("netns", "pids", name).strip()]
    for name in dead:
        ip("netns", "del", name)
    live = set(namespaces) - set(dead)
    for word in ip("-o", "link", "show").split():
        link = word.split("@")[0].rstrip(":")
        if link.startswith(("tgw", "tpv")) and link[:-1] not in live:
            ip("link", "del", link)
    if not live:
        for route in ("198.51.100.0/24", f"{METADATA}/32"):
            ip("route", "del", route)


class World:
    def __init__(self) -> None:
        tag = os.urandom(2).hex()
        self.gw, self.pv = f"tgw{tag}", f"tpv{tag}"
        self.processes: list[subprocess.Popen[str]] = []
        self.host_listeners: list[socket.socket] = []
        self.lock = -1

    def take_the_host(self) -> None:
        """The machine-wide lock on the world's host routes and addresses, waiting up to WORLD_WAIT
        for another test run's world (it names its holder); released at teardown or with the process."""
        import fcntl

        os.makedirs(os.path.dirname(WORLD_LOCK), exist_ok=True)
        # self.lock is set only once the lock is held: teardown deletes the host's routes when it is
        # set, and a run that gave up waiting must not delete the routes of the world that holds it.
        lock = os.open(WORLD_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + WORLD_WAIT
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = os.pread(lock, 4096, 0).decode(errors="replace")
                    os.close(lock)
                    raise AssertionError(f"another test run's world still holds the host's routes after "
                                         f"{WORLD_WAIT:.0f} s: {holder}") from None
                time.sleep(0.5)
        self.lock = lock
        os.ftruncate(self.lock, 0)
        os.pwrite(self.lock, f"pid {os.getpid()}: {' '.join(sys.argv)[:300]}\n".encode(), 0)
        clear_dead_worlds()

    def build(self) -> "World":
        self.take_the_host()
        gw, pv = self.gw, self.pv
        sh(f"ip netns add {gw}", f"ip netns add {pv}",
           f"ip link add {gw}h type veth peer name {gw}i", f"ip link set {gw}i netns {gw}",
           f"ip addr add 203.0.113.1/30 dev {gw}h", f"ip link set {gw}h up",
           f"ip -n {gw} addr add 203.0.113.2/30 dev {gw}i", f"ip -n {gw} link set {gw}i up",
           f"ip -n {gw} link set lo up", f"ip -n {gw} addr add {INTERNET}/32 dev lo",
           f"ip -n {gw} addr add {DNS}/32 dev lo", f"ip -n {gw} addr add {METADATA}/32 dev lo",
           f"ip -n {gw} addr add {OTHER}/32 dev lo",
           f"ip -n {gw} route add default via 203.0.113.1",
           "ip route add 198.51.100.0/24 via 203.0.113.2", f"ip route add {METADATA}/32 via 203.0.113.2",
           # The world's uplink forwards, as a real uplink would be set up by its admin.
           f"echo 1 > /proc/sys/net/ipv4/conf/{gw}h/forwarding",
           f"ip link add {pv}h type veth peer name {pv}i", f"ip link set {pv}i netns {pv}",
           f"ip addr add 10.77.0.1/24 dev {pv}h", f"ip link set {pv}h up",
           f"ip -n {pv} addr add {PRIVATE}/24 dev {pv}i", f"ip -n {pv} link set {pv}i up",
           f"ip -n {pv} link set lo up", f"ip -n {pv} route add default via 10.77.0.1",
           f"echo 1 > /proc/sys/net/ipv4/conf/{pv}h/forwarding",
           # One more address of the host's own (its local route wins over the world's /24).
           f"ip addr add {HOST_ONLY}/32 dev {gw}h")
        for ns, role in ((gw, "gateway"), (pv, "private")):
            proc = subprocess.Popen(["ip", "netns", "exec", ns, PY, "-c", SERVERS, role], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            self.processes.append(proc)
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        for address in ("127.0.0.1", "0.0.0.0"):
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((address, 0))
            listener.listen(16)
            self.host_listeners.append(listener)
        return self

    @property
    def loopback_port(self) -> int:
        return self.host_listeners[0].getsockname()[1]

    @property
    def any_port(self) -> int:
        return self.host_listeners[1].getsockname()[1]

    def teardown(self) -> None:
        for proc in self.processes:
            proc.kill()
            proc.wait()
        for listener in self.host_listeners:
            listener.close()
        if self.lock < 0:                                   # never took the host: nothing of ours there
            return
        for command in ("ip route del 198.51.100.0/24", f"ip route del {METADATA}/32", f"ip link del {self.gw}h",
                        f"ip link del {self.pv}h", f"ip netns del {self.gw}", f"ip netns del {self.pv}"):
            subprocess.run(command, shell=True, capture_output=True, timeout=30)
        os.close(self.lock)
        self.lock = -1


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    w = World()
    try:
        yield w.build()
    finally:
        w.teardown()


def targets(world: World) -> list[str]:
    return ["internet.test:8080", f"{INTERNET}:8080", f"{OTHER}:8080", f"{METADATA}:80", f"{PRIVATE}:8080",
            "private.test:8080",
            f"127.0.0.1:{world.loopback_port}", f"GATEWAY:{world.any_port}", f"192.0.2.2:{world.any_port}"]


def probe_in_sandbox(world: World, workspace: Path, *network: str) -> dict[str, str]:
    """What PROBE saw from a `sandboxd run` with ``network`` options; the run left no link behind."""
    run = subprocess.Popen([SANDBOXD, "run", "--workspace", str(workspace), *network, "--", PY, "-c", PROBE,
                            *targets(world)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = run.communicate(timeout=120)
    assert run.returncode == 0, stderr
    assert sandbox_links(run.pid) == set()                    # its link (named after it) went with it
    return json.loads(stdout.strip().splitlines()[-1])


def probe_on_host(world: World) -> dict[str, str]:
    result = subprocess.run([PY, "-c", PROBE, *[t for t in targets(world) if "test" not in t and "GATEWAY" not in t]],
                            capture_output=True, text=True, timeout=120)
    return json.loads(result.stdout)


def test_the_world_is_reachable_from_the_host(world: World) -> None:
    """The control: every destination the sandbox must not reach is there, from the host."""
    seen = probe_on_host(world)
    assert seen[f"{INTERNET}:8080"] == "open: hello from internet"
    assert seen[f"{METADATA}:80"] == "open: hello from metadata"
    assert seen[f"{PRIVATE}:8080"] == "open: hello from private"
    assert seen[f"127.0.0.1:{world.loopback_port}"].startswith("open")


def test_without_network_nothing_is_reachable(world: World, workspace: Path) -> None:
    seen = probe_in_sandbox(world, workspace)
    assert not [t for t, outcome in seen.items() if outcome.startswith("open")], seen


def test_isolated_network_reaches_the_internet_but_not_the_host(world: World, workspace: Path) -> None:
    seen = probe_in_sandbox(world, workspace, "--network", "--dns", DNS)
    assert seen["internet.test:8080"] == "open: hello from internet", seen      # DNS through the resolver
    assert seen[f"{INTERNET}:8080"] == "open: hello from internet", seen
    # The metadata service: refused by init's connect broker before the host's table (tests/test_metadata.py).
    assert seen[f"{METADATA}:80"] == "PermissionError", seen
    for blocked in (f"{PRIVATE}:8080", "private.test:8080", f"GATEWAY:{world.any_port}", f"192.0.2.2:{world.any_port}"):
        assert seen[blocked] in ("TimeoutError", "ConnectionRefusedError", "OSError"), (blocked, seen)
    # 127.0.0.1 inside is the sandbox's own loopback: the host's listener is not there.
    assert seen[f"127.0.0.1:{world.loopback_port}"] == "ConnectionRefusedError", seen


def test_host_network_mode_is_the_host_as_it_is(world: World, workspace: Path) -> None:
    seen = probe_in_sandbox(world, workspace, "--network=host")
    assert seen[f"{PRIVATE}:8080"] == "open: hello from private", seen
    assert seen[f"127.0.0.1:{world.loopback_port}"].startswith("open"), seen


def test_a_session_with_network_gets_its_own_namespace(world: World, workspace: Path) -> None:
    fs = ForkServer.start()
    try:
        assert sandbox_links(fs.pid) == set()
        fs.open_session("net", LaunchSpec(argv=("true",), workspace=str(workspace), dns=(DNS,),
                                          policy=WorkspaceWrite(network_access=True)))
        assert len(sandbox_links(fs.pid)) == 1
        read_end, write_end = os.pipe()
        null = os.open("/dev/null", os.O_RDONLY)
        call_id, _ = fs.call("net", [PY, "-c", PROBE, *targets(world)], {"PATH": "/usr/bin:/bin"}, str(workspace),
                             60, (null, write_end, write_end))
        os.close(write_end)
        output = b""
        while chunk := os.read(read_end, 65536):
            output += chunk
        os.close(read_end)
        os.close(null)
        assert fs.wait(call_id).exit_code == 0, output
        seen = json.loads(output.decode().strip().splitlines()[-1])
        assert seen["internet.test:8080"] == "open: hello from internet"
        assert seen[f"{PRIVATE}:8080"] != "open: hello from private" and seen[f"{METADATA}:80"] == "PermissionError"
        fs.close_session("net")
        assert sandbox_links(fs.pid) == set()
    finally:
        fs.close()


def net_namespaces_held(pid: int) -> set[str]:
    """The network namespaces that ``pid`` and its descendants hold: by a descriptor or by being in one."""
    held = set()
    for proc in (pid, *descendants(pid)):
        try:
            held.add(os.readlink(f"/proc/{proc}/ns/net"))
            for fd in os.listdir(f"/proc/{proc}/fd"):
                target = os.readlink(f"/proc/{proc}/fd/{fd}")
                if target.startswith("net:["):
                    held.add(target)
        except FileNotFoundError:                       # it ended meanwhile
            continue
    return held


def test_five_hundred_sessions_leave_nothing_behind(workspace: Path) -> None:
    """500 isolated sessions opened and closed one after the other, from a pool of one block: each
    close gives its block back (the next open gets it), removes its link and lets go of its namespace."""
    pool = free_pool()
    fs = ForkServer.start()
    try:
        held_before = net_namespaces_held(fs.pid)
        started = time.monotonic()
        addresses = set()
        for n in range(500):
            fs.open_session(f"s{n}", LaunchSpec(argv=("true",), workspace=str(workspace), network_pool=pool,
                                                policy=WorkspaceWrite(network_access=True)))
            (link,) = sandbox_links(fs.pid)
            addresses.add(subprocess.run(["ip", "-br", "-4", "addr", "show", link], capture_output=True,
                                         text=True).stdout.split()[2])
            fs.close_session(f"s{n}")
        elapsed = time.monotonic() - started
        assert sandbox_links(fs.pid) == set()
        first = pool.split("/")[0].rsplit(".", 1)
        assert addresses == {f"{first[0]}.{int(first[1]) + 1}/30"}, addresses   # the pool's one block, each time
        assert net_namespaces_held(fs.pid) == held_before                        # no namespace kept alive
        print(f"500 sessions with isolated network created and closed in {elapsed:.1f} s")
    finally:
        fs.close()


def test_bad_network_options_are_refused(workspace: Path) -> None:
    for args, message in ((["--network=sideways"], "use --network (isolated) or --network=host"),
                          (["--dns", "1.2.3.4"], "--dns only applies to the isolated network"),
                          (["--network", "--dns", "not-an-ip"], "must be an IPv4 address"),
                          (["--allow-host", "1.2.3.4"], "--allow-host only applies to the isolated network"),
                          (["--network", "--allow-host", "1.2.3/8"], "give an IPv4 address or CIDR"),
                          (["--network", "--allow-host", "1.2.3.4:99999"], "bad port range"),
                          (["--allow-unix-socket", "relative.sock"], "must be an absolute path"),
                          (["--sandbox", "read-only", "--allow-unix-socket", "/x.sock"], "options of workspace-write"),
                          (["--network=host", "--publish", "8000"], "published ports need a network of the sandbox's own"),
                          (["--publish", "eighty"], "give [HOSTPORT:]PORT"),
                          (["--publish", "70000:80"], "ports go from 1 to 65535"),
                          (["--allow-domain", "pypi.org"], "--allow-domain only applies to the isolated network"),
                          (["--network", "--allow-domain", "py*pi.org"], "give a name like pypi.org")):
        result = subprocess.run([SANDBOXD, "run", *args, "--", "true"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 125 and message in result.stderr, (args, result.stderr)


BLOCKED = ("TimeoutError", "ConnectionRefusedError", "OSError", "PermissionError")


def test_an_allowlist_admits_exactly_what_it_lists(world: World, workspace: Path) -> None:
    everything = probe_in_sandbox(world, workspace, "--network", "--dns", DNS)
    assert everything[f"{OTHER}:8080"] == "open: hello from other"              # the control
    only = probe_in_sandbox(world, workspace, "--network", "--dns", DNS, "--allow-host", f"{INTERNET}:8080")
    assert only["internet.test:8080"] == "open: hello from internet", only      # DNS still resolves
    assert only[f"{OTHER}:8080"] in BLOCKED, only
    by_range = probe_in_sandbox(world, workspace, "--network", "--dns", DNS, "--allow-host", "198.51.100.0/24:80-90")
    assert by_range[f"{INTERNET}:8080"] in BLOCKED and by_range[f"{OTHER}:8080"] in BLOCKED, by_range
    by_cidr = probe_in_sandbox(world, workspace, "--network", "--dns", DNS, "--allow-host", "198.51.100.0/30",
                               "--allow-host", f"{OTHER}:8000-8100")
    assert by_cidr[f"{INTERNET}:8080"] in BLOCKED, by_cidr                     # .10 is outside the /30
    assert by_cidr[f"{OTHER}:8080"] == "open: hello from other", by_cidr
    # The host's filter still rules under an allowlist: a private range stays out of reach.
    private = probe_in_sandbox(world, workspace, "--network", "--allow-host", f"{PRIVATE}:8080")
    assert private[f"{PRIVATE}:8080"] in BLOCKED, private


UNIX_PROBE = textwrap.dedent('''
    import socket, sys
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(sys.argv[1]); print("connected", s.recv(64).decode())
    except OSError as e:
        print("refused", e.errno)
''')


def test_host_unix_sockets_only_by_name(workspace: Path, base_dir: Path) -> None:
    path = base_dir / "agent.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(8)
    os.chmod(path, 0o777)
    stop = False

    def answer() -> None:
        while not stop:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.sendall(b"agent")
            conn.close()
    import threading
    threading.Thread(target=answer, daemon=True).start()

    def connect(*options: str) -> str:
        result = subprocess.run([SANDBOXD, "run", "--workspace", str(workspace), *options, "--", PY, "-c", UNIX_PROBE,
                                 str(path)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()
    try:
        assert connect("--sandbox", "danger-full-access") == "connected agent"  # the control
        assert connect("--network") == "refused 13"                          # isolated: EACCES, like no network
        assert connect() == "refused 13"
        assert connect("--network=host") == "refused 13"                     # the host's network: the same
        assert connect("--network=host", "--allow-unix-socket", str(path)) == "connected agent"
        assert connect("--network", "--allow-unix-socket", str(path)) == "connected agent"
        assert connect("--allow-unix-socket", str(path)) == "connected agent"
        other = socket.socket(socket.AF_UNIX)              # allowing another socket (it must exist) grants
        other.bind(str(base_dir / "other.sock"))           # nothing on this one
        try:
            assert connect("--allow-unix-socket", str(base_dir / "other.sock")) == "refused 13"
        finally:
            other.close()
    finally:
        stop = True
        server.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(port: int, within: float = 20.0) -> str:
    deadline = time.monotonic() + within
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(b"GET / HTTP/1.0\r\n\r\n")
                reply = b""
                while chunk := s.recv(65536):
                    reply += chunk
                if reply:
                    return reply.split(b"\r\n", 1)[0].decode()
        except OSError:
            pass
        if time.monotonic() > deadline:
            return "unreachable"
        time.sleep(0.1)


@pytest.mark.parametrize("network", [["--network"], []], ids=["isolated", "no-network"])
def test_a_published_port_reaches_a_server_on_the_sandbox_loopback(workspace: Path, network: list[str]) -> None:
    port = free_port()
    (workspace / "index.html").write_text("published")
    server = subprocess.Popen([SANDBOXD, "run", "--workspace", str(workspace), *network, "--publish", f"{port}:8000",
                               "--", PY, "-m", "http.server", "8000", "--bind", "127.0.0.1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert http_get(port) == "HTTP/1.0 200 OK"
        unpublished = subprocess.run([PY, "-c", PROBE, "127.0.0.1:8000"], capture_output=True, text=True)
        assert not json.loads(unpublished.stdout)["127.0.0.1:8000"].startswith("open")   # only what is published
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert http_get(port, within=1) == "unreachable"


def test_publishing_a_taken_port_fails_before_anything_runs(workspace: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        result = subprocess.run([SANDBOXD, "run", "--workspace", str(workspace), "--network", "--publish",
                                 f"{taken.getsockname()[1]}:80", "--", "sleep", "30"], capture_output=True, text=True,
                                timeout=60)
    assert result.returncode == 125 and "the host port is taken" in result.stderr, result.stderr


def test_a_session_publishes_its_ports(workspace: Path) -> None:
    from daemon_helpers import create_session, running_daemon
    from sandboxd.v1 import sandboxd_pb2 as pb

    port = free_port()
    (workspace / "index.html").write_text("session")
    with running_daemon("sbxd-publish-") as d:
        session = create_session(d.stub, workspace, pb.SandboxPolicy(
            mode=pb.SandboxPolicy.WORKSPACE_WRITE, network_access=True, published_ports=[f"{port}:8000"]))
        assert list(session.sandbox_policy.published_ports) == [f"{port}:8000"]
        d.stub.StartBackground(pb.StartBackgroundRequest(session_id=session.id, argv=[
            PY, "-m", "http.server", "8000", "--bind", "127.0.0.1"], cwd=str(workspace)))
        assert http_get(port) == "HTTP/1.0 200 OK"
        d.stub.CloseSession(pb.CloseSessionRequest(session_id=session.id))
        assert http_get(port, within=1) == "unreachable"
        assert d.own_links() == set()


PROXY_PROBE = textwrap.dedent('''
    import json, os, socket, struct, sys, urllib.request
    proxy = os.environ["HTTP_PROXY"].rsplit("/", 1)[-1].split(":")
    proxy = (proxy[0], int(proxy[1]))
    result = {}
    def http(url):
        try:
            return "open: " + urllib.request.urlopen(url, timeout=10).read().decode()
        except urllib.error.HTTPError as e:
            return f"http {e.code}"
        except OSError as e:
            return type(e).__name__
    result["http internet"] = http("http://internet.test:8080/")
    result["http subdomain"] = http("http://api.internet.test:8080/")
    result["http other"] = http("http://other.test:8080/")
    result["http private"] = http("http://private.test:8080/")
    def connect_tunnel(name):
        with socket.create_connection(proxy, timeout=10) as s:
            s.sendall(f"CONNECT {name}:8080 HTTP/1.1\\r\\nHost: {name}\\r\\n\\r\\n".encode())
            status = s.recv(4096).split(b"\\r\\n", 1)[0].decode()
            if " 200 " not in status:
                return status
            s.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
            reply = b""
            while chunk := s.recv(4096):
                reply += chunk
            return "open: " + reply.split(b"\\r\\n\\r\\n", 1)[-1].decode()
    result["connect internet"] = connect_tunnel("internet.test")
    result["connect other"] = connect_tunnel("other.test")
    def socks(name):
        with socket.create_connection(proxy, timeout=10) as s:
            s.sendall(b"\\x05\\x01\\x00"); s.recv(2)
            s.sendall(b"\\x05\\x01\\x00\\x03" + bytes([len(name)]) + name.encode() + struct.pack(">H", 8080))
            reply = s.recv(10)
            if reply[1] != 0:
                return f"socks refused {reply[1]}"
            s.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            return "open: " + data.split(b"\\r\\n\\r\\n", 1)[-1].decode()
    result["socks internet"] = socks("internet.test")
    result["socks other"] = socks("other.test")
    for direct in ("198.51.100.10", "198.51.100.11"):
        try:
            socket.create_connection((direct, 8080), timeout=3).close()
            result["direct " + direct] = "open"
        except OSError as e:
            result["direct " + direct] = type(e).__name__
    print(json.dumps(result))
''')


def test_allowed_domains_go_through_the_proxy_and_nothing_else(world: World, workspace: Path) -> None:
    result = subprocess.run([SANDBOXD, "run", "--workspace", str(workspace), "--network", "--dns", DNS,
                             "--allow-domain", "internet.test", "--allow-domain", "*.internet.test",
                             "--allow-domain", "private.test", "--", PY, "-c", PROXY_PROBE],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["http internet"] == "open: hello from internet", seen
    assert seen["http subdomain"] == "open: hello from internet", seen
    assert seen["connect internet"] == "open: hello from internet", seen
    assert seen["socks internet"] == "open: hello from internet", seen
    for refused in ("http other", "connect other"):
        assert "403" in seen[refused], seen
    assert seen["socks other"] == "socks refused 2", seen
    assert seen["http private"] == "http 403", seen                 # allowed by name, but a private address
    # A program that ignores the proxy variables gets nothing, not even the allowed host.
    assert seen["direct 198.51.100.10"] in BLOCKED and seen["direct 198.51.100.11"] in BLOCKED, seen
    assert "blocked a connection to other.test:8080: not in the allowed domains" in result.stderr
    assert "private.test:8080: it resolves to 10.77.0.10, in 10.0.0.0/8, a blocked range" in result.stderr


A_LABEL_PROBE = textwrap.dedent('''
    import json, os, socket, struct, sys, urllib.request
    proxy = os.environ["HTTP_PROXY"].rsplit("/", 1)[-1].split(":")
    proxy = (proxy[0], int(proxy[1]))
    def body(s):
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
        return "open: " + reply.split(b"\\r\\n\\r\\n", 1)[-1].decode()
    def connect(name):                                # name: the bytes a client sends
        with socket.create_connection(proxy, timeout=10) as s:
            s.sendall(b"CONNECT " + name + b":8080 HTTP/1.1\\r\\n\\r\\n")
            status = s.recv(4096).split(b"\\r\\n", 1)[0].decode()
            if " 200 " not in status:
                return status
            s.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
            return body(s)
    def socks(name):
        with socket.create_connection(proxy, timeout=10) as s:
            s.sendall(b"\\x05\\x01\\x00"); s.recv(2)
            s.sendall(b"\\x05\\x01\\x00\\x03" + bytes([len(name)]) + name + struct.pack(">H", 8080))
            reply = s.recv(10)
            if reply[1] != 0:
                return f"socks refused {reply[1]}"
            s.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
            return body(s)
    def http(url):
        try:
            return "open: " + urllib.request.urlopen(url, timeout=10).read().decode()
        except urllib.error.HTTPError as e:
            return f"http {e.code}"
    a_label, unicode_name = b"xn--bcher-kva.test", "bücher.test".encode()
    print(json.dumps({"http a-label": http("http://xn--bcher-kva.test:8080/"),
                      "connect a-label": connect(a_label), "socks a-label": socks(a_label),
                      "connect unicode": connect(unicode_name), "socks unicode": socks(unicode_name)}))
''')


def test_an_a_label_goes_through_every_proxy_protocol_and_its_unicode_name_does_not(world: World,
                                                                                    workspace: Path) -> None:
    """An allowed domain given as its A-label is reached by plain HTTP, CONNECT and SOCKS5 alike (the
    proxy matches the name as sent: SOCKS5 names were once decoded from IDNA into Unicode, which no
    allowed domain matches), and the same name sent in Unicode is refused on both."""
    result = subprocess.run([SANDBOXD, "run", "--workspace", str(workspace), "--network", "--dns", DNS,
                             "--allow-domain", "xn--bcher-kva.test", "--", PY, "-c", A_LABEL_PROBE],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen == {"http a-label": "open: hello from internet", "connect a-label": "open: hello from internet",
                    "socks a-label": "open: hello from internet", "connect unicode": "HTTP/1.1 403 Forbidden",
                    "socks unicode": "socks refused 2"}, (seen, result.stderr)


def test_a_session_reports_refused_domains_as_events(world: World, workspace: Path) -> None:
    from daemon_helpers import Daemon, create_session, make_base_dir, remove_tree, run_exec
    from sandboxd.v1 import sandboxd_pb2 as pb

    base = make_base_dir("sbxd-domains-")
    d = Daemon(base, args=["--dns", DNS])
    try:
        d.start()
        session = create_session(d.stub, workspace, pb.SandboxPolicy(
            mode=pb.SandboxPolicy.WORKSPACE_WRITE, network_access=True, allowed_domains=["internet.test"]))
        outcome = run_exec(d.stub, session.id, [PY, "-c", PROXY_PROBE])
        seen = json.loads(outcome.stdout.decode().strip().splitlines()[-1])
        assert seen["http internet"] == "open: hello from internet" and "403" in seen["http other"], seen
        denials = [json.loads(e.data_json) for e in d.stub.QueryEvents(pb.QueryEventsRequest(
            session_id=session.id, types=["PermissionDenied"])).events]
        assert {x["destination"] for x in denials} >= {"other.test:8080"}, denials
        assert all(x["reason"] == "network_request" for x in denials), denials
    finally:
        d.close()
        remove_tree(base)


def test_only_sandboxes_with_allowed_domains_reach_the_proxy_port(world: World, workspace: Path) -> None:
    """A host service on the proxy port (a squid on 0.0.0.0:3128, say) is as out of reach as any
    other for a sandbox that has no domain allowlist."""
    from sandboxd.defaults import PROXY_PORT

    squid = socket.socket()
    squid.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squid.bind(("0.0.0.0", PROXY_PORT))
    squid.listen(8)
    try:
        seen = probe_in_sandbox(world, workspace, "--network", "--dns", DNS)
        assert seen["internet.test:8080"].startswith("open")                  # the sandbox works
        plain = subprocess.run([SANDBOXD, "run", "--workspace", str(workspace), "--network", "--", PY, "-c", PROBE,
                                f"GATEWAY:{PROXY_PORT}"], capture_output=True, text=True, timeout=60)
        assert json.loads(plain.stdout)[f"GATEWAY:{PROXY_PORT}"] in BLOCKED, plain.stdout
    finally:
        squid.close()


def test_stale_proxy_access_is_swept() -> None:
    from sandboxd.kernel import nftables

    nftables.ensure_table([])
    nftables.allow_proxy("10.233.255.254", True)                   # no link has 10.233.255.253
    assert "10.233.255.254" in nftables.proxied_addresses()
    kernel_netns.sweep_stale()
    assert "10.233.255.254" not in nftables.proxied_addresses()


HOST_REACH_PROBE = textwrap.dedent('''
    # Every request is sent first, then every reply read: they wait on the proxy side by side.
    # (One thread: a connect from a second thread of an allowed-domains sandbox gets ENOSYS.)
    import json, os, socket, struct, sys
    proxy = os.environ["HTTP_PROXY"].rsplit("/", 1)[-1].split(":")
    proxy = (proxy[0], int(proxy[1]))
    port = int(sys.argv[1])
    def socks(name, p):
        return b"\\x05\\x01\\x00" + b"\\x05\\x01\\x00\\x03" + bytes([len(name)]) + name.encode() + struct.pack(">H", p)
    requests = {"http host": f"GET http://host.test:{port}/ HTTP/1.0\\r\\n\\r\\n".encode(),
                "connect host": f"CONNECT host.test:{port} HTTP/1.1\\r\\n\\r\\n".encode(),
                "socks host": socks("host.test", port),
                "http uplink": f"GET http://uplink.test:{port}/ HTTP/1.0\\r\\n\\r\\n".encode(),
                "http internet": b"GET http://internet.test:8080/ HTTP/1.0\\r\\n\\r\\n",
                "socks internet": socks("internet.test", 8080)}
    sockets = {}
    for key, request in requests.items():
        sockets[key] = socket.create_connection(proxy, timeout=30)
        sockets[key].sendall(request)
    result = {}
    for key, s in sockets.items():
        reply = b""
        try:
            while chunk := s.recv(4096):
                reply += chunk
                if key.startswith("socks") and len(reply) >= 12:
                    break
        except OSError as e:
            reply = type(e).__name__.encode()
        if key.startswith("socks"):
            result[key] = f"socks reply {reply[3]}" if len(reply) >= 12 else reply.decode()
        elif key == "http internet":
            result[key] = reply.split(b"\\r\\n\\r\\n", 1)[-1].decode()
        else:
            result[key] = reply.split(b"\\r\\n", 1)[0].decode()
        s.close()
    # The proxy's way out is its socket mark: the sandbox cannot set it (CAP_NET_ADMIN).
    marked = socket.socket()
    try:
        marked.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, int(sys.argv[2]))
        marked.settimeout(3)
        marked.connect(("198.51.100.10", 8080))
        result["mark"] = "connected"
    except OSError as e:
        result["mark"] = type(e).__name__
    print(json.dumps(result))
''')


def test_the_proxy_cannot_reach_the_host_through_an_allowed_name(world: World, workspace: Path) -> None:
    """host.test is allowed and resolves to an address of the host: the proxy connects from the
    sandbox's namespace, so the host's kernel filter refuses it as it refuses the sandbox, through
    plain HTTP, CONNECT and SOCKS5 alike, and the host-only service sees no connection."""
    from sandboxd.kernel.nftables import PROXY_MARK

    service = socket.socket()
    service.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    service.bind(("0.0.0.0", 0))
    service.listen(16)
    port = service.getsockname()[1]
    try:
        with socket.create_connection((HOST_ONLY, port), timeout=5):   # the control: it is there, for the host
            pass
        service.accept()[0].close()
        result = subprocess.run([SANDBOXD, "run", "--workspace", str(workspace), "--network", "--dns", DNS,
                                 "--allow-domain", "host.test", "--allow-domain", "uplink.test",
                                 "--allow-domain", "internet.test", "--", PY, "-c", HOST_REACH_PROBE, str(port),
                                 str(PROXY_MARK)],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        seen = json.loads(result.stdout.strip().splitlines()[-1])
        assert seen["http internet"] == "hello from internet", seen                 # the control, in the sandbox
        assert seen["socks internet"] == "socks reply 0", seen
        assert seen["http host"] == "HTTP/1.1 502 Bad Gateway", seen                # the kernel said no
        assert seen["connect host"] == "HTTP/1.1 502 Bad Gateway", seen
        assert seen["socks host"] == "socks reply 5", seen
        assert seen["http uplink"] == "HTTP/1.1 403 Forbidden", seen                # refused early, with a reason
        assert f"uplink.test:{port}: it resolves to {UPLINK}, in 203.0.113.0/24, a blocked range" in result.stderr
        assert seen["mark"] == "PermissionError", seen
        service.setblocking(False)
        with pytest.raises(BlockingIOError):
            service.accept()                                                        # nothing came through
    finally:
        service.close()


def test_a_proxy_upstream_is_marked_and_only_the_proxy_ruleset_lets_the_mark_out() -> None:
    from sandboxd.kernel import nftables

    via_proxy = nftables.egress_ruleset(["192.0.2.53"], [], via_proxy=True)
    assert f"meta mark {nftables.PROXY_MARK:#x}" in via_proxy
    assert "meta mark" not in nftables.egress_ruleset(["192.0.2.53"], [("198.51.100.7", ())])


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process ``pid`` holds."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue                                   # closed meanwhile
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


def test_the_fork_server_hands_the_proxy_listener_over(workspace: Path) -> None:
    """With allowed domains, the session's proxy listener comes back with the session: listening on
    127.0.0.1:3128 of the sandbox's own namespace (its init's /proc/net/tcp lists it), and no longer
    held by the fork server (the daemon's copy is the only one: it is never closed and bound again)."""
    from sandboxd.defaults import PROXY_PORT

    fs = ForkServer.start()
    try:
        info = fs.open_session("proxied", LaunchSpec(argv=("true",), workspace=str(workspace), dns=(DNS,),
                                                     policy=WorkspaceWrite(network_access=True,
                                                                           allowed_domains=("internet.test",))))
        assert info.proxy_listener >= 0
        with socket.socket(fileno=info.proxy_listener) as listener:
            assert listener.getsockname() == ("127.0.0.1", PROXY_PORT)
            assert listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
            inode = os.fstat(listener.fileno()).st_ino
            with open(f"/proc/{info.init_pid}/net/tcp") as table:         # the sandbox's namespace
                listening = {int(line.split()[9]) for line in table.read().splitlines()[1:]
                             if line.split()[1] == f"0100007F:{PROXY_PORT:04X}" and line.split()[3] == "0A"}
            assert listening == {inode}
            # The fork server closes its copy right after the answer that passed it: wait for that.
            deadline = time.monotonic() + 10 * SLOW
            while inode in socket_inodes(fs.pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert inode not in socket_inodes(fs.pid)
        # The control: a session without allowed domains gets none.
        assert fs.open_session("plain", LaunchSpec(argv=("true",), workspace=str(workspace), dns=(DNS,),
                                                   policy=WorkspaceWrite(network_access=True))).proxy_listener == -1
        fs.close_session("proxied")
        fs.close_session("plain")
    finally:
        fs.close()


# A plain user's attack on the egress proxy's address: the proxy port (3128) needs no privilege,
# and IP_FREEBIND lets anyone bind an address no interface has yet, such as the host side of the
# link the next sandbox will get. It takes every host address of the daemon's pool at port 3128
# before any session exists, and records whatever reaches it.
PROXY_SQUATTER = textwrap.dedent('''
    import json, os, select, socket, sys
    uid, gid, addresses, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(","), int(sys.argv[4])
    os.setgroups([]); os.setresgid(gid, gid, gid); os.setresuid(uid, uid, uid)
    IP_FREEBIND = 15
    held = []
    for address in addresses:
        s = socket.socket()
        s.setsockopt(socket.IPPROTO_IP, IP_FREEBIND, 1)
        s.bind((address, port))
        s.listen(64)
        s.setblocking(False)
        held.append(s)
    print("held", os.getuid(), flush=True)
    received, stdin = [], select.poll()
    stdin.register(0, select.POLLIN)
    while not stdin.poll(10):                      # until the test closes our stdin
        for s in held:
            try:
                conn, _ = s.accept()
            except BlockingIOError:
                continue
            conn.settimeout(2)
            try:
                received.append(conn.recv(200).decode(errors="replace"))
            except OSError as e:
                received.append(type(e).__name__)
            conn.close()
    print(json.dumps(received))
''')


def test_no_other_user_can_take_the_proxy_address(world: World, workspace: Path, plain_users: Any) -> None:
    """A plain user holds 3128 on every host address of the daemon's pool (bound before any sandbox
    exists, then accepting). Sessions with allowed domains are still built and served, through the
    proxy on the sandbox's own loopback, and nothing a sandbox sends reaches that user. The control:
    the listener where it was (the host side of the link, bound by root as the fork server did) cannot
    be bound against this user, and whatever reaches that address does reach the user."""
    import ipaddress

    from daemon_helpers import Daemon, create_session, make_base_dir, remove_tree, run_exec
    from sandboxd.defaults import PROXY_PORT
    from sandboxd.network.egress_proxy import host_owns
    from sandboxd.v1 import sandboxd_pb2 as pb

    (attacker,) = plain_users(1)
    pool = ipaddress.ip_network(f"10.234.{int.from_bytes(os.urandom(1), 'big')}.0/29")   # this daemon's alone
    hosts = [str(block[1]) for block in pool.subnets(new_prefix=30)]
    squatter = subprocess.Popen([PY, "-c", PROXY_SQUATTER, str(attacker.uid), str(attacker.gid), ",".join(hosts),
                                 str(PROXY_PORT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
    base = make_base_dir("sbxd-squat-")
    d = Daemon(base, args=["--dns", DNS], env={"SANDBOXD_NETWORK_POOL": str(pool)})
    try:
        assert squatter.stdout is not None
        assert squatter.stdout.readline().split() == ["held", str(attacker.uid)]
        # The control: the old place, bound by root as the fork server bound it, is the user's.
        old_place = socket.socket()
        old_place.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        old_place.setsockopt(socket.IPPROTO_IP, 15, 1)                  # IP_FREEBIND: no link has it yet
        with old_place, pytest.raises(OSError) as taken:
            old_place.bind((hosts[0], PROXY_PORT))
        assert taken.value.errno == errno.EADDRINUSE
        d.start()
        seen = []
        for _ in range(3):                                              # each gets the pool's first free block
            session = create_session(d.stub, workspace, pb.SandboxPolicy(
                mode=pb.SandboxPolicy.WORKSPACE_WRITE, network_access=True, allowed_domains=["internet.test"]))
            proxied = run_exec(d.stub, session.id, [PY, "-c", PROXY_PROBE])
            direct = run_exec(d.stub, session.id, [PY, "-c", PROBE, f"GATEWAY:{PROXY_PORT}"])
            seen.append((json.loads(proxied.stdout.decode().strip().splitlines()[-1]),
                         json.loads(direct.stdout.decode().strip().splitlines()[-1])))
            # The control: what reaches the host side's port 3128 reaches the user (sent from the host,
            # to the session's link: the one address of the pool that is the host's now).
            (link,) = [address for address in hosts if host_owns(address)]
            with socket.create_connection((link, PROXY_PORT), timeout=5) as reaching:
                reaching.sendall(b"control")
            d.stub.CloseSession(pb.CloseSessionRequest(session_id=session.id))
        for through_proxy, to_the_link in seen:
            assert through_proxy["http internet"] == "open: hello from internet", through_proxy
            assert through_proxy["connect internet"] == "open: hello from internet", through_proxy
            assert to_the_link[f"GATEWAY:{PROXY_PORT}"] in BLOCKED, to_the_link
    finally:
        d.close()
        remove_tree(base)
        try:
            out, _ = squatter.communicate(timeout=30)                  # closes its stdin: it stops
        finally:
            squatter.kill()                                            # (gone already, unless it hung)
            squatter.wait()
    assert json.loads(out.strip().splitlines()[-1]) == ["control"] * 3, out


def test_a_world_that_gave_up_waiting_leaves_the_holders_routes(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    """A run whose world timed out waiting for the lock must not, in its teardown, delete the host
    routes of the world that holds it (CI once lost its world's routes to a helper's run that gave
    up). The control: a world that took the lock does delete them at teardown."""
    import fcntl
    import sys

    module = sys.modules[__name__]
    monkeypatch.setattr(module, "WORLD_LOCK", str(tmp_path / "world.lock"))
    monkeypatch.setattr(module, "WORLD_WAIT", 0.2)
    monkeypatch.setattr(module, "clear_dead_worlds", lambda: None)
    ran: list[str] = []
    monkeypatch.setattr(subprocess, "run", lambda command, **_: ran.append(str(command)))
    holder = os.open(tmp_path / "world.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        waiting = World()
        with pytest.raises(AssertionError, match="still holds the host's routes"):
            waiting.take_the_host()
        waiting.teardown()
        assert ran == []
    finally:
        os.close(holder)
    taking = World()
    taking.take_the_host()
    taking.teardown()
    assert "ip route del 198.51.100.0/24" in ran
