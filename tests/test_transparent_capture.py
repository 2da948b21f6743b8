"""Transparent capture (network.transparent): in a proxied isolated sandbox, programs that ignore
HTTP(S)_PROXY (Node 20's built-in fetch, curl --noproxy '*') reach an allowed name through the
egress proxy, judged by the name their connection carries (SNI, Host), never by its address.

Against tests/tls_world.py's stand-in internet (HTTPS on api.test.example and other.test.example,
its DNS), plus plain HTTP servers on port 80 of the same addresses that record each request's Host.
The controls: the same sandbox with its capture chain deleted from outside (the fetch fails), and a
direct connection from the host (what the sandbox would reach without the wall)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import BASE_ENV, PY, SANDBOXD, eventually
from tls_world import API_HOST, META_HOST, NAME_TABLE, NAMES, OTHER_HOST, TlsWorld, inside, tls_world  # noqa: F401

pytestmark = pytest.mark.timeout(300)

NODE = shutil.which("node") or "/usr/bin/node"
FETCH = textwrap.dedent('''
    fetch(process.argv[1]).then(async r => console.log("status " + r.status + ": " + await r.text()),
                                e => console.log("failed: " + (e.cause ? e.cause.code || e.cause.message : e.message)))
''')
# Raw connections from inside the sandbox: TLS to an address without SNI, and two requests on one
# port-80 connection whose Host changes. Each prints what came back.
RAW = textwrap.dedent('''
    import json, socket, ssl, sys
    result = {}
    try:
        with socket.create_connection((sys.argv[1], 443), timeout=10) as raw:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            with context.wrap_socket(raw) as tls:               # no server_hostname: no SNI
                result["no sni"] = "handshake done"
    except OSError as e:
        result["no sni"] = type(e).__name__
    with socket.create_connection((sys.argv[1], 80), timeout=10) as s:
        s.sendall(("GET /first HTTP/1.1\\r\\nHost: %s\\r\\n\\r\\n"
                   "GET /second HTTP/1.1\\r\\nHost: %s\\r\\n\\r\\n" % (sys.argv[2], sys.argv[3])).encode())
        reply = b""
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except OSError:
            pass
    result["switch"] = reply.decode("latin-1")
    # The capture's listener dialled directly: no redirect, so no destination port; refused.
    try:
        with socket.create_connection(("127.0.0.1", 3129), timeout=10) as s:
            s.sendall(("GET /direct HTTP/1.1\\r\\nHost: %s\\r\\n\\r\\n" % sys.argv[2]).encode())
            result["direct"] = s.recv(65536).decode("latin-1")
    except OSError as e:
        result["direct"] = type(e).__name__
    print(json.dumps(result))
''')


class PlainRecorder:
    """HTTP/1.1 on port 80 of one world address: answers ``plain NAME PATH`` and records
    (Host, path) of every request."""

    def __init__(self, netns: str, address: str, name: str) -> None:
        with inside(netns):
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((address, 80))
        self.sock.listen(16)
        self.name, self.seen, self.lock = name, [], threading.Lock()
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        data = b""
        with conn:
            conn.settimeout(30)
            try:
                while True:
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(65536)
                        if not chunk:
                            return
                        data += chunk
                    head, _, data = data.partition(b"\r\n\r\n")
                    lines = head.decode("latin-1").split("\r\n")
                    path = lines[0].split(" ")[1]
                    host = next((line.split(":", 1)[1].strip() for line in lines[1:]
                                 if line.lower().startswith("host:")), "")
                    with self.lock:
                        self.seen.append((host, path))
                    body = f"plain {self.name} {path}".encode()
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def plain(tls_world: TlsWorld) -> Iterator[dict[str, PlainRecorder]]:  # noqa: F811
    servers = {host: PlainRecorder(tls_world.world.gw, NAME_TABLE[host], host) for host in (API_HOST, OTHER_HOST)}
    yield servers
    for server in servers.values():
        server.close()


@pytest.fixture
def ca_in(workspace: Path, tls_world: TlsWorld) -> str:  # noqa: F811
    """The world's CA where the sandbox can read it."""
    path = workspace / "world-ca.pem"
    shutil.copyfile(tls_world.ca_file, path)
    os.chmod(path, 0o644)
    return str(path)


def run(workspace: Path, *options: str, command: list[str], env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SANDBOXD, "run", "--workspace", str(workspace), "--network", "--dns", NAMES, *options,
                           "--", *command], capture_output=True, text=True, timeout=120, env=env or BASE_ENV)


def node_fetch(ca: str, url: str) -> list[str]:
    return ["/usr/bin/env", f"NODE_EXTRA_CA_CERTS={ca}", NODE, "-e", FETCH, url]


def curl(ca: str, url: str) -> list[str]:
    return ["curl", "-sS", "--noproxy", "*", "--max-time", "20", "--cacert", ca, url]


# -- root `sandboxd run` -------------------------------------------------------------------------

def test_node_fetch_reaches_an_allowed_name_in_a_root_run(tls_world: TlsWorld, workspace: Path,  # noqa: F811
                                                           ca_in: str) -> None:
    tls_world.api.clear()
    got = run(workspace, "--allow-domain", API_HOST, command=node_fetch(ca_in, tls_world.url("/from-node")))
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "status 200: hello /from-node", (got.stdout, got.stderr)
    assert [seen.path for seen in tls_world.api.seen] == ["/from-node"]
    # The name is what is judged: the same fetch to a name not allowed never arrives.
    tls_world.other.clear()
    refused = run(workspace, "--allow-domain", API_HOST,
                  command=node_fetch(ca_in, tls_world.url("/not-here", OTHER_HOST)))
    assert refused.stdout.startswith("failed"), refused.stdout
    assert tls_world.other.seen == []
    assert "other.test.example:443" in refused.stderr and "not in the allowed domains" in refused.stderr


def test_curl_ignoring_the_proxy_reaches_only_allowed_names(tls_world: TlsWorld, workspace: Path,  # noqa: F811
                                                             ca_in: str) -> None:
    tls_world.api.clear()
    tls_world.other.clear()
    allowed = run(workspace, "--allow-domain", API_HOST, command=curl(ca_in, tls_world.url("/from-curl")))
    assert allowed.returncode == 0 and allowed.stdout == "hello /from-curl", (allowed.stdout, allowed.stderr)
    unlisted = run(workspace, "--allow-domain", API_HOST, command=curl(ca_in, tls_world.url("/x", OTHER_HOST)))
    assert unlisted.returncode != 0, unlisted.stdout
    assert tls_world.other.seen == [] and [s.path for s in tls_world.api.seen] == ["/from-curl"]
    # Control: from the host, with no wall, the unlisted name answers.
    with tls_world.connect(OTHER_HOST) as tls:
        tls.sendall(f"GET /x HTTP/1.1\r\nHost: {OTHER_HOST}\r\nConnection: close\r\n\r\n".encode())
        assert b"hello /x" in tls.recv(65536) + tls.recv(65536)


def test_a_connection_without_a_name_is_refused_and_a_host_switch_is_judged(
        tls_world: TlsWorld, plain: dict[str, PlainRecorder], workspace: Path) -> None:  # noqa: F811
    api_address = NAME_TABLE[API_HOST]
    for server in plain.values():
        with server.lock:
            server.seen.clear()
    got = run(workspace, "--allow-domain", API_HOST, "--allow-domain", OTHER_HOST,
              command=[PY, "-c", RAW, api_address, API_HOST, OTHER_HOST])
    assert got.returncode == 0, got.stderr
    result = json.loads(got.stdout.strip().splitlines()[-1])
    # TLS to the address itself, no SNI: refused (closed before any handshake), and reported.
    assert result["no sni"] != "handshake done", result
    assert "(no name):443" in got.stderr and "server name" in got.stderr, got.stderr
    # Port 80: the first request goes to the name its Host says; the second names another host on
    # the same connection and is refused there (421), never sent on.
    assert "plain api.test.example /first" in result["switch"], result
    assert "421" in result["switch"], result
    assert plain[API_HOST].seen == [(API_HOST, "/first")]
    assert plain[OTHER_HOST].seen == []
    assert "plain" not in result["direct"], result           # /direct never arrived (seen above)
    # Control: without the wall (from the host), the same bytes to that address reach both paths.
    with socket.create_connection((api_address, 80), timeout=10) as s:
        s.sendall(f"GET /first HTTP/1.1\r\nHost: {API_HOST}\r\n\r\nGET /second HTTP/1.1\r\nHost: {OTHER_HOST}"
                  f"\r\n\r\n".encode())
        assert eventually(lambda: len(plain[API_HOST].seen) == 3, 10), plain[API_HOST].seen
    assert plain[API_HOST].seen[1:] == [(API_HOST, "/first"), (OTHER_HOST, "/second")]


def test_a_host_on_port_80_is_judged_by_the_allowlist(tls_world: TlsWorld, plain: dict[str, PlainRecorder],  # noqa: F811
                                                      workspace: Path) -> None:
    for server in plain.values():
        with server.lock:
            server.seen.clear()
    got = run(workspace, "--allow-domain", API_HOST, command=[
        "sh", "-c", f"curl -sS --noproxy '*' --max-time 20 http://{API_HOST}/ok; echo; "
                    f"curl -sS --noproxy '*' --max-time 20 -o /dev/null -w '%{{http_code}}' http://{OTHER_HOST}/no"])
    assert got.stdout.splitlines() == ["plain api.test.example /ok", "403"], (got.stdout, got.stderr)
    assert plain[API_HOST].seen == [(API_HOST, "/ok")] and plain[OTHER_HOST].seen == []
    # A name that resolves to the metadata address is refused even when allowed by name: curl
    # resolves it inside and init's connect broker refuses the connect() before capture sees it;
    # by the proxy (named, not resolved inside), it is a 403 saying why.
    meta = run(workspace, "--allow-domain", META_HOST, command=[
        "sh", "-c", f"curl -sS --noproxy '*' --max-time 20 -o /dev/null -w '%{{http_code}}' "
                    f"http://{META_HOST}/latest/meta-data/; echo; "
                    f"curl -sS --max-time 20 -o /dev/null -w '%{{http_code}}' http://{META_HOST}/latest/meta-data/"])
    assert meta.stdout.splitlines() == ["000", "403"], (meta.stdout, meta.stderr)
    assert "Couldn't connect" in meta.stderr and "cloud metadata" in meta.stderr, meta.stderr


# -- daemon sessions -----------------------------------------------------------------------------

def netns_holders(inode: int) -> list[int]:
    """The processes in the network namespace ``inode``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino == inode:
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


def sockets_of(pid: int) -> set[str]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            found.add(link)
    return found


def test_node_fetch_in_a_daemon_session_and_without_capture_it_fails(tls_world: TlsWorld, workspace: Path,  # noqa: F811
                                                                     ca_in: str) -> None:
    from daemon_helpers import Daemon, create_session, make_base_dir, remove_tree, run_exec
    from sandboxd.v1 import sandboxd_pb2 as pb

    base = make_base_dir("sbxd-capture-")
    d = Daemon(base, args=["--dns", NAMES])
    try:
        d.start()
        d.stub.ListSessions(pb.ListSessionsRequest())     # the client's own connection, before counting
        before = sockets_of(d.pid)
        session = create_session(d.stub, workspace, pb.SandboxPolicy(
            mode=pb.SandboxPolicy.WORKSPACE_WRITE, network_access=True, allowed_domains=[API_HOST]))
        tls_world.api.clear()
        fetched = run_exec(d.stub, session.id, node_fetch(ca_in, tls_world.url("/session")))
        assert fetched.stdout.decode().strip() == "status 200: hello /session", fetched.describe()
        assert [seen.path for seen in tls_world.api.seen] == ["/session"]
        inode = int(run_exec(d.stub, session.id, [PY, "-c", "import os; print(os.stat('/proc/self/ns/net').st_ino)"])
                    .stdout.decode().strip())
        holders = netns_holders(inode)
        assert holders
        assert len(sockets_of(d.pid) - before) >= 2        # the proxy's listeners: what must go with it
        # Control: the same sandbox without its capture chain (deleted from outside): Node 20
        # ignores HTTPS_PROXY, so its fetch has no way out.
        subprocess.run(["nsenter", f"--net=/proc/{holders[0]}/ns/net", "nft", "delete", "chain", "inet",
                        "sandboxd_egress", "capture"], check=True, capture_output=True, timeout=30)
        tls_world.api.clear()
        blocked = run_exec(d.stub, session.id, node_fetch(ca_in, tls_world.url("/session-again")))
        assert blocked.stdout.decode().startswith("failed"), blocked.describe()
        assert tls_world.api.seen == []
        d.stub.CloseSession(pb.CloseSessionRequest(session_id=session.id))
        # Nothing left: no process in its namespace, no socket of the daemon's (the proxy's two
        # listeners and their connections) beyond those it had before.
        assert eventually(lambda: netns_holders(inode) == [], 20), netns_holders(inode)
        assert eventually(lambda: sockets_of(d.pid) <= before, 20), sockets_of(d.pid) - before
    finally:
        d.close()
        remove_tree(base)


# -- the pieces, without a sandbox ---------------------------------------------------------------

def test_only_a_proxied_ruleset_captures_and_never_the_proxy_or_an_allowed_host() -> None:
    from sandboxd.kernel import nftables

    proxied = nftables.egress_ruleset(["192.0.2.53"], [("198.51.100.7", ((22, 22),))], via_proxy=True)
    capture = proxied[proxied.index("chain capture"):]
    assert "redirect to :3129" in capture and "tcp dport { 80, 443 }" in capture
    # Before the redirect: loopback, the proxy's own marked sockets, the allowed host, in that order.
    assert (capture.index('oifname "lo" return') < capture.index(f"meta mark {nftables.PROXY_MARK:#x} return")
            < capture.index("ip daddr 198.51.100.7 return") < capture.index("redirect"))
    assert "chain capture" not in nftables.egress_ruleset(["192.0.2.53"], [("198.51.100.7", ())])


def test_a_request_names_its_host_in_exactly_one_field() -> None:
    from sandboxd.network.transparent import host_header

    assert host_header(b"GET / HTTP/1.1\r\nAccept: */*\r\nhOsT:  a.example:80 ") == b"a.example:80"
    assert host_header(b"GET / HTTP/1.1\r\nHost: a.example\r\nHost: b.example") is None
    assert host_header(b"GET / HTTP/1.1\r\nHost:") is None
    assert host_header(b"GET / HTTP/1.0\r\nX-Host: a.example") is None


# -- interception of a captured connection, in-process ---------------------------------------------

@pytest.fixture
def scratch_netns() -> Iterator[int]:
    """A network namespace of this test's own: loopback up, a veth pair whose default route leads
    nowhere, and the proxied egress ruleset (capture included). Its descriptor."""
    from sandboxd.kernel import nftables

    name = f"sbxcapt{os.urandom(3).hex()}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        for command in ([f"ip -n {name} link set lo up"],
                        [f"ip -n {name} link add c0 type veth peer name c1",
                         f"ip -n {name} link set c0 up", f"ip -n {name} link set c1 up",
                         f"ip -n {name} addr add 10.99.0.1/24 dev c0",
                         f"ip -n {name} route add default via 10.99.0.2"]):
            for line in command:
                subprocess.run(line.split(), check=True, timeout=30)
        subprocess.run(["ip", "netns", "exec", name, "nft", "-f", "-"], check=True, timeout=30, text=True,
                       input=nftables.egress_ruleset([], [], via_proxy=True))
        fd = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)
    finally:
        subprocess.run(["ip", "netns", "del", name], timeout=30)


def test_a_captured_connection_to_a_ruled_host_is_intercepted_and_judged(scratch_netns: int, tmp_path: Path) -> None:
    import http.server
    import ssl

    from interception_helpers import API, UpstreamCA, _handler, Recorder
    from test_egress_rules import Names
    from sandboxd.network.egress_proxy import EgressProxy, ProxyEvent
    from sandboxd.network.interception.ca import SessionCA
    from sandboxd.network.interception.intercepted import Interceptor
    from sandboxd.network.interception.upstream_tls import upstream_context
    from sandboxd.network.tcp_relay import RelayLoop, socket_in_namespace
    from sandboxd.network.transparent import listen_captured
    from sandboxd.policy.network import NetworkRules, parse_endpoint

    test_ca, recorder = UpstreamCA(), Recorder()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 443), _handler(recorder), bind_and_activate=False)
    server.socket.close()
    server.socket = socket_in_namespace(scratch_netns)            # the upstream: 127.0.0.1:443 in there
    server.socket.setblocking(True)
    server.socket.bind(("127.0.0.1", 443))
    server.socket.listen(8)
    server.socket = test_ca.server_context(tmp_path).wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    names = Names({API: "127.0.0.1"})
    session_ca = SessionCA.generate("capture0123456789")
    loop = RelayLoop("test-capture")
    events: list[ProxyEvent] = []
    proxy = EgressProxy(EgressProxy.listen(scratch_netns), NetworkRules(
        domains=(API,), endpoints=(parse_endpoint(f"{API}=GET:/read/**"),)), netns_fd=scratch_netns,
        resolvers=[names.address], on_event=events.append, allowed_ranges=("127.0.0.0/8",),
        interceptor=Interceptor(session_ca, upstream_context(test_ca.pem)), loop=loop).start()
    proxy.serve_captured(listen_captured(scratch_netns))
    trusted = ssl.create_default_context(cadata=session_ca.cert_pem().decode())

    def request(method: str, path: str) -> bytes:
        raw = socket_in_namespace(scratch_netns)
        raw.setblocking(True)
        raw.settimeout(30)
        raw.connect(("192.0.2.99", 443))                    # any address: the name is what counts
        with trusted.wrap_socket(raw, server_hostname=API) as tls:
            tls.sendall(f"{method} {path} HTTP/1.1\r\nHost: {API}\r\nContent-Length: 0\r\n"
                        "Connection: close\r\n\r\n".encode())
            answer = b""
            while chunk := tls.recv(65536):
                answer += chunk
            return answer
    try:
        allowed = request("GET", "/read/1")
        assert allowed.startswith(b"HTTP/1.1 200") and allowed.endswith(b"hello /read/1"), allowed
        refused = request("POST", "/read/1")
        assert refused.startswith(b"HTTP/1.1 403") and b"GET:/read/**" in refused, refused
        assert [(m, p) for m, p, _ in recorder.requests] == [("GET", "/read/1")]
        assert eventually(lambda: any(event.kind == "endpoint" and event.method == "POST" for event in events),
                          20), events                   # reported off the loop
    finally:
        proxy.close()
        loop.close()
        server.shutdown()
        server.server_close()
        names.close()


def test_a_captured_port_80_connection_is_cut_when_its_host_is_removed(scratch_netns: int) -> None:
    """Hostile pass L4: a live policy change cuts open captured plain-HTTP connections to a host it
    removes, as it cuts the proxy's own (control: the same connection serves a second request when
    the change keeps the host)."""
    import http.server

    from interception_helpers import API, _handler, Recorder
    from test_egress_rules import Names
    from sandboxd.network.egress_proxy import EgressProxy
    from sandboxd.network.tcp_relay import RelayLoop, socket_in_namespace
    from sandboxd.network.transparent import listen_captured
    from sandboxd.policy.network import NetworkRules

    recorder = Recorder()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 80), _handler(recorder), bind_and_activate=False)
    server.socket.close()
    server.socket = socket_in_namespace(scratch_netns)
    server.socket.setblocking(True)
    server.socket.bind(("127.0.0.1", 80))
    server.socket.listen(8)
    server.daemon_threads = True
    server.protocol_version = "HTTP/1.1"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    names = Names({API: "127.0.0.1", "kept.example": "127.0.0.1"})
    loop = RelayLoop("test-capture-cut")
    proxy = EgressProxy(EgressProxy.listen(scratch_netns), NetworkRules(domains=(API, "kept.example")),
                        netns_fd=scratch_netns, resolvers=[names.address], allowed_ranges=("127.0.0.0/8",),
                        loop=loop).start()
    proxy.serve_captured(listen_captured(scratch_netns))

    def get(conn: socket.socket, host: str, path: str) -> bytes:
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        answer = b""
        while b"hello " + path.encode() not in answer:
            chunk = conn.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer

    def connection() -> socket.socket:
        raw = socket_in_namespace(scratch_netns)
        raw.setblocking(True)
        raw.settimeout(30)
        raw.connect(("192.0.2.99", 80))                     # any address: the Host header is what counts
        return raw
    try:
        kept, cut = connection(), connection()
        assert b"hello /1" in get(kept, "kept.example", "/1")
        assert b"hello /1" in get(cut, API, "/1")
        proxy.update(NetworkRules(domains=("kept.example",)))
        assert b"hello /2" in get(kept, "kept.example", "/2")     # the control: kept hosts keep serving
        cut.sendall(f"GET /2 HTTP/1.1\r\nHost: {API}\r\n\r\n".encode())
        try:
            assert cut.recv(65536) == b""                         # cut: closed, nothing relayed
        except ConnectionResetError:
            pass
        assert ("GET", "/2") in [(m, p) for m, p, _ in recorder.requests]
        assert len([p for _, p, _ in recorder.requests if p == "/2"]) == 1
        kept.close()
        cut.close()
    finally:
        proxy.close()
        loop.close()
        server.shutdown()
        server.server_close()
        names.close()
