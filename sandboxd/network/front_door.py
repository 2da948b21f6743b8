"""The front door: who is calling the gRPC daemon, as the kernel says.

The daemon must know each caller's uid/gid/pid to show it only its own
sessions, and only the kernel can say that truthfully (SO_PEERCRED on the
accepted socket). grpcio's Python server never hands out the accepted socket,
and for a Unix connection ``context.peer()`` is just ``"unix:"`` - unless the
*client* end was bound to a pathname before connecting: then the server sees
``"unix:<that path>"``.

So the front door owns the public socket and, for every connection it
accepts, reads SO_PEERCRED, opens its own connection to the real gRPC server
(listening on a private socket) from a socket bound to a fresh path in a
private directory, remembers ``"unix:<that path>" -> credentials``, and relays
bytes both ways. A handler then turns ``context.peer()`` back into the
caller's credentials with :func:`caller`.

One thread runs the whole door on epoll: accepting, the (non-blocking) connect
to the backend, and both directions of every relay, each spliced through a pipe
(zero copy) with backpressure: a side is not read while its pipe still holds
bytes the other side has not taken. An idle connection costs descriptors, never
a thread; each uid may hold at most ``connections_per_uid`` of them (more are
accepted and closed at once), and nothing is accepted while the daemon is short
of descriptors. At accept the door also reads the caller's supplementary groups
(SO_PEERGROUPS) and may refuse it (``peer_check``): every call on a refused
connection then fails with CallerRefused (sandboxd.errors) saying why.

Why this cannot be forged: a peer string only maps to credentials if it names
one of our relay paths exactly, and only this process can bind there (the
relay directory is 0700 and ours). A process that reaches the backend socket
some other way (it lives in a 0700 directory, so only our uid can) shows up as
``"unix:"`` or as some other path, and is refused.

Wiring it up::

    door = FrontDoor("/run/sandboxd/sandboxd.sock", "/run/sandboxd/private/grpc.sock",
                     relay_dir="/run/sandboxd/private/relay")
    server.add_insecure_port("unix:/run/sandboxd/private/grpc.sock")
    server.start()
    door.start()
    ...
    def Run(self, request, context):
        who = caller(door, context)       # CallerRefused if it did not come through the door
    ...
    door.close()
    server.stop(grace)
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import resource
import signal
import socket
import threading
import time

import psutil

from sandboxd.errors import CallerRefused
from sandboxd.kernel.pod_cgroups import CgroupRefused, read_cgroups
from sandboxd.printable import printable
from sandboxd.network.event_loop import READ, WRITE, Acceptor, EventLoop
from sandboxd.network.peer_credentials import PeerCredentials, peer_groups, peer_ucred
from sandboxd.network.socket_files import (clear_relay_dir, ensure_private_dir, listen, unlink_if_same,
                                           unlink_quietly)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

__all__ = ["FrontDoor", "caller"]

log = logging.getLogger(__name__)

# sizeof(sockaddr_un.sun_path) is 108, including the terminating NUL.
_SUN_PATH_MAX = 107
# Room the temporary name the public socket is bound under takes: ".<pid>.new".
_PUBLIC_TEMP_ROOM = len(".4194304.new")
# Room a relay file name may take at the end of the relay directory: "/<n>.sock", n up to 2**64.
_RELAY_NAME_ROOM = len("/18446744073709551615.sock")

# gRPC percent-encodes the peer address (a space becomes "%20", "é" "%C3%A9"...),
# and has not always: a relay directory spelled only with these characters reads
# the same either way, so the peer string is predictable.
_PLAIN_PATH_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789/._-")

# What one direction of a relay may hold in flight, besides the two sockets' own
# kernel buffers: the pipe the bytes are spliced through. Big enough that a
# stream moves in few system calls, small enough that a slow reader stalls the
# writer (backpressure) instead of making us buffer.
_CHUNK = 256 * 1024

_SPLICE_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
_IN, _OUT = READ, WRITE

# Not in Python's socket module: from <asm-generic/socket.h>.
_SO_PEERPIDFD = 77       # Linux 6.5+
# The refusal of a connection whose process exited before the door could check it.
_PEER_GONE = ("the process that opened this connection exited before the daemon could check it; "
              "connect from the process that makes the calls")
# SO_PEERCRED's pid is 0 when the caller's process is outside the daemon's PID namespace (a daemon
# in a container of its own): nothing of it can be looked at, so whether it is sandboxed is unknown.
_PEER_INVISIBLE = ("the daemon cannot see the process that opened this connection (it is outside the daemon's "
                   "PID namespace), so it cannot check that it is not sandboxed; run the daemon in its callers' "
                   "PID namespace (Kubernetes: hostPID: true, or shareProcessNamespace: true for a sidecar)")

# Descriptors one live connection costs the daemon: the accepted socket, the socket to
# the backend, two pipes (two ends each), and the gRPC server's end of the backend socket.
_FDS_PER_CONNECTION = 7
# How often the daemon's descriptors are really counted (/proc/self/fd); in between,
# the front door's own are added by arithmetic. Near the limit: more often.
_CALIBRATE_EVERY = 1.0
_CALIBRATE_NEAR_LIMIT = 0.05

# Connections accepted per wake-up before the relays get their turn.
_ACCEPT_BURST = 64
# A pending connection left in the backlog keeps the listener readable, so
# out of descriptors the door stops watching it for this long instead of spinning.
_ACCEPT_BACKOFF = 0.1
# The same warning about the same thing (a uid over quota, no descriptors) at most this often.
_LOG_EVERY = 60.0

# The gRPC server's backlog full: the connect is retried, sooner first, for at most this long.
_CONNECT_RETRY_FIRST = 0.005
_CONNECT_RETRY_MAX = 0.1
_CONNECT_PATIENCE = 30.0


def refused_owner(uid: int) -> str:
    """Whom a refused connection of ``uid`` is counted against when connections are counted per
    owner (connection_owner): its own bucket, held to connections_per_uid, apart from the uid's."""
    return f"refused callers of uid {uid}"


class FrontDoor:
    """Owns the public Unix socket and relays each connection to the gRPC server, remembering who it is.

    ``public_path`` is created here (mode ``mode``); a stale socket file left by
    a dead daemon is replaced, anything else there is refused. ``backend_path``
    is where the gRPC server listens; its directory must be private (0700, ours).
    ``relay_dir`` holds one socket file per live connection; it is created if
    missing and must be private too. Nothing is accepted before :meth:`start`
    (connections wait in the backlog).

    One thread does everything (accepting, connecting to the backend, relaying both ways
    of every connection), on epoll with non-blocking sockets, so an idle connection costs
    descriptors but no thread. Bounds: at most ``connections_per_uid`` live connections per
    uid (``root_connections`` for uid 0; default four times as many), and no accept at all
    while fewer than ``fd_reserve`` descriptors are left under RLIMIT_NOFILE, so the rest
    of the daemon keeps working. A connection over its uid's quota is accepted and closed
    at once.
    """

    def __init__(self, public_path: str, backend_path: str, *, mode: int = 0o666, relay_dir: str,
                 listener: "socket.socket | None" = None, connections_per_uid: int = 64,
                 root_connections: int | None = None, fd_reserve: int = 64,
                 peer_check: "Callable[[PeerCredentials, int], str] | None" = None,
                 read_cgroups: bool = False,
                 connection_owner: "Callable[[PeerCredentials], int | str] | None" = None,
                 on_start: "Callable[[], None] | None" = None) -> None:
        """``listener``: an already listening public socket (systemd socket activation); it is
        used as it is, and left in place at close (it belongs to the service manager).

        ``peer_check``: the refusal hook, called once per accepted connection with who connected
        and a pidfd of the connecting process (SO_PEERPIDFD; -1 before Linux 6.5, or when that
        process is gone already). It returns the reason to refuse that caller, or "" to serve
        it; a refused connection stays open, and every call on it fails with CallerRefused
        (PERMISSION_DENIED) saying the reason. The pidfd is open only during the call: a check
        that reads ``/proc/<pid>`` confirms with it (``signal.pidfd_send_signal(pidfd, 0)``)
        that the pid still named the same process; the door itself confirms it after the check,
        and refuses a connection whose process is gone already. It runs on the front door's only
        thread, so it must be quick and never block; if it raises, the caller is refused.

        ``read_cgroups``: also read the connecting process's /proc/PID/cgroup at accept, in the
        same pidfd-confirmed window, into its credentials (``cgroups``): tenancy by pod names the
        caller by it (service.principals). A process that cannot be read is refused.

        ``connection_owner``: whom a connection is counted against, once it is checked (its uid,
        or a name: tenancy by pod counts each pod's apart, whatever uid it runs as); a name is
        held to ``connections_per_uid``. A refused connection is not asked about: it is counted
        as :func:`refused_owner` of its uid. Without it, connections are counted per uid, before
        the check.

        ``on_start``: run once on the door's thread before it accepts anything (tenancy by pod joins
        the node's cgroup namespace there, for this thread's reads)."""
        if connections_per_uid < 1:
            raise ValueError(f"connections_per_uid must be at least 1, not {connections_per_uid}")
        # Absolute paths: the peer string is the relay path exactly as bound, and
        # the daemon may chdir later.
        self._public_path = os.path.abspath(public_path)
        self._backend_path = os.path.abspath(backend_path)
        self._relay_dir = os.path.abspath(relay_dir)
        for what, path, room in (("public socket", self._public_path, _PUBLIC_TEMP_ROOM),
                                 ("backend socket", self._backend_path, 0),
                                 ("relay directory", self._relay_dir, _RELAY_NAME_ROOM)):
            if len(os.fsencode(path)) + room > _SUN_PATH_MAX:
                raise ValueError(f"{what} path {path!r} is too long for a Unix socket address "
                                 f"(at most {_SUN_PATH_MAX - room} bytes)")
        if not set(self._relay_dir) <= _PLAIN_PATH_CHARS:
            raise ValueError(f"relay directory {self._relay_dir!r} may only use letters, digits and '/._-' "
                             "(gRPC would percent-encode anything else in the peer address)")
        # The whole scheme rests on nobody else binding in relay_dir; the backend
        # directory being private keeps everyone else from bypassing the door.
        ensure_private_dir(self._relay_dir, create=True, what="relay directory")
        ensure_private_dir(os.path.dirname(self._backend_path), create=False, what="backend socket directory")

        self._per_uid_limit = connections_per_uid
        self._root_limit = root_connections if root_connections is not None else 4 * connections_per_uid
        self._fd_reserve = fd_reserve
        self._peer_check = peer_check
        self._read_cgroups = read_cgroups
        self._connection_owner = connection_owner
        self._on_start = on_start

        if listener is not None:
            self._listener, self._public_id = listener, None
        else:
            self._listener, self._public_id = listen(self._public_path, mode)
        # Only after we own the public socket (so no live daemon uses relay_dir):
        # clear relay files a dead daemon left behind.
        clear_relay_dir(self._relay_dir)

        # Guards what other threads read (_per_uid for counts) and _closing/_started.
        self._lock = threading.Lock()
        self._closing = False
        self._started = False
        # Everything below belongs to the loop thread (or to close() once it has ended).
        self._relays: dict[int, _Relay] = {}
        self._identities: dict[str, PeerCredentials] = {}
        self._per_uid: dict[int | str, int] = {}
        self._numbers = itertools.count()
        self._refused_logged: dict[int | str, float] = {}
        self._starved_logged = -_LOG_EVERY
        self._fds_others = 0             # descriptors not counted per relay, at the last calibration
        self._fds_calibrated = float("-inf")
        self._pidfd_supported = True
        # The loop (network.event_loop, the relays' too): its thread is the door's only one.
        self._loop = EventLoop("sandboxd-frontdoor", on_stop=self._teardown)
        self._acceptor = Acceptor(self._loop, self._listener, self._admit, name="front door", burst=_ACCEPT_BURST,
                                  backoff=_ACCEPT_BACKOFF, room=self._room_for_one, starved=self._starved)

    # ------------------------------------------------------------------ public API

    @property
    def public_path(self) -> str:
        return self._public_path

    @property
    def backend_path(self) -> str:
        return self._backend_path

    @property
    def connections(self) -> int:
        """Relayed connections currently alive (being set up, or relaying; refused callers included)."""
        return len(self._relays)

    def connection_limit(self, owner: int | str) -> int:
        """How many connections ``owner`` (a uid, or what connection_owner names) may hold at once
        (quotas.connections_per_uid; root's own bound)."""
        return self._root_limit if owner == 0 else self._per_uid_limit

    def connections_by_uid(self) -> dict[int | str, int]:
        """Live connections per caller uid (refused callers included), or per what
        ``connection_owner`` named: for ``sandboxctl status``."""
        with self._lock:
            return dict(self._per_uid)

    def start(self) -> None:
        """Start accepting connections (in a daemon thread, the front door's only one)."""
        with self._lock:
            if self._closing:
                raise RuntimeError("front door is closed")
            if self._started:
                raise RuntimeError("front door already started")
            self._started = True
        if self._on_start is not None:
            self._loop.post(self._on_start)
        self._loop.post(self._acceptor.start)
        self._loop.start()

    def identity(self, peer: str) -> PeerCredentials | None:
        """The credentials behind ``peer`` (a gRPC ``context.peer()``), or None if it is not a live relay."""
        # A plain dict read: atomic under the GIL, and on every call's path.
        return self._identities.get(peer)

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, tear down every relay, remove the public socket and the relay files. Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if not self._loop.stop(timeout):
            # Only a peer_check that blocks can do this; the loop tears down when it returns.
            log.warning("front door: the loop did not stop within %.1fs", timeout)

    def __enter__(self) -> "FrontDoor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop

    def _teardown(self) -> None:
        """Cut every relay, close the listener. The loop has ended (it closes its own descriptors next)."""
        self._closing = True
        for relay in list(self._relays.values()):
            relay.abort()
        self._identities.clear()
        self._acceptor.stop()
        self._listener.close()
        if self._public_id is not None:
            unlink_if_same(self._public_path, self._public_id)

    # ------------------------------------------------------------------ accepting

    def _starved(self, why: str) -> None:
        """The acceptor rests (network.event_loop.Acceptor): said at most once a minute."""
        now = time.monotonic()
        if now - self._starved_logged < _LOG_EVERY:
            return
        self._starved_logged = now
        if why:
            log.warning("front door: cannot accept (%s); retrying", why)
        else:
            log.warning("front door: fewer than %d file descriptors left (limit %d): not accepting "
                        "new connections for now", self._fd_reserve + _FDS_PER_CONNECTION, _fd_limit())

    def _room_for_one(self) -> bool:
        """Whether one more connection leaves at least ``fd_reserve`` descriptors for the rest of the daemon.

        Counting /proc/self/fd costs ~1.5 us per descriptor, too much for every accept: the
        count is taken at most once a second, and the descriptors relays open since are
        added by arithmetic. Near the limit it is counted again (at most every 50 ms).
        """
        limit = _fd_limit()
        now = time.monotonic()
        if now - self._fds_calibrated > _CALIBRATE_EVERY:
            self._calibrate(now)
        need = self._fd_reserve + _FDS_PER_CONNECTION
        free = limit - self._fds_others - _FDS_PER_CONNECTION * len(self._relays)
        if free >= need:
            return True
        if now - self._fds_calibrated > _CALIBRATE_NEAR_LIMIT:
            self._calibrate(now)
            free = limit - self._fds_others - _FDS_PER_CONNECTION * len(self._relays)
        return free >= need

    def _calibrate(self, now: float) -> None:
        try:
            # (the count's own descriptor, listing /proc/PID/fd, is counted too: one of slack.)
            total = psutil.Process().num_fds()
        except (psutil.Error, OSError):
            total = 0  # no /proc: only our own relays are counted
        self._fds_others = total - _FDS_PER_CONNECTION * len(self._relays)
        self._fds_calibrated = now

    def _admit(self, conn: socket.socket, _address: object = None) -> None:
        try:
            pid, uid, gid = peer_ucred(conn)
        except OSError:
            conn.close()  # gone already
            return
        if self._connection_owner is None and not self._room_for(uid):
            conn.close()
            return
        groups = peer_groups(conn)
        credentials = PeerCredentials(uid=uid, gid=gid, pid=pid, groups=groups)
        if self._peer_check is not None or self._read_cgroups:
            refusal, cgroups = self._inspect(conn, credentials)
            if refusal or cgroups:
                credentials = PeerCredentials(uid=uid, gid=gid, pid=pid, groups=groups, refusal=refusal,
                                              cgroups=cgroups)
        owner: int | str = uid
        if self._connection_owner is not None:
            # A refused caller (its process gone, sandboxed, its pod unknown) cannot be told apart
            # from anyone else of its uid: counted in a bucket of its own, never in the uid's, so
            # a pod's uid 0 cannot spend the node root's connections (its probes, operators).
            owner = refused_owner(uid) if credentials.refusal else self._connection_owner(credentials)
            if not self._room_for(owner):
                conn.close()
                return
        conn.setblocking(False)
        relay = _Relay(self, next(self._numbers), conn, credentials, owner)
        with self._lock:
            self._per_uid[owner] = self._per_uid.get(owner, 0) + 1
        self._relays[relay.number] = relay
        relay.connect()

    def _room_for(self, owner: int | str) -> bool:
        """Whether ``owner`` (a uid, or what connection_owner named) may open one more connection;
        logged (at most once a minute per owner) when not."""
        limit = self._root_limit if owner == 0 else self._per_uid_limit
        count = self._per_uid.get(owner, 0)
        if count < limit:
            return True
        now = time.monotonic()
        if now - self._refused_logged.get(owner, -_LOG_EVERY) >= _LOG_EVERY:
            if len(self._refused_logged) >= 1024:  # (owners whose minute is over are forgotten)
                self._refused_logged = {u: t for u, t in self._refused_logged.items() if now - t < _LOG_EVERY}
            self._refused_logged[owner] = now
            shown = f"uid {owner}" if isinstance(owner, int) else printable(owner)
            log.warning("front door: %s has %d connections open, its limit (quotas.connections_per_uid): "
                        "closing its new ones", shown, count)
        return False

    def _check(self, conn: socket.socket, credentials: PeerCredentials) -> str:
        """The refusal of this caller, or "" (:meth:`_inspect`)."""
        return self._inspect(conn, credentials)[0]

    def _inspect(self, conn: socket.socket, credentials: PeerCredentials) -> tuple[str, str]:
        """Ask peer_check about this caller, with a pidfd pinning its process when the kernel can;
        (the refusal or "", its /proc/PID/cgroup when read_cgroups or "").

        With a pidfd, a verdict is only kept if the process was alive from before the check
        until after it: then the pid the check looked at (/proc/<pid>) was that process, not a
        later one given the same number. A connection whose process is gone already is refused:
        whoever holds it now (a child it forked, a process it passed the socket to) is unknown."""
        if credentials.pid == 0:
            return _PEER_INVISIBLE, ""
        pidfd = -1
        if self._pidfd_supported:
            try:
                pidfd = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
            except OSError as exc:
                if exc.errno == errno.ENOPROTOOPT:
                    self._pidfd_supported = False  # before Linux 6.5: the pid alone
                elif exc.errno in (errno.ESRCH, errno.EINVAL):
                    return _PEER_GONE, ""  # (EINVAL: kernels before 6.16, for a reaped process)
                # Anything else: the pid alone.
        cgroups = ""
        try:
            reason = str(self._peer_check(credentials, pidfd) or "") if self._peer_check is not None else ""
            if self._read_cgroups and not reason:
                cgroups = read_cgroups(credentials.pid)
            if pidfd >= 0 and not reason:
                signal.pidfd_send_signal(pidfd, 0)
        except (ProcessLookupError, FileNotFoundError):
            reason = _PEER_GONE
        except CgroupRefused as exc:
            reason = str(exc)
        except Exception:  # noqa: BLE001 - a check that cannot decide refuses
            log.exception("front door: peer check failed for pid %d uid %d", credentials.pid, credentials.uid)
            reason = "the daemon could not check who is calling; refusing"
        finally:
            if pidfd >= 0:
                os.close(pidfd)
        return reason, "" if reason else cgroups

    # ------------------------------------------------------------------ called by relays

    def _remember(self, relay: "_Relay") -> None:
        self._identities[relay.peer] = relay.credentials

    def _forget(self, relay: "_Relay") -> None:
        self._identities.pop(relay.peer, None)
        if self._relays.pop(relay.number, None) is None:
            return
        owner = relay.owner
        with self._lock:
            left = self._per_uid[owner] - 1
            if left:
                self._per_uid[owner] = left
            else:
                del self._per_uid[owner]
        if not self._closing:
            self._acceptor.resume_if_room()


_CONNECTING, _RELAYING, _CLOSED = "connecting", "relaying", "closed"


class _Direction:
    """One way of a relay: bytes from ``src`` go through a pipe to ``dst``."""

    __slots__ = ("src", "dst", "dst_sock", "r", "w", "pending", "eof", "done")

    def __init__(self, src: socket.socket, dst: socket.socket, r: int, w: int) -> None:
        self.src, self.dst, self.dst_sock, self.r, self.w = src.fileno(), dst.fileno(), dst, r, w
        self.pending = 0      # bytes in the pipe not yet written to dst
        self.eof = False      # src said EOF
        self.done = False     # ... and everything before it reached dst, which got a half-close


class _Side:
    """What the loop calls for one socket of a relay: its client's, or its backend's."""

    __slots__ = ("relay", "is_client")

    def __init__(self, relay: "_Relay", is_client: bool) -> None:
        self.relay, self.is_client = relay, is_client

    def on_ready(self, mask: int) -> None:
        if self.relay.state is not _CLOSED:
            self.relay.on_event(self.is_client, mask)

    def close(self) -> None:
        """A failure escaped the relay (the loop logged it): cut it, not the door."""
        self.relay.abort()


class _Relay:
    """One accepted connection and its connection to the backend, driven by the door's loop."""

    __slots__ = ("door", "number", "client", "backend", "credentials", "owner", "path", "peer", "state", "up", "down",
                 "_client_mask", "_backend_mask", "_client_side", "_backend_side", "_pipes", "_connect_delay",
                 "_connect_deadline")

    def __init__(self, door: FrontDoor, number: int, client: socket.socket, credentials: PeerCredentials,
                 owner: int | str) -> None:
        self.door = door
        self.number = number
        self.client = client
        self.backend: socket.socket | None = None
        self.credentials = credentials
        self.owner = owner                  # whose connection it is counted as (FrontDoor._per_uid)
        self.path = os.path.join(door._relay_dir, f"{number}.sock")
        self.peer = "unix:" + self.path
        self.state = _CONNECTING
        self.up: _Direction | None = None
        self.down: _Direction | None = None
        self._client_mask = 0
        self._backend_mask = 0
        self._client_side = _Side(self, True)
        self._backend_side = _Side(self, False)
        self._pipes: list[int] = []
        self._connect_delay = _CONNECT_RETRY_FIRST
        self._connect_deadline = time.monotonic() + _CONNECT_PATIENCE

    # -- connecting

    def connect(self) -> None:
        backend = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        self.backend = backend
        try:
            # Binding is what makes the gRPC server's context.peer() name this relay.
            backend.bind(self.path)
        except OSError as exc:
            log.warning("front door: relay %d: cannot bind %s: %s", self.number, self.path, exc)
            self.abort()
            return
        # Known before the first byte reaches the server, so no call can ever
        # arrive ahead of its identity.
        self.door._remember(self)
        self._try_connect()

    def _try_connect(self) -> None:
        if self.state is not _CONNECTING:
            return
        assert self.backend is not None
        try:
            # A Unix socket connects at once or not at all: EAGAIN means the server's
            # backlog is full, and nothing signals when it has room, so: retry later.
            self.backend.connect(self.door._backend_path)
        except (BlockingIOError, InterruptedError):
            if time.monotonic() + self._connect_delay > self._connect_deadline:
                log.warning("front door: relay %d: the gRPC server accepted nothing for %.0fs",
                            self.number, _CONNECT_PATIENCE)
                self.abort()
                return
            self.door._loop.later(self._connect_delay, self._try_connect)
            self._connect_delay = min(2 * self._connect_delay, _CONNECT_RETRY_MAX)
            return
        except OSError as exc:
            log.warning("front door: relay %d: cannot connect to %s: %s", self.number, self.door._backend_path, exc)
            self.abort()
            return
        self._start_relaying()

    def _start_relaying(self) -> None:
        assert self.backend is not None
        up_r, up_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._pipes += (up_r, up_w)
        down_r, down_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._pipes += (down_r, down_w)
        for w in (up_w, down_w):
            try:
                # A bigger pipe than the default 64 KiB: fewer system calls per MiB.
                fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, _CHUNK)
            except OSError:
                pass  # over the pipe-user-pages limit: the default size still works
        self.up = _Direction(self.client, self.backend, up_r, up_w)
        self.down = _Direction(self.backend, self.client, down_r, down_w)
        self.state = _RELAYING
        self._update()

    # -- relaying

    def on_event(self, is_client: bool, mask: int) -> None:
        """``mask`` is not needed: each direction tries what its state allows, and EAGAIN says not yet."""
        up, down = self.up, self.down
        assert up is not None and down is not None
        # The side that fired is read from (if its pipe is empty) and written to (if the
        # other direction's pipe holds bytes); nothing is tried that the event does not hint at.
        if is_client:
            ok = self._move(up, True) and (not down.pending or self._move(down, False))
        else:
            ok = self._move(down, True) and (not up.pending or self._move(up, False))
        if ok:
            self._update()

    def _move(self, d: _Direction, read: bool) -> bool:
        """Read into the pipe if it is empty, write out what it holds. False when the relay was aborted."""
        try:
            if read and not d.pending and not d.eof:
                n = os.splice(d.src, d.w, _CHUNK, flags=_SPLICE_FLAGS)
                if n == 0:
                    d.eof = True
                d.pending = n
            if d.pending:
                # Straight on: most of the time dst has room, which saves a trip through epoll.
                d.pending -= os.splice(d.r, d.dst, d.pending, flags=_SPLICE_FLAGS)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            # A reset or a broken pipe: nothing more can flow either way.
            if exc.errno not in (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN):
                log.debug("front door: relay %d: %s", self.number, exc)
            self.abort()
            return False
        if d.eof and not d.pending and not d.done:
            # Clean EOF: tell the other side we are done writing but keep the other
            # direction open, so gRPC sees an orderly end.
            d.done = True
            try:
                d.dst_sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # not connected any more: the other direction finds out
        return True

    def _update(self) -> None:
        up, down = self.up, self.down
        assert up is not None and down is not None and self.backend is not None
        if up.done and down.done:
            self.finish()
            return
        # Backpressure: a side is read only while its pipe is empty, and written only while it is not.
        client = (_IN if not up.eof and not up.pending else 0) | (_OUT if down.pending else 0)
        backend = (_IN if not down.eof and not down.pending else 0) | (_OUT if up.pending else 0)
        if client != self._client_mask:
            self.door._loop.watch(up.src, self._client_mask, client, self._client_side)
            self._client_mask = client
        if backend != self._backend_mask:
            self.door._loop.watch(down.src, self._backend_mask, backend, self._backend_side)
            self._backend_mask = backend

    # -- ending

    def abort(self) -> None:
        """Cut both directions now (whatever is in flight is lost) and clean up."""
        self.finish()

    def finish(self) -> None:
        """Close both sockets and the pipes, forget the identity, remove the relay file. Once."""
        if self.state is _CLOSED:
            return
        self.state = _CLOSED
        door = self.door
        if self._client_mask:
            door._loop.watch(self.client, self._client_mask, 0, self._client_side)
        if self._backend_mask and self.backend is not None:
            door._loop.watch(self.backend, self._backend_mask, 0, self._backend_side)
        self._client_mask = self._backend_mask = 0
        self.client.close()
        if self.backend is not None:
            self.backend.close()
        for fd in self._pipes:
            os.close(fd)
        self._pipes = []
        # File first: once a relay is no longer counted, nothing of it is left.
        unlink_quietly(self.path)
        door._forget(self)


def _fd_limit() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 30


def caller(front_door: FrontDoor, context: "Any") -> PeerCredentials:
    """The credentials of the process behind a gRPC call; CallerRefused if it did not come through the door,
    or if the door refused it (its ``peer_check`` gave a reason: the error says it).

    Call it at the start of a handler: the mapping goes away with the connection.
    """
    peer = context.peer()
    who = front_door.identity(peer)
    if who is None:
        raise CallerRefused(f"unknown caller {peer!r}: not connected through the front door")
    if who.refusal:
        raise CallerRefused(who.refusal)
    return who
