"""A small HTTP/1.x GET listener on an event loop of its own: the metrics endpoint.

Scrapers are callers like any other: one that connects and sends nothing must not stall the
others (``http.server`` served one connection at a time, so one idle client held it for its
timeout, and a few in turn held it for good). Here every connection is a non-blocking socket on
one epoll loop (network.event_loop), so idle ones cost a descriptor each, never the listener:

- a request must arrive whole (``MAX_REQUEST`` bytes at most) within ``REQUEST_SECONDS`` of the
  connect, and the answer be taken within ``ANSWER_SECONDS``; past either the connection is closed;
- each peer address holds at most ``PER_PEER`` connections and all peers ``TOTAL``: past the cap
  the oldest of that peer's (or anyone's) connections still waiting for its request is closed to
  make room, so a flood of idle connections cannot keep out a scraper, which sends its request at
  once; a peer whose connections are all being answered gets its new one closed;
- the answer is made off the loop (``EventLoop.offload``, fair between peers): collecting the
  metrics reads the daemon's state under its locks.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Callable

from sandboxd.network.event_loop import READ, WRITE, Acceptor, EventLoop

MAX_REQUEST = 8192            # a GET with its headers; more is refused (431)
REQUEST_SECONDS = 5.0         # from the connect to the request's blank line
ANSWER_SECONDS = 10.0         # from the answer being ready to its last byte taken
PER_PEER = 64                 # connections one peer address holds at once (a burst of scrapes fits)
TOTAL = 1024                  # connections all peers hold at once
ACCEPT_BACKOFF = 0.5          # seconds the listener rests when the process is out of descriptors

REASONS = {200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
           431: "Request Header Fields Too Large", 503: "Service Unavailable"}


@dataclass(frozen=True, slots=True)
class Request:
    peer_host: str
    peer_port: int
    our_port: int
    path: str
    accept: str                # the Accept header ("" when absent): the exposition format asked for


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    content_type: str
    body: bytes


def _plain(status: int, text: str) -> Answer:
    return Answer(status, "text/plain; charset=utf-8", (text + "\n").encode())


class _Connection:
    """One scraper's connection: reading its request, then being answered, then closed."""

    def __init__(self, owner: "ScrapeListener", sock: socket.socket, peer: tuple[str, int]) -> None:
        self.owner, self.sock, self.peer = owner, sock, peer
        self.state = "reading"             # reading -> answering -> closed
        self.events = 0
        self.received = bytearray()
        self.pending = memoryview(b"")
        self.deadline = time.monotonic() + REQUEST_SECONDS
        sock.setblocking(False)

    def on_ready(self, mask: int) -> None:
        if self.state == "reading" and mask & READ:
            self._read()
        elif self.state == "answering" and mask & WRITE:
            self._write()

    def expire(self) -> None:
        self.close()

    def _read(self) -> None:
        try:
            data = self.sock.recv(MAX_REQUEST + 1 - len(self.received))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        if not data:
            self.close()
            return
        self.received += data
        end = self.received.find(b"\r\n\r\n")
        if end < 0:
            end = self.received.find(b"\n\n")
        if end < 0:
            if len(self.received) > MAX_REQUEST:
                self.respond(_plain(431, "the request is too long"))
            return
        self._watch(0)                     # nothing more is read: the answer is on its way
        self.deadline = time.monotonic() + ANSWER_SECONDS     # the timer reads it again when due
        self.owner.answer_for(self, bytes(self.received[:end]))

    def respond(self, answer: Answer) -> None:
        """Send ``answer`` and close (loop thread)."""
        if self.state == "closed":
            return
        head = (f"HTTP/1.1 {answer.status} {REASONS.get(answer.status, 'Error')}\r\n"
                f"Content-Type: {answer.content_type}\r\nContent-Length: {len(answer.body)}\r\n"
                "Connection: close\r\n\r\n").encode("ascii")
        self.pending = memoryview(head + answer.body)
        self.state = "answering"
        self.deadline = time.monotonic() + ANSWER_SECONDS
        self.owner.loop.add_timed(self)
        self._write()

    def _write(self) -> None:
        while self.pending:
            try:
                sent = self.sock.send(self.pending)
            except (BlockingIOError, InterruptedError):
                self._watch(WRITE)
                return
            except OSError:
                break
            self.pending = self.pending[sent:]
        self.close()

    def _watch(self, events: int) -> None:
        self.owner.loop.watch(self.sock, self.events, events, self)
        self.events = events

    def close(self) -> None:
        if self.state == "closed":
            return
        self.state = "closed"
        self._watch(0)
        self.owner.loop.discard_timed(self)
        self.sock.close()
        self.owner.forget(self)


class ScrapeListener:
    """Serves GET requests on ``listener`` (bound, listening) with ``answer(request)``, which runs
    on a worker thread and may be slow. ``start`` starts its loop; ``close`` ends it and closes
    every connection and the listener."""

    def __init__(self, listener: socket.socket, answer: Callable[[Request], Answer], *, name: str,
                 per_peer: int = PER_PEER, total: int = TOTAL) -> None:
        self._listener, self._answer, self.per_peer, self.total = listener, answer, per_peer, total
        self.our_port = listener.getsockname()[1]
        self.loop = EventLoop(name, on_stop=self._on_stop)
        self._connections: dict[_Connection, None] = {}     # insertion order: the oldest first
        self._by_peer: dict[str, list[_Connection]] = {}
        self._acceptor = Acceptor(self.loop, listener, self._admit, name=name, backoff=ACCEPT_BACKOFF)

    def start(self) -> None:
        self.loop.start()
        self.loop.post(self._acceptor.start)

    def close(self) -> None:
        self.loop.close()

    def held(self) -> int:
        """Connections held now (from any thread: a count read on the loop)."""
        return self.loop.call(lambda: len(self._connections))

    # -- on the loop thread ---------------------------------------------------------------------

    def _admit(self, sock: socket.socket, address: tuple[str, int]) -> None:
        peer = address[0]
        mine = self._by_peer.get(peer, [])
        if len(mine) >= self.per_peer and not self._evict(mine):
            sock.close()                   # all of this peer's are being answered: it waits its turn
            return
        if len(self._connections) >= self.total and not self._evict(list(self._connections)):
            sock.close()
            return
        connection = _Connection(self, sock, (peer, address[1]))
        self._connections[connection] = None
        self._by_peer.setdefault(peer, []).append(connection)
        connection._watch(READ)
        self.loop.add_timed(connection)

    @staticmethod
    def _evict(candidates: list[_Connection]) -> bool:
        """Close the oldest of ``candidates`` still waiting for its request; False if none is."""
        for connection in candidates:
            if connection.state == "reading":
                connection.close()
                return True
        return False

    def forget(self, connection: _Connection) -> None:
        self._connections.pop(connection, None)
        mine = self._by_peer.get(connection.peer[0])
        if mine is not None:
            mine.remove(connection)
            if not mine:
                del self._by_peer[connection.peer[0]]

    def answer_for(self, connection: _Connection, head: bytes) -> None:
        request = self._parse(connection, head)
        if isinstance(request, Answer):
            connection.respond(request)
            return

        def answer() -> Answer:
            return self._answer(request)

        def then(future: "object") -> None:
            try:
                result = future.result()          # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001 - a failed collection is a 503, not a lost connection
                result = _plain(503, "the metrics could not be collected")
            connection.respond(result)
        if not self.loop.offload(answer, then, owner=connection.peer[0]):
            connection.respond(_plain(503, "too many scrapes waiting: try again"))

    def _parse(self, connection: _Connection, head: bytes) -> "Request | Answer":
        lines = head.decode("latin-1").splitlines()
        parts = lines[0].split() if lines else []
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return _plain(400, "not an HTTP/1 request")
        method, target = parts[0], parts[1]
        if method != "GET":
            return _plain(405, "only GET")
        accept = ""
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if colon and name.strip().lower() == "accept":
                accept = value.strip()
        return Request(peer_host=connection.peer[0], peer_port=connection.peer[1], our_port=self.our_port,
                       path=target.split("?", 1)[0], accept=accept)

    def _on_stop(self) -> None:
        self._acceptor.stop()
        for connection in list(self._connections):
            connection.close()
        self._listener.close()
