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
   (with "terminal": [rows, columns], on a terminal: stdin is the socket its master goes back on)
  {"op": "signal", "id": N, "signum": S}    {"op": "cancel", "id": N}               to a running launch or call
  {"op": "check_paths", "id": N, "caller": [uid, gid, [groups]], "paths": [...]}   may the caller write them?
  {"op": "ping", "id": N}                                                          the daemon's watchdog

and answers, tagged with the request's id:

  {"event": "started", "pid": P, "inner_pid": Q}  {"event": "session_ready", "init_pid": P, "workspace": W}
  {"event": "paths_checked", "paths": [real paths]}  {"event": "pong"}
  {"event": "error", "error": {step, errno, path, hint, ...}}  {"event": "session_closed"}
  {"event": "exited", "info": {exit_code, signal, timed_out, ...}}

Launches and calls take the same ``Spawner`` paths that ``sandboxd run`` uses.

The loop never waits on a caller's path: the paths a request names are opened as its caller in a
child (access.PendingOpen), a session's build and a command's start are reported on pipes, and
each of those is a descriptor in the poll loop with a deadline (``wait_seconds``). A file system
that does not answer (a FUSE server that never replies, a hung NFS mount) costs only the request
that named it: DeadlineExceeded naming the path, the child SIGKILLed and reaped whenever it goes.
Sandboxes, sessions and calls die with the fork server, and it dies with its client.
"""

from __future__ import annotations

import array
import errno
import json
import math
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, overload

from sandboxd._record import Record
from sandboxd.kernel import access
from sandboxd.launcher.plan import path_check as plan_path_check
from sandboxd.launcher.plan import path_requests as plan_path_requests
from sandboxd.errors import DeadlineExceeded, Forbidden, InvalidPolicy, SandboxdError, SetupError
from sandboxd.policy.limits import MAX_TIMEOUT_SECONDS  # noqa: F401 - re-exported for the edge's callers
from sandboxd.policy.limits import check_timeout as limits_check_timeout
from sandboxd.policy.spec import LaunchSpec, spec_from_dict, spec_to_dict
from sandboxd.supervisor.spawner import ExitInfo, SandboxProcess, SessionBuild, SessionSandbox, Spawner
from sandboxd.supervisor.waits import Orphans, ReportReader, Waits

if TYPE_CHECKING:
    from collections.abc import Callable

MAX_MESSAGE = 1 << 20
SO_SNDBUFFORCE = 32
# Errors that cross from the fork server as their kind and message (a SetupError has more fields).
_PLAIN_ERRORS: dict[str, type[SandboxdError]] = {cls.__name__: cls for cls in (InvalidPolicy, Forbidden,
                                                                                 DeadlineExceeded)}
# How long a request may wait on a caller's paths, a session's build or a command's start
# (``fork_server.wait_seconds``): a lookup that takes longer is on a file system that does not answer.
DEFAULT_WAIT_SECONDS = 10.0
# How long closing a session waits for its init to be reaped (milliseconds, normally) before
# leaving it to the loop: a process stuck on a file system that does not answer may hold it.
CLOSE_WAIT_SECONDS = 5.0
# The longest one poll() waits: far enough to cost nothing, near enough that no deadline can
# overflow poll's millisecond int (the loop recomputes after every wake). Time limits above
# MAX_TIMEOUT_SECONDS (a week) are refused before they get here (policy Limits, SessionCall) and
# again at this edge (check_timeout); the loop itself copes with any deadline.
MAX_POLL_MS = 60_000
# How often the loop removes sandbox groups of dead creators (cheap: a few directory listings).
SWEEP_SECONDS = 60.0


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


def _send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None,
          data: bytes | None = None) -> None:
    data = json.dumps(message).encode() if data is None else data
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(data)


def message_limit(sock: socket.socket) -> int:
    """The largest request ``sock`` carries in one message: what its send buffer allows (the
    kernel refuses a SEQPACKET message over SO_SNDBUF - 32 bytes with EMSGSIZE), raised to
    MAX_MESSAGE when it can be (root: SO_SNDBUFFORCE), never above what the server reads."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 2 * MAX_MESSAGE)
    except OSError:
        pass                                              # not root: the default buffer
    return min(MAX_MESSAGE, sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) - 32 - 1024)


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

    def __init__(self, sock: socket.socket, native_calls: bool = True,
                 wait_seconds: float = DEFAULT_WAIT_SECONDS, call_helper: str | None = None) -> None:
        from sandboxd.kernel import netns
        from sandboxd.kernel.cgroups import sweep_stale
        from sandboxd.launcher.native_call import REBUILD, check_helper
        sweep_stale()                                     # what a SIGKILLed predecessor left behind
        netns.sweep_stale()                               # its isolated networks' links and proxy access too
        self.sock = sock
        # Once, at start: a helper built from other constants or another call plan is not used.
        helper = check_helper(call_helper) if native_calls else None
        if helper is not None and helper.unusable:
            _log(f"call helper {helper.state}: session calls take the slower Python path; rebuild it: {REBUILD}")
        self.spawner = Spawner(native_helper=helper.path if helper else None)
        self.running: dict[int, tuple[SandboxProcess, float | None]] = {}
        self.sessions: dict[str, SessionSandbox] = {}
        # poll, not select: descriptors past 1024 (a thousand sessions) are ordinary here.
        self._poller = select.poll()
        self._sock_fd = sock.fileno()
        self._poller.register(self._sock_fd, select.POLLIN)
        self._watched: dict[int, int] = {}                # call id -> its pidfd in the poller
        self.wait_seconds = wait_seconds
        self._waits = Waits(self._poller)                 # requests waiting on a child: paths, builds, starts
        self._orphans = Orphans(self._poller)             # children given up on, reaped when they go
        self._opening: set[str] = set()                   # sessions being built
        self._closed_while_opening: set[str] = set()
        self._unanswered: set[int] = set()                # calls that never started: their end is nobody's
        # The start-up sweep can run before a SIGKILLed predecessor's fork server has died (its
        # parent-death signal is asynchronous): its groups are taken by a later sweep, never waited for.
        self._next_sweep = time.monotonic() + SWEEP_SECONDS

    def serve(self) -> None:
        while True:
            deadlines = [d for d in (proc.wake_at(t) for proc, t in self.running.values()) if d is not None]
            deadlines += self._waits.deadlines()
            deadlines.append(self._next_sweep)
            try:
                events = self._poller.poll(poll_timeout_ms(min(deadlines) if deadlines else None, time.monotonic()))
            except InterruptedError:
                continue
            self._collect_exits({fd for fd, _ in events})
            for fd, _ in events:
                self._waits.ready(fd, self._answer_error)
                self._orphans.ready(fd)
            self._waits.expire(time.monotonic(), self._answer_error)
            if time.monotonic() >= self._next_sweep:
                self._sweep(patient=False)
            if any(fd == self._sock_fd for fd, _ in events) and not self._handle_next():
                self._shutdown()
                return

    def _collect_exits(self, ready: "set[int] | None" = None) -> None:
        """Report the calls that ended. With ``ready`` (the descriptors poll() reported), only the
        calls whose pidfd is among them or whose time limit or stop grace has come are polled: a
        waitpid per running call on every turn made each call cost more for every other one running
        (330 us a turn with 400 running, 40 us now: tests/bench_call_start.py --loop-turn)."""
        now = time.monotonic()
        for call_id, (proc, limit) in list(self.running.items()):
            if ready is not None and proc.fileno() not in ready:
                wake = proc.wake_at(limit)
                if wake is None or wake > now:
                    continue
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
                if call_id in self._unanswered:
                    self._unanswered.discard(call_id)
                    continue
                self._answer({"id": call_id, "event": "exited", "info": info.to_dict()})

    def _answer(self, message: dict[str, Any]) -> None:
        try:
            _send(self.sock, message)
        except OSError as exc:                            # the daemon is gone: EOF ends the loop
            if exc.errno == errno.EMSGSIZE and message.get("event") != "error":
                self._answer_error(int(message.get("id") or 0), InvalidPolicy(
                    f"the answer to request {message.get('id')} is too large for the fork server's socket; "
                    "ask for fewer paths at once"))
                return
            _log(f"cannot answer the daemon: {exc}")

    def _answer_error(self, call_id: int, exc: BaseException) -> None:
        """A request's failure as its answer: every failure is one, none ends the loop."""
        if isinstance(exc, SandboxdError):
            error = exc.to_dict() if isinstance(exc, SetupError) else {"kind": type(exc).__name__, "detail": str(exc)}
        else:
            _log(f"request {call_id} failed: {type(exc).__name__}: {exc}")
            error = {"kind": "SetupError", "step": "fork server",
                     "detail": f"the fork server could not handle the request ({type(exc).__name__}: {exc})"}
        self._answer({"id": call_id, "event": "error", "error": error})

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
        except Exception as exc:  # noqa: BLE001 - the dispatch edge: every failure is an answer
            self._answer_error(call_id, exc)
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
            if op == "launch":
                spec = spec_from_dict(_field(message, "spec", dict))
                limit = check_timeout(spec.limits.timeout_seconds, "limit timeout_seconds")
                # The stdio descriptors outlive this request's message: the launch waits on the paths.
                stdio = (os.dup(fds[0]), os.dup(fds[1]), os.dup(fds[2]))
                def close_stdio() -> None:
                    for fd in stdio:
                        os.close(fd)
                def launch(opened: list[int]) -> None:
                    try:
                        self._await_start(call_id, self.spawner.launch(spec, stdio=stdio, opened=opened), limit)
                    finally:
                        close_stdio()
                try:
                    self._open_paths(call_id, spec.caller, plan_path_requests(spec), launch, plan_path_check(spec),
                                     undo=close_stdio)
                except BaseException:
                    close_stdio()
                    raise
                return
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
            terminal = _terminal_size(message.get("terminal"))
            self._await_start(call_id, self.spawner.launch_call(session, tuple(argv), dict(env), cwd,
                                                                stdio=(fds[0], fds[1], fds[2]), tool=tool,
                                                                terminal=terminal), limit)
        elif op == "session_open":
            name = _field(message, "session", str)
            if name in self.sessions or name in self._opening:
                raise InvalidPolicy(f"session {name!r} is already open in the fork server")
            spec = spec_from_dict(_field(message, "spec", dict))
            check_timeout(spec.limits.timeout_seconds, "limit timeout_seconds")
            self._opening.add(name)
            try:
                self._open_paths(call_id, spec.caller, plan_path_requests(spec),
                                 lambda opened: self._build_session(call_id, name, spec, opened), plan_path_check(spec),
                                 undo=lambda: self._forget_opening(name))
            except BaseException:
                self._forget_opening(name)
                raise
        elif op == "session_close":
            name = _field(message, "session", str)
            closing = self.sessions.pop(name, None)
            if closing is not None:
                self._close_session(closing)
            elif name in self._opening:
                self._closed_while_opening.add(name)      # closed as its build ends
            self._answer({"id": call_id, "event": "session_closed"})
        elif op == "check_paths":
            paths = [str(p) for p in _field(message, "paths", list)]
            caller = message.get("caller")
            who = (int(caller[0]), int(caller[1]), tuple(int(g) for g in caller[2])) if caller else None
            def checked(opened: list[int]) -> None:
                try:
                    real = [access.real_path(fd) for fd in opened]
                finally:
                    for fd in opened:
                        os.close(fd)
                self._answer({"id": call_id, "event": "paths_checked", "paths": real})
            self._open_paths(call_id, who, [access.PathRequest(path, "workspace", access.WRITE) for path in paths],
                             checked)
        elif op == "ping":
            self._answer({"id": call_id, "event": "pong"})
        elif op in ("signal", "cancel"):
            entry = self.running.get(call_id)
            signum = _field(message, "signum", int) if op == "signal" else signal.SIGKILL
            if not 0 < signum < signal.NSIG:
                raise InvalidPolicy(f"signal {signum} is not a signal number")
            if entry:
                if op == "cancel":
                    entry[0].stop()                       # never waits: see SandboxProcess.stop
                else:
                    entry[0].send_signal(signum)
        else:
            raise InvalidPolicy(f"unknown fork server operation {op!r}")

    # -- waiting on children, never blocking ---------------------------------------------------

    def _open_paths(self, call_id: int, caller: "tuple[int, int, tuple[int, ...]] | None",
                    requests: "list[access.PathRequest]", then: "Callable[[list[int]], None]",
                    check: "Callable[[list[int]], None] | None" = None,
                    undo: "Callable[[], None]" = lambda: None) -> None:
        """Open ``requests`` as ``caller`` in a child (which also runs ``check`` on them, see
        access.PendingOpen), then ``then(descriptors)`` (which owns them) from the loop; a lookup
        past the deadline answers DeadlineExceeded naming its path. ``undo``: what to release when
        ``then`` is never called (a refused path, the deadline)."""
        # Root's paths too (the daemon's own launches, root's sessions): a hung NFS mount named by
        # accident must not hold everyone else either.
        who = access.Caller(caller[0], caller[1], tuple(caller[2])) if caller else access.Caller(0, 0, ())
        pending = access.PendingOpen(who, requests, check)

        def ready() -> bool:
            if not pending.step():
                return False
            try:
                opened = pending.take()
            except BaseException:
                undo()
                raise
            finally:
                pending.abandon()
                self._orphans.add(pending.pidfd, lambda: pending.reap())
            then(opened)
            return True

        def expire() -> None:
            undo()
            waiting = pending.waiting_on()
            pending.abandon()
            self._orphans.add(pending.pidfd, lambda: pending.reap())
            what = f"{waiting.what} {waiting.path!r}" if waiting else \
                f"the symlink check along {', '.join(repr(r.path) for r in requests if r.what != 'allowed Unix socket')}"
            raise DeadlineExceeded(
                f"{what} did not answer within {self.wait_seconds:g} s when opened as uid {who.uid}: it is on a "
                "file system that does not answer (a FUSE server that does not reply, a hung NFS or sshfs "
                "mount); release that mount or leave the path out")

        self._waits.add(pending.fileno(), call_id, time.monotonic() + self.wait_seconds, ready, expire)

    def _build_session(self, call_id: int, name: str, spec: LaunchSpec, opened: list[int]) -> None:
        """Start the session's build; it is answered from the loop when its init reports."""
        try:
            build = self.spawner.begin_session(spec, opened)
        except BaseException:
            self._forget_opening(name)
            raise
        if isinstance(build, SessionSandbox):
            self._session_ready(call_id, name, build)
            return
        reader = ReportReader(build.report_fd)

        def ready() -> bool:
            if not reader.read():
                return False
            try:
                session = build.finish(reader.data)
            finally:
                self._opening.discard(name)
            self._session_ready(call_id, name, session)
            return True

        def expire() -> None:
            self._forget_opening(name)
            self._abandon_session(build)
            raise DeadlineExceeded(f"the sandbox of session {name!r} was not built within {self.wait_seconds:g} s "
                                   "(a workspace or writable root on a file system that does not answer?)")

        self._waits.add(build.report_fd, call_id, time.monotonic() + self.wait_seconds, ready, expire)

    def _forget_opening(self, name: str) -> None:
        """A session that will not be open after all: its name is free again."""
        self._opening.discard(name)
        self._closed_while_opening.discard(name)

    def _abandon_session(self, build: SessionBuild) -> None:
        self._release_when_gone(build.abandon())

    def _release_when_gone(self, session: SessionSandbox) -> None:
        """Hand a killed session whose init has not gone yet to the orphans: reaped and closed
        when its pidfd says so, never waited for on the loop."""
        def gone() -> bool:
            if not session.reap():
                return False
            session.close()
            return True
        self._orphans.add(session.pidfd, gone)

    def _session_ready(self, call_id: int, name: str, session: SessionSandbox) -> None:
        if name in self._closed_while_opening:
            self._closed_while_opening.discard(name)
            self._close_session(session)
            raise InvalidPolicy(f"session {name!r} was closed while its sandbox was being built")
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

    def _await_start(self, call_id: int, proc: SandboxProcess, limit: float | None) -> None:
        """Answer "started" once the command was exec'd (its setup report's EOF), from the loop:
        a cwd or program on a file system that does not answer holds only this request."""
        reader = ReportReader(proc.report_fileno())

        def ready() -> bool:
            if not reader.read():
                return False
            proc.started_with(reader.data)
            self._track(call_id, proc, limit)
            self._answer({"id": call_id, "event": "started", "pid": proc.pid, "inner_pid": proc.inner_pid})
            return True

        def expire() -> None:
            # Stopped (SIGKILL after the grace if its supervisor is stuck too) and reaped like a
            # running call, but its end is nobody's answer: the request is answered here.
            proc.stop()
            self._unanswered.add(call_id)
            self._track(call_id, proc, None)
            raise DeadlineExceeded(f"the command did not start within {self.wait_seconds:g} s: its cwd, its "
                                   "program or a path it names is on a file system that does not answer")

        self._waits.add(proc.report_fileno(), call_id, time.monotonic() + self.wait_seconds, ready, expire)

    def _track(self, call_id: int, proc: SandboxProcess, limit: float | None) -> None:
        """Watch a started call: its pidfd in the poller, its end reported by ``_collect_exits``."""
        self.running[call_id] = (proc, limit)
        self._watched[call_id] = proc.fileno()
        self._poller.register(proc.fileno(), select.POLLIN)

    def _close_session(self, session: SessionSandbox) -> None:
        """Kill the session and wait until it is gone, reaping its calls meanwhile (init's exit
        waits for them; see SessionSandbox.kill). Bounded: a stuck kernel cannot hang us."""
        session.kill()
        deadline = time.monotonic() + CLOSE_WAIT_SECONDS
        while not session.reap() and time.monotonic() < deadline:
            waiter = select.poll()
            for fd in (session.pidfd, *self._watched.values()):
                waiter.register(fd, select.POLLIN)
            waiter.poll(50)
            self._collect_exits()
        if session.init_pid is not None:
            # A process of it is stuck in the kernel (a hard NFS mount): released when it goes.
            self._release_when_gone(session)
            return
        session.close()
        self._collect_exits()

    def _session(self, message: dict[str, Any]) -> SessionSandbox:
        session = self.sessions.get(_field(message, "session", str))
        if session is None:
            raise InvalidPolicy(f"no open session {message.get('session')!r} in the fork server")
        return session

    def _sweep(self, patient: bool) -> None:
        """Remove sandbox groups whose creator died (a SIGKILLed predecessor's)."""
        from sandboxd.kernel.cgroups import sweep_stale
        self._next_sweep = time.monotonic() + SWEEP_SECONDS
        try:
            sweep_stale(patient=patient)
        except OSError as exc:                            # a cgroup file system gone odd: next time
            _log(f"sweeping stale sandbox groups failed: {exc}")

    def _shutdown(self) -> None:
        self._waits.expire(math.inf, lambda _call_id, _error: None)   # SIGKILLs what they wait on
        for session in list(self.sessions.values()):
            self._close_session(session)
        self.sessions.clear()
        for proc, _ in self.running.values():
            proc.kill()
            proc.wait()
        self._sweep(patient=True)                         # what the start-up sweep was too early for


def _field(message: dict[str, Any], key: str, kind: type, optional: bool = False) -> Any:
    """``message[key]`` if it is a ``kind`` (None allowed when ``optional``), else InvalidPolicy."""
    value = message.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidPolicy(f"fork server request field {key!r} must be a {kind.__name__}, got {value!r}")
    return value


def _terminal_size(value: object) -> tuple[int, int] | None:
    """A call's terminal, [rows, columns], checked again at this edge (terminal_call.check_terminal)."""
    from sandboxd.kernel.terminals import MAX_SIZE, MIN_SIZE
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and MIN_SIZE <= n <= MAX_SIZE for n in value)):
        raise InvalidPolicy(f"a terminal is [rows, columns], each {MIN_SIZE} to {MAX_SIZE}, got {value!r}")
    return value[0], value[1]


def _log(text: str) -> None:
    """The fork server has no logger of its own: its stderr is the daemon's."""
    try:
        sys.stderr.write(f"sandboxd-fork: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def serve(sock: socket.socket, native_calls: bool = True, wait_seconds: float = DEFAULT_WAIT_SECONDS,
          call_helper: str | None = None) -> None:
    """The fork server loop. Returns when the client end closes, after killing everything.
    ``native_calls``: run session calls with sandboxd-call when it is built and current
    (native_call.check_helper; ``call_helper``: another build of it than the package's, for tests);
    ``wait_seconds``: how long a request may wait on a caller's paths (see the module's doc)."""
    _Server(sock, native_calls, wait_seconds, call_helper).serve()


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
        self._wait_seconds = DEFAULT_WAIT_SECONDS
        self._call_helper: str | None = None
        self._limit = message_limit(sock)
        self.last_heard = time.monotonic()       # when it last answered anything (the watchdog's progress)

    @property
    def native_calls(self) -> bool:
        return self._native_calls

    @classmethod
    def start(cls, native_calls: bool = True, wait_seconds: float = DEFAULT_WAIT_SECONDS,
              call_helper: str | None = None) -> "ForkServer":
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
            flags = ([] if native_calls else ["--python-calls"]) + [f"--wait-seconds={wait_seconds!r}"] + (
                [f"--call-helper={call_helper}"] if call_helper else [])
            child = subprocess.Popen([sys.executable, "-m", "sandboxd.supervisor.forkserver", str(child_end.fileno()),
                                      *flags],
                                     pass_fds=(child_end.fileno(),), env=env, stdin=subprocess.DEVNULL,
                                     close_fds=True)
        finally:
            child_end.close()
        server = cls(parent_end, child.pid)
        server._process = child
        server._wanted_native_calls = native_calls
        server._wait_seconds = wait_seconds
        server._call_helper = call_helper
        from sandboxd.launcher.native_call import check_helper
        server._native_calls = native_calls and check_helper(call_helper).path is not None   # as the server decides
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
                self._sock.send(json.dumps({"op": "ping", "id": call_id}).encode(), socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False                              # its queue is full: it is not reading
            except OSError as exc:
                raise SetupError("fork server", 0, detail=f"the fork server has exited ({exc.strerror})") from None
        finally:
            self._send_lock.release()
        return self._wait_event(call_id, ("pong",), timeout=max(0.0, deadline - time.monotonic())) is not None

    def close_session(self, session: str) -> None:
        self._expect(self._request({"op": "session_close", "session": session}), "session_closed")

    def call(self, session: str, argv: list[str], env: dict[str, str], cwd: str, timeout: float | None,
             stdio: tuple[int, int, int], tool: dict[str, object] | None = None,
             terminal: tuple[int, int] | None = None) -> tuple[int, int | None]:
        """Run one command (or a file tool) in a session; return (call id, its pid inside the session).
        With ``terminal`` (rows, columns) it runs on a terminal whose master comes back on stdin."""
        request: dict[str, Any] = {"op": "call", "session": session, "argv": list(argv), "env": dict(env),
                                   "cwd": cwd, "timeout": timeout, "tool": tool}
        if terminal is not None:
            request["terminal"] = list(terminal)
        call_id = self._request(request, list(stdio))
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
        fresh = ForkServer.start(self._wanted_native_calls, self._wait_seconds, self._call_helper)
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
                self._limit = fresh._limit
                self._native_calls = fresh._native_calls
                self.last_heard = time.monotonic()
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
        data = json.dumps(message).encode()
        if len(data) > self._limit:
            # Refused here: sent, it would fail with EMSGSIZE, which says nothing to the caller.
            raise InvalidPolicy(f"the request is too large for the fork server: {len(data)} bytes, limit "
                                f"{self._limit} (too many writable roots, allowed sockets, paths, arguments or "
                                "environment entries, or too long ones): send fewer")
        try:
            _send(self._sock, message, fds, data)
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

    @overload
    def _wait_event(self, call_id: int, kinds: tuple[str, ...]) -> dict[str, Any]: ...

    @overload
    def _wait_event(self, call_id: int, kinds: tuple[str, ...], timeout: float) -> dict[str, Any] | None: ...

    def _wait_event(self, call_id: int, kinds: tuple[str, ...], timeout: float | None = None) -> dict[str, Any] | None:
        """The next event of ``kinds`` for ``call_id`` (None if ``timeout`` seconds pass first).
        Whoever waits reads (leader/follower): one waiting thread at a time reads the socket and
        hands others their events, so an answer wakes its own caller directly, with no reader
        thread in between."""
        deadline = None if timeout is None else time.monotonic() + timeout
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
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                if self._reading:
                    self._cond.wait(remaining)
                    continue
                self._reading = True
                self._cond.release()
                message: dict[str, Any] | None
                fds: list[int]
                try:
                    if remaining is not None and not _readable_within(self._sock, remaining):
                        message, fds = {}, []             # nothing yet: back to the deadline check
                    else:
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
                    self.last_heard = time.monotonic()
                    self._events.setdefault(message["id"], []).append(message)
                self._cond.notify_all()           # another waiter's event, or the next reader's turn


def _readable_within(sock: socket.socket, seconds: float) -> bool:
    waiter = select.poll()
    waiter.register(sock.fileno(), select.POLLIN)
    return bool(waiter.poll(max(0, math.ceil(seconds * 1000))))


def _main(fd: int, native_calls: bool = True, wait_seconds: float = DEFAULT_WAIT_SECONDS,
          call_helper: str | None = None) -> None:
    """Entry point of the fork server process."""
    import prctl  # python-prctl: off the one-shot launch path, so its import cost is fine here

    expected_parent = os.getppid()
    prctl.set_name("sandboxd-fork")
    prctl.set_pdeathsig(signal.SIGKILL)      # the fork server never outlives the daemon
    if os.getppid() != expected_parent:      # the daemon died before that took effect
        os._exit(0)
    serve(socket.socket(fileno=fd), native_calls, wait_seconds, call_helper)


if __name__ == "__main__":
    import sys

    waits = [float(flag.partition("=")[2]) for flag in sys.argv[2:] if flag.startswith("--wait-seconds=")]
    helpers = [flag.partition("=")[2] for flag in sys.argv[2:] if flag.startswith("--call-helper=")]
    _main(int(sys.argv[1]), native_calls="--python-calls" not in sys.argv[2:],
          wait_seconds=waits[-1] if waits else DEFAULT_WAIT_SECONDS, call_helper=helpers[-1] if helpers else None)
