"""Published ports: a sandbox's server reachable on the host's loopback, explicitly, per port.

``--publish [HOSTPORT:]PORT`` listens on 127.0.0.1:HOSTPORT on the host and, for each
connection, opens one to 127.0.0.1:PORT *inside* the sandbox's network namespace (the loop
thread enters it with setns just long enough to create the socket, which stays bound to it). So
a dev server that listens on the sandbox's loopback only, as most do by default, is reachable,
and nothing else of the sandbox is. The process's one relay loop (tcp_relay) serves every
published port: no thread per connection, and a sandbox's published ports share the caps of
``PeerCaps`` (more connections are closed at once and counted): so many at once in all, so many
per connecting user, and a reserve no one but the owner can take, so another local user holding
idle connections cannot take the owner's service offline.

Host ports below net.ipv4.ip_unprivileged_port_start (1024 by default) are root's to publish,
as they are root's to bind: see ``check_host_ports``.
"""

from __future__ import annotations

import os
import socket

from sandboxd.errors import Forbidden
from sandboxd.kernel import inet_diag
from sandboxd.policy.sandbox import parse_publish
from sandboxd.network.tcp_relay import (Connecting, RelayLoop, Relay, TcpService, listen_tcp, refuse,
                                           socket_in_namespace)

UNPRIVILEGED_PORT_START = "/proc/sys/net/ipv4/ip_unprivileged_port_start"
DEFAULT_CONNECTIONS = 256
DEFAULT_PER_PEER = 32
Peer = int | str            # the connecting uid, or "address HOST" when the kernel cannot name one


class PeerCaps:
    """The connection caps of one sandbox's published ports, shared by all of them: at most
    ``limit`` connections at once in all; at most ``per_peer`` for each connecting uid (or address,
    when no local socket names a uid) but the owners'; and everyone but the owners together at most
    ``limit - reserve``, where the reserve is ``per_peer`` (at most half the limit). So the owner
    always has ``reserve`` connections to its own service, however many users hold idle ones.
    Used on the loop thread only."""

    def __init__(self, limit: int, per_peer: int = DEFAULT_PER_PEER, owners: "frozenset[int]" = frozenset()) -> None:
        self.limit, self.per_peer, self.owners = limit, max(1, min(per_peer, limit)), owners
        self.reserve = min(self.per_peer, limit // 2)
        self.active = self.others = self.refused = 0
        self.by_peer: dict[Peer, int] = {}

    def take(self, peer: Peer) -> bool:
        owner = peer in self.owners
        if self.active >= self.limit or not owner and (
                self.by_peer.get(peer, 0) >= self.per_peer or self.others >= self.limit - self.reserve):
            self.refused += 1
            return False
        self.active += 1
        self.others += 0 if owner else 1
        self.by_peer[peer] = self.by_peer.get(peer, 0) + 1
        return True

    def release(self, peer: Peer) -> None:
        self.active -= 1
        self.others -= 0 if peer in self.owners else 1
        left = self.by_peer[peer] - 1
        if left:
            self.by_peer[peer] = left
        else:
            del self.by_peer[peer]


def connecting_peer(client: socket.socket, address: str) -> Peer:
    """Who is connecting: the uid that created the client's socket (loopback: the kernel knows it),
    else its address."""
    try:
        uid = inet_diag.tcp_peer_uid(client.getpeername()[:2], client.getsockname()[:2])
    except OSError:
        uid = None                                      # already reset by the peer
    return uid if uid is not None else f"address {address}"


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
                 cap: PeerCaps | None = None, loop: RelayLoop | None = None) -> None:
        self.host_port, self.sandbox_port = host_port, sandbox_port
        self.cap = cap or PeerCaps(DEFAULT_CONNECTIONS)
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
        peer = connecting_peer(client, address)
        if not self.cap.take(peer):
            refuse(client)                                     # over a cap: closed at once
            return
        try:
            inner = socket_in_namespace(self._netns)
        except Exception:  # noqa: BLE001 - the sandbox is gone: refuse this connection
            self.cap.release(peer)
            refuse(client)
            return
        pending = _Pending(self, client, inner, peer)
        self.track(pending)
        pending.connecting = Connecting(self._loop, inner, ("127.0.0.1", self.sandbox_port), pending.connected)

    def _close_in_loop(self) -> None:
        if not self._closed:
            super()._close_in_loop()
            os.close(self._netns)


class _Pending:
    """A published connection while its inner socket connects; then a Relay."""

    def __init__(self, port: PublishedPort, client: socket.socket, inner: socket.socket, peer: Peer) -> None:
        self.port, self.client, self.inner, self.peer = port, client, inner, peer
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
        self.port.cap.release(self.peer)
        if self.relay is not None:
            self.port.untrack(self.relay)
        self.client.close()                             # (a relay closed them already: no harm)
        self.inner.close()

    def close(self) -> None:
        if self.connecting is not None:
            self.connecting.close()
        self._release()


def publish_all(netns_fd: int, entries: "tuple[str, ...] | list[str]", *, connections: int = DEFAULT_CONNECTIONS,
                per_peer: int = DEFAULT_PER_PEER, owners: "frozenset[int]" = frozenset()) -> list[PublishedPort]:
    """One PublishedPort per entry, all sharing one PeerCaps (``connections`` at once, ``per_peer``
    per connecting user but ``owners``); on a failure, the ones already open are closed."""
    cap = PeerCaps(connections, per_peer, owners)
    published: list[PublishedPort] = []
    try:
        for entry in entries:
            published.append(PublishedPort(netns_fd, *parse_publish(entry), cap=cap))
    except BaseException:
        for port in published:
            port.close()
        raise
    return published
