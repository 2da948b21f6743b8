"""Published ports: a sandbox's server reachable on the host's loopback, explicitly, per port.

``--publish [HOSTPORT:]PORT`` listens on 127.0.0.1:HOSTPORT on the host and, for each
connection, opens one to 127.0.0.1:PORT *inside* the sandbox's network namespace (the loop
thread enters it with setns just long enough to create the socket, which stays bound to it). So
a dev server that listens on the sandbox's loopback only, as most do by default, is reachable,
and nothing else of the sandbox is. The process's one relay loop (tcp_relay) serves every
published port: no thread per connection, and at most ``cap.limit`` connections at once per
sandbox (more are closed at once and counted).

Host ports below net.ipv4.ip_unprivileged_port_start (1024 by default) are root's to publish,
as they are root's to bind: see ``check_host_ports``.
"""

from __future__ import annotations

import os
import socket

from sandboxd.errors import Forbidden
from sandboxd.policy.sandbox import parse_publish
from sandboxd.supervisor.tcp_relay import (ConnectionCap, Connecting, RelayLoop, Relay, TcpService, listen_tcp,
                                           refuse, socket_in_namespace)

UNPRIVILEGED_PORT_START = "/proc/sys/net/ipv4/ip_unprivileged_port_start"
DEFAULT_CONNECTIONS = 256


def unprivileged_port_start() -> int:
    """The lowest port a process without CAP_NET_BIND_SERVICE may bind (1024 when unreadable)."""
    try:
        with open(UNPRIVILEGED_PORT_START) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 1024


def check_host_ports(root: bool, entries: "tuple[str, ...] | list[str]") -> None:
    """Forbidden unless the caller could bind every host port of ``entries`` itself: the root daemon
    must not lend a caller the privilege of binding low ports. Local root (``root``, as
    service.callers decides it) may publish any port."""
    if root or not entries:
        return
    start = unprivileged_port_start()
    for entry in entries:
        host_port, sandbox_port = parse_publish(entry)
        if host_port < start:
            raise Forbidden(f"publish {entry!r}: host port {host_port} is below {start} "
                            f"(net.ipv4.ip_unprivileged_port_start), which only root may publish: "
                            f"use a host port from {start} up, like {max(start, 18000 + sandbox_port % 1000)}:"
                            f"{sandbox_port}")


class PublishedPort(TcpService):
    def __init__(self, netns_fd: int, host_port: int, sandbox_port: int, bind: str = "127.0.0.1", *,
                 cap: ConnectionCap | None = None, loop: RelayLoop | None = None) -> None:
        self.host_port, self.sandbox_port = host_port, sandbox_port
        self.cap = cap or ConnectionCap(DEFAULT_CONNECTIONS)
        listener = listen_tcp(bind, host_port, step="publish",
                              hint="the host port is taken: publish on another one (HOSTPORT:PORT)")
        self._netns = os.dup(netns_fd)
        super().__init__(listener, f"sandboxd-publish-{host_port}", loop)
        try:
            self.start()
        except BaseException:
            os.close(self._netns)
            listener.close()
            raise

    def accepted(self, client: socket.socket, address: str) -> None:
        if not self.cap.take():
            refuse(client)                                     # over the sandbox's cap: closed at once
            return
        try:
            inner = socket_in_namespace(self._netns)
        except Exception:  # noqa: BLE001 - the sandbox is gone: refuse this connection
            self.cap.release()
            refuse(client)
            return
        pending = _Pending(self, client, inner)
        self.track(pending)
        pending.connecting = Connecting(self._loop, inner, ("127.0.0.1", self.sandbox_port), pending.connected)

    def _close_in_loop(self) -> None:
        if not self._closed:
            super()._close_in_loop()
            os.close(self._netns)


class _Pending:
    """A published connection while its inner socket connects; then a Relay."""

    def __init__(self, port: PublishedPort, client: socket.socket, inner: socket.socket) -> None:
        self.port, self.client, self.inner = port, client, inner
        self.connecting: Connecting | None = None
        self.relay: Relay | None = None
        self.done = False

    def connected(self, error: OSError | None) -> None:
        port = self.port
        port.untrack(self)
        if error is not None:
            self._release()
            return
        relay = Relay(port.loop, self.client, self.inner, on_close=self._release)
        self.relay = relay
        if not relay.closed:
            port.track(relay)

    def _release(self) -> None:
        if self.done:
            return
        self.done = True
        self.port.cap.release()
        if self.relay is not None:
            self.port.untrack(self.relay)
        self.client.close()                             # (a relay closed them already: no harm)
        self.inner.close()

    def close(self) -> None:
        if self.connecting is not None:
            self.connecting.close()
        self._release()


def publish_all(netns_fd: int, entries: "tuple[str, ...] | list[str]", *,
                connections: int = DEFAULT_CONNECTIONS) -> list[PublishedPort]:
    """One PublishedPort per entry, all sharing one cap of ``connections`` at once; on a failure,
    the ones already open are closed."""
    cap = ConnectionCap(connections)
    published: list[PublishedPort] = []
    try:
        for entry in entries:
            published.append(PublishedPort(netns_fd, *parse_publish(entry), cap=cap))
    except BaseException:
        for port in published:
            port.close()
        raise
    return published
