"""The egress proxy's relays under a hostile client or upstream: TCP_NODELAY on every relayed
socket, a request head that must end in time (each request of a connection), bounded buffers
whatever one side sends while the other never reads.

Loopback, no daemon: tcp_relay.Relay on real TCP sockets, and intercepted connections through
interception_helpers' CONNECT front (World).
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from interception_helpers import API, World
from sandboxd.network.interception import intercepted
from sandboxd.network.tcp_relay import Relay, RelayLoop


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    try:
        yield w
    finally:
        w.close()


def tls_through(world: World, host: str = API, receive_buffer: int = 0) -> ssl.SSLSocket:
    """A TLS connection to ``host`` through the front, trusting the session's CA (``receive_buffer``:
    its SO_RCVBUF, when given)."""
    raw = socket.socket()
    raw.settimeout(30)
    if receive_buffer:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    raw.connect(("127.0.0.1", world.front.port))
    raw.sendall(f"CONNECT {host}:{world.upstream.port} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = raw.recv(4096)
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 200"), head
    return world.client_context().wrap_socket(raw, server_hostname=host)


def response(tls: ssl.SSLSocket) -> bytes:
    """One response with a Content-Length, read whole."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = tls.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += tls.recv(65536)
    return head + b"\r\n\r\n" + body


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(65536) == b""
    except (ConnectionError, ssl.SSLError):
        return True


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    return a, b


def test_a_tunnels_sockets_are_set_tcp_nodelay() -> None:
    loop = RelayLoop("test-nodelay")
    (client, ours_a), (ours_b, upstream) = tcp_pair(), tcp_pair()
    try:
        for sock in (ours_a, ours_b):                    # control: off by default
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
        for sock in (ours_a, ours_b):
            sock.setblocking(False)
        loop.call(lambda: Relay(loop, ours_a, ours_b))
        assert ours_a.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        assert ours_b.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        loop.close()
        for sock in (client, upstream):
            sock.close()


def test_an_intercepted_connections_sockets_are_set_tcp_nodelay(world: World) -> None:
    with tls_through(world) as tls:
        tls.sendall(f"GET /a HTTP/1.1\r\nHost: {API}:{world.upstream.port}\r\n\r\n".encode())
        assert response(tls).startswith(b"HTTP/1.1 200")
        connection = world.front.mediated[0]
        for side in world.loop.call(lambda: (connection._client.sock, connection._upstream.sock)):
            assert side.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


@pytest.mark.parametrize("earlier", [0, 1])
def test_a_request_head_that_does_not_end_in_time_closes_the_connection(
        world: World, monkeypatch: pytest.MonkeyPatch, earlier: int) -> None:
    monkeypatch.setattr(intercepted, "REQUEST_HEAD_SECONDS", 0.5)
    host = f"Host: {API}:{world.upstream.port}\r\n"
    with tls_through(world) as tls:
        for _ in range(earlier):                         # each request has the limit, not just the first
            tls.sendall(f"GET /a HTTP/1.1\r\n{host}\r\n".encode())
            assert response(tls).startswith(b"HTTP/1.1 200")
        tls.sendall(f"GET /slow HTTP/1.1\r\n{host}".encode())    # never ends
        assert closed(tls)
    assert any(kind == "timeout" and "request head" in detail for kind, detail, _, _ in world.front.reports)
    # Control: a head sent in pieces that ends in time is answered.
    with tls_through(world) as tls:
        tls.sendall(b"GET /pieces HTTP/1.1\r\n")
        time.sleep(0.1)
        tls.sendall(f"{host}\r\n".encode())
        assert response(tls).startswith(b"HTTP/1.1 200")


def test_a_sandbox_that_sends_fast_and_never_reads_is_blocked_not_buffered(tmp_path: Path) -> None:
    """Pipelined requests sent as fast as the socket takes them, no answer ever read: h11 holds a
    pipelined request while the one before is answered, so unread answers once let the proxy read
    (and hold) without end (the first hostile pass grew the daemon 400 MiB). Bounded now: the
    sender blocks after the kernel's buffers and the proxy's few hundred KiB."""
    from sandboxd.network.interception.http1 import MAX_BACKLOG
    from sandboxd.network.tcp_relay import BUFFER_LIMIT, CHUNK

    world = World(tmp_path)                              # it answers with the path: as big as the request
    try:
        tls = tls_through(world, receive_buffer=4096)    # the kernel holds little of what is not read
        request = f"GET /{'x' * 8000} HTTP/1.1\r\nHost: {API}:{world.upstream.port}\r\n\r\n".encode()
        burst, sent, limit = request * 8, 0, 64 << 20
        tls.settimeout(3)
        try:
            while sent < limit:
                tls.sendall(burst)
                sent += len(burst)
        except TimeoutError:
            pass
        connection = world.front.mediated[0]

        def held() -> tuple[int, int, int, int]:
            assert connection.mediator is not None
            return (len(connection._client.out), len(connection._upstream.out), *connection.mediator.backlog)

        client_out, upstream_out, backlog_client, backlog_upstream = world.loop.call(held)
        assert sent < limit, "the sender was never blocked"
        assert client_out <= BUFFER_LIMIT + 2 * CHUNK and upstream_out <= BUFFER_LIMIT + 2 * CHUNK
        assert backlog_client <= MAX_BACKLOG + CHUNK and backlog_upstream <= MAX_BACKLOG + CHUNK
        tls.close()
    finally:
        world.close()


def test_an_upstream_that_answers_unasked_is_cut_not_passed_or_buffered(tmp_path: Path) -> None:
    """The upstream answers one request with 8 MiB of further responses nobody asked for. They were
    passed on (the sandbox would take one for the answer to its next request) or held by h11 without
    bound; now the connection is cut once the asked-for answer has passed."""
    world = World(tmp_path, raw=True)
    one = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    world.upstream.answer = one * ((8 << 20) // len(one))          # type: ignore[union-attr]
    try:
        with tls_through(world) as tls:
            tls.sendall(f"GET /a HTTP/1.1\r\nHost: {API}:{world.upstream.port}\r\n\r\n".encode())
            answer = b""
            while True:
                try:
                    piece = tls.recv(65536)
                except (ConnectionError, ssl.SSLError):
                    break
                if not piece:
                    break
                answer += piece
        assert answer == one, answer[:300]                      # the asked-for answer, and nothing more
        assert world.wait_closed(1)
        assert any(kind == "upstream" and "no request" in detail for kind, detail, _, _ in world.front.reports)
    finally:
        world.close()
