"""TCP plumbing of published ports and the egress proxy: one event loop per process.

Every listener and every connection of the egress proxies and published ports of a process (the
daemon, or one ``sandboxd run``) is served by ONE thread running an epoll loop over non-blocking
sockets, so a flood of connections costs file descriptors (capped per session, see
``ConnectionCap``) and never threads: the loop, its timers and its accept back-off are
network.event_loop's, the same as the front door's. Blocking work (the proxy's DNS resolution)
goes to the loop's small pool of worker threads and comes back to the loop.

Bytes are copied with bounded buffers and backpressure: a side is not read while its peer's
outgoing buffer holds ``BUFFER_LIMIT`` (32 KiB) bytes, so a slow reader slows its writer down instead of
growing the daemon's memory. A relayed connection with no traffic either way for ``IDLE_SECONDS``
(10 minutes) is closed; connecting a socket gives up after ``CONNECT_SECONDS``.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from typing import Any, Callable

from sandboxd.errors import SetupError
from sandboxd.network.event_loop import READ, WRITE, Acceptor, EventLoop

CHUNK = 32 * 1024
# Bytes waiting for one side before its peer is no longer read. The kernel's socket buffers do the
# real buffering; this one only has to carry a read over to the next write. So a connection holds
# at most 2 x (BUFFER_LIMIT + CHUNK) = 128 KiB of the daemon's memory, 32 MiB per capped session.
BUFFER_LIMIT = 32 * 1024
IDLE_SECONDS = 600.0               # a relayed connection quiet this long either way is closed
CONNECT_SECONDS = 10.0             # connecting a socket (the proxy's upstream, a published port's inner one)
ACCEPT_BACKOFF_SECONDS = 1.0       # out of fds: a listener rests this long instead of spinning

log = logging.getLogger("sandboxd")


def listen_tcp(address: str, port: int, *, step: str, hint: str | None = None, netns_fd: int = -1) -> socket.socket:
    """A listening TCP socket on address:port (in the network namespace ``netns_fd``; -1: this
    process's), or a SetupError naming the step (and what to do)."""
    sock = (socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) if netns_fd < 0 else
            socket_in_namespace(netns_fd))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
    except OSError as exc:
        sock.close()
        raise SetupError(step, exc.errno or 0, f"{address}:{port}", hint=hint) from None
    sock.listen(1024)
    return sock


def nodelay(sock: socket.socket) -> None:
    """TCP_NODELAY on a relayed socket: what it is given goes out at once, not held back by Nagle
    until the peer acknowledges (a new tunnel's p50 went from 43 ms to 2.9 ms)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


class ConnectionCap:
    """At most ``limit`` connections at once (one session's egress proxy; published ports have
    per-user caps as well: publish.PeerCaps); the ones turned away are counted in ``refused``.
    Used on the loop thread only."""

    def __init__(self, limit: int) -> None:
        self.limit, self.active, self.refused = limit, 0, 0

    def take(self) -> bool:
        if self.active >= self.limit:
            self.refused += 1
            return False
        self.active += 1
        return True

    def release(self) -> None:
        self.active -= 1


class RelayLoop(EventLoop):
    """The TCP services' loop (network.event_loop), started at once: the process shares one
    (``shared_loop``); a test may run one of its own."""

    def __init__(self, name: str = "sandboxd-relay") -> None:
        super().__init__(name)
        self.start()


_shared: RelayLoop | None = None
_shared_lock = threading.Lock()


def shared_loop() -> RelayLoop:
    """The process's one loop, started on first use."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = RelayLoop()
        return _shared


def socket_in_namespace(netns_fd: int, mark: int | None = None) -> socket.socket:
    """A non-blocking TCP socket of the network namespace ``netns_fd``: this thread enters it just
    long enough to create the socket, which stays bound to it. ``mark``: its SO_MARK."""
    from sandboxd.kernel import namespaces

    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        namespaces.setns(netns_fd, namespaces.CLONE_NEWNET)          # this thread only
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        finally:
            namespaces.setns(own, namespaces.CLONE_NEWNET)
    finally:
        os.close(own)
    if mark is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
    return sock


class Connecting:
    """A non-blocking connect of ``sock`` to ``address`` watched by the loop; ``done(error)``
    (None: connected) is called once, on the loop thread."""

    def __init__(self, loop: RelayLoop, sock: socket.socket, address: tuple[str, int],
                 done: Callable[[OSError | None], None]) -> None:
        self._loop, self._sock, self._done = loop, sock, done
        self._finished = self._watched = False
        self.deadline = time.monotonic() + CONNECT_SECONDS
        code = sock.connect_ex(address)
        if code in (0, errno.EISCONN):
            self._finish(None)
        elif code in (errno.EINPROGRESS, errno.EAGAIN, errno.EALREADY):
            loop.watch(sock, 0, WRITE, self)
            self._watched = True
            loop.add_timed(self)
        else:
            self._finish(OSError(code, os.strerror(code)))

    def on_ready(self, _mask: int) -> None:
        code = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        self._finish(None if code == 0 else OSError(code, os.strerror(code)))

    def expire(self) -> None:
        self._finish(TimeoutError(errno.ETIMEDOUT, "connection timed out"))

    def close(self) -> None:
        """Given up (the service closes): the caller closes the socket."""
        self._stop()

    def _stop(self) -> bool:
        if self._finished:
            return False
        self._finished = True
        self._loop.discard_timed(self)
        if self._watched:
            self._loop.watch(self._sock, WRITE, 0, self)
            self._watched = False
        return True

    def _finish(self, error: OSError | None) -> None:
        if self._stop():
            self._done(error)


class _End:
    """One side of a relay: its socket, the bytes waiting to be written to it, how it ends."""

    __slots__ = ("relay", "sock", "out", "eof", "shut", "events")

    def __init__(self, relay: "Relay", sock: socket.socket, pending: bytes) -> None:
        self.relay, self.sock = relay, sock
        self.out = bytearray(pending)
        self.eof = False                                # it sent its last byte (read returned b"")
        self.shut = False                               # we sent it our last byte (shutdown SHUT_WR)
        self.events = 0                                 # what the loop watches it for now
        nodelay(sock)

    def on_ready(self, mask: int) -> None:
        self.relay.ready(self, mask)

    def close(self) -> None:
        self.relay.close()


class Relay:
    """Copies bytes both ways between two connected non-blocking sockets until both directions
    have ended (or either fails, or it idles out), then closes both and calls ``on_close``.
    ``to_a``/``to_b``: bytes to send first (what the proxy already read)."""

    def __init__(self, loop: RelayLoop, a: socket.socket, b: socket.socket, *, to_a: bytes = b"", to_b: bytes = b"",
                 on_close: Callable[[], None] = lambda: None) -> None:
        self._loop, self._on_close = loop, on_close
        self._a, self._b = _End(self, a, to_a), _End(self, b, to_b)
        self._closed = False
        self.deadline = time.monotonic() + IDLE_SECONDS
        loop.add_timed(self)
        for end in (self._a, self._b):
            if end.out:
                self._flush(end)
        self._update()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def buffered(self) -> tuple[int, int]:
        """Bytes waiting to be written to a, and to b (loop thread only)."""
        return len(self._a.out), len(self._b.out)

    def _peer(self, end: _End) -> _End:
        return self._b if end is self._a else self._a

    def ready(self, end: _End, mask: int) -> None:
        self.deadline = time.monotonic() + IDLE_SECONDS
        if mask & WRITE:
            self._flush(end)
        if mask & READ and not self._closed:
            self._pull(end)
        self._update()

    def _pull(self, end: _End) -> None:
        peer = self._peer(end)
        try:
            data = end.sock.recv(CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        if data:
            peer.out += data
        else:
            end.eof = True
        self._flush(peer)                               # most of the time the bytes go at once

    def _flush(self, end: _End) -> None:
        if end.out:
            try:
                sent = end.sock.send(end.out)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self.close()
                return
            del end.out[:sent]
        if not end.out and self._peer(end).eof and not end.shut:
            end.shut = True                             # its peer is done and everything was passed on
            try:
                end.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def _update(self) -> None:
        if self._closed:
            return
        if self._a.shut and self._b.shut:
            self.close()
            return
        for end in (self._a, self._b):
            peer = self._peer(end)
            wanted = (READ if not end.eof and len(peer.out) < BUFFER_LIMIT else 0) | (WRITE if end.out else 0)
            self._loop.watch(end.sock, end.events, wanted, end)
            end.events = wanted

    def expire(self) -> None:
        if time.monotonic() < self.deadline:            # traffic since: look again later
            self._loop.add_timed(self)
        else:
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.discard_timed(self)
        for end in (self._a, self._b):
            self._loop.watch(end.sock, end.events, 0, end)
            end.events = 0
            end.sock.close()
        self._on_close()


class TcpService:
    """A bound, listening socket served by the loop: ``accepted(client, address)`` runs on the
    loop thread for each connection (non-blocking). Connections registered with ``track`` are
    closed with the service."""

    def __init__(self, listener: socket.socket, name: str, loop: RelayLoop | None = None) -> None:
        self.name = name
        self._listener = listener
        self._loop = loop or shared_loop()
        self._closed = False
        self._connections: set[Any] = set()
        self._acceptor = Acceptor(self._loop, listener, self._admit, name=name, backoff=ACCEPT_BACKOFF_SECONDS)

    @property
    def loop(self) -> RelayLoop:
        return self._loop

    def start(self) -> "TcpService":
        self._loop.call(self._watch_listener)
        return self

    def _watch_listener(self) -> None:
        if not self._closed:
            self._acceptor.start()

    def _admit(self, client: socket.socket, address: Any) -> None:
        client.setblocking(False)
        self.accepted(client, address[0])

    def accepted(self, client: socket.socket, address: str) -> None:
        raise NotImplementedError

    def track(self, connection: Any) -> None:
        self._connections.add(connection)

    def untrack(self, connection: Any) -> None:
        self._connections.discard(connection)

    @property
    def connections(self) -> int:
        return len(self._connections)

    def close(self) -> None:
        """Stop listening and close every connection of this service (returns when done)."""
        if not self._closed:
            self._loop.call(self._close_in_loop)

    def _close_in_loop(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._acceptor.stop()
        self._listener.close()
        for connection in list(self._connections):
            connection.close()
        self._connections.clear()


def refuse(client: socket.socket, reply: bytes = b"") -> None:
    """Close ``client`` at once, after ``reply`` if its socket buffer takes it now."""
    if reply:
        try:
            client.send(reply)
        except OSError:
            pass
    client.close()
