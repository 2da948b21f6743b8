"""The domain allowlist: a small filtering proxy (HTTP CONNECT, plain HTTP, SOCKS5) between an
isolated sandbox and the internet.

With ``allowed_domains`` the sandbox's namespace lets out nothing but DNS and TCP to this proxy
(kernel.nftables.egress_ruleset), so a program that ignores the proxy variables gets nothing. The
proxy listens on the host side of the sandbox's link, port 3128, and for each request:

- takes the destination *name* (CONNECT host:port, an absolute http:// URI, or a SOCKS5 domain
  address; a bare IP address is refused: there is no name to check),
- checks it against the allowlist (``pypi.org`` exactly, ``*.pypi.org`` any subdomain),
- resolves it itself (the configured resolvers, else the host's), refuses any address the
  host filter would (loopback, link-local and the metadata service, private ranges), and
  connects; or refuses, and reports the refusal (``on_denied``: an event in the daemon, a line on
  stderr for ``sandboxd run``).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from typing import Callable

from sandboxd.kernel.nftables import BLOCKED_RANGES
from sandboxd.supervisor.tcp_relay import TcpService, listen_tcp, relay

PROXY_PORT = 3128
_BLOCKED = [ipaddress.ip_network(r) for r in BLOCKED_RANGES]


def domain_allowed(name: str, patterns: "tuple[str, ...] | list[str]") -> bool:
    name = name.rstrip(".").lower()
    for pattern in patterns:
        pattern = pattern.rstrip(".").lower()
        if pattern.startswith("*."):
            if name.endswith(pattern[1:]) and name != pattern[2:]:
                return True
        elif name == pattern:
            return True
    return False


def proxy_environment(host_address: str) -> dict[str, str]:
    url = f"http://{host_address}:{PROXY_PORT}"
    env = {"NO_PROXY": "localhost,127.0.0.1", "ALL_PROXY": f"socks5h://{host_address}:{PROXY_PORT}"}
    for name in ("HTTP_PROXY", "HTTPS_PROXY"):
        env[name] = url
    return {**env, **{key.lower(): value for key, value in env.items()}}


def resolve(name: str, resolvers: "list[str] | tuple[str, ...]") -> str:
    """An IPv4 address of ``name``: a one-question A query to the resolvers, else the host's."""
    if not resolvers:
        return socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    query = struct.pack(">HHHHHH", os.getpid() & 0xFFFF, 0x0100, 1, 0, 0, 0)
    query += b"".join(bytes([len(label)]) + label.encode("idna") for label in name.rstrip(".").split(".")) + b"\0"
    query += struct.pack(">HH", 1, 1)
    for server in resolvers:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(3)
            try:
                sock.sendto(query, (server, 53))
                reply = sock.recv(1500)
            except OSError:
                continue
        count = struct.unpack(">H", reply[6:8])[0]
        offset = len(query)
        for _ in range(count):
            while True:                                   # the answer's name: labels, maybe ending in a pointer
                size = reply[offset]
                if size == 0 or size & 0xC0 == 0xC0:
                    offset += 1 if size == 0 else 2
                    break
                offset += 1 + size
            kind, _klass, _ttl, length = struct.unpack(">HHIH", reply[offset:offset + 10])
            offset += 10
            if kind == 1 and length == 4:
                return socket.inet_ntoa(reply[offset:offset + 4])
            offset += length
    raise OSError(f"cannot resolve {name}")


class EgressProxy:
    def __init__(self, listener: socket.socket, allowed: "tuple[str, ...]", *, client_address: str,
                 resolvers: "list[str] | tuple[str, ...]" = (),
                 on_denied: "Callable[[str, str], None]" = lambda destination, why: None) -> None:
        """``listener``: bound and listening (see ``listen``); only ``client_address`` (the
        sandbox) is served, once ``start`` is called. ``on_denied(destination, why)`` is told of
        every refusal."""
        self._listener, self._allowed, self._client = listener, allowed, client_address
        self._resolvers, self._on_denied = list(resolvers), on_denied
        self._service: TcpService | None = None

    @staticmethod
    def listen(host_address: str) -> socket.socket:
        return listen_tcp(host_address, PROXY_PORT, step="egress proxy",
                          hint=f"something else holds port {PROXY_PORT} on every address of the host")

    def start(self) -> "EgressProxy":
        proxy = self

        class Service(TcpService):
            def handle(self, client: socket.socket, address: str) -> None:
                if address != proxy._client:
                    client.close()                        # another sandbox's traffic: not ours to serve
                else:
                    proxy._serve(client)
        self._service = Service(self._listener, "sandboxd-egress-proxy")
        return self

    def close(self) -> None:
        if self._service is not None:
            self._service.close()
        else:
            self._listener.close()

    def _serve(self, client: socket.socket) -> None:
        client.settimeout(30)
        try:
            first = client.recv(1, socket.MSG_PEEK)
            if first == b"\x05":
                self._socks5(client)
            elif first:
                self._http(client)
        except (OSError, ValueError, IndexError, struct.error):
            pass
        finally:
            client.close()

    def _open(self, name: str, port: int) -> socket.socket | None:
        destination = f"{name}:{port}"
        if not domain_allowed(name, self._allowed):
            self._on_denied(destination, "not in the allowed domains")
            return None
        try:
            address = resolve(name, self._resolvers)
        except OSError:
            self._on_denied(destination, "the name does not resolve")
            return None
        if any(ipaddress.ip_address(address) in network for network in _BLOCKED):
            self._on_denied(destination, f"it resolves to {address}, a blocked range")
            return None
        try:
            return socket.create_connection((address, port), timeout=15)
        except OSError:
            return None

    def _http(self, client: socket.socket) -> None:
        head = b""
        while b"\r\n\r\n" not in head and len(head) < 65536:
            chunk = client.recv(4096)
            if not chunk:
                return
            head += chunk
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        method, target, version = request_line.split(" ", 2)
        if method.upper() == "CONNECT":
            name, _, port = target.rpartition(":")
            upstream = self._open(name.strip("[]"), int(port))
            if upstream is None:
                client.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                return
            client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            rest = head.split(b"\r\n\r\n", 1)[1]
            if rest:
                upstream.sendall(rest)
        else:
            if not target.startswith("http://"):
                client.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                return
            authority, _, path = target[len("http://"):].partition("/")
            name, _, port = authority.partition(":")
            upstream = self._open(name, int(port or 80))
            if upstream is None:
                client.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                return
            upstream.sendall(f"{method} /{path} {version}\r\n".encode("latin-1") + head.split(b"\r\n", 1)[1])
        relay(client, upstream)

    def _socks5(self, client: socket.socket) -> None:
        _version, count = client.recv(2)
        client.recv(count)                                # offered methods: we take "no authentication"
        client.sendall(b"\x05\x00")
        _v, command, _r, kind = client.recv(4)
        if kind == 3:
            name = client.recv(client.recv(1)[0]).decode("idna")
        else:
            client.recv(4 if kind == 1 else 16)
            name = ""
        port = struct.unpack(">H", client.recv(2))[0]
        if command != 1 or not name:
            if not name:
                self._on_denied(f"(an address):{port}", "SOCKS5 without a name: use socks5h")
            client.sendall(b"\x05\x02\x00\x01" + b"\0" * 6)   # connection not allowed by ruleset
            return
        upstream = self._open(name, port)
        if upstream is None:
            client.sendall(b"\x05\x02\x00\x01" + b"\0" * 6)
            return
        client.sendall(b"\x05\x00\x00\x01" + b"\0" * 6)
        relay(client, upstream)

