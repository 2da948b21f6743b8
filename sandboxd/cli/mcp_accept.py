"""The accept loop of `sandboxd mcp --http`: each connection is checked as it is accepted
(cli.mcp_door.PeerCheck), before a byte of it is read or any HTTP machinery is made for it; only
the server's own user's (outside any sandbox) reach uvicorn.

Any local user may connect to a loopback port, as fast as it likes. Round 4's hostile pass did,
from another uid: each refused connection was kept open 10 s for its client to read why, so a
connect loop filled the server's 1024 descriptors; the owner's own request waited 19 s and was
refused as a stranger's (the peer lookup, short of a descriptor, found nobody), and asyncio's
accept logged `out of system resource` a million times (153 MB in 40 s). So here:

- a refused connection is answered (403; 503 when the check itself could not be made) and kept
  REFUSED_LINGER seconds for its client to read the answer only while the peer's uid holds fewer
  than REFUSED_PER_UID such connections and the server fewer than ``refused_total``; past either
  it is reset at once (SO_LINGER 0: an RST, nothing kept). What other users (and the owner's
  sandboxes) hold in this process is so bounded, whatever their rate, and the rest of the
  descriptor limit (raised to the hard limit at start) stays the owner's: that is the reserve;
- a burst of ACCEPT_BURST connections is accepted and checked, then the loop serves what else is
  ready (the owner's requests) before it accepts more;
- an accept that fails for want of resources (the owner's own connections at the limit) stops
  accepting for ACCEPT_BACKOFF seconds (the kernel keeps the queue) instead of spinning;
- each of these is logged once, then at most once per LOG_EVERY seconds per cause, with the count
  since the last line (Tally): never a line per connection.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import struct
from collections.abc import Callable
from typing import Any

import uvicorn

from sandboxd.cli.mcp_door import GONE, OTHER_USER, SANDBOXED, UNCHECKED, PeerCheck
from sandboxd.kernel.addresses import SHORT_OF_RESOURCES

log = logging.getLogger("sandboxd.mcp")

# How long a refused client has to read its answer and close, before its connection is cut.
REFUSED_LINGER = 10.0
# Refused connections kept open for that long at once: per peer uid, and in all (at most a
# sixteenth of the descriptor limit). Past them a refused connection is reset without a word.
REFUSED_PER_UID = 8
REFUSED_TOTAL = 64
ACCEPT_BURST = 64
ACCEPT_BACKOFF = 0.1
LOG_EVERY = 60.0
_RESET = struct.pack("ii", 1, 0)           # SO_LINGER on, 0 s: close() sends an RST


# What the log says of refused connections, by the reason their client was given.
_REFUSED = {OTHER_USER: "refused connections of another user's process (uid {uid})",
            SANDBOXED: "refused connections of a process of uid {uid} inside a sandbox (or one it cannot examine)",
            GONE: "refused connections of uid {uid} whose process exited before it was checked"}


def refused_total(descriptor_limit: int) -> int:
    """The bound on refused connections held open at once, for a process of this descriptor limit."""
    return max(1, min(REFUSED_TOTAL, descriptor_limit // 16))


def _answer(status: str, text: str, *extra: str) -> bytes:
    body = text.encode()
    head = "".join(f"{line}\r\n" for line in (f"HTTP/1.1 {status}", "Content-Type: text/plain", "Connection: close",
                                              *extra, f"Content-Length: {len(body)}"))
    return head.encode() + b"\r\n" + body


class Tally:
    """Log lines about what happens per connection, bounded: the first event of a cause is logged
    at once; those after it are counted and said in one line per ``every`` seconds while they go
    on ("… (N more in the last 60 s)"). At most MAX_CAUSES causes at once: past them an event is
    counted under ``overflow`` (a user with many uids, a rootless container's, names one each)."""

    MAX_CAUSES = 32

    def __init__(self, loop: asyncio.AbstractEventLoop, every: float = LOG_EVERY) -> None:
        self._loop, self._every = loop, every
        self._counts: dict[str, int] = {}                 # cause -> events since its last line
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def note(self, cause: str, overflow: str = "more connections refused or failed, of other kinds or uids") -> None:
        if cause not in self._counts and len(self._counts) >= self.MAX_CAUSES:
            cause = overflow
        if cause in self._counts:
            self._counts[cause] += 1
            return
        log.warning("%s", cause)
        self._counts[cause] = 0
        self._timers[cause] = self._loop.call_later(self._every, self._said, cause)

    def _said(self, cause: str) -> None:
        count = self._counts.pop(cause)
        del self._timers[cause]
        if count:
            log.warning("%s (%d more in the last %.0f s)", cause, count, self._every)
            self._counts[cause] = 0
            self._timers[cause] = self._loop.call_later(self._every, self._said, cause)

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._counts.clear()


class _Refused(asyncio.Protocol):
    """A refused connection: its answer written and our side shut at once; what the client sends
    is read and dropped until it closes (closing with its request unread would make the kernel
    reset the connection, and the client might never see why), for REFUSED_LINGER seconds at most.
    ``open`` holds it meanwhile; ``done`` is called once it is closed."""

    def __init__(self, answer: bytes, open_: "set[_Refused]", done: Callable[[], None]) -> None:
        self._answer, self._open, self._done = answer, open_, done
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._open.add(self)
        transport.write(self._answer)
        try:
            transport.write_eof()
        except OSError:                           # reset by its client already (ENOTCONN)
            transport.abort()
            return
        self._timer = asyncio.get_running_loop().call_later(REFUSED_LINGER, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        assert self.transport is not None
        self.transport.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._open.discard(self)
        self._done()


class Doorkeeper:
    """Accepts on ``listener`` for the loop it is started on, checks each connection with
    ``check``, and hands the admitted ones to ``serve`` (a protocol factory: uvicorn's)."""

    def __init__(self, listener: socket.socket, check: PeerCheck, descriptor_limit: int, *,
                 log_every: float = LOG_EVERY) -> None:
        self._listener, self._check, self._log_every = listener, check, log_every
        self._refused_total = refused_total(descriptor_limit)
        self._refused_by_uid: dict[int | None, int] = {}    # refused connections open, by peer uid
        self._refused = 0                                   # and in all
        self._lingering: set[_Refused] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._serve: Callable[[], asyncio.Protocol] | None = None
        self._tally: Tally | None = None
        self._resume: asyncio.TimerHandle | None = None
        listener.setblocking(False)

    def start(self, loop: asyncio.AbstractEventLoop, serve: Callable[[], asyncio.Protocol]) -> None:
        self._loop, self._serve, self._tally = loop, serve, Tally(loop, self._log_every)
        loop.add_reader(self._listener.fileno(), self._accept)

    def stop(self) -> None:
        """No more accepting; refused connections still open are closed (admitted ones are uvicorn's)."""
        if self._loop is None:
            return
        self._loop.remove_reader(self._listener.fileno())
        if self._resume is not None:
            self._resume.cancel()
        for refused in list(self._lingering):
            if refused.transport is not None:
                refused.transport.abort()
        assert self._tally is not None
        self._tally.close()
        self._loop = None

    def _accept(self) -> None:
        assert self._loop is not None and self._tally is not None
        for _ in range(ACCEPT_BURST):
            try:
                conn, _address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in SHORT_OF_RESOURCES:
                    self._tally.note(f"cannot accept connections ({os.strerror(exc.errno or 0)}); "
                                     f"retrying every {ACCEPT_BACKOFF:g} s")
                    self._loop.remove_reader(self._listener.fileno())
                    self._resume = self._loop.call_later(ACCEPT_BACKOFF, self._resumed)
                    return
                continue                                   # that one connection is lost (ECONNABORTED...)
            conn.setblocking(False)
            self._admit(conn)

    def _resumed(self) -> None:
        self._resume = None
        if self._loop is not None:
            self._loop.add_reader(self._listener.fileno(), self._accept)

    def _admit(self, conn: socket.socket) -> None:
        assert self._tally is not None and self._serve is not None
        try:
            verdict = self._check.check(conn)
        except OSError as exc:
            if exc.errno not in SHORT_OF_RESOURCES:
                conn.close()                               # reset and gone before it could be looked at
                return
            self._tally.note("cannot check who connects (short of file descriptors or memory): answering 503")
            self._refuse(conn, None, _answer("503 Service Unavailable", UNCHECKED, "Retry-After: 1"))
            return
        except Exception as exc:  # noqa: BLE001 - one connection's failure must not end the listener
            self._tally.note(f"cannot check who connects ({type(exc).__name__}: {exc}): closing such connections")
            conn.close()
            return
        if not verdict.refusal:
            self._attach(conn, self._serve, None)
            return
        who = _REFUSED.get(verdict.refusal, "connections refused by uid {uid}")
        self._tally.note(who.format(uid="unknown" if verdict.uid is None else verdict.uid))
        self._refuse(conn, verdict.uid, _answer("403 Forbidden", verdict.refusal))

    def _refuse(self, conn: socket.socket, uid: int | None, answer: bytes) -> None:
        """Answer and linger, within the bounds; past them, reset at once."""
        held = self._refused_by_uid.get(uid, 0)
        if held >= REFUSED_PER_UID or self._refused >= self._refused_total:
            try:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            except OSError:
                pass
            conn.close()
            return
        self._refused_by_uid[uid] = held + 1
        self._refused += 1
        released = False

        def release() -> None:                    # once: when it closes, or if it never got a transport
            nonlocal released
            if released:
                return
            released = True
            self._refused -= 1
            left = self._refused_by_uid[uid] - 1
            if left:
                self._refused_by_uid[uid] = left
            else:
                del self._refused_by_uid[uid]

        self._attach(conn, lambda: _Refused(answer, self._lingering, release), release)

    def _attach(self, conn: socket.socket, factory: Callable[[], asyncio.Protocol],
                failed: Callable[[], None] | None) -> None:
        """``conn`` served by a protocol of ``factory`` on the loop (an asyncio transport of its own)."""
        assert self._loop is not None
        task = self._loop.create_task(self._loop.connect_accepted_socket(factory, conn))
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._attached, conn, failed))

    def _attached(self, conn: socket.socket, failed: Callable[[], None] | None, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is not None:
            conn.close()
            if failed is not None:
                failed()


class Server(uvicorn.Server):
    """uvicorn serving what ``doorkeeper`` admits: uvicorn makes no listener of its own (asyncio's
    accept loop would hand it every connection, refused or not, and logs each accept failure)."""

    def __init__(self, config: uvicorn.Config, doorkeeper: Doorkeeper) -> None:
        super().__init__(config)
        self.doorkeeper = doorkeeper

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=[])
        if self.should_exit:
            return
        config = self.config
        self.doorkeeper.start(asyncio.get_running_loop(), functools.partial(
            config.http_protocol_class, config=config, server_state=self.server_state,  # type: ignore[call-arg]
            app_state=self.lifespan.state))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.doorkeeper.stop()
        await super().shutdown(sockets=None)
