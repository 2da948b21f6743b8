"""The domain allowlist of a rootless `sandboxd run` (--network --allow-domain as a plain user).

A plain user cannot build the isolated network (a veth pair, NAT and an nftables filter in the
host's namespace). Instead the sandbox gets a network namespace with only loopback, in which its
init listens on 127.0.0.1:PROXY_PORT before the command exists and hands that listening socket
out over a socket pair (launcher.rootless.hand_over_proxy_listener). `sandboxd run` accepts on it
and runs the same egress proxy as root's isolated network (network.egress_proxy), which
connects out from the host's namespace as the user: the only way out of the sandbox is through
the proxy, and the proxy reaches only the allowed names, refusing every address in
REFUSED_RANGES (loopback, private, link-local and reserved ranges) and every address of the host
itself (egress_proxy.host_owns) before it connects to exactly the address it checked: with no
kernel filter behind it, those checks are the wall. This is the technique of Anthropic's sandbox-runtime, which bridges a
socket into a network namespace instead of routing one.
"""

from __future__ import annotations

import _socket
import os
import socket

from sandboxd.errors import SetupError
from sandboxd.launcher.init_loop import receive_fd
from sandboxd.network.egress_proxy import PROXY_ADDRESS


class LoopbackProxy:
    """The parent's side of the hand-over; in the place of an IsolatedNetwork for `sandboxd run`."""

    sandbox_address = PROXY_ADDRESS      # the sandbox's own loopback: its only network
    netns_fd = -1                        # the proxy connects from this process's namespace

    def __init__(self, resolvers: "tuple[str, ...]" = ()) -> None:
        self.resolvers = list(resolvers)
        self._ours, self._theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
        self._listener: socket.socket | None = None
        self._received = False

    def child_end(self) -> int:
        """The descriptor init sends the listener on, the child's: the spawner closes it after the fork."""
        fd = os.dup(self._theirs.fileno())
        self._theirs.close()
        return fd

    @property
    def proxy_listener(self) -> socket.socket | None:
        """The sandbox's listening socket, received once (after the command started: init sent it
        before forking the command, so this never waits on a sandbox still being built)."""
        if not self._received:
            self._received = True
            fd = receive_fd(self._ours)
            if fd is None:
                raise SetupError("egress proxy", detail="the sandbox did not hand over its proxy socket")
            self._listener = socket.socket(fileno=fd)
        return self._listener

    @proxy_listener.setter
    def proxy_listener(self, value: socket.socket | None) -> None:
        self._received, self._listener = True, value

    def resolv_conf(self) -> None:
        return None                      # names are resolved by the proxy, not in the sandbox

    def close(self) -> None:
        self._theirs.close()
        self._ours.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
