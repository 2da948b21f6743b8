"""The fork server: a small single-threaded process that does every fork.

The daemon starts it before any gRPC thread exists (a forked child of a
threaded process can deadlock, and fork cost grows with the parent's
memory), then sends it requests over a SOCK_SEQPACKET socket pair, one JSON
object per message:

  {"op": "launch", "id": N, "spec": {...}}  + SCM_RIGHTS [stdin, stdout, stderr]   one-shot sandbox
  {"op": "session_open", "id": N, "session": S, "spec": {...}}                     build a session's sandbox
  {"op": "session_close", "id": N, "session": S}                                   kill all of it
  {"op": "call", "id": N, "session": S, "argv": [...], "env": {...}, "cwd": C,
   "timeout": T}  + SCM_RIGHTS [stdin, stdout, stderr]                              one command in a session
  {"op": "signal", "id": N, "signum": S}    {"op": "cancel", "id": N}               to a running launch or call
  {"op": "check_paths", "id": N, "caller": [uid, gid, [groups]], "paths": [...]}   may the caller write them?

and answers, tagged with the request's id:

  {"event": "started", "pid": P, "inner_pid": Q}  {"event": "session_ready", "init_pid": P, "workspace": W}
  {"event": "paths_checked", "paths": [real paths]}
  {"event": "error", "error": {step, errno, path, hint, ...}}  {"event": "session_closed"}
  {"event": "exited", "info": {exit_code, signal, timed_out, ...}}

Launches and calls take the same ``Spawner`` paths that ``sandboxd run`` uses.
Sandboxes, sessions and calls die with the fork server, and it dies with its client.
"""

from __future__ import annotations

import array
import json
import math
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any

from sandboxd._record import Record
from sandboxd.errors import Forbidden, InvalidPolicy, SandboxdError, SetupError
from sandboxd.policy.limits import MAX_TIMEOUT_SECONDS  # noqa: F401 - re-exported for the edge's callers
from sandboxd.policy.limits import check_timeout as limits_check_timeout
from sandboxd.policy.spec import LaunchSpec, spec_from_dict, spec_to_dict
from sandboxd.supervisor.spawner import ExitInfo, SandboxProcess, SessionSandbox, Spawner

MAX_MESSAGE = 1 << 20
# Errors that cross from the fork server as their kind and message (a SetupError has more fields).
_PLAIN_ERRORS: dict[str, type[SandboxdError]] = {cls.__name__: cls for cls in (InvalidPolicy, Forbidden)}
# The longest one poll() waits: far enough to cost nothing, near enough that no deadline can
# overflow poll's millisecond int (the loop recomputes after every wake). Time limits above
# MAX_TIMEOUT_SECONDS (a week) are refused before they get here (policy Limits, SessionCall) and
# again at this edge (check_timeout); the loop itself copes with any deadline.
MAX_POLL_MS = 60_000


def check_timeout(timeout: object, what: str = "timeout_seconds") -> float | None:
    """A call's time limit as a float (None or 0: no limit), or InvalidPolicy for what no clock can
    hold; the same range as the policy's (policy.limits.check_timeout), checked again at this edge."""
    if timeout is None or (timeout == 0 and not isinstance(timeout, bool)):
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise InvalidPolicy(f"{what} must be a number of seconds, got {timeout!r}")
    return limits_check_timeout(timeout, what)


def poll_timeout_ms(deadline: float | None, now: float) -> int:
    """poll()'s timeout for the nearest ``deadline``: never negative, never beyond MAX_POLL_MS,
    whatever the deadline (inf, NaN, 1e300): the loop must never raise on a value."""
    if deadline is None:
        return MAX_POLL_MS
    remaining = deadline - now
    if not remaining < MAX_POLL_MS / 1000:            # also NaN
        return MAX_POLL_MS
    if remaining <= 0:                                # also -inf
        return 0
    return math.ceil(remaining * 1000)


def _send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(data)


def _recv(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    fds = array.array("i")
    data, ancdata, _, _ = sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(16 * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    if not data:
        return None, list(fds)
    try:
        message = json.loads(data)
    except ValueError:                                    # also a message cut at MAX_MESSAGE
        message = None
    if not isinstance(message, dict):
        return {"op": None, "malformed": True}, list(fds)   # answered as an error, never taken as EOF
    return message, list(fds)


class _Server:
    """The server side: runs in the fork server process, single-threaded."""

    def __init__(self, sock: socket.socket, native_calls: bool = True) -> None:
        from sandboxd.kernel import netns
        from sandboxd.kernel.cgroups import sweep_stale
        from sandboxd.launcher.native_call import helper_path
        sweep_stale()                                     # what a SIGKILLed predecessor left behind
        netns.sweep_stale()                               # its isolated networks' links and proxy access too
        self.sock = sock
        self.spawner = Spawner(native_helper=helper_path() if native_calls else None)
        self.running: dict[int, tuple[SandboxProcess, float | None]] = {}
        self.sessions: dict[str, SessionSandbox] = {}
        # poll, not select: descriptors past 1024 (a thousand sessions) are ordinary here.
        self._poller = select.poll()
        self._sock_fd = sock.fileno()
        self._poller.register(self._sock_fd, select.POLLIN)
        self._watched: dict[int, int] = {}                # call id -> its pidfd in the poller

    def serve(self) -> None:
        while True:
            deadlines = [d for d in (proc.deadline(t) for proc, t in self.running.values()) if d is not None]
            try:
                events = self._poller.poll(poll_timeout_ms(min(deadlines) if deadlines else None, time.monotonic()))
            except InterruptedError:
                continue
            self._collect_exits()
            if any(fd == self._sock_fd for fd, _ in events) and not self._handle_next():
                self._shutdown()
                return

    def _collect_exits(self) -> None:
        for call_id, (proc, limit) in list(self.running.items()):
            try:
                info = proc.poll(limit)
            except Exception as exc:  # noqa: BLE001 - one broken call must not end everyone's
                _log(f"collecting call {call_id} failed: {type(exc).__name__}: {exc}")
                try:
                    proc.kill()
                except Exception:  # noqa: BLE001 - best effort: it is reported as killed either way
                    pass
                info = ExitInfo(exit_code=None, signal=signal.SIGKILL, timed_out=False, wall_seconds=0.0,
                                cpu_seconds=None, peak_memory_bytes=None, oom_killed=False)
            if info is not None:
                del self.running[call_id]
                # By number: poll() above closed the pidfd, and nothing polls in between.
                self._poller.unregister(self._watched.pop(call_id))
                self._answer({"id": call_id, "event": "exited", "info": info.to_dict()})

    def _answer(self, message: dict[str, Any]) -> None:
        try:
            _send(self.sock, message)
        except OSError as exc:                            # the daemon is gone: EOF ends the loop
            _log(f"cannot answer the daemon: {exc}")

    def _handle_next(self) -> bool:
        try:
            message, fds = _recv(self.sock)
        except (OSError, ValueError):
            message, fds = None, []
        if message is None:
            for fd in fds:
                os.close(fd)
            return False
        call_id = 0
        try:
            if message.get("malformed"):
                raise InvalidPolicy("a fork server request must be one JSON object below 1 MiB")
            call_id = message.get("id", 0)
            if isinstance(call_id, bool) or not isinstance(call_id, int):
                call_id = 0
                raise InvalidPolicy("a fork server request needs an integer id")
            self._dispatch(call_id, message, fds)
        except SandboxdError as exc:
            error = exc.to_dict() if isinstance(exc, SetupError) else {"kind": type(exc).__name__, "detail": str(exc)}
            self._answer({"id": call_id, "event": "error", "error": error})
        except Exception as exc:  # noqa: BLE001 - the dispatch edge: every failure is an answer
            _log(f"request {call_id} failed: {type(exc).__name__}: {exc}")
            self._answer({"id": call_id, "event": "error", "error": {
                "kind": "SetupError", "step": "fork server",
                "detail": f"the fork server could not handle the request ({type(exc).__name__}: {exc})"}})
        finally:
            for fd in fds:
                os.close(fd)
        return True

    def _dispatch(self, call_id: int, message: dict[str, Any], fds: list[int]) -> None:
        """One request, checked field by field: the daemon is trusted, but a bug there must
        come back as an error answer, never end every sandbox of every user."""
        op = message.get("op")
        if op in ("launch", "call"):
            if call_id <= 0 or call_id in self.running:
                raise InvalidPolicy(f"request id {call_id!r} is not a fresh positive id")
            if len(fds) != 3:
                raise InvalidPolicy("a launch needs exactly three descriptors: stdin, stdout, stderr")
            stdio = (fds[0], fds[1], fds[2])
            if op == "launch":
                spec = spec_from_dict(_field(message, "spec", dict))
                limit = check_timeout(spec.limits.timeout_seconds, "limit timeout_seconds")
                proc = self.spawner.launch(spec, stdio=stdio)
            else:
                session = self._session(message)
                argv = _field(message, "argv", list)
                env = _field(message, "env", dict, optional=True) or {}
                cwd = _field(message, "cwd", str)
                tool = _field(message, "tool", dict, optional=True)
                if not all(isinstance(item, str) for item in (*argv, *env, *env.values())):
                    raise InvalidPolicy("argv and env must hold strings only")
                if any("\0" in item for item in (*argv, *env, *env.values(), cwd)):
                    raise InvalidPolicy("argv, env and cwd cannot contain NUL characters")
                limit = check_timeout(message.get("timeout"))
                proc = self.spawner.launch_call(session, tuple(argv), dict(env), cwd, stdio=stdio, tool=tool)
            proc.wait_started()
            self.running[call_id] = (proc, limit)
            self._watched[call_id] = proc.fileno()
            self._poller.register(proc.fileno(), select.POLLIN)
            self._answer({"id": call_id, "event": "started", "pid": proc.pid, "inner_pid": proc.inner_pid})
        elif op == "session_open":
            name = _field(message, "session", str)
            if name in self.sessions:
                raise InvalidPolicy(f"session {name!r} is already open in the fork server")
            spec = spec_from_dict(_field(message, "spec", dict))
            check_timeout(spec.limits.timeout_seconds, "limit timeout_seconds")
            session = self.spawner.open_session(spec)
            self.sessions[name] = session
            ready: dict[str, Any] = {"id": call_id, "event": "session_ready", "init_pid": session.init_pid,
                                     "workspace": session.plan.workspace}
            network = session.network
            if network is not None:
                # The daemon serves the egress proxy (this process has no threads): it binds the
                # same address next, before the session can run anything.
                if network.proxy_listener is not None:
                    network.proxy_listener.close()
                    network.proxy_listener = None
                ready.update(host_address=network.host_address, sandbox_address=network.sandbox_address,
                             resolvers=network.resolvers)
            self._answer(ready)
        elif op == "session_close":
            closing = self.sessions.pop(_field(message, "session", str), None)
            if closing is not None:
                self._close_session(closing)
            self._answer({"id": call_id, "event": "session_closed"})
        elif op == "check_paths":
            paths = _field(message, "paths", list)
            self._answer({"id": call_id, "event": "paths_checked",
                          "paths": check_paths(message.get("caller"), [str(p) for p in paths])})
        elif op in ("signal", "cancel"):
            entry = self.running.get(call_id)
            signum = _field(message, "signum", int) if op == "signal" else signal.SIGKILL
            if not 0 < signum < signal.NSIG:
                raise InvalidPolicy(f"signal {signum} is not a signal number")
            if entry:
                if op == "cancel":
                    entry[0].kill()
                else:
                    entry[0].send_signal(signum)
        else:
            raise InvalidPolicy(f"unknown fork server operation {op!r}")

    def _close_session(self, session: SessionSandbox) -> None:
        """Kill the session and wait until it is gone, reaping its calls meanwhile (init's exit
        waits for them; see SessionSandbox.kill). Bounded: a stuck kernel cannot hang us."""
        session.kill()
        deadline = time.monotonic() + 30
        while not session.reap() and time.monotonic() < deadline:
            waiter = select.poll()
            for fd in (session.pidfd, *self._watched.values()):
                waiter.register(fd, select.POLLIN)
            waiter.poll(50)
            self._collect_exits()
        session.close()
        self._collect_exits()

    def _session(self, message: dict[str, Any]) -> SessionSandbox:
        session = self.sessions.get(_field(message, "session", str))
        if session is None:
            raise InvalidPolicy(f"no open session {message.get('session')!r} in the fork server")
        return session

    def _shutdown(self) -> None:
        for session in list(self.sessions.values()):
            self._close_session(session)
        self.sessions.clear()
        for proc, _ in self.running.values():
            proc.kill()
            proc.wait()


def _field(message: dict[str, Any], key: str, kind: type, optional: bool = False) -> Any:
    """``message[key]`` if it is a ``kind`` (None allowed when ``optional``), else InvalidPolicy."""
    value = message.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidPolicy(f"fork server request field {key!r} must be a {kind.__name__}, got {value!r}")
    return value


def _log(text: str) -> None:
    """The fork server has no logger of its own: its stderr is the daemon's."""
    try:
        sys.stderr.write(f"sandboxd-fork: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def check_paths(caller: Any, paths: list[str]) -> list[str]:
    """The real paths of ``paths`` as ``caller`` [uid, gid, [groups]] resolves them, if it may
    write each (asked of the kernel under its credentials: kernel.access)."""
    from sandboxd.kernel import access

    who = access.Caller(int(caller[0]), int(caller[1]), tuple(int(g) for g in caller[2])) if caller else None
    fds = access.open_as(who, [access.PathRequest(path, "workspace", access.WRITE) for path in paths])
    try:
        return [access.real_path(fd) for fd in fds]
    finally:
        for fd in fds:
            os.close(fd)


def serve(sock: socket.socket, native_calls: bool = True) -> None:
    """The fork server loop. Returns when the client end closes, after killing everything.
    ``native_calls``: run session calls with sandboxd-call when it is built (native_call.py)."""
    _Server(sock, native_calls).serve()


class SessionInfo(Record):
    init_pid: int
    workspace: str                      # the workspace's real path, as the owner's lookup resolved it
    host_address: str | None            # the host side of an isolated network's link
    sandbox_address: str | None
    resolvers: tuple[str, ...]


class ForkServer:
    """Client handle of a running fork server. Thread-safe: any number of threads may launch
    and wait at once; whichever of them waits reads the server's answers for all."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self._sock = sock
        self.pid = pid
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._events: dict[int, list[dict[str, Any]]] = {}
        self._next_id = 1
        self._closed = False
        self._reading = False                     # a waiting thread is reading the socket
        self._process: "Any" = None
        self._native_calls = False
        self._wanted_native_calls = True
        self._first_id = 1                        # ids below it went to a server that has died since

    @property
    def native_calls(self) -> bool:
        return self._native_calls

    @classmethod
    def start(cls, native_calls: bool = True) -> "ForkServer":
        """Start the server as a fresh interpreter (``python -m sandboxd.supervisor.forkserver``).

        Not a fork of the caller: the daemon has gRPC threads, and a forked copy of a
        threaded process may deadlock; and a fresh process is as small as it gets,
        which keeps every later fork cheap. subprocess spawns it without forking Python.
        """
        import subprocess
        import sys

        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "PYTHONPATH": package_root}
        try:
            flags = [] if native_calls else ["--python-calls"]
            child = subprocess.Popen([sys.executable, "-m", "sandboxd.supervisor.forkserver", str(child_end.fileno()),
                                      *flags],
                                     pass_fds=(child_end.fileno(),), env=env, stdin=subprocess.DEVNULL,
                                     close_fds=True)
        finally:
            child_end.close()
        server = cls(parent_end, child.pid)
        server._process = child
        server._wanted_native_calls = native_calls
        from sandboxd.launcher.native_call import helper_path
        server._native_calls = native_calls and helper_path() is not None
        return server

    # -- requests ------------------------------------------------------------------------------

    def launch(self, spec: LaunchSpec, stdio: tuple[int, int, int] = (0, 1, 2)) -> int:
        """Start a one-shot sandbox; return its id once the command is running, or raise SetupError."""
        call_id = self._request({"op": "launch", "spec": spec_to_dict(spec)}, list(stdio))
        self._expect(call_id, "started")
        return call_id

    def open_session(self, session: str, spec: LaunchSpec) -> "SessionInfo":
        """Build a session's sandbox (``spec.argv`` is not run): its init's pid and, with an isolated
        network, its addresses."""
        event = self._expect(self._request({"op": "session_open", "session": session,
                                            "spec": spec_to_dict(spec)}), "session_ready")
        return SessionInfo(int(event.get("init_pid") or 0), str(event.get("workspace") or ""),
                           event.get("host_address"), event.get("sandbox_address"), tuple(event.get("resolvers") or ()))

    def check_paths(self, caller: "tuple[int, int, tuple[int, ...]] | None", paths: list[str]) -> list[str]:
        """The real paths of ``paths`` if ``caller`` may write each (Forbidden or InvalidPolicy if not)."""
        event = self._expect(self._request({"op": "check_paths", "caller": list(caller[:2]) + [list(caller[2])]
                                            if caller else None, "paths": list(paths)}), "paths_checked")
        return [str(p) for p in event["paths"]]

    def close_session(self, session: str) -> None:
        self._expect(self._request({"op": "session_close", "session": session}), "session_closed")

    def call(self, session: str, argv: list[str], env: dict[str, str], cwd: str, timeout: float | None,
             stdio: tuple[int, int, int], tool: dict[str, object] | None = None) -> tuple[int, int | None]:
        """Run one command (or a file tool) in a session; return (call id, its pid inside the session)."""
        call_id = self._request({"op": "call", "session": session, "argv": list(argv), "env": dict(env),
                                 "cwd": cwd, "timeout": timeout, "tool": tool}, list(stdio))
        event = self._expect(call_id, "started")
        return call_id, event.get("inner_pid")

    def signal(self, call_id: int, signum: int) -> None:
        self._send({"op": "signal", "id": call_id, "signum": signum})

    def cancel(self, call_id: int) -> None:
        """Kill everything the launch or call started; its ``wait`` then reports how it ended."""
        self._send({"op": "cancel", "id": call_id})

    def wait(self, call_id: int) -> ExitInfo:
        event = self._wait_event(call_id, ("exited",))
        return ExitInfo(**event["info"])

    def close(self) -> None:
        """Stop the server: it kills every sandbox and session it holds, then exits."""
        with self._send_lock:
            if not self._closed:
                try:
                    self._sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass                                  # it died already: reading finds EOF
        try:
            self._wait_event(-1, ())                      # reads (and drops) what is left, until EOF
        except SetupError:
            pass
        self._sock.close()
        if self._process is not None:
            self._process.wait()

    def restart(self) -> None:
        """Replace a dead server with a fresh one, in place (every holder of this client keeps it).

        Requests still waiting on the old server fail at once ("the fork server exited"), then
        later requests go to the new one. The old server's sandboxes died with it; the new one
        sweeps what they left (cgroups, links) as it starts. A fresh interpreter again, spawned
        by subprocess (fork+exec in C, no Python code runs in the child), so the threaded
        daemon may call this."""
        fresh = ForkServer.start(self._wanted_native_calls)
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
                self._native_calls = fresh._native_calls
                self._first_id = self._next_id
                self._events.clear()
                self._closed = False
                self._cond.notify_all()
        old_sock.close()
        if old_process is not None:
            old_process.wait()                            # it is dead already: only the zombie

    # -- plumbing ------------------------------------------------------------------------------

    def _request(self, message: dict[str, Any], fds: list[int] | None = None) -> int:
        with self._send_lock:
            call_id = self._next_id
            self._next_id += 1
            message["id"] = call_id
            self._send_locked(message, fds)
        return call_id

    def _send(self, message: dict[str, Any]) -> None:
        with self._send_lock:
            self._send_locked(message, None)

    def _send_locked(self, message: dict[str, Any], fds: list[int] | None) -> None:
        if self._closed:
            raise SetupError("fork server", 0, detail="the fork server has exited")
        try:
            _send(self._sock, message, fds)
        except OSError as exc:                            # EPIPE, ECONNRESET: it died under us
            raise SetupError("fork server", 0, detail=f"the fork server has exited ({exc.strerror})") from None

    def _expect(self, call_id: int, kind: str) -> dict[str, Any]:
        event = self._wait_event(call_id, (kind, "error"))
        if event["event"] == "error":
            error = event["error"]
            plain = _PLAIN_ERRORS.get(str(error.get("kind")))
            if plain is not None:
                raise plain(error.get("detail", "invalid request"))
            raise SetupError.from_dict(error)
        return event

    def _wait_event(self, call_id: int, kinds: tuple[str, ...]) -> dict[str, Any]:
        """The next event of ``kinds`` for ``call_id``. Whoever waits reads (leader/follower):
        one waiting thread at a time reads the socket and hands others their events, so an
        answer wakes its own caller directly, with no reader thread in between."""
        with self._cond:
            while True:
                queue = self._events.get(call_id, [])
                for index, event in enumerate(queue):
                    if event["event"] in kinds:
                        queue.pop(index)
                        if not queue:
                            self._events.pop(call_id, None)
                        return event
                if self._closed or 0 < call_id < self._first_id:
                    raise SetupError("fork server", 0, detail="the fork server exited")
                if self._reading:
                    self._cond.wait()
                    continue
                self._reading = True
                self._cond.release()
                try:
                    message, fds = _recv(self._sock)
                except (OSError, ValueError):
                    message, fds = None, []
                finally:
                    self._cond.acquire()
                    self._reading = False
                for fd in fds:
                    os.close(fd)
                if message is None:
                    self._closed = True
                elif isinstance(message.get("id"), int):
                    self._events.setdefault(message["id"], []).append(message)
                self._cond.notify_all()           # another waiter's event, or the next reader's turn


def _main(fd: int, native_calls: bool = True) -> None:
    """Entry point of the fork server process."""
    import prctl  # python-prctl: off the one-shot launch path, so its import cost is fine here

    expected_parent = os.getppid()
    prctl.set_name("sandboxd-fork")
    prctl.set_pdeathsig(signal.SIGKILL)      # the fork server never outlives the daemon
    if os.getppid() != expected_parent:      # the daemon died before that took effect
        os._exit(0)
    serve(socket.socket(fileno=fd), native_calls)


if __name__ == "__main__":
    import sys

    _main(int(sys.argv[1]), native_calls="--python-calls" not in sys.argv[2:])
