"""The door of `sandboxd mcp --http`: who may talk to it.

An MCP server that asks its client to approve held calls (elicitation) is an approval channel,
as much as the daemon's own socket: a command that reached it could open a session and approve
its own calls. It runs as its user, and so do that user's sandboxed commands; with the host's
network (a `--network=host` session, a `sandboxd run --network=host`) they share its loopback.
Three walls, each enough against a sandboxed command on its own:

1. The connect broker of every sandbox refuses its listening sockets: they are registered with
   the daemon at start (RegisterApprovalChannel: service.approval_channels), for as long as this
   process lives, whatever network the sandbox has and whenever it was built.
2. A connection whose process is not this user's, or runs inside a sandbox (in a PID namespace
   below this server's: PeerCheck says why this is wider than the daemon's own test), gets 403
   before any HTTP is read: on a Unix socket by SO_PEERCRED (pinned with SO_PEERPIDFD), on a
   loopback port by the kernel's record of the client socket (sock_diag's uid; its holders in /proc).
   A check that could not be made (no descriptor left to make it with) gets 503, never a guess.
   The accept loop that asks (cli.mcp_accept) bounds what refused connections hold, so another
   user's flood of them cannot take the server from its own user.
3. Every request carries this server's bearer token, or gets 401. It is 256 random bits made at
   start and written 0600 in the user's directory in the daemon's place, which every sandbox
   hides (the daemon's answer names it), or the runtime's own ($SANDBOXD_MCP_TOKEN): so a
   command that reaches the port through something else (a proxy of the user's on localhost, a
   port forward) still has nothing to send.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import signal
import socket
import struct
from typing import Any, NamedTuple

from sandboxd.kernel.addresses import SHORT_OF_RESOURCES

TOKEN_ENV = "SANDBOXD_MCP_TOKEN"
MIN_TOKEN = 32
# RFC 6750's b64token characters: what a client may put after "Bearer ".
_TOKEN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~+/=")
_UCRED = struct.Struct("iII")
_SO_PEERPIDFD = 77               # Linux 6.5+

SANDBOXED = ("sandboxd mcp serves processes of its own PID namespace only, never one inside a sandbox or container "
             "(or one it cannot examine: not dumpable): a sandboxed command may not answer approvals (ask the "
             "user, outside the sandbox)\n")
OTHER_USER = "sandboxd mcp serves its own user only\n"
GONE = "sandboxd mcp: the process that opened this connection exited before it could be checked\n"
UNCHECKED = ("sandboxd mcp could not check who opened this connection (it is short of file descriptors or "
             "memory): retry in a moment\n")
NO_TOKEN = ("sandboxd mcp: send this server's bearer token (Authorization: Bearer TOKEN); sandboxd mcp said "
            "where it is when it started (docs/mcp.md)\n")


def runtime_token() -> str | None:
    """The token the runtime passed ($SANDBOXD_MCP_TOKEN), checked; None when it passed none."""
    token = os.environ.get(TOKEN_ENV)
    if token is None:
        return None
    if len(token) < MIN_TOKEN or not set(token) <= _TOKEN_CHARS:
        raise ValueError(f"${TOKEN_ENV} must be at least {MIN_TOKEN} characters of A-Z a-z 0-9 - . _ ~ + / = "
                         "(a random secret, such as `openssl rand -hex 32` prints)")
    return token


def new_token() -> str:
    return secrets.token_hex(32)


def token_file_name(listen: tuple[str, int] | str) -> str:
    """The token's file name in the user's secrets directory, from what the server listens on."""
    if isinstance(listen, str):
        digest = hashlib.sha256(listen.encode()).hexdigest()[:12]
        return f"http-unix-{os.path.basename(listen)}-{digest}.token"
    host = f"[{listen[0]}]" if ":" in listen[0] else listen[0]
    return f"http-{host}-{listen[1]}.token"


def write_token(path: str, token: str) -> None:
    """``token`` in ``path``, mode 0600 from its first byte: written under a temporary name made
    afresh (never through a planted link), then renamed into place."""
    temp = f"{path}.{os.getpid()}.new"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, token.encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.rename(temp, path)
    except OSError:
        os.unlink(temp)
        raise


def remove_token(path: str, token: str) -> None:
    """Remove the token file if it still holds this server's token (not a later server's)."""
    try:
        with open(path) as f:
            if f.read().strip() != token:
                return
        os.unlink(path)
    except OSError:
        pass


class BearerOnly:
    """ASGI middleware: a request without this server's bearer token gets 401."""

    def __init__(self, app: Any, token: str) -> None:
        self._app, self._expected = app, f"Bearer {token}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = next((value for key, value in scope.get("headers", ()) if key == b"authorization"), b"")
            if not hmac.compare_digest(given, self._expected):
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"text/plain"),
                                        (b"www-authenticate", b'Bearer realm="sandboxd-mcp"')]})
                await send({"type": "http.response.body", "body": NO_TOKEN.encode()})
                return
        await self._app(scope, receive, send)


class Verdict(NamedTuple):
    """What PeerCheck found: why the connection is refused ("" to serve it), and the uid that
    opened it (None when unknown: a client socket gone before it was looked at)."""

    refusal: str
    uid: int | None


class PeerCheck:
    """Wall 2 (see the module's text): why a connection is refused, or "".

    The daemon's own test (service.sandboxed_peers) asks, as root, whether the peer's PID
    namespace is a sandbox's; this server runs as its user, who may not look at a sandbox's init
    (it is not dumpable) nor into a process that made itself so. So it asks what its user may
    read, and refuses more. On a Unix socket the kernel names the peer's process (SO_PEERCRED):
    refused when it is in a PID namespace below this server's (``NSpid``: every sandbox,
    sandboxd's or another tool's, and every container). On a loopback port the kernel names no
    process: served only when a process of this user in this server's own PID namespace is seen
    holding the client's socket; a socket held only by a sandboxed process, also one that made
    itself non-dumpable to hide its descriptors, is refused (and so is a client that is not
    dumpable: none of the agent runtimes is).

    A lookup that fails for want of a descriptor or memory raises OSError (SHORT_OF_RESOURCES):
    the caller answers 503 (UNCHECKED). Taken for "no such socket" or "no such holder", it turned
    the server's own user into a stranger when a flood had used up its descriptors."""

    def __init__(self) -> None:
        from sandboxd.kernel import peers

        self._peers = peers
        self._uid = os.getuid()
        self._depth = peers.namespace_depth(os.getpid()) or 1
        self._namespace = os.stat("/proc/self/ns/pid").st_ino
        self._last = 0                                # the process that held the last client socket

    def check(self, sock: Any) -> Verdict:
        if sock.family == socket.AF_UNIX:
            return self._unix(sock)
        peer, local = sock.getpeername(), sock.getsockname()
        from sandboxd.kernel.inet_diag import tcp_peer_socket
        client = tcp_peer_socket((peer[0], peer[1]), (local[0], local[1]))     # (uid, inode) of its socket
        if client is None:
            return Verdict(OTHER_USER, None)          # not on this host (or gone already)
        if client[0] != self._uid:
            return Verdict(OTHER_USER, client[0])
        holder = self._peers.holder_in_namespace({client[1]}, self._uid, self._namespace, self._last)
        self._last = holder or self._last
        return Verdict("" if holder else SANDBOXED, self._uid)

    def _unix(self, sock: Any) -> Verdict:
        pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        if uid != self._uid:
            return Verdict(OTHER_USER, uid)
        if pid <= 0:
            return Verdict(SANDBOXED, uid)            # outside our PID namespace: nothing of it can be seen
        pidfd = -1
        try:
            pidfd = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
        except OSError as exc:
            if exc.errno in SHORT_OF_RESOURCES:
                raise
            if exc.errno in (errno.ESRCH, errno.EINVAL):
                return Verdict(GONE, uid)
        try:
            depth = self._peers.namespace_depth(pid)
            reason = GONE if depth is None else SANDBOXED if depth != self._depth else ""
            if pidfd >= 0 and not reason:
                signal.pidfd_send_signal(pidfd, 0)    # the pid looked at was that process all along
        except ProcessLookupError:
            reason = GONE
        finally:
            if pidfd >= 0:
                os.close(pidfd)
        return Verdict(reason, uid)
