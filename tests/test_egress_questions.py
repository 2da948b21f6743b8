"""The egress proxy's end of ``unlisted = ask`` (issue 26 item 3): a connection to an unlisted
host, or a request no endpoint rule lets through, is held and asked about (network.questions)
instead of refused; the answer connects it, passes it, or refuses it.

In-process, as test_egress_rules (whose Setup this borrows): a real EgressProxy on a loop of its
own, a real DNS server, real upstreams on loopback. The asker is a stand-in for the daemon's
(service/network_questions): it records each question and answers when the test says so.
"""

from __future__ import annotations

import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from interception_helpers import API, OTHER
from sandboxd.network.egress_proxy import SOCKS_NOT_ALLOWED, EgressProxy
from sandboxd.network.interception.intercepted import Interceptor
from sandboxd.network.interception.upstream_tls import upstream_context
from sandboxd.network.questions import Answer, OnAnswer, Question
from sandboxd.network.tcp_relay import listen_tcp
from sandboxd.policy.network import NetworkRules, Unlisted, parse_endpoint
from test_egress_rules import LOOPBACK, PLAIN, Setup, _ask, _cut, _read_all

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the proxy connects from a namespace it enters (root)")

WAIT = 20.0


class FakeAsk:
    """Records each question with its on_answer; ``withdrawn`` counts withdraws."""

    def __init__(self) -> None:
        self.asked: list[tuple[Question, OnAnswer]] = []
        self.withdrawn: list[Question] = []
        self.threads: list[str] = []
        self._changed = threading.Condition()

    def __call__(self, question: Question, on_answer: OnAnswer) -> "callable":
        with self._changed:
            self.asked.append((question, on_answer))
            self.threads.append(threading.current_thread().name)
            self._changed.notify_all()

        def withdraw() -> None:
            with self._changed:
                self.withdrawn.append(question)
                self._changed.notify_all()
        return withdraw

    def wait(self, count: int) -> tuple[Question, OnAnswer]:
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.asked) >= count, WAIT), self.asked
            return self.asked[count - 1]

    def wait_withdrawn(self, count: int) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.withdrawn) >= count, WAIT), self.withdrawn


class AskSetup(Setup):
    def asking(self, rules: NetworkRules, ask: FakeAsk | None, allowed_ranges: tuple[str, ...] = (LOOPBACK,)
               ) -> EgressProxy:
        listener = listen_tcp("127.0.0.1", 0, step="test proxy")
        netns = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            proxy = EgressProxy(listener, rules, netns_fd=netns, resolvers=[self.names.address],
                                on_event=self.events.append, allowed_ranges=allowed_ranges,
                                interceptor=Interceptor(self.session_ca, upstream_context(self.test_ca.pem)),
                                ask=ask, loop=self.loop).start()
        finally:
            os.close(netns)
        self.proxies.append(proxy)
        self.ports[id(proxy)] = listener.getsockname()[1]
        return proxy

    def send_connect(self, proxy: EgressProxy, host: str, port: int) -> socket.socket:
        raw = socket.create_connection(("127.0.0.1", self.ports[id(proxy)]), timeout=30)
        raw.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        return raw


def _head(sock: socket.socket) -> bytes:
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            break
        head += chunk
    return head


def _nothing_yet(sock: socket.socket) -> bool:
    """Nothing has come back on ``sock`` (the proxy holds it)."""
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)
    return False


def _rules(*endpoints: str, domains: tuple[str, ...] = (API,), unlisted: Unlisted = Unlisted.ASK) -> NetworkRules:
    return NetworkRules(domains=domains, endpoints=tuple(parse_endpoint(text) for text in endpoints),
                        unlisted=unlisted)


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[AskSetup]:
    made = AskSetup(tmp_path)
    yield made
    made.close()


def test_an_unlisted_host_is_asked_allowed_once_then_asked_again_and_refused(setup: AskSetup) -> None:
    ask = FakeAsk()
    proxy = setup.asking(_rules(), ask)
    port = setup.upstream.port
    raw = setup.send_connect(proxy, OTHER, port)
    question, answer = ask.wait(1)
    # No proposal: the upstream's port is neither 80 nor 443, and a domain would allow every port.
    assert question == Question(host=OTHER, port=port, method="CONNECT", path="", scheme="https",
                                proposal="", proposal_kind="", why=f"{OTHER}:{port} is not allowed as CONNECT ")
    assert all(name.startswith("test-egress-rules-work") for name in ask.threads), "asked off the relay loop"
    assert _nothing_yet(raw)                                  # held: no answer to the CONNECT yet
    answer(Answer.ALLOW_ONCE)
    assert _head(raw).startswith(b"HTTP/1.1 200"), "allowed once, the tunnel opens"
    with ssl.create_default_context(cadata=setup.test_ca.pem).wrap_socket(raw, server_hostname=OTHER) as tls:
        tls.sendall(f"GET /once HTTP/1.1\r\nHost: {OTHER}\r\nConnection: close\r\n\r\n".encode())
        assert _read_all(tls).endswith(b"hello /once")
    again = setup.send_connect(proxy, OTHER, port)             # the next connection asks again
    ask.wait(2)[1](Answer.DENY)
    refused = _read_all(again)
    assert refused.startswith(b"HTTP/1.1 403"), refused
    assert f"{OTHER}:{port} is not among the allowed domains (allowed: {API})".encode() in refused, refused
    assert [path for _, path, _ in setup.upstream.recorder.requests] == ["/once"]


def test_allow_for_the_session_connects_the_held_connection(setup: AskSetup) -> None:
    ask = FakeAsk()
    proxy = setup.asking(_rules(), ask)
    raw = setup.send_connect(proxy, OTHER, setup.upstream.port)
    ask.wait(1)[1](Answer.ALLOW_SESSION)
    assert _head(raw).startswith(b"HTTP/1.1 200")
    raw.close()


def test_without_ask_or_under_refuse_an_unlisted_host_is_refused_at_once(setup: AskSetup) -> None:
    ask = FakeAsk()
    for proxy in (setup.asking(_rules(), None), setup.asking(_rules(unlisted=Unlisted.REFUSE), ask)):
        _, head = setup.connect(proxy, OTHER, setup.upstream.port)
        assert head.startswith(b"HTTP/1.1 403"), head
    assert ask.asked == []
    _, head = setup.connect(setup.asking(_rules(), ask), API, setup.upstream.port)   # control: a listed host
    assert head.startswith(b"HTTP/1.1 200") and ask.asked == []


@pytest.mark.parametrize("name", ["metadata.google.internal", "metadata.test"])
def test_metadata_is_never_asked(setup: AskSetup, name: str) -> None:
    ask = FakeAsk()
    proxy = setup.asking(_rules(), ask, allowed_ranges=(LOOPBACK, "169.254.0.0/16"))
    _, head = setup.connect(proxy, name, 80)
    assert head.startswith(b"HTTP/1.1 403"), head
    assert setup.event("metadata").host == name
    assert ask.asked == []


def test_a_refused_range_is_never_asked(setup: AskSetup) -> None:
    ask = FakeAsk()
    proxy = setup.asking(_rules(), ask, allowed_ranges=())     # loopback, where OTHER resolves, is refused
    _, head = setup.connect(proxy, OTHER, setup.upstream.port)
    assert head.startswith(b"HTTP/1.1 403"), head
    assert "127.0.0.1" in setup.event("range").detail
    assert ask.asked == []
    raw = setup.send_connect(setup.asking(_rules(), ask), OTHER, setup.upstream.port)   # control: named, asked
    ask.wait(1)
    raw.close()


def test_a_client_that_leaves_withdraws_its_question(setup: AskSetup) -> None:
    ask = FakeAsk()
    proxy = setup.asking(_rules(), ask)
    raw = setup.send_connect(proxy, OTHER, setup.upstream.port)
    question, answer = ask.wait(1)
    assert ask.withdrawn == []
    raw.close()
    ask.wait_withdrawn(1)
    assert ask.withdrawn == [question]
    answer(Answer.ALLOW_ONCE)                                  # late: nothing left to answer, nothing breaks
    _, head = setup.connect(proxy, API, setup.upstream.port)
    assert head.startswith(b"HTTP/1.1 200")


def test_socks5_is_asked_and_a_deny_is_a_socks_refusal(setup: AskSetup) -> None:
    ask = FakeAsk()
    proxy = setup.asking(_rules(), ask)
    with socket.create_connection(("127.0.0.1", setup.ports[id(proxy)]), timeout=30) as sock:
        sock.sendall(b"\x05\x01\x00")
        assert sock.recv(2) == b"\x05\x00"
        name = OTHER.encode()
        sock.sendall(b"\x05\x01\x00\x03" + bytes([len(name)]) + name + struct.pack(">H", setup.upstream.port))
        question, answer = ask.wait(1)
        assert (question.host, question.method, question.path) == (OTHER, "CONNECT", "")
        answer(Answer.DENY)
        assert sock.recv(10) == SOCKS_NOT_ALLOWED


def test_a_plain_request_is_asked_with_its_method_and_path_and_each_request_asks(setup: AskSetup) -> None:
    ask = FakeAsk()
    proxy = setup.asking(_rules(), ask)
    port = setup.plain.port
    with socket.create_connection(("127.0.0.1", setup.ports[id(proxy)]), timeout=30) as sock:
        sock.sendall(f"GET http://{PLAIN}:{port}/a/1?token=x HTTP/1.1\r\nHost: {PLAIN}:{port}\r\n\r\n"
                     f"GET http://{PLAIN}:{port}/b HTTP/1.1\r\nHost: {PLAIN}:{port}\r\n\r\n".encode())
        sock.shutdown(socket.SHUT_WR)
        question, answer = ask.wait(1)
        assert (question.host, question.port, question.method, question.path, question.scheme) == (
            PLAIN, port, "GET", "/a/1", "http")                # never the query, headers or body
        answer(Answer.ALLOW_ONCE)
        second, answer = ask.wait(2)                           # the next request of the connection
        assert (second.method, second.path) == ("GET", "/b")
        answer(Answer.DENY, "sandboxd: refused by the test")
        received = _read_all(sock)
    assert b"plain /a/1" in received and b"plain /b" not in received, received
    assert b"HTTP/1.1 403" in received and b"refused by the test" in received, received


def test_an_endpoint_miss_is_asked_as_an_endpoint_question(setup: AskSetup) -> None:
    ask = FakeAsk()
    proxy = setup.asking(_rules(f"{API}=GET:/repos/*/issues/**"), ask)
    allowed = setup.https(proxy, "GET", "/repos/a/issues/1")      # control: the rule's own, not asked
    assert allowed.startswith(b"HTTP/1.1 200") and ask.asked == []
    results: list[bytes] = []
    first = threading.Thread(target=lambda: results.append(setup.https(proxy, "POST", "/repos/a/issues/12")))
    first.start()
    question, answer = ask.wait(1)
    assert question == Question(host=API, port=setup.upstream.port, method="POST", path="/repos/a/issues/12",
                                scheme="https", proposal=f"{API}=POST:/repos/a/issues/*", proposal_kind="endpoint",
                                why=f"POST /repos/a/issues/12 matches none of the 1 endpoint rule for {API}")
    answer(Answer.ALLOW_ONCE)
    first.join(WAIT)
    assert results[0].startswith(b"HTTP/1.1 200"), results
    second = threading.Thread(target=lambda: results.append(setup.https(proxy, "POST", "/repos/a/issues/13")))
    second.start()
    ask.wait(2)[1](Answer.DENY)
    second.join(WAIT)
    assert results[1].startswith(b"HTTP/1.1 403"), results
    assert b"POST /repos/a/issues/13 is not among the endpoint rules" in results[1]
    assert [(m, p) for m, p, _ in setup.upstream.recorder.requests] == [
        ("GET", "/repos/a/issues/1"), ("POST", "/repos/a/issues/12")]


def test_a_held_request_whose_connection_closes_is_withdrawn(setup: AskSetup) -> None:
    ask = FakeAsk()
    proxy = setup.asking(_rules(f"{API}=GET:/only"), ask)
    raw, head = setup.connect(proxy, API, setup.upstream.port)
    assert head.startswith(b"HTTP/1.1 200")
    tls = ssl.create_default_context(cafile=str(setup.ca_file)).wrap_socket(raw, server_hostname=API)
    tls.sendall(f"POST /other HTTP/1.1\r\nHost: {API}:{setup.upstream.port}\r\nContent-Length: 0\r\n\r\n".encode())
    question, _ = ask.wait(1)
    assert question.proposal_kind == "endpoint"
    tls.close()
    ask.wait_withdrawn(1)
    deadline = time.monotonic() + WAIT
    while proxy.cap.active and time.monotonic() < deadline:     # its connection is released too
        time.sleep(0.02)
    assert proxy.cap.active == 0


def _tunnel(setup: AskSetup, proxy: EgressProxy, ask: FakeAsk, count: int, answer: Answer) -> ssl.SSLSocket:
    """A CONNECT to the unlisted OTHER, asked (the ``count``th question) and answered ``answer``."""
    raw = setup.send_connect(proxy, OTHER, setup.upstream.port)
    ask.wait(count)[1](answer)
    assert _head(raw).startswith(b"HTTP/1.1 200")
    return ssl.create_default_context(cadata=setup.test_ca.pem).wrap_socket(raw, server_hostname=OTHER)


def test_a_tunnel_allowed_once_is_cut_when_its_host_gains_endpoint_rules(setup: AskSetup) -> None:
    """Hostile r7b M5: the person's answer spares the connection the allowlist cut only; once the
    host has endpoint rules, its requests must be read, whatever the answer was."""
    ask = FakeAsk()
    proxy = setup.asking(_rules(), ask)
    port = setup.upstream.port
    tls = _tunnel(setup, proxy, ask, 1, Answer.ALLOW_ONCE)
    assert _ask(tls, port, "/first").startswith(b"HTTP/1.1 200")
    proxy.update(_rules(unlisted=Unlisted.REFUSE))              # OTHER still unlisted: the answer stands
    assert _ask(tls, port, "/still").startswith(b"HTTP/1.1 200")
    proxy.update(_rules(f"{OTHER}=GET:/first", domains=(API, OTHER), unlisted=Unlisted.REFUSE))
    assert _cut(tls)
    assert "its requests must now be read" in setup.event("policy").detail
    assert [path for _, path, _ in setup.upstream.recorder.requests] == ["/first", "/still"]


def test_a_tunnel_allowed_for_the_session_is_cut_when_the_owner_removes_its_host(setup: AskSetup) -> None:
    """Allow for the session became a rule of the allowlist: removing it cuts the connection.
    Control: a tunnel to the same host allowed once stays (its answer was never the allowlist)."""
    ask = FakeAsk()
    proxy = setup.asking(_rules(), ask)
    port = setup.upstream.port
    once = _tunnel(setup, proxy, ask, 1, Answer.ALLOW_ONCE)
    raw = setup.send_connect(proxy, OTHER, port)
    answer = ask.wait(2)[1]
    proxy.update(_rules(domains=(API, OTHER)))                  # the rule added, as the daemon does before answering
    answer(Answer.ALLOW_SESSION)
    assert _head(raw).startswith(b"HTTP/1.1 200")
    granted = ssl.create_default_context(cadata=setup.test_ca.pem).wrap_socket(raw, server_hostname=OTHER)
    assert _ask(granted, port, "/granted").startswith(b"HTTP/1.1 200")
    proxy.update(_rules())                                      # the owner removes OTHER
    assert _cut(granted)
    assert "no longer allowed" in setup.event("policy").detail
    assert _ask(once, port, "/once").startswith(b"HTTP/1.1 200")
