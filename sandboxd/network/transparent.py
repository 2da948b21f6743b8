"""Transparent capture: the egress proxy's way of serving programs that ignore HTTP(S)_PROXY.

Node 20's built-in ``fetch``, Go programs built without the proxy hook, a static binary: in a
proxied isolated sandbox they connect straight to an address, which the sandbox's own filter used
to reject. Now its namespace redirects TCP to ports 80 and 443 of any outside address (but the
policy's allowed hosts, reached directly, and the proxy's own sockets) to a second listener of the
egress proxy, ``PROXY_ADDRESS``:TRANSPARENT_PORT (kernel.nftables.egress_ruleset), bound before the
sandbox exists (``listen_captured``) and served with ``EgressProxy.serve_captured``.

A captured connection is judged by the NAME it carries, never by the address it was sent to (a
program's DNS answer is its own: it could be anything). SO_ORIGINAL_DST is read for the port only:

- 443: the server name (SNI) of the TLS ClientHello, which is left unread in the socket (peeked,
  with SO_RCVLOWAT so the loop wakes only when more bytes came); then exactly what a CONNECT to that
  name and port 443 gets: a tunnel, or interception for a host with endpoint rules or credentials
  (its ClientHello goes to the minted leaf), and the allowlist, metadata and range checks of
  EgressProxy.open_upstream.
- 80: the Host header of the first request; then what an ``http://`` request through the proxy
  gets (interception.plain: every request read and judged), except that requests are in
  origin-form and each must name the same host in its Host (another gets a 421 and the connection
  ends: a new connection is judged afresh).

A connection that carries no name (TLS without SNI, a request without Host, anything else) is
refused, and reported. Captured connections count in the proxy's connection cap with its others.
"""

from __future__ import annotations

import socket
import struct

from sandboxd.defaults import TRANSPARENT_PORT
from sandboxd.kernel.nftables import CAPTURED_PORTS
from sandboxd.network.egress_proxy import (HTTP_BAD_GATEWAY, HTTP_BAD_REQUEST, HTTP_FORBIDDEN, MAX_REQUEST_HEAD,
                                           PROXY_ADDRESS, EgressProxy, _Request)
from sandboxd.network.interception import sni
from sandboxd.network.tcp_relay import RelayLoop, TcpService, listen_tcp, refuse

SO_ORIGINAL_DST = 80                    # <linux/netfilter_ipv4.h>: the destination before the redirect
HTTPS_PORT, HTTP_PORT = 443, 80
_PEEK = {HTTPS_PORT: sni.MAX_HELLO, HTTP_PORT: MAX_REQUEST_HEAD + 1}


def listen_captured(netns_fd: int) -> socket.socket:
    """The capture's listening socket on PROXY_ADDRESS:TRANSPARENT_PORT in the network namespace
    ``netns_fd`` (a sandbox's new one, before any of its processes exists)."""
    return listen_tcp(PROXY_ADDRESS, TRANSPARENT_PORT, step="transparent capture", netns_fd=netns_fd)


def captured_port(client: socket.socket) -> int | None:
    """The port ``client`` was sent to before the redirect; None when it was not redirected."""
    try:
        raw = client.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    except OSError:
        return None
    return int(struct.unpack(">H", raw[2:4])[0])


def host_header(head: bytes) -> bytes | None:
    """The value of the one Host field of a request ``head`` (its lines up to the blank one); None
    when it has none or several."""
    values = [line.partition(b":")[2].strip() for line in head.split(b"\r\n")[1:]
              if line.partition(b":")[0].strip().lower() == b"host"]
    return values[0] if len(values) == 1 and values[0] else None


class CapturedListener(TcpService):
    """The capture's listener, served on the proxy's loop; its connections are the proxy's (its
    cap, its tracking, closed with it)."""

    def __init__(self, listener: socket.socket, proxy: EgressProxy, loop: RelayLoop) -> None:
        super().__init__(listener, "sandboxd-transparent-capture", loop)
        self._proxy = proxy

    def accepted(self, client: socket.socket, address: str) -> None:
        # Any address of the sandbox's namespace may be the source (its eth0's, as routed before
        # the redirect): only its own processes reach this loopback listener.
        proxy = self._proxy
        port = captured_port(client)
        if port not in CAPTURED_PORTS:                  # dialled directly: there is no destination
            refuse(client)
            return
        if not proxy.cap.take():
            proxy._refuse_over_cap(client)             # reported once per episode, as the proxy's own
            return
        proxy.track(_Captured(proxy, client, port))


class _Captured(_Request):
    """One captured connection until its upstream is connected: waits for its name, without
    reading past it, then goes the way of the proxy's own requests (egress_proxy._Request)."""

    def __init__(self, proxy: EgressProxy, client: socket.socket, port: int) -> None:
        self.captured = port
        super().__init__(proxy, client)
        # A refusal of TLS is a closed connection: there is no HTTP to answer in.
        self.forbidden = HTTP_FORBIDDEN if port == HTTP_PORT else b""
        self.unreachable = HTTP_BAD_GATEWAY if port == HTTP_PORT else b""

    def on_ready(self, _mask: int) -> None:
        try:
            data = self.client.recv(_PEEK[self.captured], socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        if not data:
            self.close()
            return
        if self.captured == HTTPS_PORT:
            self._tls(data)
        else:
            self._plain(data)

    def _more(self, have: int) -> None:
        """Wake again only when the socket holds more than the ``have`` bytes peeked."""
        try:
            self.client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, have + 1)
        except OSError:
            self.close()

    def _nameless(self, why: str, reply: bytes = b"") -> None:
        self.proxy.denied(f"(no name):{self.captured}", why, "protocol")
        self.fail(reply)

    def _tls(self, data: bytes) -> None:
        if sni.needs_more(data):
            self._more(len(data))
            return
        name = sni.server_name(data)
        if name is None:
            self._nameless("a connection to port 443 without a TLS server name (SNI): there is no name "
                           "to check (an address is never one)")
            return
        self._begin(name, HTTPS_PORT)

    def _plain(self, data: bytes) -> None:
        end = data.find(b"\r\n\r\n")
        if end < 0:
            if len(data) > MAX_REQUEST_HEAD:
                self.fail(HTTP_BAD_REQUEST)
            else:
                self._more(len(data))
            return
        host = host_header(data[:end])
        if host is None:
            self._nameless("a request to port 80 without one Host header: there is no name to check",
                           HTTP_BAD_REQUEST)
            return
        name, colon, port = host.decode("latin-1").rpartition(":")
        if not colon or "]" in port:                    # no port ("name", "[v6]")
            name = host.decode("latin-1")
        elif port != str(HTTP_PORT):
            self._nameless(f"a request to port 80 whose Host names port {port[:8]!r}", HTTP_BAD_REQUEST)
            return
        try:
            self.to_upstream = self.client.recv(len(data))   # what was peeked: the mediator reads it again
        except OSError:
            self.close()
            return
        self.plain = True
        self._begin(name, HTTP_PORT)

    def _begin(self, name: str, port: int) -> None:
        try:
            self.client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
        except OSError:
            self.close()
            return
        if not name:
            self._nameless("an empty name")
            return
        self._start(name, port)

    def connected(self, error: OSError | None) -> None:
        if not self.plain or error is not None or self.closed:
            super().connected(error)
            return
        from sandboxd.network.interception.plain import PlainMediated

        assert self.upstream is not None
        proxy, upstream = self.proxy, self.upstream
        if not proxy.rules.allowed(self.host, self.port):  # an update while resolving or connecting
            proxy.denied(f"{self.host}:{self.port}", "the network policy changed while connecting")
            self.fail(self.forbidden)
            return
        self.closed = True                              # the mediator owns both sockets from here
        proxy.untrack(self)
        mediated = PlainMediated(proxy.loop, self.client, upstream, self.host, self.port, first=self.to_upstream,
                                 on_request=proxy.request_hook(self.host, self.port),
                                 report=proxy.report_for(self.host, self.port), absolute_form=False,
                                 on_close=self._relay_closed)
        self.relay = mediated
        if not mediated.closed:
            proxy.track(mediated)
            proxy.opened(mediated, self.host, self.port, "plain")   # for update() to cut, as the proxy's own


def serve_captured(proxy: EgressProxy, listener: socket.socket) -> TcpService:
    """Serve ``listener`` (``listen_captured``'s, in the proxy's sandbox's namespace) for ``proxy``:
    the caller closes the returned service with the proxy (EgressProxy.serve_captured does)."""
    return CapturedListener(listener, proxy, proxy.loop).start()


__all__ = ["CapturedListener", "captured_port", "host_header", "listen_captured", "serve_captured"]
