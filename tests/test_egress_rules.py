"""The egress proxy's rules (issue 26, design §4-§5, §7.3): endpoint rules judged on every request
of an intercepted connection, ``update`` for the next request, plain http:// to a host with rules
refused, cloud metadata names and addresses refused whatever the rules and allowed ranges say.

In-process, on loopback, no daemon: a real ``EgressProxy`` on a loop of its own connecting from
this process's network namespace (``allowed_ranges`` names 127.0.0.0/8 so it may reach the test
upstreams), a real DNS server on a loopback address of its own (the proxy resolves every name
itself), the HTTPS upstream of interception_helpers with its own CA. Each refusal has its control.
"""

from __future__ import annotations

import http.server
import os
import random
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from interception_helpers import API, OTHER, SECRET, UpstreamCA, Upstream, credential_set
from sandboxd.network.credentials import CredentialSet
from sandboxd.network import dns as dns_client
from sandboxd.network.egress_proxy import EgressProxy, ProxyEvent, refused_range
from sandboxd.network.event_loop import LOOKUP, LOOKUPS_PER_OWNER
from sandboxd.network.interception.ca import SessionCA
from sandboxd.network.interception.intercepted import Interceptor
from sandboxd.network.interception.upstream_tls import upstream_context
from sandboxd.network.tcp_relay import RelayLoop, listen_tcp
from sandboxd.network.upstream import UpstreamRoute
from sandboxd.policy.network import CredentialSpec, NetworkRules, parse_endpoint

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the proxy connects from a namespace it enters (root)")

PLAIN = "plain.test"
LOOPBACK = "127.0.0.0/8"


def _dns_socket() -> tuple[socket.socket, str]:
    """A UDP socket bound to port 53 of a free 127.53.X.Y (dns.resolve asks port 53), and that address."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    for _ in range(20):
        address = f"127.53.{random.randrange(1, 255)}.{random.randrange(1, 255)}"
        try:
            sock.bind((address, 53))
            return sock, address
        except OSError:
            continue
    sock.close()
    pytest.fail("no free loopback address for the test DNS server")


class Names:
    """A DNS server on 127.53.X.Y:53 (dns.resolve asks port 53): ``answers`` maps a name to an A
    address; every question asked is kept."""

    def __init__(self, answers: dict[str, str]) -> None:
        import dns.message

        self._message = dns.message
        self.answers, self.asked = answers, []
        self.sock, self.address = _dns_socket()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        import dns.rcode
        import dns.rrset

        while True:
            try:
                data, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            query = self._message.from_wire(data)
            name = query.question[0].name.to_text().rstrip(".")
            self.asked.append(name)
            reply = self._message.make_response(query)
            if name in self.answers:
                reply.answer.append(dns.rrset.from_text(name + ".", 60, "IN", "A", self.answers[name]))
            else:
                reply.set_rcode(dns.rcode.NXDOMAIN)
            self.sock.sendto(reply.to_wire(), peer)

    def close(self) -> None:
        self.sock.close()


class SilentNames:
    """A DNS server on 127.53.X.Y:53 that answers nothing (a name server a sandbox's owner controls,
    that never replies) until ``release``, then NXDOMAIN to every question held and to later ones."""

    def __init__(self) -> None:
        self.held: list[tuple[bytes, tuple[str, int]]] = []
        self.released = False
        self.lock = threading.Lock()
        self.sock, self.address = _dns_socket()
        threading.Thread(target=self._hold, daemon=True).start()

    def _hold(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(4096)
            except OSError:
                return
            with self.lock:
                self.held.append((data, peer))
                if self.released:
                    self._answer()

    def _answer(self) -> None:
        import dns.message
        import dns.rcode

        for data, peer in self.held:
            reply = dns.message.make_response(dns.message.from_wire(data))
            reply.set_rcode(dns.rcode.NXDOMAIN)
            self.sock.sendto(reply.to_wire(), peer)
        self.held.clear()

    def release(self) -> None:
        with self.lock:
            self.released = True
            self._answer()

    def questions(self) -> int:
        with self.lock:
            return len(self.held)

    def close(self) -> None:
        self.release()
        self.sock.close()


class PlainUpstream:
    """An http:// server on 127.0.0.1 answering every GET with its path."""

    def __init__(self) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                body = b"plain " + self.path.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Setup:
    def __init__(self, tmp: Path) -> None:
        self.test_ca = UpstreamCA()
        self.upstream = Upstream(self.test_ca, tmp)
        self.plain = PlainUpstream()
        self.names = Names({API: "127.0.0.1", OTHER: "127.0.0.1", PLAIN: "127.0.0.1",
                            "metadata.test": "169.254.169.254", "mapped.test": "169.254.170.2"})
        self.session_ca = SessionCA.generate("rules0123456789")
        self.ca_file = tmp / "session-ca.pem"
        self.ca_file.write_bytes(self.session_ca.cert_pem())
        self.loop = RelayLoop("test-egress-rules")
        self.events: list[ProxyEvent] = []
        self.proxies: list[EgressProxy] = []
        self.ports: dict[int, int] = {}                   # id(proxy) -> its port

    def proxy(self, rules: NetworkRules, allowed_ranges: tuple[str, ...] = (LOOPBACK,),
              credentials: CredentialSet | None = None, upstream: UpstreamRoute | None = None,
              trusted_pem: str | None = None, resolvers: tuple[str, ...] = (),
              intercepted_connections: int = 64) -> EgressProxy:
        """A proxy on the test's loop; ``trusted_pem``: what it trusts for upstreams (the test CA);
        ``resolvers``: its DNS (the test's Names by default)."""
        listener = listen_tcp("127.0.0.1", 0, step="test proxy")
        netns = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            proxy = EgressProxy(listener, rules, netns_fd=netns, resolvers=resolvers or [self.names.address],
                                on_event=self.events.append, allowed_ranges=allowed_ranges,
                                interceptor=Interceptor(self.session_ca, upstream_context(
                                    self.test_ca.pem if trusted_pem is None else trusted_pem)),
                                credentials=credentials, upstream=upstream, loop=self.loop,
                                intercepted_connections=intercepted_connections).start()
        finally:
            os.close(netns)
        self.proxies.append(proxy)
        self.ports[id(proxy)] = listener.getsockname()[1]
        return proxy

    def event(self, kind: str, timeout: float = 20.0) -> ProxyEvent:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for event in list(self.events):
                if event.kind == kind:
                    return event
            time.sleep(0.02)
        raise AssertionError(f"no {kind} event among {self.events}")

    def connect(self, proxy: EgressProxy, host: str, port: int) -> tuple[socket.socket, bytes]:
        """A CONNECT to host:port through ``proxy``: the socket and the proxy's answer head."""
        raw = socket.create_connection(("127.0.0.1", self.ports[id(proxy)]), timeout=30)
        raw.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = raw.recv(4096)
            if not chunk:
                break
            head += chunk
        return raw, head

    def tls(self, proxy: EgressProxy, host: str = API) -> ssl.SSLSocket:
        """A TLS connection through a CONNECT to ``host``, trusting only the session's CA."""
        raw, head = self.connect(proxy, host, self.upstream.port)
        assert head.startswith(b"HTTP/1.1 200"), head
        return ssl.create_default_context(cafile=str(self.ca_file)).wrap_socket(raw, server_hostname=host)

    def https(self, proxy: EgressProxy, method: str, path: str, host: str = API) -> bytes:
        """One request over TLS through a CONNECT, trusting only the session's CA; what came back."""
        raw, head = self.connect(proxy, host, self.upstream.port)
        assert head.startswith(b"HTTP/1.1 200"), head
        context = ssl.create_default_context(cafile=str(self.ca_file))
        with context.wrap_socket(raw, server_hostname=host) as tls:
            tls.sendall(f"{method} {path} HTTP/1.1\r\nHost: {host}:{self.upstream.port}\r\n"
                        "Content-Length: 0\r\nConnection: close\r\n\r\n".encode())
            return _read_all(tls)

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.close()
        self.loop.close()
        self.upstream.close()
        self.plain.close()
        self.names.close()


def _read_all(sock: socket.socket) -> bytes:
    answer = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (ssl.SSLError, ConnectionError, TimeoutError):
            break
        if not chunk:
            break
        answer += chunk
    return answer


def _plain_get(setup: Setup, proxy: EgressProxy, host: str, port: int, paths: tuple[str, ...]) -> bytes:
    with socket.create_connection(("127.0.0.1", setup.ports[id(proxy)]), timeout=30) as sock:
        sock.sendall(b"".join(f"GET http://{host}:{port}{path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
                              for path in paths))
        sock.shutdown(socket.SHUT_WR)
        return _read_all(sock)


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    made = Setup(tmp_path)
    yield made
    made.close()


def _rules(*endpoints: str, domains: tuple[str, ...] = (API, OTHER, PLAIN)) -> NetworkRules:
    return NetworkRules(domains=domains, endpoints=tuple(parse_endpoint(text) for text in endpoints))


def test_an_endpoint_rule_lets_get_through_and_refuses_post_with_the_rule_set(setup: Setup) -> None:
    proxy = setup.proxy(_rules(f"{API}=GET:/repos/*/issues/**"))
    allowed = setup.https(proxy, "GET", "/repos/a/issues/1")          # control: the rule's own request
    assert allowed.startswith(b"HTTP/1.1 200") and allowed.endswith(b"hello /repos/a/issues/1"), allowed
    refused = setup.https(proxy, "POST", "/repos/a/issues/1")
    assert refused.startswith(b"HTTP/1.1 403"), refused
    assert b"POST /repos/a/issues/1 is not among the endpoint rules for api.internet.test" in refused
    assert b"GET:/repos/*/issues/**" in refused
    event = setup.event("endpoint")
    assert (event.host, event.method, event.path) == (API, "POST", "/repos/a/issues/1")
    assert [(m, p) for m, p, _ in setup.upstream.recorder.requests] == [("GET", "/repos/a/issues/1")]


def test_an_ambiguous_path_is_refused_before_matching(setup: Setup) -> None:
    proxy = setup.proxy(_rules(f"{API}=GET:/repos/*/issues/**"))
    refused = setup.https(proxy, "GET", "/repos/a/issues/../../gists")
    assert refused.startswith(b"HTTP/1.1 400"), refused
    assert setup.upstream.recorder.requests == []


def test_a_host_without_rules_is_tunnelled_not_intercepted(setup: Setup) -> None:
    proxy = setup.proxy(_rules(f"{API}=GET:/only"))
    raw, head = setup.connect(proxy, OTHER, setup.upstream.port)
    assert head.startswith(b"HTTP/1.1 200"), head
    # The upstream's own certificate: the session's CA does not verify it, the test CA does.
    with pytest.raises(ssl.SSLCertVerificationError):
        ssl.create_default_context(cafile=str(setup.ca_file)).wrap_socket(raw, server_hostname=OTHER)
    raw, head = setup.connect(proxy, OTHER, setup.upstream.port)
    with ssl.create_default_context(cadata=setup.test_ca.pem).wrap_socket(raw, server_hostname=OTHER) as tls:
        tls.sendall(f"POST /anything HTTP/1.1\r\nHost: {OTHER}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    .encode())
        assert _read_all(tls).startswith(b"HTTP/1.1 200")


def test_update_applies_to_the_next_request(setup: Setup) -> None:
    proxy = setup.proxy(_rules(f"{API}=GET:/a"))
    assert setup.https(proxy, "POST", "/a").startswith(b"HTTP/1.1 403")
    proxy.update(_rules(f"{API}=GET,POST:/a"))
    assert setup.https(proxy, "POST", "/a").startswith(b"HTTP/1.1 200")
    proxy.update(_rules(f"{API}=GET,POST:/a", domains=(OTHER,)))     # the host is no longer allowed
    _, head = setup.connect(proxy, API, setup.upstream.port)
    assert head.startswith(b"HTTP/1.1 403"), head
    assert setup.event("domain").host == API


def test_every_plain_http_request_on_a_keep_alive_connection_is_judged(setup: Setup) -> None:
    proxy = setup.proxy(_rules(f"{PLAIN}=GET:/a"))
    answer = _plain_get(setup, proxy, PLAIN, setup.plain.port, ("/a", "/b"))
    assert answer.startswith(b"HTTP/1.1 200") and b"plain /a" in answer, answer      # control: the rule's own
    assert b"HTTP/1.1 403" in answer and b"plain /b" not in answer, answer
    assert b"GET /b is not among the endpoint rules for plain.test" in answer
    event = setup.event("endpoint")
    assert (event.host, event.method, event.path) == (PLAIN, "GET", "/b")
    # Control: without rules, both requests of the connection reach the upstream.
    proxy.update(_rules())
    answer = _plain_get(setup, proxy, PLAIN, setup.plain.port, ("/a", "/b"))
    assert b"plain /a" in answer and b"plain /b" in answer, answer


def test_a_keep_alive_plain_connection_is_one_upstream(setup: Setup) -> None:
    proxy = setup.proxy(_rules())
    port = setup.plain.port
    with socket.create_connection(("127.0.0.1", setup.ports[id(proxy)]), timeout=30) as sock:
        sock.sendall(f"GET http://{PLAIN}:{port}/a HTTP/1.1\r\nHost: {PLAIN}:{port}\r\n\r\n"
                     f"GET http://{OTHER}:{port}/b HTTP/1.1\r\nHost: {OTHER}:{port}\r\n\r\n".encode())
        sock.shutdown(socket.SHUT_WR)
        answer = _read_all(sock)
    assert b"plain /a" in answer, answer                                              # control
    assert b"HTTP/1.1 400" in answer and b"plain /b" not in answer, answer


def test_a_metadata_name_is_refused_without_being_resolved(setup: Setup) -> None:
    proxy = setup.proxy(_rules(domains=("metadata.google.internal", API)), allowed_ranges=(LOOPBACK, "169.254.0.0/16"))
    _, head = setup.connect(proxy, "metadata.google.internal", 80)
    assert head.startswith(b"HTTP/1.1 403"), head
    assert setup.event("metadata").host == "metadata.google.internal"
    assert "metadata.google.internal" not in setup.names.asked
    _, head = setup.connect(proxy, API, setup.upstream.port)         # control: an allowed name is asked
    assert head.startswith(b"HTTP/1.1 200") and API in setup.names.asked, head


@pytest.mark.parametrize("name", ["metadata.test", "mapped.test"])
def test_a_name_resolving_to_a_metadata_address_is_refused_even_in_an_allowed_range(setup: Setup, name: str) -> None:
    proxy = setup.proxy(_rules(domains=(name,)), allowed_ranges=(LOOPBACK, "169.254.0.0/16"))
    _, head = setup.connect(proxy, name, 80)
    assert head.startswith(b"HTTP/1.1 403"), head
    event = setup.event("metadata")
    assert event.host == name and "cloud metadata" in event.detail
    # Control: the allowed range does open the rest of 169.254/16, and without it the range is refused.
    assert not refused_range("169.254.1.1", ("169.254.0.0/16",)) and refused_range("169.254.1.1")
    assert refused_range("169.254.169.254", ("169.254.0.0/16",))
    assert refused_range("::ffff:169.254.169.254", ("::/0",))


def test_a_blocked_range_is_refused_unless_named(setup: Setup) -> None:
    proxy = setup.proxy(_rules(), allowed_ranges=())
    _, head = setup.connect(proxy, OTHER, setup.upstream.port)
    assert head.startswith(b"HTTP/1.1 403"), head
    assert "127.0.0.1" in setup.event("range").detail
    # Control: named, the same loopback upstream is reached.
    named = setup.proxy(_rules())
    _, head = setup.connect(named, OTHER, setup.upstream.port)
    assert head.startswith(b"HTTP/1.1 200"), head


def test_a_plain_http_1_0_request_without_host_takes_the_targets_authority(setup: Setup) -> None:
    proxy = setup.proxy(_rules(f"{PLAIN}=GET:/a"))
    port = setup.plain.port
    for path, expected in (("/a", b"plain /a"), ("/b", b"HTTP/1.1 403")):              # the rule, and its control
        with socket.create_connection(("127.0.0.1", setup.ports[id(proxy)]), timeout=30) as sock:
            sock.sendall(f"GET http://{PLAIN}:{port}{path} HTTP/1.0\r\n\r\n".encode())
            answer = _read_all(sock)
        assert expected in answer, answer


def _ask(tls: ssl.SSLSocket, port: int, path: str, extra: str = "") -> bytes:
    """One keep-alive GET to API on ``tls``; its whole response (the upstream answers with
    Content-Length)."""
    tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {API}:{port}\r\n{extra}\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = tls.recv(65536)
        if not chunk:
            return head
        head += chunk
    top, _, body = head.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in top.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = tls.recv(65536)
        if not chunk:
            break
        body += chunk
    return top + b"\r\n\r\n" + body


def _cut(sock: socket.socket) -> bool:
    """Whether the proxy closed ``sock`` (EOF or reset, nothing more to read)."""
    try:
        return sock.recv(65536) == b""
    except (ConnectionError, ssl.SSLError):
        return True


def test_update_cuts_open_connections_to_a_host_no_longer_allowed(setup: Setup) -> None:
    proxy = setup.proxy(_rules(f"{API}=GET:/**"))
    kept = setup.tls(proxy)                                              # intercepted, to API
    tunnel, head = setup.connect(proxy, OTHER, setup.upstream.port)     # tunnelled, to OTHER
    assert head.startswith(b"HTTP/1.1 200"), head
    assert _ask(kept, setup.upstream.port, "/a").startswith(b"HTTP/1.1 200")
    proxy.update(_rules(f"{API}=GET:/**", domains=(API,)))             # OTHER is gone, API stays
    assert _cut(tunnel)
    assert "no longer allowed" in setup.event("policy").detail
    assert _ask(kept, setup.upstream.port, "/b").startswith(b"HTTP/1.1 200")    # control: API's lives on
    proxy.update(_rules(domains=(OTHER,)))
    assert _cut(kept)
    end = time.monotonic() + 20                          # events are told off the loop
    while len([e for e in setup.events if e.kind == "policy"]) < 2 and time.monotonic() < end:
        time.sleep(0.02)
    assert sorted(event.host for event in setup.events if event.kind == "policy") == sorted([OTHER, API])


def test_update_cuts_a_tunnel_to_a_host_that_gains_endpoint_rules(setup: Setup) -> None:
    proxy = setup.proxy(_rules())
    tunnel, head = setup.connect(proxy, OTHER, setup.upstream.port)
    assert head.startswith(b"HTTP/1.1 200"), head
    other, head = setup.connect(proxy, API, setup.upstream.port)        # control: stays a tunnel
    proxy.update(_rules(f"{OTHER}=GET:/only"))
    assert _cut(tunnel)
    assert "must now be read" in setup.event("policy").detail
    with ssl.create_default_context(cadata=setup.test_ca.pem).wrap_socket(other, server_hostname=API) as tls:
        assert _ask(tls, setup.upstream.port, "/still").startswith(b"HTTP/1.1 200")


def test_update_with_new_credentials_cuts_only_connections_whose_credential_changed(setup: Setup) -> None:
    port = setup.upstream.port
    spec = CredentialSpec("TOKEN", API, port)
    rules = NetworkRules(domains=(OTHER,), credentials=(spec,))
    phantom = "sbxp_" + "a" * 40
    first = credential_set(port, phantom)
    proxy = setup.proxy(rules, credentials=first)
    tls = setup.tls(proxy)
    auth = f"Authorization: Bearer {phantom}\r\n"
    assert _ask(tls, setup.upstream.port, "/check", auth).endswith(b"ok")
    same = credential_set(port, phantom)                                # equal values, new objects
    proxy.update(rules, credentials=same)
    first.wipe()                                                        # the old set may go at once
    assert _ask(tls, setup.upstream.port, "/check", auth).endswith(b"ok")      # unchanged: it lives on
    proxy.update(rules, credentials=credential_set(port, phantom, secret=SECRET + b"2"))
    assert _cut(tls)
    assert "credentials changed" in setup.event("policy").detail
    # The next connection takes the new secret (the upstream checks for the old one: "bad").
    assert _ask(setup.tls(proxy), setup.upstream.port, "/check", auth).endswith(b"bad")


@pytest.mark.parametrize("target, status", [
    ("/repos/a;x/issues/1", b"400"), ("/repos//issues/1", b"400"), ("/repos/a/issues/1?_method=DELETE", b"400"),
    ("/repos/a/issues/1?_METHOD%3dDELETE", b"400"), ("/repos/a/issues/%2e%2e/1", b"400"),
    ("/repos/a/issues/" + "x" * 8200, b"414"),
])
def test_a_target_servers_read_differently_is_refused_on_a_ruled_host(setup: Setup, target: str, status: bytes) -> None:
    proxy = setup.proxy(_rules(f"{API}=GET:/repos/*/issues/**"))
    answer = setup.https(proxy, "GET", target)
    assert answer.startswith(b"HTTP/1.1 " + status), answer[:200]
    assert len(answer.partition(b"\r\n\r\n")[2]) <= 4096
    assert setup.upstream.recorder.requests == []
    # Control: a plain target the rule names passes.
    assert setup.https(proxy, "GET", "/repos/a/issues/1").startswith(b"HTTP/1.1 200")


def test_a_costly_endpoint_check_is_judged_off_the_loop(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    from sandboxd.network import egress_proxy
    from sandboxd.policy.network import match_cost

    judged_on: list[str] = []
    real = egress_proxy.endpoint_allowed

    def recording(rules: object, method: str, path: str) -> bool:
        judged_on.append(threading.current_thread().name)
        return real(rules, method, path)  # type: ignore[arg-type]
    monkeypatch.setattr(egress_proxy, "endpoint_allowed", recording)
    many = [f"{API}=GET:/r{index}" + "/*" * 30 for index in range(20)] + [f"{API}=GET:/a/**"]
    path = "/a" * 40
    assert match_cost(_rules(*many).ruled(API), path) > egress_proxy.MAX_LOOP_COMPARISONS
    proxy = setup.proxy(_rules(*many))
    assert setup.https(proxy, "GET", path).startswith(b"HTTP/1.1 200")
    assert setup.https(proxy, "POST", path).startswith(b"HTTP/1.1 403")
    assert len(judged_on) == 2 and setup.loop.name not in judged_on, judged_on
    # Control: a cheap check stays on the loop.
    judged_on.clear()
    cheap = setup.proxy(_rules(f"{API}=GET:/a/**"))
    assert setup.https(cheap, "GET", "/a/b").startswith(b"HTTP/1.1 200")
    assert judged_on == [setup.loop.name]


def test_one_proxys_names_that_never_resolve_do_not_hold_up_another_proxys_requests(
        setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """M3 (hostile r7): every session's proxy shares the process's loop and its worker threads. A
    sandbox allowed names whose DNS never answers (here a name server that holds every question)
    asks for many of them at once; another session's proxy still resolves, connects, refuses and
    reports while every one of those lookups is pending."""
    silent = SilentNames()
    monkeypatch.setattr(dns_client, "TIMEOUT_SECONDS", 600.0)     # never answered, for the test's length
    attacker = setup.proxy(NetworkRules(domains=("*.slow.test",)), resolvers=(silent.address,))
    victim = setup.proxy(NetworkRules(domains=(API,)))
    asking: list[socket.socket] = []
    try:
        for number in range(4 * LOOKUPS_PER_OWNER):
            sock = socket.create_connection(("127.0.0.1", setup.ports[id(attacker)]), timeout=30)
            sock.sendall(f"CONNECT n{number}.slow.test:443 HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            asking.append(sock)
        # Its lookups beyond its share wait in its own queue (the control: 16 asked, all would run
        # in one shared pool, and 4 shared threads were all the proxies had).
        deadline = time.monotonic() + 30
        while setup.loop.load(attacker, LOOKUP) != (LOOKUPS_PER_OWNER, 3 * LOOKUPS_PER_OWNER) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert setup.loop.load(attacker, LOOKUP) == (LOOKUPS_PER_OWNER, 3 * LOOKUPS_PER_OWNER)
        assert silent.questions() == LOOKUPS_PER_OWNER

        raw, head = setup.connect(victim, API, setup.upstream.port)    # resolved, connected, tunnelled
        raw.close()
        refused, refusal = setup.connect(victim, "elsewhere.test", 443)  # refused, and reported
        refused.close()
        assert head.startswith(b"HTTP/1.1 200"), head
        assert refusal.startswith(b"HTTP/1.1 403"), refusal
        assert setup.event("domain").host == "elsewhere.test"
        # ...all while the sandbox's own lookups are every one still pending.
        assert setup.loop.load(attacker, LOOKUP) == (LOOKUPS_PER_OWNER, 3 * LOOKUPS_PER_OWNER)
        assert silent.questions() == LOOKUPS_PER_OWNER
        for sock in asking:
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1)

        silent.release()                   # its DNS answers at last: its own requests then get theirs
        for sock in asking:
            sock.settimeout(30)
            assert _read_all(sock).startswith(b"HTTP/1.1 403"), "queued, not dropped"
    finally:
        for sock in asking:
            sock.close()
        silent.close()


def test_intercepted_connections_have_a_cap_of_their_own(setup: Setup) -> None:
    """M5 (hostile r7): quotas.intercepted_connections_per_session. Past it an intercepted
    connection is refused with a 503 and reported, while a tunnel (the general cap's) still opens;
    one closed makes room again."""
    proxy = setup.proxy(_rules(f"{API}=GET:/v1/**"), intercepted_connections=2)
    held = [setup.tls(proxy), setup.tls(proxy)]                        # at the cap: both handshaken
    try:
        over, head = setup.connect(proxy, API, setup.upstream.port)
        over.close()
        assert head.startswith(b"HTTP/1.1 503"), head
        assert "quotas.intercepted_connections_per_session" in setup.event("cap").detail
        assert proxy.intercepted_cap.refused == 1
        tunnel, head = setup.connect(proxy, OTHER, setup.upstream.port)   # control: not intercepted
        tunnel.close()
        assert head.startswith(b"HTTP/1.1 200"), head
        held.pop().close()
        deadline = time.monotonic() + 30                                # the proxy sees the close
        while proxy.loop.call(lambda: proxy.intercepted_cap.active) > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        again = setup.tls(proxy)
        held.append(again)
        assert _ask(again, setup.upstream.port, "/v1/x").startswith(b"HTTP/1.1 ")
    finally:
        for tls in held:
            tls.close()


def test_the_daemon_gives_its_proxies_the_intercepted_connections_quota() -> None:
    """The setting reaches every session's proxy: read from the configuration (config.settings),
    passed by the daemon to the registry, by the registry to EgressProxies, by it to EgressProxy."""
    import inspect

    from sandboxd.service import daemon, sandbox_network
    from sandboxd.service.sessions import registry

    assert "intercepted_connections=s.intercepted_connections" in inspect.getsource(daemon)
    assert "intercepted_connections=intercepted_connections" in inspect.getsource(registry.SessionRegistry)
    assert "intercepted_connections=self._intercepted" in inspect.getsource(sandbox_network.EgressProxies)
    assert "intercepted_connections" in inspect.signature(EgressProxy.__init__).parameters
