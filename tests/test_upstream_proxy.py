"""Behind a corporate proxy (issue 26 item 4; network.upstream): every connection the egress proxy
lets out (tunnel, intercepted, plain http://) goes on as a CONNECT through it, after our own checks
(allowlist, metadata, the range of what the name resolves to here); the upstream's certificate is
still verified end to end through it.

In-process, as test_egress_rules: a real EgressProxy, the test DNS server, the HTTPS and plain
upstreams, and a tiny CONNECT proxy of this test's own (threads) that records each CONNECT and
resolves every name to 127.0.0.1 itself (so a name this side cannot resolve still reaches it).
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from interception_helpers import API, OTHER, credential_set
from sandboxd.network.upstream import UpstreamRoute
from sandboxd.policy.network import CredentialSpec, NetworkRules
from test_egress_rules import PLAIN, Setup, _read_all, _rules

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the proxy connects from a namespace it enters (root)")

ONLY_THERE = "only-upstream.test"           # a name the test DNS server does not know


class CorporateProxy:
    """Answers ``CONNECT host:port`` with ``answer`` and, on a 2xx, pumps bytes to 127.0.0.1:port;
    ``targets`` keeps every CONNECT's authority."""

    def __init__(self, answer: bytes = b"HTTP/1.1 200 Connection established\r\n\r\n") -> None:
        self.answer = answer
        self.targets: list[str] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def route(self) -> UpstreamRoute:
        return UpstreamRoute("127.0.0.1", self.port)

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(client,), daemon=True).start()

    def _one(self, client: socket.socket) -> None:
        with client:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = client.recv(4096)
                if not chunk:
                    return
                head += chunk
            method, authority, _ = head.split(b"\r\n")[0].decode().split(" ")
            assert method == "CONNECT"
            self.targets.append(authority)
            client.sendall(self.answer)
            if not self.answer.startswith(b"HTTP/1.1 2"):
                return
            with socket.create_connection(("127.0.0.1", int(authority.rpartition(":")[2]))) as upstream:
                threading.Thread(target=_pump, args=(upstream, client), daemon=True).start()
                _pump(client, upstream)

    def close(self) -> None:
        self.listener.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while chunk := source.recv(65536):
            sink.sendall(chunk)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        pass


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Setup, CorporateProxy]]:
    setup, corporate = Setup(tmp_path), CorporateProxy()
    yield setup, corporate
    setup.close()
    corporate.close()


def test_a_tunnel_goes_through_the_upstream_proxy(world: tuple[Setup, CorporateProxy]) -> None:
    setup, corporate = world
    proxy = setup.proxy(_rules(), upstream=corporate.route())
    raw, head = setup.connect(proxy, OTHER, setup.upstream.port)
    assert head.startswith(b"HTTP/1.1 200"), head
    with ssl.create_default_context(cadata=setup.test_ca.pem).wrap_socket(raw, server_hostname=OTHER) as tls:
        tls.sendall(f"GET /t HTTP/1.1\r\nHost: {OTHER}\r\nConnection: close\r\n\r\n".encode())
        assert _read_all(tls).endswith(b"hello /t")
    assert corporate.targets == [f"{OTHER}:{setup.upstream.port}"]


def test_an_intercepted_host_gets_its_credential_through_the_upstream_proxy(world: tuple[Setup, CorporateProxy]) -> None:
    setup, corporate = world
    port = setup.upstream.port
    phantom = "sbxp_" + "b" * 40
    proxy = setup.proxy(NetworkRules(credentials=(CredentialSpec("TOKEN", API, port),)),
                        credentials=credential_set(port, phantom), upstream=corporate.route())
    raw, head = setup.connect(proxy, API, port)
    assert head.startswith(b"HTTP/1.1 200"), head
    with ssl.create_default_context(cafile=str(setup.ca_file)).wrap_socket(raw, server_hostname=API) as tls:
        tls.sendall(f"GET /check HTTP/1.1\r\nHost: {API}:{port}\r\nAuthorization: Bearer {phantom}\r\n"
                    "Connection: close\r\n\r\n".encode())
        assert _read_all(tls).endswith(b"ok")
    assert corporate.targets == [f"{API}:{port}"]


def test_the_upstreams_certificate_is_verified_end_to_end_through_it(world: tuple[Setup, CorporateProxy]) -> None:
    setup, corporate = world
    proxy = setup.proxy(_rules(f"{API}=GET:/**"), upstream=corporate.route(), trusted_pem="")
    raw, head = setup.connect(proxy, API, setup.upstream.port)
    answer = head + _read_all(raw)
    assert b"HTTP/1.1 502" in answer and b"is not trusted" in answer, answer
    assert corporate.targets == [f"{API}:{setup.upstream.port}"]          # it went through, and stopped there
    assert setup.upstream.recorder.requests == []


def test_plain_http_goes_through_the_upstream_proxy_as_a_connect(world: tuple[Setup, CorporateProxy]) -> None:
    setup, corporate = world
    proxy = setup.proxy(_rules(f"{PLAIN}=GET:/a"), upstream=corporate.route())
    port = setup.plain.port
    with socket.create_connection(("127.0.0.1", setup.ports[id(proxy)]), timeout=30) as sock:
        sock.sendall(f"GET http://{PLAIN}:{port}/a HTTP/1.1\r\nHost: {PLAIN}:{port}\r\n\r\n"
                     f"GET http://{PLAIN}:{port}/b HTTP/1.1\r\nHost: {PLAIN}:{port}\r\n\r\n".encode())
        sock.shutdown(socket.SHUT_WR)
        answer = _read_all(sock)
    assert b"plain /a" in answer and b"HTTP/1.1 403" in answer and b"plain /b" not in answer, answer
    assert corporate.targets == [f"{PLAIN}:{port}"]


def test_a_name_only_the_upstream_proxy_resolves_goes_through(world: tuple[Setup, CorporateProxy]) -> None:
    setup, corporate = world
    proxy = setup.proxy(_rules(domains=(ONLY_THERE,)), upstream=corporate.route())
    _, head = setup.connect(proxy, ONLY_THERE, setup.upstream.port)
    assert head.startswith(b"HTTP/1.1 200"), head
    assert corporate.targets == [f"{ONLY_THERE}:{setup.upstream.port}"]
    # Control: without the upstream proxy the same name is refused (it resolves nowhere here).
    _, head = setup.connect(setup.proxy(_rules(domains=(ONLY_THERE,))), ONLY_THERE, setup.upstream.port)
    assert head.startswith(b"HTTP/1.1 403"), head


def test_a_name_resolving_here_to_a_refused_range_stays_refused(world: tuple[Setup, CorporateProxy]) -> None:
    setup, corporate = world
    proxy = setup.proxy(_rules(), allowed_ranges=(), upstream=corporate.route())
    _, head = setup.connect(proxy, OTHER, setup.upstream.port)
    assert head.startswith(b"HTTP/1.1 403"), head
    assert b"127.0.0.0/8" in head and b"network.allowed_ranges" in head, head
    event = setup.event("range")
    assert "127.0.0.1" in event.detail and "network.allowed_ranges" in event.detail
    assert corporate.targets == []
    # Control: root named the range: the same name goes through.
    _, head = setup.connect(setup.proxy(_rules(), upstream=corporate.route()), OTHER, setup.upstream.port)
    assert head.startswith(b"HTTP/1.1 200"), head
    assert corporate.targets == [f"{OTHER}:{setup.upstream.port}"]


def test_a_metadata_name_never_reaches_the_upstream_proxy(world: tuple[Setup, CorporateProxy]) -> None:
    setup, corporate = world
    proxy = setup.proxy(_rules(domains=("metadata.google.internal", "metadata.test")), upstream=corporate.route(),
                        allowed_ranges=("127.0.0.0/8", "169.254.0.0/16"))
    for name in ("metadata.google.internal", "metadata.test"):
        _, head = setup.connect(proxy, name, 80)
        assert head.startswith(b"HTTP/1.1 403"), head
    assert corporate.targets == []


def test_an_upstream_proxy_refusal_is_a_502_quoted_printably(tmp_path: Path) -> None:
    setup, corporate = Setup(tmp_path), CorporateProxy(b"HTTP/1.1 407 Auth\x1b[31m needed\r\n\r\n")
    try:
        proxy = setup.proxy(_rules(), upstream=corporate.route())
        _, head = setup.connect(proxy, OTHER, setup.upstream.port)
        assert head.startswith(b"HTTP/1.1 502"), head
        event = setup.event("upstream")
        assert "407" in event.detail and "\x1b" not in event.detail, event
        assert corporate.targets == [f"{OTHER}:{setup.upstream.port}"]
    finally:
        setup.close()
        corporate.close()
