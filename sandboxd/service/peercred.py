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
        who = caller(door, context)       # PermissionError if it did not come through the door
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
import select
import socket
import stat
import struct
import threading
import time

from sandboxd._record import Record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

__all__ = ["PeerCredentials", "FrontDoor", "caller"]

log = logging.getLogger(__name__)

# struct ucred { pid_t pid; uid_t uid; gid_t gid; }: the kernel's answer to SO_PEERCRED.
_UCRED = struct.Struct("iII")

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

# A pending connection left in the backlog keeps the listener readable, so
# after EMFILE and friends the accept loop pauses instead of spinning.
_ACCEPT_BACKOFF = 0.1
_ACCEPT_RESOURCE_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class PeerCredentials(Record):
    """A caller as the kernel saw it when it connected (SO_PEERCRED); or, for a TLS caller,
    the local uid/gid it acts as, and ``principal`` naming its client certificate."""

    uid: int
    gid: int
    pid: int
    principal: str = ""
    # Supplementary groups, from SO_PEERGROUPS at connect time (the caller's /proc entry may be
    # gone or reused by then); for a TLS caller, those of the local user it acts as.
    groups: tuple[int, ...] = ()
    # Non-empty when the caller must be refused whatever it asks (for example: its process runs
    # inside one of this daemon's own sandboxes); the reason, said to the caller.
    refusal: str = ""


class FrontDoor:
    """Owns the public Unix socket and relays each connection to the gRPC server, remembering who it is.

    ``public_path`` is created here (mode ``mode``); a stale socket file left by
    a dead daemon is replaced, anything else there is refused. ``backend_path``
    is where the gRPC server listens; its directory must be private (0700, ours).
    ``relay_dir`` holds one socket file per live connection; it is created if
    missing and must be private too. Nothing is accepted before :meth:`start`
    (connections wait in the backlog).
    """

    def __init__(self, public_path: str, backend_path: str, *, mode: int = 0o666, relay_dir: str,
                 listener: "socket.socket | None" = None) -> None:
        """``listener``: an already listening public socket (systemd socket activation); it is
        used as it is, and left in place at close (it belongs to the service manager)."""
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
        _ensure_private_dir(self._relay_dir, create=True, what="relay directory")
        _ensure_private_dir(os.path.dirname(self._backend_path), create=False, what="backend socket directory")

        if listener is not None:
            self._listener, self._public_id = listener, None
        else:
            self._listener, self._public_id = _listen(self._public_path, mode)
        # Only after we own the public socket (so no live daemon uses relay_dir):
        # clear relay files a dead daemon left behind.
        _clear_relay_dir(self._relay_dir)

        self._lock = threading.Lock()
        self._closing = False
        self._relays: dict[int, _Relay] = {}
        self._identities: dict[str, PeerCredentials] = {}
        self._numbers = itertools.count()
        self._accept_thread: threading.Thread | None = None
        # close() writes here to wake the accept loop: closing a socket another
        # thread is blocked on does not wake it.
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)

    # ------------------------------------------------------------------ public API

    @property
    def public_path(self) -> str:
        return self._public_path

    @property
    def backend_path(self) -> str:
        return self._backend_path

    @property
    def connections(self) -> int:
        """Relayed connections currently alive (being set up, or relaying)."""
        return len(self._relays)

    def start(self) -> None:
        """Start accepting connections (in a daemon thread)."""
        with self._lock:
            if self._closing:
                raise RuntimeError("front door is closed")
            if self._accept_thread is not None:
                raise RuntimeError("front door already started")
            self._accept_thread = threading.Thread(target=self._accept_loop, name="sandboxd-frontdoor-accept",
                                                   daemon=True)
        self._accept_thread.start()

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
            relays = list(self._relays.values())
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._accept_thread is not None and self._accept_thread is not threading.current_thread():
            self._accept_thread.join(timeout)
        self._listener.close()
        if self._public_id is not None:
            _unlink_if_same(self._public_path, self._public_id)
        # Relays admitted before _closing was set; none can be added after.
        for relay in relays:
            relay.abort()
        deadline = time.monotonic() + timeout
        for relay in relays:
            if not relay.finished.wait(max(0.0, deadline - time.monotonic())):
                # Typically stuck in connect() to a backend that never accepts.
                log.warning("front door: relay %d did not finish within %.1fs", relay.number, timeout)
                _unlink_quietly(relay.path)
        with self._lock:
            self._identities.clear()
        if self._accept_thread is None or not self._accept_thread.is_alive():
            # (Were it still polling, a closed and reused fd number could wake it wrongly.)
            os.close(self._wake_r)
            os.close(self._wake_w)

    def __enter__(self) -> "FrontDoor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ accepting

    def _accept_loop(self) -> None:
        poller = select.poll()
        poller.register(self._listener.fileno(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        waker = select.poll()
        waker.register(self._wake_r, select.POLLIN)
        self._listener.setblocking(False)
        starved = False
        while not self._closing:
            try:
                poller.poll()
                if self._closing:
                    break
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                continue  # another wake-up, or the client gave up before we got to it
            except OSError as exc:
                if exc.errno in _ACCEPT_RESOURCE_ERRORS:
                    if not starved:
                        log.warning("front door: cannot accept (%s); retrying", os.strerror(exc.errno or 0))
                    starved = True
                    waker.poll(int(_ACCEPT_BACKOFF * 1000))
                elif self._closing:
                    break
                else:
                    # ECONNABORTED, EPROTO...: that one connection is lost, not the door.
                    log.debug("front door: accept failed: %s", exc)
                continue
            starved = False
            try:
                self._admit(conn)
            except Exception:  # noqa: BLE001 - one bad connection must not end the loop
                log.exception("front door: dropping a connection")
                conn.close()

    def _admit(self, conn: socket.socket) -> None:
        try:
            raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        except OSError:
            conn.close()  # gone already
            return
        pid, uid, gid = _UCRED.unpack(raw)
        # splice() needs blocking sockets, whatever socket.setdefaulttimeout() says.
        conn.setblocking(True)
        number = next(self._numbers)
        relay = _Relay(self, number, conn, PeerCredentials(uid=uid, gid=gid, pid=pid))
        with self._lock:
            if self._closing:
                conn.close()
                return
            self._relays[number] = relay
        # The backend connect() can block (its backlog full), so it happens in
        # the relay's own thread, never here.
        if not relay.spawn(relay.run, "up"):
            relay.abort()
            relay.finish()

    # ------------------------------------------------------------------ called by relays

    def _remember(self, relay: "_Relay") -> bool:
        with self._lock:
            if self._closing:
                return False
            self._identities[relay.peer] = relay.credentials
            return True

    def _forget(self, relay: "_Relay") -> None:
        with self._lock:
            self._identities.pop(relay.peer, None)
            self._relays.pop(relay.number, None)


class _Relay:
    """One accepted connection and its connection to the backend; one thread per direction."""

    def __init__(self, door: FrontDoor, number: int, client: socket.socket, credentials: PeerCredentials) -> None:
        self.door = door
        self.number = number
        self.client = client
        self.backend: socket.socket | None = None
        self.credentials = credentials
        self.path = os.path.join(door._relay_dir, f"{number}.sock")
        self.peer = "unix:" + self.path
        self.finished = threading.Event()
        # Guards the sockets: a shutdown() from another thread must never race
        # their close() (the fd number could already belong to something else).
        self._lock = threading.Lock()
        self._closed = False
        self._aborted = False
        self._threads = 0  # pump threads started and not yet done; the last one cleans up

    def spawn(self, target: "Callable[[], None]", direction: str) -> bool:
        with self._lock:
            self._threads += 1
        try:
            threading.Thread(target=target, name=f"sandboxd-relay-{self.number}-{direction}", daemon=True).start()
            return True
        except RuntimeError as exc:  # can't start new thread
            log.warning("front door: relay %d: %s", self.number, exc)
            with self._lock:
                self._threads -= 1
            return False

    def run(self) -> None:
        """Thread 'up': connect to the backend, start 'down', then pump client -> backend."""
        try:
            if not self._connect():
                self.abort()
                return
            backend = self.backend
            assert backend is not None
            if not self.spawn(lambda: self._pump_and_finish(backend, self.client), "down"):
                self.abort()
                return
            self._pump(self.client, backend)
        except Exception:  # noqa: BLE001
            log.exception("front door: relay %d failed", self.number)
            self.abort()
        finally:
            self.thread_done()

    def _connect(self) -> bool:
        backend = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        backend.setblocking(True)
        with self._lock:
            if self._aborted:
                backend.close()
                return False
            self.backend = backend
        try:
            # Binding is what makes the gRPC server's context.peer() name this relay.
            backend.bind(self.path)
        except OSError as exc:
            log.warning("front door: relay %d: cannot bind %s: %s", self.number, self.path, exc)
            return False
        # Known before the first byte reaches the server, so no call can ever
        # arrive ahead of its identity.
        if not self.door._remember(self):
            return False
        try:
            backend.connect(self.door._backend_path)
        except OSError as exc:
            log.warning("front door: relay %d: cannot connect to %s: %s", self.number, self.door._backend_path, exc)
            return False
        return not self._aborted

    def _pump_and_finish(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            self._pump(src, dst)
        except Exception:  # noqa: BLE001
            log.exception("front door: relay %d failed", self.number)
            self.abort()
        finally:
            self.thread_done()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        """Move bytes src -> dst until EOF, through a pipe (zero copy); pass EOF on as a half-close."""
        r, w = os.pipe2(os.O_CLOEXEC)
        try:
            try:
                # A bigger pipe than the default 64 KiB: fewer system calls per MiB.
                fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, _CHUNK)
            except OSError:
                pass  # over the pipe-user-pages limit: the default size still works
            s, d = src.fileno(), dst.fileno()
            try:
                while True:
                    # Blocks until src has data; moves at most a pipe-full. The pipe
                    # is always drained before the next read, so this never blocks
                    # on the pipe, and at most one pipe-full is ever in flight.
                    n = os.splice(s, w, _CHUNK, flags=os.SPLICE_F_MOVE)
                    if n == 0:
                        break
                    while n:
                        # Blocks while dst is full: that is the backpressure.
                        n -= os.splice(r, d, n, flags=os.SPLICE_F_MOVE)
            except OSError as exc:
                # A reset, a broken pipe, or abort() shutting us down: nothing
                # more can flow either way.
                if exc.errno not in (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN, errno.EBADF):
                    log.debug("front door: relay %d: %s", self.number, exc)
                self.abort()
                return
            # Clean EOF: tell the other side we are done writing but keep the
            # other direction open, so gRPC sees an orderly end.
            self._shutdown(dst, socket.SHUT_WR)
        finally:
            os.close(r)
            os.close(w)

    def _shutdown(self, sock: socket.socket, how: int) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                sock.shutdown(how)
            except OSError:
                pass  # not connected (yet, or any more)

    def abort(self) -> None:
        """Stop both directions now: wakes pump threads blocked in either socket."""
        with self._lock:
            self._aborted = True
            if self._closed:
                return
            for sock in (self.client, self.backend):
                if sock is not None:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

    def thread_done(self) -> None:
        with self._lock:
            self._threads -= 1
            last = self._threads == 0
        if last:
            self.finish()

    def finish(self) -> None:
        """Close both sockets, forget the identity, remove the relay file. Only once no pump runs."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.client.close()
            if self.backend is not None:
                self.backend.close()
        # File first: once a relay is no longer counted, nothing of it is left.
        _unlink_quietly(self.path)
        self.door._forget(self)
        self.finished.set()


def caller(front_door: FrontDoor, context: "Any") -> PeerCredentials:
    """The credentials of the process behind a gRPC call; PermissionError if it did not come through the door.

    Call it at the start of a handler: the mapping goes away with the connection.
    """
    peer = context.peer()
    who = front_door.identity(peer)
    if who is None:
        raise PermissionError(f"unknown caller {peer!r}: not connected through the front door")
    return who


# ---------------------------------------------------------------------- filesystem helpers


def _ensure_private_dir(path: str, *, create: bool, what: str) -> None:
    """``path`` must be a real directory, owned by us, closed to group and others."""
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"{what} does not exist", path) from None
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, f"{what} is not a directory", path)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise PermissionError(errno.EACCES, f"{what} must be owned by uid {os.geteuid()} and mode 0700 "
                              f"(it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})", path)


def _listen(path: str, mode: int) -> tuple[socket.socket, tuple[int, int]]:
    """Bind and listen on ``path`` with ``mode``; returns the socket and the file's (dev, ino)."""
    _remove_stale_socket(path)
    # Bound under a temporary name, chmod'ed, then renamed into place: clients
    # can never see the socket with the umask's mode instead of ``mode``.
    temp = f"{path}.{os.getpid()}.new"
    _unlink_quietly(temp)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(temp)
        os.chmod(temp, mode)
        sock.listen(socket.SOMAXCONN)
        os.rename(temp, path)
        st = os.lstat(path)
    except BaseException:
        sock.close()
        _unlink_quietly(temp)
        raise
    return sock, (st.st_dev, st.st_ino)


def _remove_stale_socket(path: str) -> None:
    """Make room at ``path``: nothing there, or a socket nobody listens on (removed). Else refuse."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(errno.EEXIST, "refusing to replace something that is not a socket "
                              "(remove it, or choose another socket path)", path)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        # Nobody listening: a dead daemon's leftover.
        _unlink_quietly(path)
        return
    except FileNotFoundError:
        return
    except BlockingIOError:
        pass  # a full backlog: someone is listening
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, "another process is accepting connections on this socket "
                  "(is another sandboxd running?)", path)


def _clear_relay_dir(relay_dir: str) -> None:
    for name in os.listdir(relay_dir):
        stem, dot, ext = name.partition(".")
        if stem.isdigit() and dot and ext == "sock":
            _unlink_quietly(os.path.join(relay_dir, name))


def _unlink_if_same(path: str, ident: tuple[int, int]) -> None:
    """Remove ``path`` only if it is still our socket (not one a newer daemon put there)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino) == ident:
        _unlink_quietly(path)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
