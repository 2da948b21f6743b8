"""The second wall around the daemon: a caller whose process runs inside a sandbox is refused.

The first wall is in every sandbox: sandboxd's sockets are hidden and connect() to them is
refused by init's broker (launcher.connect_broker). This one is in the daemon: whatever way a
connection was made (a hard link to the socket planted by another user, a listener the broker
did not know), a peer process inside a sandbox gets PERMISSION_DENIED on every call, with this
reason. "Inside a sandbox" means: its PID namespace is one of this daemon's live sandboxes', or
that namespace's PID 1 is a sandboxd init (a `sandboxd run` sandbox, or a sandbox of another
daemon). A process in our own PID namespace is never one: the check costs one stat then.
"""

from __future__ import annotations

import os
from typing import Callable

from sandboxd.kernel import peers
from sandboxd.kernel.addresses import SHORT_OF_RESOURCES

REASON = ("this connection comes from a process inside a sandboxd sandbox: sandboxed commands may not use "
          "the daemon (ask the user, outside the sandbox)")
# When the daemon could not look (out of descriptors or memory): refused, never taken for "not
# sandboxed" (a sandbox that exhausts the daemon's descriptors must not pass the wall that way).
UNKNOWN = ("the daemon could not tell whether this connection comes from a sandbox (it is short of "
           "descriptors or memory): try again shortly")
# What a sandboxd init calls itself (launcher.sequence: process.set_title).
INIT_TITLES = ("sandboxd-init", "sandboxd-session")


class SandboxedPeers:
    def __init__(self, sandbox_namespaces: Callable[[], set[int]]) -> None:
        """``sandbox_namespaces``: the PID namespaces of this daemon's live sandboxes."""
        self._sandbox_namespaces = sandbox_namespaces
        # TCP peers already judged, by peer address: (the connection's socket inodes, the verdict).
        # Checked against the inodes again on every call, so a port reused by another
        # connection is judged anew.
        self._tcp_verdicts: dict[tuple[str, int, int], tuple[frozenset[int], str]] = {}
        # Foreign PID namespaces already judged: namespace -> (its PID 1, that process's start time, verdict).
        self._namespace_verdicts: dict[int, tuple[int, float | None, str]] = {}
        self._own = peers.pid_namespace(os.getpid())

    def reason_for_pid(self, pid: int) -> str:
        """The refusal for the process ``pid``, or "" when it is not sandboxed (or already gone:
        what it sent can only be answered on its connection, which is gone with it); UNKNOWN when
        it could not be told."""
        try:
            return self._reason_for_pid(pid)
        except OSError as exc:
            if exc.errno in SHORT_OF_RESOURCES:
                return UNKNOWN
            raise

    def _reason_for_pid(self, pid: int) -> str:
        namespace = peers.pid_namespace(pid) if pid > 0 else None
        if namespace is None or namespace == self._own:
            return ""
        if namespace in self._sandbox_namespaces():
            return REASON
        return self._foreign_namespace(namespace)

    def _foreign_namespace(self, namespace: int) -> str:
        """Another PID namespace (a container, or a sandbox not of this daemon): sandboxed when its
        PID 1 is a sandboxd init. Finding that PID 1 walks /proc, so the verdict is kept per
        namespace, for as long as the same PID 1 (pid and start time) still runs: a namespace's
        PID 1 never changes, and repeated connections from one cost a stat and a read."""
        known = self._namespace_verdicts.get(namespace)
        if known is not None and peers.start_time(known[0]) == known[1]:
            return known[2]
        init = peers.namespace_init(namespace)
        reason = ""
        if init is not None and peers.command_line(init).startswith(INIT_TITLES):
            reason = REASON
        if init is not None:
            if len(self._namespace_verdicts) > 4096:
                self._namespace_verdicts.clear()
            self._namespace_verdicts[namespace] = (init, peers.start_time(init), reason)
        return reason

    def reason_for_tcp(self, peer_host: str, peer_port: int, server_port: int) -> str:
        """The refusal for the TCP client at ``peer_host:peer_port`` of our ``server_port``; UNKNOWN
        when it could not be told."""
        try:
            return self._reason_for_tcp(peer_host, peer_port, server_port)
        except OSError as exc:
            if exc.errno in SHORT_OF_RESOURCES:
                return UNKNOWN
            raise

    def _reason_for_tcp(self, peer_host: str, peer_port: int, server_port: int) -> str:
        key = (peer_host, peer_port, server_port)
        inodes = peers.tcp_client_inodes(peer_host, peer_port, server_port)
        known = self._tcp_verdicts.get(key)
        if known is not None and known[0] == inodes:
            return known[1]
        reason = ""
        for pid in peers.pids_holding(inodes):
            reason = self._reason_for_pid(pid)
            if reason:
                break
        if len(self._tcp_verdicts) > 4096:
            self._tcp_verdicts.clear()
        self._tcp_verdicts[key] = (inodes, reason)
        return reason


def parse_peer(peer: str) -> tuple[str, int] | None:
    """(host, port) of a gRPC peer string such as "ipv4:127.0.0.1:5000" or "ipv6:[::1]:5000"."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        return None
