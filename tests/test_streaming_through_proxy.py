"""Streams pass an intercepted host without buffering (issue 26: SSE, chunked, MCP streamable HTTP,
WebSocket upgrade; a host with endpoint rules and no credential): through ``Intercepted`` against a
raw TLS upstream that sends its first piece, then waits until the client has it before sending the
rest. Were the proxy to hold a response until it ended, the client would never get the first piece
and the test would fail (the upstream gives up after 30 s and the client sees no first piece).
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from interception_helpers import API, World

CHUNKED = "Transfer-Encoding: chunked\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


# path -> (response head, first piece, the rest); the rest follows once the client has the first.
STREAMS: dict[str, tuple[str, bytes, bytes]] = {
    "/sse": (f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n{CHUNKED}\r\n",
             chunk(b"data: first\n\n"), chunk(b"data: second\n\n") + b"0\r\n\r\n"),
    "/download": (f"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n{CHUNKED}\r\n",
                  chunk(b"first-block"), chunk(b"second-block") + b"0\r\n\r\n"),
    # MCP streamable HTTP: a POSTed JSON-RPC request answered as an event stream, here one whose
    # length is the connection's (no Content-Length, no chunking: read until close).
    "/mcp": ("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n",
             b'event: message\ndata: {"jsonrpc":"2.0","method":"notifications/progress"}\n\n',
             b'event: message\ndata: {"jsonrpc":"2.0","id":1,"result":{}}\n\n'),
}


class StreamingUpstream:
    """A TLS server with the test CA's certificate answering STREAMS' paths, and a WebSocket
    upgrade at /ws (one frame out, then it echoes what it gets); ``gate`` is set by the test once
    the client has the first piece."""

    def __init__(self, world: World, tmp: Path) -> None:
        self.context = world.test_ca.server_context(tmp)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.gate = threading.Event()
        self.echoed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(raw,), daemon=True).start()

    def _one(self, raw: socket.socket) -> None:
        try:
            with self.context.wrap_socket(raw, server_side=True) as tls:
                head = b""
                while b"\r\n\r\n" not in head:
                    piece = tls.recv(65536)
                    if not piece:
                        return
                    head += piece
                path = head.split(b" ")[1].decode()
                if path == "/ws":
                    self._websocket(tls)
                    return
                first_line, *rest = STREAMS[path]
                tls.sendall(first_line.encode() + rest[0])
                if self.gate.wait(30):
                    tls.sendall(rest[1])
        except (OSError, ssl.SSLError):
            pass

    def _websocket(self, tls: ssl.SSLSocket) -> None:
        tls.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                    b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n" + b"\x81\x05hello")
        got = tls.recv(65536)                       # the client's frame, passed on unparsed
        if got:
            tls.sendall(got)
            self.echoed.set()
        self.gate.wait(30)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[World, StreamingUpstream]]:
    # A host with endpoint rules (so intercepted) and no credential.
    w = World(tmp_path, on_request=lambda method, target: None)
    upstream = StreamingUpstream(w, tmp_path)
    try:
        yield w, upstream
    finally:
        upstream.gate.set()
        upstream.close()
        w.close()


def through(world: World, port: int) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", world.front.port), timeout=30)
    raw.sendall(f"CONNECT {API}:{port} HTTP/1.1\r\nHost: {API}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        piece = raw.recv(4096)
        assert piece, head
        head += piece
    assert head.startswith(b"HTTP/1.1 200"), head
    return world.client_context().wrap_socket(raw, server_hostname=API)


def read_until(tls: ssl.SSLSocket, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        piece = tls.recv(65536)
        assert piece, data
        data += piece
    return data


@pytest.mark.parametrize("path, method, first, last", [
    ("/sse", "GET", b"data: first", b"data: second"),
    ("/download", "GET", b"first-block", b"second-block"),
    ("/mcp", "POST", b"notifications/progress", b'"id":1'),
])
def test_a_stream_passes_piece_by_piece(world: tuple[World, StreamingUpstream], path: str, method: str,
                                        first: bytes, last: bytes) -> None:
    front, upstream = world
    body = b'{"jsonrpc":"2.0","id":1,"method":"tools/call"}' if method == "POST" else b""
    with through(front, upstream.port) as tls:
        tls.sendall(f"{method} {path} HTTP/1.1\r\nHost: {API}:{upstream.port}\r\nAccept: text/event-stream\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        seen = read_until(tls, first)               # before the upstream sends the rest
        assert last not in seen
        upstream.gate.set()
        assert last in seen + read_until(tls, last)


def test_a_websocket_upgrade_without_a_credential_passes_frames_both_ways(
        world: tuple[World, StreamingUpstream]) -> None:
    front, upstream = world
    with through(front, upstream.port) as tls:
        tls.sendall(f"GET /ws HTTP/1.1\r\nHost: {API}:{upstream.port}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                    "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n".encode())
        seen = read_until(tls, b"\x81\x05hello")    # the upstream's frame, while it still holds the connection
        assert seen.startswith(b"HTTP/1.1 101")
        frame = b"\x81\x83\x00\x00\x00\x00abc"      # masked "abc" (key 0)
        tls.sendall(frame)
        assert read_until(tls, frame).endswith(frame)
        assert upstream.echoed.is_set()
