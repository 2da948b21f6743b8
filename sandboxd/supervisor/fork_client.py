"""The fork server's client: ``ForkServer``, the daemon's handle on the fork server process
(``fork_server``), which it starts as a fresh interpreter and talks to over the typed protocol
(``fork_protocol``). Thread-safe: any number of the daemon's threads send requests and wait for
their answers at once; whoever waits reads the socket for all (leader/follower)."""

from __future__ import annotations

import math
import os
import select
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, TypeVar, overload

from sandboxd._record import Record
from sandboxd.errors import InvalidPolicy, SandboxdError, SetupError
from sandboxd.policy.spec import LaunchSpec
from sandboxd.supervisor import fork_protocol as protocol
from sandboxd.supervisor.fork_protocol import (CLOSE_WAIT_SECONDS, DEFAULT_ORPHAN_SECONDS, DEFAULT_STUCK_OPENERS,
                                               DEFAULT_WAIT_SECONDS, Attach, Attached, Call, CallEnded,
                                               CallerRecord, Cancel, CheckPaths, Error, Event, Exited, HeldCall,
                                               HeldSession, Launch, Malformed, Message, PathsChecked, Ping, Pong,
                                               Request, Review, ReviewStarted, SessionClose, SessionClosed,
                                               SessionOpen, SessionReady, Signal, Started, Stop, spec_record)
from sandboxd.supervisor.spawner import ExitInfo

if TYPE_CHECKING:
    from collections.abc import Callable

E = TypeVar("E", bound=Event)


class SessionInfo(Record):
    """What the fork server built for a session's sandbox (SessionReady): the daemon keeps these
    facts and acts on them, and never resolves the session's paths again itself, as root."""

    init_pid: int
    workspace: str                      # the workspace's real path, as the owner's lookup resolved it
    writable_roots: tuple[str, ...]     # the policy's writable roots' real paths, the same way (no workspace)
    host_address: str | None            # the host side of an isolated network's link
    sandbox_address: str | None
    resolvers: tuple[str, ...]
    # The egress proxy's listening socket (allowed domains), bound by the fork server and handed
    # over (SessionReady): the receiver's to close, once whoever serves it has its own copy. -1: none.
    proxy_listener: int = -1
    pid_namespace: int = 0              # its PID namespace's inode, read by the fork server (0: none)
    transparent_listener: int = -1      # transparent capture's (network.transparent), the same way


class HandedOver(SetupError):
    """This daemon handed its sandboxes over (``ForkServer.detach``): what it still had in flight
    runs on in the surviving supervisor, and the next daemon records its end; nothing here may
    (an audit end event written now would be a second one)."""

    def __init__(self, step: str = "fork server", errno: int = 0, path: str | None = None, hint: str | None = None,
                 detail: str | None = "the daemon handed its sandboxes over to the next daemon") -> None:
        super().__init__(step, errno, path, hint=hint, detail=detail)


class Adoption(Record):
    """What a surviving supervisor held when this daemon attached (fork_protocol's Attach answer):
    sessions by sandbox name (their listeners are this daemon's to close), the calls still running
    (their ends come by ``ForkServer.wait_held``) and those that ended while no daemon was attached."""

    sessions: dict[str, SessionInfo]
    running: tuple[HeldCall, ...]
    ended: tuple[CallEnded, ...]


class ForkServer:
    """Client handle of a running fork server. Thread-safe: any number of threads may launch
    and wait at once; whichever of them waits reads the server's answers for all."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self._sock = sock
        self.pid = pid
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._events: dict[int, list[Event]] = {}
        self._passed: dict[int, list[int]] = {}   # descriptors that came with an event, by request id
        self._next_id = 1
        self._closed = False
        self._reading = False                     # a waiting thread is reading the socket
        self._process: "Any" = None
        self._native_calls = False
        self._wanted_native_calls = True
        self._first_id = 1                        # ids below it went to a server that has died since
        self._wait_seconds = DEFAULT_WAIT_SECONDS
        self._call_helper: str | None = None
        self._close_seconds = CLOSE_WAIT_SECONDS
        self._stuck_openers = DEFAULT_STUCK_OPENERS
        self._survive: str | None = None          # the attach socket of a surviving supervisor
        self._handed_over = False                 # detach() ran: every request fails HandedOver
        # Readable once detach() ran: what waits on a call's pipes (calls.SessionCall.output) stops.
        self._handover_r, self._handover_w = os.pipe2(os.O_CLOEXEC)
        self._orphan_seconds = DEFAULT_ORPHAN_SECONDS
        self._cgroup = ""                         # a surviving supervisor's own v2 group (supervisor.cgroup)
        self._limit = protocol.message_limit(sock)
        self._received = protocol.receive_buffer()        # every event is read into it (one reader at a time)
        self.last_heard = time.monotonic()       # when it last answered anything (the watchdog's progress)
        # When this server was started, and whether it has answered anything since: until it has, it
        # is starting (its loop has not run yet), which the watchdog tells from a loop that stopped.
        self.started_at = self.last_heard
        self.answered = False

    @property
    def native_calls(self) -> bool:
        return self._native_calls

    @property
    def survives(self) -> bool:
        """Whether the server outlives this daemon (a surviving supervisor: ``detach``)."""
        return self._survive is not None

    @classmethod
    def start(cls, native_calls: bool = True, wait_seconds: float = DEFAULT_WAIT_SECONDS,
              call_helper: str | None = None, close_seconds: float = CLOSE_WAIT_SECONDS,
              stuck_openers: int = DEFAULT_STUCK_OPENERS, survive: str | None = None,
              orphan_seconds: float = DEFAULT_ORPHAN_SECONDS, cgroup: str = "") -> "ForkServer":
        """Start the server as a fresh interpreter (``python -m sandboxd.supervisor.fork_server``).

        Not a fork of the caller: the daemon has gRPC threads, and a forked copy of a
        threaded process may deadlock; and a fresh process is as small as it gets,
        which keeps every later fork cheap. subprocess spawns it without forking Python.
        ``survive``: the path of its attach socket (supervisor.attach_point): it is a surviving
        supervisor, which outlives this daemon and waits ``orphan_seconds`` for the next; with
        ``cgroup`` it moves itself into that v2 group first (kernel.supervisor_cgroup).
        In a session of its own, away from the daemon's terminal: Ctrl-C on `sandboxd serve`
        (SIGINT to the terminal's whole foreground group) is the daemon's to handle, by
        closing sessions in order and then the fork server, which it killed mid-loop before
        (a KeyboardInterrupt traceback); Ctrl-Z no longer stops it either.
        """
        import subprocess
        import sys

        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "PYTHONPATH": package_root}
        try:
            flags = ([] if native_calls else ["--python-calls"]) + [f"--wait-seconds={wait_seconds!r}",
                                                                     f"--close-seconds={close_seconds!r}",
                                                                     f"--stuck-openers={int(stuck_openers)}"] + (
                [f"--call-helper={call_helper}"] if call_helper else []) + (
                [f"--survive={survive}", f"--orphan-seconds={orphan_seconds!r}"] if survive else []) + (
                [f"--cgroup={cgroup}"] if survive and cgroup else [])
            # -P: `python -m` would put the working directory first on sys.path, so a `sandboxd`
            # package in whatever directory the daemon was started from (a user's) would run as root.
            child = subprocess.Popen([sys.executable, "-P", "-m", "sandboxd.supervisor.fork_server",
                                      str(child_end.fileno()), *flags],
                                     pass_fds=(child_end.fileno(),), env=env, stdin=subprocess.DEVNULL,
                                     close_fds=True, start_new_session=True)
        finally:
            child_end.close()
        server = cls(parent_end, child.pid)
        server._process = child
        server._wanted_native_calls = native_calls
        server._wait_seconds = wait_seconds
        server._call_helper = call_helper
        server._close_seconds = close_seconds
        server._stuck_openers = stuck_openers
        server._survive, server._orphan_seconds, server._cgroup = survive, orphan_seconds, cgroup
        from sandboxd.launcher.native_call import check_helper
        server._native_calls = native_calls and check_helper(call_helper).path is not None   # as the server decides
        return server

    @classmethod
    def attach(cls, path: str, native_calls: bool = True, wait_seconds: float = DEFAULT_WAIT_SECONDS,
               call_helper: str | None = None, close_seconds: float = CLOSE_WAIT_SECONDS,
               stuck_openers: int = DEFAULT_STUCK_OPENERS, orphan_seconds: float = DEFAULT_ORPHAN_SECONDS,
               timeout: float = 30.0, cgroup: str = "") -> "tuple[ForkServer, Adoption] | None":
        """Attach to the surviving supervisor listening at ``path`` (a previous daemon's), and
        learn what it holds; None if none listens there (no socket, or a stale one: then
        ``start`` a fresh one). SetupError if one listens but refuses (another daemon is attached)
        or does not answer within ``timeout``. The other arguments are what a ``restart`` starts a
        new one with, should this one die later. Called before any other thread uses the client."""
        from sandboxd.supervisor.attach_point import peer
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            return None
        try:
            pid, uid = peer(sock)
            if uid != 0:                                  # the directory is root's 0700: never, but checked
                raise SetupError("fork server", detail=f"the supervisor socket {path} is served by uid {uid}")
            server = cls(sock, pid)
            adoption = server._read_adoption(timeout)
        except BaseException:
            sock.close()
            raise
        server._wanted_native_calls, server._wait_seconds, server._call_helper = native_calls, wait_seconds, call_helper
        server._close_seconds, server._stuck_openers = close_seconds, stuck_openers
        server._survive, server._orphan_seconds, server._cgroup = path, orphan_seconds, cgroup
        from sandboxd.launcher.native_call import check_helper
        server._native_calls = native_calls and check_helper(call_helper).path is not None
        return server, adoption

    def _read_adoption(self, timeout: float) -> Adoption:
        """Send Attach and read its whole answer here (no other thread uses the client yet)."""
        try:
            protocol.send(self._sock, Attach(1).encode())
        except OSError:
            pass                                          # refused and closed already: its answer is queued
        deadline = time.monotonic() + timeout
        sessions: dict[str, SessionInfo] = {}
        running: list[HeldCall] = []
        ended: list[CallEnded] = []
        try:
            while True:
                if not _readable_within(self._sock, max(0.0, deadline - time.monotonic())):
                    raise SetupError("fork server", detail=f"the surviving supervisor did not answer within {timeout:g} s")
                try:
                    message, fds = protocol.receive(self._sock, protocol.events(), self._received)
                except OSError as exc:
                    raise SetupError("fork server",
                                     detail=f"the surviving supervisor refused the attach ({exc})") from None
                for fd in fds:
                    os.set_inheritable(fd, False)
                if isinstance(message, HeldSession):
                    proxy = fds.pop(0) if message.proxy_listener and fds else -1
                    captured = fds.pop(0) if message.transparent_listener and fds else -1
                    sessions[message.session] = SessionInfo(
                        message.init_pid or 0, message.workspace, tuple(message.writable_roots), message.host_address,
                        message.sandbox_address, tuple(message.resolvers or ()), proxy, message.pid_namespace, captured)
                elif isinstance(message, HeldCall):
                    running.append(message)
                elif isinstance(message, CallEnded):
                    ended.append(message)
                elif isinstance(message, Attached):
                    self._next_id = max(message.next_id, 2)   # ids below are the held calls' (wait_held)
                    self.last_heard = time.monotonic()
                    self.answered = True
                    return Adoption(sessions, tuple(running), tuple(ended))
                for fd in fds:
                    os.close(fd)
                if message is None:
                    raise SetupError("fork server", detail="the surviving supervisor closed the connection")
                if isinstance(message, Error):
                    raise SandboxdError.from_dict(message.error)
                if isinstance(message, Malformed):
                    raise SetupError("fork server", detail=f"the supervisor's answer was malformed: {message}")
        except BaseException:
            for info in sessions.values():
                for fd in (info.proxy_listener, info.transparent_listener):
                    if fd >= 0:
                        os.close(fd)
            raise

    # -- requests ------------------------------------------------------------------------------

    def launch(self, spec: LaunchSpec, stdio: tuple[int, int, int] = (0, 1, 2)) -> int:
        """Start a one-shot sandbox; return its id once the command is running, or raise SetupError."""
        wire = spec_record(spec)
        call_id = self._request(lambda call_id: Launch(call_id, wire), list(stdio))
        self._expect(call_id, Started)
        return call_id

    def open_session(self, session: str, spec: LaunchSpec, review_dir: str = "", *, session_bytes: int = 0,
                     owner_bytes: int = 0, owner_stores: "list[str] | None" = None,
                     owner_stores_max: int = 0) -> "SessionInfo":
        """Build a session's sandbox (``spec.argv`` is not run): its init's pid and, with an isolated
        network, its addresses. ``review_dir``: review mode, its change set there, a store bounded
        by the other four (SessionOpen)."""
        wire = spec_record(spec)
        call_id = self._request(lambda call_id: SessionOpen(call_id, session, wire, review_dir, session_bytes,
                                                            owner_bytes, list(owner_stores or []),
                                                            owner_stores_max))
        event = self._expect(call_id, SessionReady)
        with self._cond:
            passed = self._passed.pop(call_id, [])
        proxy = passed.pop(0) if event.proxy_listener and passed else -1
        captured = passed.pop(0) if event.transparent_listener and passed else -1
        return SessionInfo(event.init_pid or 0, event.workspace, tuple(event.writable_roots), event.host_address,
                           event.sandbox_address,
                           tuple(event.resolvers or ()), proxy, event.pid_namespace, captured)

    def check_paths(self, caller: "tuple[int, int, tuple[int, ...]] | None", paths: list[str],
                    owner: str = "") -> list[str]:
        """The real paths of ``paths`` if ``caller`` may write each (Forbidden or InvalidPolicy if not);
        ``owner``: whom the lookup counts against (LaunchSpec.owner)."""
        who = CallerRecord(caller[0], caller[1], list(caller[2])) if caller else None
        wanted = [str(path) for path in paths]
        return self._expect(self._request(lambda call_id: CheckPaths(call_id, who, wanted, owner)), PathsChecked).paths

    def review(self, make: "Callable[[int], Review]", timeout: float, fds: "list[int] | None" = None) -> dict[str, object]:
        """Run a review request (fork_protocol.Review, ``make(id)``, with ``fds``: its reviewed_fd)
        and return its child's answer, read here from the pipe the fork server passed (never by the
        fork server's loop), within ``timeout`` seconds and REVIEW_ANSWER_BYTES; the error it names raised."""
        call_id = self._request(make, fds)
        self._expect(call_id, ReviewStarted)
        with self._cond:
            passed = self._passed.pop(call_id, [])
        if len(passed) != 1:
            for fd in passed:
                os.close(fd)
            raise SetupError("fork server", detail="a review request was answered without its pipe")
        return read_review_answer(passed[0], timeout)

    def ping(self, timeout: float) -> bool:
        """True if the server answers a ping within ``timeout`` seconds (the daemon's watchdog);
        False if it does not. SetupError if it has exited. Never blocks past ``timeout``: not on
        the send lock (a sender may be stuck on a full socket) nor on a socket the server has
        stopped draining."""
        deadline = time.monotonic() + timeout
        if not self._send_lock.acquire(timeout=timeout):
            return False
        try:
            if self._closed:
                raise SetupError("fork server", 0, detail="the fork server has exited")
            call_id = self._next_id
            self._next_id += 1
            try:
                protocol.send(self._sock, Ping(call_id).encode(), None, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False                              # its queue is full: it is not reading
            except OSError as exc:
                raise SetupError("fork server", 0, detail=f"the fork server has exited ({exc.strerror})") from None
        finally:
            self._send_lock.release()
        return self._wait_event(call_id, (Pong,), timeout=max(0.0, deadline - time.monotonic())) is not None

    def close_session(self, session: str) -> None:
        """Kill all of a session; return once every process of it is gone and its sandbox released,
        or after the fork server's close bound (a process stuck in the kernel: released when it goes)."""
        self._expect(self._request(lambda call_id: SessionClose(call_id, session)), SessionClosed)

    def call(self, session: str, argv: list[str], env: dict[str, str], cwd: str, timeout: float | None,
             stdio: tuple[int, int, int], tool: dict[str, object] | None = None,
             terminal: tuple[int, int] | None = None, tag: str = "",
             taps: tuple[int, ...] = ()) -> tuple[int, int | None]:
        """Run one command (or a file tool) in a session; return (call id, its pid inside the session).
        With ``terminal`` (rows, columns) it runs on a terminal whose master comes back on stdin.
        ``tag`` and ``taps`` (the read ends of its stdout and stderr pipes, or none): what a surviving
        supervisor keeps of the call for the next daemon (fork_protocol.Call); ignored otherwise."""
        size: list[object] | None = None if terminal is None else list(terminal)
        if not self.survives:
            tag, taps = "", ()
        out_tap, err_tap = len(taps) > 0, len(taps) > 1
        call_id = self._request(lambda call_id: Call(call_id, session, list(argv), dict(env), cwd, timeout, tool, size,
                                                     tag, out_tap, err_tap),
                                [*stdio, *taps[:2]])
        return call_id, self._expect(call_id, Started).inner_pid

    def signal(self, call_id: int, signum: int) -> None:
        self._send(Signal(call_id, signum))

    def cancel(self, call_id: int) -> None:
        """Kill everything the launch or call started; its ``wait`` then reports how it ended."""
        self._send(Cancel(call_id))

    def wait(self, call_id: int) -> ExitInfo:
        event = self._wait_event(call_id, (Exited,))
        assert isinstance(event, Exited)
        return ExitInfo(event.exit_code, event.signal, event.timed_out, event.wall_seconds, event.cpu_seconds,
                        event.peak_memory_bytes, event.oom_killed)

    @property
    def handed_over(self) -> bool:
        """``detach`` ran: the sandboxes are the supervisor's, for the next daemon."""
        return self._handed_over

    @property
    def handover_fd(self) -> int:
        """A descriptor that is readable once this daemon handed its sandboxes over (``detach``):
        a thread reading a call's output polls it too, and stops then (HandedOver)."""
        return self._handover_r

    def wait_held(self, call_id: int) -> CallEnded:
        """The end of a call a surviving supervisor held for this daemon (Adoption.running)."""
        event = self._wait_event(call_id, (CallEnded,))
        assert isinstance(event, CallEnded)
        return event

    def detach(self) -> None:
        """Leave a surviving supervisor running with every sandbox (the handover: the next daemon
        attaches); the connection is closed without ``Stop``. A server that does not survive is
        closed (``close``): it cannot outlive this daemon."""
        if not self.survives:
            self.close()
            return
        with self._send_lock:
            self._closed = self._handed_over = True
            if self._handover_w >= 0:                     # not closed already (close() ran first)
                os.write(self._handover_w, b"x")
            try:
                self._sock.shutdown(socket.SHUT_RDWR)         # a reader blocked on it sees EOF now
            except OSError:
                pass
        with self._cond:
            while self._reading:
                self._cond.wait()
            self._close_passed()
            self._cond.notify_all()
        self._sock.close()
        if self._process is not None:
            self._process.returncode = 0                  # not ours to wait for: it outlives us

    def close(self) -> None:
        """Stop the server: it kills every sandbox and session it holds, then exits."""
        with self._send_lock:
            if not self._closed:
                try:
                    if self.survives:                     # else the connection's end is a handover
                        protocol.send(self._sock, Stop(0).encode())
                    self._sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass                                  # it died already: reading finds EOF
        try:
            self._wait_event(-1, ())                      # reads (and drops) what is left, until EOF
        except SetupError:
            pass
        self._sock.close()
        with self._cond:
            self._close_passed()
        self._release_handover_pipe()                     # nothing polls it after close (the daemon stopped)
        if self._process is not None:
            self._process.wait()

    def _release_handover_pipe(self) -> None:
        for fd in (self._handover_r, self._handover_w):
            if fd >= 0:                                   # close() again: closed already
                os.close(fd)
        self._handover_r = self._handover_w = -1

    def _close_passed(self) -> None:
        """Descriptors no request will take now (its server died, or this client closed)."""
        for fds in self._passed.values():
            for fd in fds:
                os.close(fd)
        self._passed.clear()

    def restart(self) -> None:
        """Replace a dead server with a fresh one, in place (every holder of this client keeps it).

        Requests still waiting on the old server fail at once ("the fork server exited"), then
        later requests go to the new one. The old server's sandboxes died with it; the new one
        sweeps what they left (cgroups, links) as it starts. A fresh interpreter again, spawned
        by subprocess (fork+exec in C, no Python code runs in the child), so the threaded
        daemon may call this."""
        fresh = ForkServer.start(self._wanted_native_calls, self._wait_seconds, self._call_helper,
                                 self._close_seconds, self._stuck_openers, self._survive, self._orphan_seconds,
                                 self._cgroup)
        with self._send_lock:
            old_sock, old_process = self._sock, self._process
            try:
                old_sock.shutdown(socket.SHUT_RDWR)       # a reader blocked on it sees EOF now
            except OSError:
                pass
            with self._cond:
                while self._reading:
                    self._cond.wait()
                self._sock, self.pid, self._process = fresh._sock, fresh.pid, fresh._process
                fresh._release_handover_pipe()            # this client's own stays (pumps poll it)
                self._limit = fresh._limit
                self._native_calls = fresh._native_calls
                self.last_heard = self.started_at = time.monotonic()
                self.answered = False
                self._first_id = self._next_id
                self._events.clear()
                self._close_passed()
                self._closed = False
                self._cond.notify_all()
        old_sock.close()
        if old_process is not None:
            old_process.wait()                            # it is dead already: only the zombie

    # -- plumbing ------------------------------------------------------------------------------

    def _request(self, make: "Callable[[int], Request]", fds: list[int] | None = None) -> int:
        """Send the request ``make(id)`` with a fresh id (taken under the send lock, so that ids
        below ``_first_id`` all went to a server that died); return the id."""
        with self._send_lock:
            call_id = self._next_id
            self._next_id += 1
            self._send_locked(make(call_id), fds)
        return call_id

    def _send(self, request: Request) -> None:
        with self._send_lock:
            self._send_locked(request, None)

    def _send_locked(self, request: Request, fds: list[int] | None) -> None:
        if self._handed_over:
            raise HandedOver()
        if self._closed:
            raise SetupError("fork server", 0, detail="the fork server has exited")
        data = request.encode()
        if len(data) > self._limit:
            # Refused here: sent, it would fail with EMSGSIZE, which says nothing to the caller.
            raise InvalidPolicy(f"the request is too large for the fork server: {len(data)} bytes, limit "
                                f"{self._limit} (too many writable roots, allowed sockets, paths, arguments or "
                                "environment entries, or too long ones): send fewer")
        try:
            protocol.send(self._sock, data, fds)
        except OSError as exc:                            # EPIPE, ECONNRESET: it died under us
            raise SetupError("fork server", 0, detail=f"the fork server has exited ({exc.strerror})") from None

    def _expect(self, call_id: int, kind: type[E]) -> E:
        """The answer ``kind`` to request ``call_id``; its Error answer raised as the error it names."""
        event = self._wait_event(call_id, (kind, Error))
        if isinstance(event, Error):
            raise SandboxdError.from_dict(event.error)
        assert isinstance(event, kind)
        return event

    @overload
    def _wait_event(self, call_id: int, kinds: tuple[type[Event], ...]) -> Event: ...

    @overload
    def _wait_event(self, call_id: int, kinds: tuple[type[Event], ...], timeout: float) -> Event | None: ...

    def _wait_event(self, call_id: int, kinds: tuple[type[Event], ...], timeout: float | None = None) -> Event | None:
        """The next event of ``kinds`` for ``call_id`` (None if ``timeout`` seconds pass first).
        Whoever waits reads (leader/follower): one waiting thread at a time reads the socket and
        hands others their events, so an answer wakes its own caller directly, with no reader
        thread in between."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                queue = self._events.get(call_id, [])
                for index, event in enumerate(queue):
                    if type(event) in kinds:
                        queue.pop(index)
                        if not queue:
                            self._events.pop(call_id, None)
                        return event
                if self._handed_over:
                    raise HandedOver()
                if self._closed or 0 < call_id < self._first_id:
                    raise SetupError("fork server", 0, detail="the fork server exited")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                if self._reading:
                    self._cond.wait(remaining)
                    continue
                self._reading = True
                self._cond.release()
                message: Message | Malformed | None
                fds: list[int]
                try:
                    if remaining is not None and not _readable_within(self._sock, remaining):
                        message, fds = Malformed(0, "nothing yet"), []   # back to the deadline check
                    else:
                        message, fds = protocol.receive(self._sock, protocol.events(), self._received)
                except OSError:
                    message, fds = None, []
                finally:
                    self._cond.acquire()
                    self._reading = False
                if isinstance(message, Event) and fds:     # as many as the record says (decode checked)
                    for fd in fds:
                        os.set_inheritable(fd, False)     # SCM_RIGHTS gives them without close-on-exec
                    self._passed.setdefault(message.id, []).extend(fds)
                else:
                    for fd in fds:
                        os.close(fd)
                if message is None:
                    self._closed = True
                elif isinstance(message, Malformed):
                    if message.id:                        # a server bug: its request fails, nobody hangs
                        self._events.setdefault(message.id, []).append(Error(message.id, SetupError(
                            "fork server", detail=f"the fork server's answer was malformed: {message}").to_dict()))
                elif isinstance(message, Event):
                    self.last_heard = time.monotonic()
                    self.answered = True
                    self._events.setdefault(message.id, []).append(message)
                self._cond.notify_all()           # another waiter's event, or the next reader's turn


# The most a review request's answer may be (a page of 10,000 changes, a diff of 4 MiB, an apply's
# list of what it did): past it the answer is refused rather than held.
REVIEW_ANSWER_BYTES = 64 << 20


def read_review_answer(fd: int, timeout: float) -> dict[str, object]:
    """A review child's answer on ``fd`` (which this closes): one JSON object, until EOF."""
    import json

    from sandboxd.errors import DeadlineExceeded, Exhausted

    deadline = time.monotonic() + timeout
    chunks: list[bytes] = []
    size = 0
    waiter = select.poll()
    waiter.register(fd, select.POLLIN)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not waiter.poll(math.ceil(left * 1000)):
                raise DeadlineExceeded(f"the change set was not read within {timeout:g} s: list or apply fewer "
                                       "paths at once")
            block = os.read(fd, 1 << 20)
            if not block:
                break
            size += len(block)
            if size > REVIEW_ANSWER_BYTES:
                raise Exhausted(f"the answer is over {REVIEW_ANSWER_BYTES >> 20} MiB: ask for fewer paths or a "
                                "smaller page")
            chunks.append(block)
    finally:
        os.close(fd)
    try:
        answer = json.loads(b"".join(chunks))
    except ValueError:
        raise SetupError("review", detail="the review request's child ended without an answer") from None
    if not isinstance(answer, dict):
        raise SetupError("review", detail="the review request's child answered something else")
    if isinstance(answer.get("error"), dict):
        raise SandboxdError.from_dict(answer["error"])
    return answer


def _readable_within(sock: socket.socket, seconds: float) -> bool:
    waiter = select.poll()
    waiter.register(sock.fileno(), select.POLLIN)
    return bool(waiter.poll(max(0, math.ceil(seconds * 1000))))
