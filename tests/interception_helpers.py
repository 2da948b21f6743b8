"""A loopback world for the interception room's tests: a test CA of our own, TLS upstreams that
trust nothing but it, and a minimal CONNECT front that hands each connection to ``Intercepted``
on a loop of its own (the egress proxy's dispatch is another track's; this stands in for it).

No network namespace, no daemon: every name the front is asked for is connected to 127.0.0.1 on
the CONNECT's port, so one upstream serves ``api.internet.test`` and ``other.test`` alike (its
certificate names both).
"""

from __future__ import annotations

import datetime
import http.server
import socket
import ssl
import threading
import time
from pathlib import Path
from typing import Any, Callable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from sandboxd.network.credentials import Credential, CredentialSet, Secret
from sandboxd.network.event_loop import READ
from sandboxd.network.interception.ca import SessionCA
from sandboxd.network.interception.http1 import RequestHook
from sandboxd.network.interception.intercepted import Intercepted, Interceptor
from sandboxd.network.interception.upstream_tls import upstream_context
from sandboxd.network.tcp_relay import Connecting, RelayLoop, TcpService, listen_tcp
from sandboxd.policy.domains import host_name
from sandboxd.policy.network import CredentialSpec

API, OTHER = "api.internet.test", "other.test"
SECRET = b"ghs_REALsecretVALUE0123456789abcdefXYZ"


class UpstreamCA:
    """A CA for the test upstreams (the stand-in for a public CA the host trusts)."""

    def __init__(self, names: tuple[str, ...] = (API, OTHER)) -> None:
        now = datetime.datetime.now(datetime.timezone.utc)
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "interception test CA")])
        self.cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(days=1))
                     .not_valid_after(now + datetime.timedelta(days=2))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .sign(self.key, hashes.SHA256()))
        leaf_key = ec.generate_private_key(ec.SECP256R1())
        leaf = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
                .issuer_name(subject).public_key(leaf_key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=2))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(name) for name in names]), critical=False)
                .sign(self.key, hashes.SHA256()))
        self.pem = self.cert.public_bytes(serialization.Encoding.PEM).decode("ascii")
        self.leaf_pem = leaf.public_bytes(serialization.Encoding.PEM)
        self.leaf_key_pem = leaf_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption())

    def server_context(self, tmp: Path) -> ssl.SSLContext:
        chain = tmp / "upstream-chain.pem"
        chain.write_bytes(self.leaf_pem + self.leaf_key_pem)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(chain)
        return context


class Recorder:
    """What an upstream received: each request's path and headers (name lower case)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.lock = threading.Lock()
        self.sse_gate = threading.Event()               # the client saw the first event

    def add(self, method: str, path: str, headers: dict[str, str]) -> None:
        with self.lock:
            self.requests.append((method, path, headers))


def _handler(recorder: Recorder) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _reply(self, body: bytes, status: int = 200, kind: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _note(self) -> None:
            recorder.add(self.command, self.path, {k.lower(): v for k, v in self.headers.items()})

        def do_GET(self) -> None:
            self._note()
            if self.path == "/check":
                good = self.headers.get("Authorization") == "Bearer " + SECRET.decode()
                self._reply(b"ok" if good else b"bad")
            elif self.path == "/echo-headers":
                self._reply("".join(f"{k}: {v}\n" for k, v in self.headers.items()).encode())
            elif self.path == "/sse":
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for number in range(3):
                    event = f"data: event {number}\n\n".encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.flush()
                    if number == 0:                     # the rest only once the client has the first
                        recorder.sse_gate.wait(30)
                self.wfile.write(b"0\r\n\r\n")
            else:
                self._reply(b"hello " + self.path.encode(), 200)

        def do_POST(self) -> None:
            self._note()
            length = int(self.headers.get("Content-Length", "0"))
            body = self.rfile.read(length)
            self._reply(b"got %d bytes: %s" % (len(body), body[:64]))

    return Handler


class Upstream:
    """An HTTPS server on 127.0.0.1 with the test CA's certificate (threads; test only)."""

    def __init__(self, ca: UpstreamCA, tmp: Path) -> None:
        self.recorder = Recorder()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.recorder))
        self.server.daemon_threads = True
        self.server.socket = ca.server_context(tmp).wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class RawUpstream:
    """A TLS server that records the exact bytes it received and answers each connection with
    ``answer`` (so a test sees how many requests the proxy passed on, byte for byte)."""

    def __init__(self, ca: UpstreamCA, tmp: Path, answer: bytes = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok") -> None:
        self.context, self.answer = ca.server_context(tmp), answer
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.received: list[bytes] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(raw,), daemon=True).start()

    def _one(self, raw: socket.socket) -> None:
        got = bytearray()
        try:
            with self.context.wrap_socket(raw, server_side=True) as conn:
                conn.settimeout(2)
                answered = 0
                while True:
                    try:
                        chunk = conn.recv(65536)
                    except (TimeoutError, OSError):
                        break
                    if not chunk:
                        break
                    got += chunk
                    while got.count(b"\r\n\r\n") > answered:   # one answer per head (enough for the corpus)
                        answered += 1
                        conn.sendall(self.answer)
        except (OSError, ssl.SSLError):
            pass
        with self.lock:
            self.received.append(bytes(got))

    def all_received(self) -> bytes:
        with self.lock:
            return b"".join(self.received)

    def close(self) -> None:
        self.listener.close()


class ConnectFront(TcpService):
    """Reads a CONNECT, connects to 127.0.0.1:port, and hands both sockets to ``Intercepted``."""

    def __init__(self, loop: RelayLoop, interceptor: Interceptor, credentials: CredentialSet | None,
                 on_request: RequestHook | None = None) -> None:
        super().__init__(listen_tcp("127.0.0.1", 0, step="test front"), "test-front", loop)
        self.port = self._listener.getsockname()[1]
        self.interceptor, self.credentials, self.on_request = interceptor, credentials, on_request
        self.reports: list[tuple[str, str, str, str]] = []
        self.mediated: list[Intercepted] = []
        self.closed_connections = 0

    def accepted(self, client: socket.socket, address: str) -> None:
        _Head(self, client)

    def report(self, kind: str, detail: str, method: str, target: str) -> None:
        self.reports.append((kind, detail, method, target))

    def on_closed(self) -> None:
        self.closed_connections += 1


class _Head:
    def __init__(self, front: ConnectFront, client: socket.socket) -> None:
        self.front, self.client, self.data = front, client, bytearray()
        front.loop.watch(client, 0, READ, self)

    def on_ready(self, _mask: int) -> None:
        chunk = self.client.recv(65536)
        if not chunk:
            self.close()
            return
        self.data += chunk
        if b"\r\n\r\n" not in self.data:
            return
        self.front.loop.watch(self.client, READ, 0, self)
        line = bytes(self.data).split(b"\r\n", 1)[0].decode()
        _, authority, _ = line.split(" ")
        name, _, port_text = authority.rpartition(":")
        host, port = host_name(name), int(port_text)
        assert host is not None
        upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        front = self.front

        def connected(error: OSError | None) -> None:
            if error is not None:
                upstream.close()
                self.client.close()
                return
            front.mediated.append(Intercepted(
                front.loop, self.client, upstream, host, port, interceptor=front.interceptor,
                credentials=front.credentials, on_request=front.on_request, report=front.report,
                on_close=front.on_closed))
        Connecting(front.loop, upstream, ("127.0.0.1", port), connected)

    def close(self) -> None:
        self.client.close()


def credential_set(port: int, phantom: str, host: str = API, secret: bytes = SECRET,
                   spec: CredentialSpec | None = None) -> CredentialSet:
    return CredentialSet([Credential(spec or CredentialSpec("TOKEN", host, port), Secret(secret), phantom)])


class World:
    """The session CA (its certificate in ``ca_file`` for the clients), the test CA's upstream, the
    front on a loop of its own."""

    def __init__(self, tmp: Path, *, credentials: Callable[[int], CredentialSet | None] | None = None,
                 on_request: RequestHook | None = None, raw: bool = False) -> None:
        self.test_ca = UpstreamCA()
        self.upstream: Upstream | RawUpstream = RawUpstream(self.test_ca, tmp) if raw else Upstream(self.test_ca, tmp)
        self.session_ca = SessionCA.generate("test0123456789")
        self.ca_file = tmp / "session-ca.pem"
        self.ca_file.write_bytes(self.session_ca.cert_pem())
        self.loop = RelayLoop("test-intercept")
        self.interceptor = Interceptor(self.session_ca, upstream_context(self.test_ca.pem))
        creds = credentials(self.upstream.port) if credentials is not None else None
        self.front = ConnectFront(self.loop, self.interceptor, creds, on_request).start()
        assert isinstance(self.front, ConnectFront)
        self.proxy = f"http://127.0.0.1:{self.front.port}"

    def url(self, path: str, host: str = API) -> str:
        return f"https://{host}:{self.upstream.port}{path}"

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def wait_closed(self, count: int, timeout: float = 20.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.front.closed_connections >= count:
                return True
            time.sleep(0.02)
        return False

    def exchange(self, request: bytes, host: str = API) -> bytes:
        """``request`` sent as is inside TLS through the front; what came back before it closed."""
        with socket.create_connection(("127.0.0.1", self.front.port), timeout=30) as raw:
            raw.sendall(f"CONNECT {host}:{self.upstream.port} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = raw.recv(4096)
                assert chunk, head
                head += chunk
            assert head.startswith(b"HTTP/1.1 200"), head
            with self.client_context().wrap_socket(raw, server_hostname=host) as tls:
                tls.sendall(request)
                answer = b""
                while True:
                    try:
                        chunk = tls.recv(65536)
                    except (ssl.SSLError, ConnectionError):
                        break
                    if not chunk:
                        break
                    answer += chunk
                return answer

    def close(self) -> None:
        self.front.close()
        self.loop.close()
        self.upstream.close()
