"""Published ports: a sandbox's server reachable on the host's loopback, explicitly, per port.

``--publish [HOSTPORT:]PORT`` listens on 127.0.0.1:HOSTPORT on the host and, for each
connection, opens one to 127.0.0.1:PORT *inside* the sandbox's network namespace (the
connecting thread enters it with setns just long enough to create the socket, which stays
bound to it). So a dev server that listens on the sandbox's loopback only, as most do by
default, is reachable, and nothing else of the sandbox is. Bytes are copied by two threads
per connection (tcp_relay); this is for development servers, not bulk traffic.
"""

from __future__ import annotations

import os
import socket

from sandboxd.kernel import namespaces
from sandboxd.policy.sandbox import parse_publish
from sandboxd.supervisor.tcp_relay import TcpService, listen_tcp, relay


class PublishedPort(TcpService):
    def __init__(self, netns_fd: int, host_port: int, sandbox_port: int, bind: str = "127.0.0.1") -> None:
        self.host_port, self.sandbox_port = host_port, sandbox_port
        listener = listen_tcp(bind, host_port, step="publish",
                              hint="the host port is taken: publish on another one (HOSTPORT:PORT)")
        self._netns = os.dup(netns_fd)
        super().__init__(listener, f"sandboxd-publish-{host_port}")

    def handle(self, client: socket.socket, address: str) -> None:
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            namespaces.setns(self._netns, namespaces.CLONE_NEWNET)     # this thread only
            try:
                inner = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            finally:
                namespaces.setns(own, namespaces.CLONE_NEWNET)
        except Exception:  # noqa: BLE001 - the sandbox is gone: refuse this connection
            client.close()
            return
        finally:
            os.close(own)
        try:
            inner.connect(("127.0.0.1", self.sandbox_port))
        except OSError:
            client.close()
            inner.close()
            return
        relay(client, inner)

    def close(self) -> None:
        if not self._closed:
            super().close()
            os.close(self._netns)


def publish_all(netns_fd: int, entries: "tuple[str, ...] | list[str]") -> list[PublishedPort]:
    """One PublishedPort per entry; on a failure, the ones already open are closed."""
    published: list[PublishedPort] = []
    try:
        for entry in entries:
            published.append(PublishedPort(netns_fd, *parse_publish(entry)))
    except BaseException:
        for port in published:
            port.close()
        raise
    return published
