"""Exec on a terminal: the call's pty master relayed to and from the Exec stream.

The terminal is made inside the session, by the call's own setup (launcher.sequence.open_terminal
and its C twin): /dev/ptmx of the session's private devpts, opened as the caller's uid after every
privilege is dropped. Its master comes back here over a socket pair passed as the call's stdin
(SCM_RIGHTS), so the daemon never opens a path inside a sandbox; the peer is the command's
controlling terminal and its fds 0, 1 and 2. The fork server only passes descriptors along, as for
a pipe-fed Exec. Here:

  master -> ``stdout`` messages (a terminal has a single output; the output limit applies)
  ``stdin`` -> written to the master (the line discipline turns ^C into SIGINT, and so on)
  ``resize`` -> TIOCSWINSZ on the master (the kernel sends SIGWINCH to the foreground group)
  ``close_stdin`` -> the terminal's end-of-file character
  ``signal`` -> to the command, as for Exec

The call ends when its command does (the call's tree is killed then, as for Exec): a waiting
thread wakes the relay, which drains what the command wrote and stops, even if a process outside
the call still holds the peer. The master is closed when the call ends; nothing else holds it.
"""

from __future__ import annotations

import errno
import os
import select
import signal
import socket
import termios
import threading
from typing import Iterator

import grpc

from sandboxd.errors import Exhausted, InvalidPolicy, SetupError
from sandboxd.kernel import terminals
from sandboxd.launcher.call_plan import Step
from sandboxd.service.calls import CHUNK, SessionCall
from sandboxd.service.sessions.registry import Session, SessionRegistry
from sandboxd.supervisor.fork_client import ForkServer
from sandboxd.supervisor.spawner import ExitInfo
from sandboxd.v1 import sandboxd_pb2 as pb

DEFAULT_TERM = "xterm-256color"
MAX_TERM_LENGTH = 64
# How long a blocked write of typed input waits before it looks again whether the call has ended.
WRITE_RECHECK_MS = 200


# A size of 0 is an unknown one (proto3's unset): the local terminal could not say (CI's `script`,
# some `docker exec -t` report 0x0). The command gets the classic terminal's instead.
DEFAULT_ROWS, DEFAULT_COLUMNS = 24, 80


def check_size(rows: int, columns: int, what: str) -> tuple[int, int]:
    """(rows, columns), each 0 (unknown) taken as the default's; InvalidPolicy past the range."""
    rows, columns = rows or DEFAULT_ROWS, columns or DEFAULT_COLUMNS
    if not (terminals.MIN_SIZE <= rows <= terminals.MAX_SIZE and terminals.MIN_SIZE <= columns <= terminals.MAX_SIZE):
        raise InvalidPolicy(f"{what} must have rows and columns from {terminals.MIN_SIZE} to {terminals.MAX_SIZE}, "
                            f"got {rows} rows and {columns} columns: send the local terminal's size")
    return rows, columns


def check_terminal(terminal: pb.Terminal) -> tuple[int, int]:
    """The terminal's (rows, columns), or InvalidPolicy saying what to fix."""
    size = check_size(terminal.rows, terminal.columns, "terminal")
    term = terminal.term
    if len(term) > MAX_TERM_LENGTH or not all(c.isascii() and (c.isalnum() or c in "-_.+") for c in term):
        raise InvalidPolicy(f"terminal.term must be a terminal type name (letters, digits, - _ . +, at most "
                            f"{MAX_TERM_LENGTH}), got {term[:80]!r}")
    return size


def environment(env: dict[str, str], terminal: pb.Terminal) -> dict[str, str]:
    """The command's environment with TERM, unless the caller set TERM itself."""
    return env if "TERM" in env else {**env, "TERM": terminal.term or DEFAULT_TERM}


class TerminalCall(SessionCall):
    """A SessionCall whose command runs on a terminal; ``master`` is its relay end."""

    def __init__(self, registry: SessionRegistry, fork: ForkServer, session: Session, argv: list[str], *,
                 env: dict[str, str], cwd: str, timeout: float | None, size: tuple[int, int]) -> None:
        super().__init__(registry, fork, session, argv, env=env, cwd=cwd, timeout=timeout)
        self._size = size
        self._ptys = session.limits.ptys
        self._channel: socket.socket | None = None
        self.master = -1
        self.ended = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
        self._waiter: threading.Thread | None = None
        self._outcome: ExitInfo | BaseException | None = None

    def _child_stdio(self) -> tuple[int, int, int]:
        """The call's stdin, stdout and stderr are all one end of a socket pair: its setup sends the
        master on fd 0, then the command's stdio becomes the terminal's peer."""
        self._channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        fd = theirs.detach()
        return fd, fd, fd

    def _start(self, sandbox: str, argv: list[str], env: dict[str, str], cwd: str, timeout: float | None,
               stdio: tuple[int, int, int], tool: dict[str, object] | None) -> None:
        assert self._channel is not None
        try:
            self.call_id, self.inner_pid = self._fork.call(sandbox, argv, env, cwd, timeout, stdio,
                                                           terminal=self._size)
        except SetupError as exc:
            if exc.step == Step.OPEN_TERMINAL and exc.errno == errno.ENOSPC:
                raise Exhausted(f"this session's sandbox already holds every terminal it may ({self._ptys}, "
                                "limits.session_ptys): a command of the session keeps them open; end it, or use "
                                "another session") from None
            raise
        call_id = self.call_id
        self._waiter = threading.Thread(target=self._wait_for_end, args=(call_id,), daemon=True,
                                        name=f"sandboxd-terminal-{call_id}")
        self._waiter.start()
        try:
            # Sent before the command was forked, so it is here once the call has started.
            self.master = self.out_r = receive_master(self._channel)
        finally:
            self._channel.close()
            self._channel = None
        os.set_blocking(self.master, False)

    def _wait_for_end(self, call_id: int) -> None:
        try:
            self._outcome = self._fork.wait(call_id)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever calls wait()
            self._outcome = exc
        self.ended.set()
        os.write(self._wake_w, b"x")

    def output(self) -> Iterator[tuple[int, bytes]]:
        """(1, chunk) as the command writes to its terminal, until the call ends and what it wrote
        before is read."""
        poller = select.poll()
        poller.register(self.master, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            events = dict(poller.poll())
            if self.master in events:
                data = _read(self.master)
                if data is None:                          # EIO: every holder of the peer closed it
                    return
                if data:
                    yield 1, data
                    continue
            if self._wake_r in events:                    # the call ended: what is buffered, then stop
                while data := _read(self.master):
                    yield 1, data
                return

    def wait(self) -> ExitInfo:
        if self._waiter is None:                          # started, but its waiting thread never did
            return super().wait()
        self._waiter.join()
        self.call_id = None
        outcome = self._outcome
        if isinstance(outcome, BaseException):
            raise outcome
        assert outcome is not None
        self.exit_info = outcome
        self._registry.call_ended(self._session)
        return outcome

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._channel is not None:
                self._channel.close()
                self._channel = None
            self.master = -1                              # closed by the SessionCall as its out_r
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            self._wake_r = self._wake_w = -1


def receive_master(channel: socket.socket) -> int:
    """The master the call's setup sent, checked to be one (a descriptor from inside a sandbox is
    never trusted to be what it claims)."""
    fds: list[int] = []
    try:
        _, ancillary, _, _ = channel.recvmsg(1, socket.CMSG_SPACE(4 * 4), socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
    except BlockingIOError:
        ancillary = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += [int.from_bytes(payload[i:i + 4], "little") for i in range(0, len(payload) - 3, 4)]
    master, extra = (fds[0], fds[1:]) if fds else (-1, [])
    for fd in extra:
        os.close(fd)
    if master < 0 or not terminals.is_master(master):
        if master >= 0:
            os.close(master)
        raise SetupError("open terminal", 0, detail="the call's setup did not send back a terminal")
    return master


def _read(master: int) -> bytes | None:
    """What the terminal has for us: b"" if nothing now, None once its peer is closed everywhere."""
    try:
        return os.read(master, CHUNK) or None
    except BlockingIOError:
        return b""
    except OSError:                                       # EIO: hung up
        return None


def feed(fork: ForkServer, call: TerminalCall, start: pb.ExecStart, requests: Iterator[pb.ExecRequest]) -> None:
    """Type the client's input into the terminal, resize it, deliver signals, until the client's
    stream ends. Works on a descriptor of its own (a dup of the master), closed here, so the call's
    end never closes one under it."""
    call_id = call.call_id
    assert call_id is not None
    master = os.dup(call.master)
    try:
        if start.stdin:
            _type(master, start.stdin, call.ended)
        if start.close_stdin:
            _type(master, _eof(master), call.ended)
        for request in requests:
            kind = request.WhichOneof("kind")
            if kind == "stdin":
                _type(master, request.stdin, call.ended)
            elif kind == "close_stdin":
                _type(master, _eof(master), call.ended)
            elif kind == "resize":
                try:
                    terminals.set_size(master, *check_size(request.resize.rows, request.resize.columns, "resize"))
                except InvalidPolicy:
                    continue                              # a bad size from a live stream is ignored, like a bad signal
            elif kind == "signal":
                if 0 < request.signal < signal.NSIG:
                    fork.signal(call_id, request.signal)
    except (OSError, termios.error, grpc.RpcError, ValueError, SetupError):
        pass  # the terminal hung up, or the client went away: the main flow sees it
    finally:
        os.close(master)


def _type(master: int, data: bytes, ended: threading.Event) -> None:
    """Write ``data`` to the (non-blocking) master, waiting for room while the call runs."""
    view = memoryview(data)
    poller = select.poll()
    poller.register(master, select.POLLOUT)
    while view and not ended.is_set():
        try:
            view = view[os.write(master, view):]
        except BlockingIOError:
            poller.poll(WRITE_RECHECK_MS)


def _eof(master: int) -> bytes:
    """The terminal's end-of-file character (^D unless the program changed it)."""
    eof = termios.tcgetattr(master)[6][termios.VEOF]
    return eof if isinstance(eof, bytes) else bytes([eof])
