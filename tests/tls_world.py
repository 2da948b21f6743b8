"""A stand-in internet for credentials and interception tests: TLS upstreams, git over HTTPS, and
a DNS server of test names, added to the world of tests/test_isolated_network.py.

Use::

    from tls_world import API_HOST, OTHER_HOST, TlsWorld, tls_world   # noqa: F401 (the fixture)

    def test_x(tls_world: TlsWorld) -> None:
        tls_world.resolvers        # ["198.51.100.54"]: --dns for `sandboxd run`, network.dns for a daemon
        tls_world.ca_file          # the upstreams' test CA (PEM, root's, 0644): network.upstream_ca_file
                                   #   for a daemon (tls_world.daemon_config()), SSL_CERT_FILE for `sandboxd run`
        tls_world.url("/check")    # https://api.test.example/check
        tls_world.api.seen         # what api.test.example received: Seen(method, path, headers, body)
        tls_world.other.seen       # the same for the second allowed host, other.test.example

Built on test_isolated_network.World (its gateway namespace, its routes for 198.51.100.0/24 and
the metadata address, its machine-wide lock: one world at a time, a second test run waits; the
namespaces and host links are named after a random tag, so another sandboxd on the machine is left
alone and its links, addresses and pool are never touched). Added to the gateway namespace:

- ``API_HOST`` on 198.51.100.20:443 and ``OTHER_HOST`` on 198.51.100.21:443, HTTPS (HTTP/1.1) with a
  certificate of the world's own test CA (interception_helpers.UpstreamCA). Each records every
  request (method, path, lower-case headers, body). Paths:
  ``/check`` (``ok`` when Authorization is ``Bearer`` + interception_helpers.SECRET, else ``bad``),
  ``/echo-headers``; ``/sse?count=N&gap=S``: N server-sent events S seconds apart (chunked);
  ``/sse-gated?count=N``: each event after the first only once the client has fetched ``/sse-ack``
  (proof without timing that nothing buffered the stream: ``Upstream.gate_timeouts`` counts the
  events sent because no ack came within GATE_SECONDS); ``/chunked?count=N``: N chunks;
  ``/ws``: a WebSocket upgrade that echoes every text or binary message; ``/git/...``: git's smart
  HTTP (git http-backend) for ``tls_world.git_url`` (a bare repository with one commit, pushes
  allowed); anything else ``hello PATH``; POST/PUT/PATCH/DELETE answer ``got N bytes: ...``.
- a DNS server on ``NAMES`` (198.51.100.54:53, UDP) answering A queries for ``NAMES`` (API_HOST,
  OTHER_HOST, META_HOST → 169.254.169.254, the world's fake metadata service; the older world's
  internet.test too), an empty answer for other types of those names, NXDOMAIN for the rest.

The servers are threads of the test process whose listening sockets were made inside the gateway
namespace (the thread enters it only to create them), so a test reads ``seen`` directly.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import shutil
import socket
import ssl
import struct
import subprocess
import tempfile
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from conftest import BASE_ENV
from interception_helpers import SECRET, Recorder, UpstreamCA, _handler
from sandboxd.kernel import namespaces
from test_isolated_network import INTERNET, METADATA, World, sh

API_HOST, OTHER_HOST, META_HOST = "api.test.example", "other.test.example", "meta.test.example"
API_ADDRESS, OTHER_ADDRESS, NAMES = "198.51.100.20", "198.51.100.21", "198.51.100.54"
NAME_TABLE: dict[str, str] = {API_HOST: API_ADDRESS, OTHER_HOST: OTHER_ADDRESS, META_HOST: METADATA,
                              "internet.test": INTERNET}
GATE_SECONDS = 30.0
WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
__all__ = ["API_HOST", "META_HOST", "NAMES", "OTHER_HOST", "SECRET", "Seen", "TlsWorld", "Upstream", "tls_world"]


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class WorldRecorder(Recorder):
    """interception_helpers.Recorder, with each request's body as well (``seen``)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Seen] = []
        self.acks = threading.Semaphore(0)
        self.gate_timeouts = 0

    def add(self, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> None:
        super().add(method, path, headers)
        with self.lock:
            self.seen.append(Seen(method, path, headers, body))


@contextlib.contextmanager
def inside(netns: str) -> Iterator[None]:
    """This thread in the named network namespace (``ip netns``) for the block: sockets made
    there stay bound to it."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    target = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        namespaces.setns(target, namespaces.CLONE_NEWNET)
        try:
            yield
        finally:
            namespaces.setns(own, namespaces.CLONE_NEWNET)
    finally:
        os.close(target)
        os.close(own)


def _world_handler(recorder: WorldRecorder, git_root: Path) -> type:
    base: Any = _handler(recorder)

    class Handler(base):                                   # type: ignore[misc]
        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                body = bytearray()
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    body += self.rfile.read(size)
                    self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return bytes(body)
            return bytes(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

        def _record(self, body: bytes = b"") -> None:
            recorder.add(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body)

        def _note(self) -> None:                           # the base's GET paths record through here
            self._record()

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def _stream_head(self, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

        def do_GET(self) -> None:
            path, _, query = self.path.partition("?")
            options = {k: v[-1] for k, v in urllib.parse.parse_qs(query).items()}
            count = int(options.get("count", "3"))
            if path.startswith("/git/"):
                self._git(b"")
            elif path == "/ws" and self.headers.get("Upgrade", "").lower() == "websocket":
                self._record()
                self._websocket()
            elif path == "/sse":
                self._record()
                self._stream_head("text/event-stream")
                for number in range(count):
                    if number:
                        threading.Event().wait(float(options.get("gap", "0.3")))
                    self._chunk(f"id: {number}\ndata: event {number}\n\n".encode())
                self._chunk(b"")
            elif path == "/sse-gated":
                self._record()
                self._stream_head("text/event-stream")
                for number in range(count):
                    if number and not recorder.acks.acquire(timeout=GATE_SECONDS):
                        with recorder.lock:
                            recorder.gate_timeouts += 1
                    self._chunk(f"id: {number}\ndata: event {number}\n\n".encode())
                self._chunk(b"")
            elif path == "/sse-ack":
                recorder.acks.release()
                self._record()
                self._reply(b"ack")
            elif path == "/chunked":
                self._record()
                self._stream_head("text/plain")
                for number in range(count):
                    self._chunk(f"chunk {number}\n".encode())
                self._chunk(b"")
            else:
                super().do_GET()

        def _other(self) -> None:
            if self.path.startswith("/git/"):
                self._git(self._body())
                return
            body = self._body()
            self._record(body)
            self._reply(b"got %d bytes: %s" % (len(body), body[:64]))

        do_POST = do_PUT = do_PATCH = do_DELETE = _other

        def _git(self, body: bytes) -> None:
            """One request of git's smart HTTP, through git http-backend (CGI)."""
            self._record(body)
            path, _, query = self.path.partition("?")
            env = {**BASE_ENV, "GIT_PROJECT_ROOT": str(git_root), "GIT_HTTP_EXPORT_ALL": "1",
                   "PATH_INFO": path[len("/git"):], "QUERY_STRING": query, "REQUEST_METHOD": self.command,
                   "CONTENT_TYPE": self.headers.get("Content-Type", ""), "CONTENT_LENGTH": str(len(body)),
                   "GIT_PROTOCOL": self.headers.get("Git-Protocol", ""), "REMOTE_USER": "world",
                   "REMOTE_ADDR": self.client_address[0],
                   "HTTP_CONTENT_ENCODING": self.headers.get("Content-Encoding", "")}
            out = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True,
                                 timeout=60).stdout
            separator = b"\r\n\r\n" if b"\r\n\r\n" in out else b"\n\n"
            head, _, payload = out.partition(separator)
            status, headers = 200, []
            for line in head.decode("latin-1").splitlines():
                name, _, value = line.partition(":")
                if name.lower() == "status":
                    status = int(value.split()[0])
                elif name:
                    headers.append((name, value.strip()))
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _websocket(self) -> None:
            """RFC 6455's handshake, then every text/binary message echoed until a close."""
            key = self.headers.get("Sec-WebSocket-Key", "").encode()
            accept = base64.b64encode(hashlib.sha1(key + WS_GUID).digest()).decode()
            self.send_response(101)
            self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade")
            self.send_header("Sec-WebSocket-Accept", accept)
            self.end_headers()
            self.wfile.flush()
            while True:
                head = self.rfile.read(2)
                if len(head) < 2:
                    return
                opcode, length = head[0] & 0x0F, head[1] & 0x7F
                if length == 126:
                    length = struct.unpack(">H", self.rfile.read(2))[0]
                elif length == 127:
                    length = struct.unpack(">Q", self.rfile.read(8))[0]
                mask = self.rfile.read(4) if head[1] & 0x80 else b"\0\0\0\0"
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(length)))
                self.wfile.write(ws_frame(opcode, data))
                self.wfile.flush()
                if opcode == 8:
                    self.close_connection = True
                    return

    return Handler


def ws_frame(opcode: int, data: bytes, mask: bytes = b"") -> bytes:
    """One final WebSocket frame (masked when ``mask``, as a client must send)."""
    size = len(data)
    extended = (bytes([size]) if size < 126 else b"\x7e" + struct.pack(">H", size) if size < 65536
                else b"\x7f" + struct.pack(">Q", size))
    if mask:
        extended = bytes([extended[0] | 0x80]) + extended[1:] + mask
        data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
    return bytes([0x80 | opcode]) + extended + data


class Upstream:
    """One HTTPS host of the world: a threading HTTP/1.1 server whose listener lives in the
    gateway namespace."""

    def __init__(self, netns: str, address: str, context: ssl.SSLContext, git_root: Path) -> None:
        self.recorder = WorldRecorder()
        with inside(netns):
            self.server = ThreadingHTTPServer((address, 443), _world_handler(self.recorder, git_root))
        self.server.daemon_threads = True
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def seen(self) -> list[Seen]:
        with self.recorder.lock:
            return list(self.recorder.seen)

    @property
    def gate_timeouts(self) -> int:
        return self.recorder.gate_timeouts

    def clear(self) -> None:
        with self.recorder.lock:
            self.recorder.seen.clear()
            self.recorder.requests.clear()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def dns_answer(query: bytes, table: dict[str, str]) -> bytes | None:
    """The answer to one DNS query: A records from ``table``, an empty answer for other types of a
    known name, NXDOMAIN otherwise (None: not a query we can read)."""
    try:
        labels, i = [], 12
        while query[i]:
            labels.append(query[i + 1:i + 1 + query[i]].decode("ascii").lower())
            i += 1 + query[i]
        qtype = struct.unpack(">H", query[i + 1:i + 3])[0]
    except (IndexError, UnicodeDecodeError, struct.error):
        return None
    address = table.get(".".join(labels))
    answers = 1 if address and qtype == 1 else 0
    flags = 0x8180 if address else 0x8183
    reply = query[:2] + struct.pack(">HHHHH", flags, 1, answers, 0, 0) + query[12:i + 5]
    if answers:
        reply += b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 60, 4) + socket.inet_aton(address or "")
    return reply


class NameServer:
    def __init__(self, netns: str, address: str, table: dict[str, str]) -> None:
        with inside(netns):
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.bind((address, 53))
        self.sock.settimeout(0.2)
        self.table, self.stopped = table, threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                query, peer = self.sock.recvfrom(512)
            except TimeoutError:
                continue
            except OSError:
                return
            reply = dns_answer(query, self.table)
            if reply is not None:
                self.sock.sendto(reply, peer)

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(5)
        self.sock.close()


class TlsWorld:
    """The world (see the module's docstring); ``build()`` then ``teardown()``."""

    def __init__(self) -> None:
        self.world = World()
        self.base = Path(tempfile.mkdtemp(prefix="sbx-tlsworld-", dir="/var/tmp"))
        os.chmod(self.base, 0o755)
        self.ca = UpstreamCA((API_HOST, OTHER_HOST))
        self.ca_file = self.base / "upstream-ca.pem"
        self.git_root = self.base / "git"
        self.api: Upstream                                 # these three: set by build
        self.other: Upstream
        self.names: NameServer
        self.resolvers = [NAMES]
        self.git_url = f"https://{API_HOST}/git/repo.git"

    def build(self) -> "TlsWorld":
        self.world.build()
        gw = self.world.gw
        sh(*(f"ip -n {gw} addr add {address}/32 dev lo" for address in (API_ADDRESS, OTHER_ADDRESS, NAMES)))
        self.ca_file.write_text(self.ca.pem)
        os.chmod(self.ca_file, 0o644)
        self._make_repository()
        context = self.ca.server_context(self.base)
        (self.base / "upstream-chain.pem").unlink()        # the key is in the context now
        self.api = Upstream(gw, API_ADDRESS, context, self.git_root)
        self.other = Upstream(gw, OTHER_ADDRESS, context, self.git_root)
        self.names = NameServer(gw, NAMES, NAME_TABLE)
        return self

    def _make_repository(self) -> None:
        env = {**BASE_ENV, "GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "world", "GIT_COMMITTER_NAME": "world",
               "GIT_AUTHOR_EMAIL": "world@test.example", "GIT_COMMITTER_EMAIL": "world@test.example"}
        work = self.base / "seed"
        for args in (["init", "-q", "-b", "main", str(work)], ["-C", str(work), "commit", "-q", "--allow-empty",
                                                                 "-m", "first"],
                     ["clone", "-q", "--bare", str(work), str(self.git_root / "repo.git")],
                     ["-C", str(self.git_root / "repo.git"), "config", "http.receivepack", "true"]):
            subprocess.run(["git", *args], check=True, env=env, capture_output=True, timeout=60)
        shutil.rmtree(work)

    def url(self, path: str, host: str = API_HOST) -> str:
        return f"https://{host}{path}"

    def daemon_config(self) -> str:
        """The [network] lines a daemon of the tests needs to reach the world (a TOML table)."""
        return (f'[network]\nupstream_ca_file = "{self.ca_file}"\n'
                f"dns = [{', '.join(repr(r).replace(chr(39), chr(34)) for r in self.resolvers)}]\n")

    def run_env(self) -> dict[str, str]:
        """`sandboxd run`'s environment: BASE_ENV, with the world's CA as the upstreams' trust."""
        return {**BASE_ENV, "SSL_CERT_FILE": str(self.ca_file)}

    def host_context(self) -> ssl.SSLContext:
        """A TLS context trusting the world's CA, for controls run on the host."""
        return ssl.create_default_context(cafile=str(self.ca_file))

    def connect(self, host: str = API_HOST, timeout: float = 10.0) -> ssl.SSLSocket:
        """A TLS connection from the host straight to one of the world's hosts (a control)."""
        raw = socket.create_connection((NAME_TABLE[host], 443), timeout=timeout)
        return self.host_context().wrap_socket(raw, server_hostname=host)

    def teardown(self) -> None:
        for name in ("api", "other", "names"):
            server = getattr(self, name, None)
            if server is not None:
                server.close()
        self.world.teardown()
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture(scope="module")
def tls_world() -> Iterator[TlsWorld]:
    world = TlsWorld()
    try:
        yield world.build()
    finally:
        world.teardown()
