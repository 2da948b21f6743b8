"""The fork server: a small single-threaded process that does every fork (its loop; its client,
``ForkServer``, which the daemon holds, is ``fork_client``).

The daemon starts it before any gRPC thread exists (a forked child of a
threaded process can deadlock, and fork cost grows with the parent's
memory), then sends it requests over a SOCK_SEQPACKET socket pair. The protocol is typed
(``fork_protocol``): one record per request and per event, one codec used by both ends (a JSON
object per message, tagged with its kind and request id, every field's type checked on decode;
descriptors as SCM_RIGHTS), and the server dispatches on the record's type through a table:

  Launch(spec)  + [stdin, stdout, stderr]                  one-shot sandbox        -> Started, then Exited
  SessionOpen(session, spec, review_dir)                   build a session's sandbox -> SessionReady:
                                                           what was built (real workspace and roots,
                                                           addresses, PID namespace; + [the egress
                                                           proxy's listener], if any)
  SessionClose(session)                                    kill all of it          -> SessionClosed(gone)
  Call(session, argv, env, cwd, timeout, tool, terminal)
        + [stdin, stdout, stderr]                          one command in a session -> Started, then Exited
        (with terminal [rows, columns]: stdin is the socket the terminal's master goes back on)
  Signal(signum), Cancel()                                 to a running launch or call (its id)
  CheckPaths(caller, paths, owner)                         may the caller write them? -> PathsChecked
  Review(review_dir, caller, action, roots, paths, ...)    a review session's change set listed, diffed,
                                                           applied or discarded in a child
                                                           (review_child) -> ReviewStarted + [the pipe
                                                           its answer comes on, read by the daemon]
  Ping()                                                   the daemon's watchdog   -> Pong

Any request may be answered Error(the error's ``to_dict``; ``SandboxdError.from_dict`` raises it
again on the daemon's side) instead; a message that is not a request (bad JSON, a field of the wrong
type, the wrong number of descriptors) is answered Error (InvalidPolicy) with its id when it had
one, and the loop goes on.

Launches and calls take the same ``Spawner`` paths that ``sandboxd run`` uses.

The loop never waits. What a request depends on is a descriptor in its poller, with a deadline:

* the paths a request names are opened as its caller in a child (access.PendingOpen), a
  session's build and a command's start are reported on pipes (``wait_seconds``): a file system
  that does not answer (a FUSE server that never replies, a hung NFS mount) costs only the request
  that named it: DeadlineExceeded naming the path, the child SIGKILLed and reaped whenever it goes.
  Such a child may outlive its request in D state: each owner has at most ``stuck_openers`` of them
  alive (``openers.Openers``; past it, with some stuck, its requests naming paths are refused at
  once), and on cgroup v1 each sits in its owner's pids group (its share);
* a running launch or call is its pidfd; its time limit and a cancel's grace (SIGKILL after
  CALL_KILL_GRACE when a call's supervisor does not end its tree) are timers of the loop;
* a session's close SIGKILLs its init and watches the init's pidfd: readable once every process
  of the session is gone (the init's exit waits for them, and the loop reaps the calls meanwhile).
  Then the sandbox is released (cgroup, network) and ``SessionClosed(gone=True)`` answered. If that
  takes longer than ``close_seconds`` (a process stuck in the kernel on a file system that does not
  answer), ``SessionClosed(gone=False)`` is answered then, and the release happens whenever the
  init goes. A danger-full-access session has no init: its cgroup is SIGKILLed and handed to the
  leftovers, and the close answered when they have removed it (or at ``close_seconds``). Only the
  closing caller waits for that answer, never another session's request;
* the cgroups of ended sandboxes (calls that ended or timed out, closed sessions, and at start-up
  and every SWEEP_SECONDS the groups of a dead predecessor: kernel.cgroups.stale_groups) are
  signalled once and handed to ``Leftovers``, which removes each when its ``cgroup.events`` says it
  is empty (cgroup v1 alone: a retry on the loop's timer). A process stuck in D state in one (on a
  FUSE mount its own user never answers) keeps its group, and costs nobody else anything;
* shutdown (the daemon's end of the socket closed) kills everything at once and runs the same loop
  until all of it is gone, or ``close_seconds`` passed.

Sandboxes, sessions and calls die with the fork server. By default it dies with its client too
(a parent-death signal). Started with ``--survive=PATH`` it is the *surviving supervisor*
(docs/architecture.md, "Restarts that lose no work"): no parent-death signal, and the end of the
daemon's connection without a ``Stop`` first (a crash, SIGKILL, a handover) is not a shutdown:
every session and call runs on, the loop goes on reaping them and enforcing their time limits,
drains the output of the calls nobody reads now into bounded tails (supervisor.tails) and keeps
how each ended (at most MAX_ENDED, ENDED_TAIL_BYTES of tails together). A new daemon connects to
the attach socket at PATH (supervisor.attach_point: root and our executable only, one daemon at a
time) and sends ``Attach``: it is told what is held (fork_protocol.HeldSession/HeldCall/CallEnded)
and served as the first one was. No daemon within ``orphan_seconds``: everything is stopped as at a
shutdown, and the supervisor exits.
"""

from __future__ import annotations

import errno
import math
import os
import select
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

from sandboxd.kernel import access, overlay, process
from sandboxd.launcher.plan import path_check as plan_path_check
from sandboxd.launcher.plan import path_requests as plan_path_requests
from sandboxd.errors import DeadlineExceeded, Exhausted, InvalidPolicy, SandboxdError, SetupError, WrongState
from sandboxd.policy.spec import LaunchSpec
from sandboxd.review import checkpoints
from sandboxd.supervisor import fork_protocol as protocol
from sandboxd.supervisor.attach_point import AttachPoint
from sandboxd.supervisor.fork_protocol import (CLOSE_WAIT_SECONDS, DEFAULT_ORPHAN_SECONDS, DEFAULT_STUCK_OPENERS,
                                               DEFAULT_WAIT_SECONDS, REVIEW_SECONDS, Attach, Attached, Call,
                                               CallEnded, Cancel, CheckPaths, Error, Event, Exited, HeldCall,
                                               HeldSession, Launch, Malformed, Message, PathsChecked, Ping, Pong,
                                               Review, ReviewStarted, SessionClose, SessionClosed, SessionOpen,
                                               SessionReady, Signal, Started, Stop, check_timeout, launch_spec)
from sandboxd.supervisor.tails import OutputTails
from sandboxd.supervisor.spawner import ExitInfo, SandboxProcess, SessionBuild, SessionSandbox, Spawner
from sandboxd.supervisor.openers import Openers, Slot
from sandboxd.supervisor.waits import Leftovers, Orphans, ReportReader, Timers, Waits
from sandboxd.supervisor.waits import log as _log

if TYPE_CHECKING:
    from collections.abc import Callable

# The longest one poll() waits: far enough to cost nothing, near enough that no deadline can
# overflow poll's millisecond int (the loop recomputes after every wake). Time limits above
# MAX_TIMEOUT_SECONDS (a week) are refused before they get here (policy Limits, SessionCall) and
# again at this edge (check_timeout); the loop itself copes with any deadline.
MAX_POLL_MS = 60_000
# How often the loop looks for sandbox groups of dead creators (cheap: a few directory listings);
# the first look is its first turn.
SWEEP_SECONDS = 60.0
# What a surviving supervisor keeps of calls that ended while no daemon was attached, for the next
# one: at most this many (the oldest dropped first, logged), their output tails at most this much
# together (the oldest tails emptied first; their exit facts stay).
MAX_ENDED = 1024
ENDED_TAIL_BYTES = 32 << 20
# The longest tag a call may carry (fork_protocol.Call.tag: the daemon's audit call id and tool).
MAX_TAG = 1024


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


class _Server:
    """The server side: runs in the fork server process, single-threaded."""

    def __init__(self, sock: socket.socket, native_calls: bool = True,
                 wait_seconds: float = DEFAULT_WAIT_SECONDS, call_helper: str | None = None,
                 close_seconds: float = CLOSE_WAIT_SECONDS, stuck_openers: int = DEFAULT_STUCK_OPENERS,
                 survive: str | None = None, orphan_seconds: float = DEFAULT_ORPHAN_SECONDS) -> None:
        from sandboxd.kernel import netns
        from sandboxd.launcher.native_call import REBUILD, check_helper
        netns.sweep_stale()                               # a SIGKILLed predecessor's links and proxy access
        self.sock: socket.socket | None = sock          # None while no daemon is attached (survival)
        # poll, not select: descriptors past 1024 (a thousand sessions) are ordinary here.
        self._poller = select.poll()
        self._timers = Timers()
        self._leftovers = Leftovers(self._poller, self._timers)   # sandbox groups on their way out
        # Once, at start: a helper built from other constants or another call plan is not used.
        helper = check_helper(call_helper) if native_calls else None
        if helper is not None and helper.unusable:
            _log(f"call helper {helper.state}: session calls take the slower Python path; rebuild it: {REBUILD}")
        self.spawner = Spawner(native_helper=helper.path if helper else None, dispose=self._leftovers.dispose)
        self.running: dict[int, tuple[SandboxProcess, float | None]] = {}
        self.sessions: dict[str, SessionSandbox] = {}
        self._sock_fd = sock.fileno()
        self._poller.register(self._sock_fd, select.POLLIN)
        self._received = protocol.receive_buffer()        # every request is read into it
        self._watched: dict[int, int] = {}                # call id -> its pidfd in the poller
        self.wait_seconds = wait_seconds
        self.close_seconds = close_seconds
        self._waits = Waits(self._poller)                 # requests waiting on a child: paths, builds, starts, closes
        self._orphans = Orphans(self._poller)             # children given up on, reaped when they go
        self._openers = Openers(stuck_openers, self._timers)   # each owner's path-opening children, bounded
        self._opening: set[str] = set()                   # sessions being built
        self._closed_while_opening: set[str] = set()
        self._closing: dict[str, list[int]] = {}          # sessions being closed -> the closes to answer when gone
        self._unanswered: set[int] = set()                # calls that never started: their end is nobody's
        # -- survival (``survive``): what a daemon that is gone cannot keep ----------------------
        self._attach_point = AttachPoint(survive) if survive else None
        if self._attach_point is not None:
            self._poller.register(self._attach_point.fileno(), select.POLLIN)
        self.orphan_seconds = orphan_seconds
        self._stopping = False                            # Stop came: the connection's end is a shutdown
        self._detached_at: float | None = None            # since when no daemon is attached
        self._orphaned_out = False                        # nobody attached within orphan_seconds
        self._tails = OutputTails(self._poller)           # the calls' output taps (fork_protocol.Call)
        self._call_facts: dict[int, tuple[str, float, str]] = {}   # call id -> (sandbox, started_at, tag)
        self._unread: set[int] = set()                    # running calls whose output no daemon reads
        self._ended: dict[int, CallEnded] = {}            # ended while detached, oldest first
        self._ready: dict[str, tuple[SessionReady, list[socket.socket]]] = {}   # SessionReady, again at attach
        self._max_id = 0                                  # the largest request id seen: the next daemon's start
        # The first turn sweeps what a SIGKILLed predecessor left behind: handed to the leftovers, so
        # the loop answers from its first turn on, however much there is and however stuck. It can
        # run before that predecessor has died (its parent-death signal is asynchronous): its groups
        # are taken by a later sweep then.
        self._next_sweep = time.monotonic()
        # The dispatch table: one handler per request type, each given the request and its descriptors.
        self._handlers: dict[type[Message], Callable[[Any, list[int]], None]] = {
            Launch: self._launch, Call: self._call, SessionOpen: self._session_open,
            SessionClose: self._session_close, Signal: self._signal, Cancel: self._cancel,
            CheckPaths: self._check_paths, Ping: self._ping, Review: self._review,
            Attach: self._attach, Stop: self._stop,
        }

    def serve(self) -> None:
        try:
            while True:
                ready = {fd for fd, _ in self._turn(None)}
                # The daemon's socket before the attach point: a connection accepted below may take
                # a descriptor number that was ready for something else this turn.
                if self._sock_fd in ready and not self._handle_next():
                    if self._attach_point is None or self._stopping:
                        self._shutdown()
                        return
                    self._detach()
                if self._attach_point is not None and self._attach_point.fileno() in ready:
                    self._accept()
                if self._orphaned_out:
                    _log(f"no daemon attached within {self.orphan_seconds:g} s: stopping every sandbox")
                    self._shutdown()
                    return
        finally:
            if self._attach_point is not None:
                self._attach_point.close()

    def _turn(self, until: float | None) -> list[tuple[int, int]]:
        """One wait of the loop, at most until the nearest deadline (or ``until``), and what is
        due then: exits collected, children's descriptors handled, deadlines expired, the sweep."""
        deadlines = [d for d in (proc.wake_at(t) for proc, t in self.running.values()) if d is not None]
        deadlines += self._waits.deadlines()
        deadlines.append(self._next_sweep)
        timer = self._timers.deadline()
        if timer is not None:
            deadlines.append(timer)
        if until is not None:
            deadlines.append(until)
        try:
            events = self._poller.poll(poll_timeout_ms(min(deadlines), time.monotonic()))
        except InterruptedError:
            return []
        self._collect_exits({fd for fd, _ in events})
        for fd, _ in events:
            self._waits.ready(fd, self._answer_error)
            self._orphans.ready(fd)
            self._leftovers.ready(fd)
            self._tails.ready(fd)
        self._waits.expire(time.monotonic(), self._answer_error)
        self._timers.run_due(time.monotonic())
        if time.monotonic() >= self._next_sweep:
            self._sweep()
        return events

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
            # Out of the poller before poll() may close the pidfd: what its end releases (the call's
            # cgroup, to the leftovers) may open a descriptor of the same number, which unregistering
            # by number afterwards would take out of the poller instead.
            pidfd = self._watched[call_id]
            self._poller.unregister(pidfd)
            try:
                info = proc.poll(limit)
            except Exception as exc:  # noqa: BLE001 - one broken call must not end everyone's
                _log(f"collecting call {call_id} failed: {type(exc).__name__}: {exc}")
                self._give_up(proc)
                info = ExitInfo(exit_code=None, signal=signal.SIGKILL, timed_out=False, wall_seconds=0.0,
                                cpu_seconds=None, peak_memory_bytes=None, oom_killed=False)
            if info is None:
                self._poller.register(pidfd, select.POLLIN)
            else:
                del self.running[call_id]
                del self._watched[call_id]
                self._ended_call(call_id, info)

    def _ended_call(self, call_id: int, info: ExitInfo) -> None:
        """Report a call's end: Exited to the daemon that reads its output, else CallEnded with its
        tails (to the daemon attached now, or kept for the next one)."""
        session, started_at, tag = self._call_facts.pop(call_id, ("", 0.0, ""))
        if call_id in self._unanswered:
            self._unanswered.discard(call_id)
            self._unread.discard(call_id)
            self._tails.drop(call_id)
            return
        if call_id not in self._unread:
            if self._answer(Exited(call_id, info.exit_code, info.signal, info.timed_out, info.wall_seconds,
                                   info.cpu_seconds, info.peak_memory_bytes, info.oom_killed)) \
                    or self._attach_point is None:
                self._tails.drop(call_id)
                return
            self._tails.drain(call_id)                    # its daemon died this very turn: kept for the next
        self._unread.discard(call_id)
        out, err, dropped = self._tails.take(call_id)
        ended = CallEnded(call_id, info.exit_code, info.signal, info.timed_out, info.wall_seconds, info.cpu_seconds,
                          info.peak_memory_bytes, info.oom_killed, call=call_id, session=session,
                          started_at=started_at, tag=tag, stdout_tail=out.decode("latin-1"),
                          stderr_tail=err.decode("latin-1"), dropped=dropped)
        if self.sock is None or not self._answer(ended):
            self._keep_ended(ended)

    def _keep_ended(self, ended: CallEnded) -> None:
        """Keep a call's end for the next daemon, within MAX_ENDED and ENDED_TAIL_BYTES."""
        self._ended[ended.call] = ended
        while len(self._ended) > MAX_ENDED:
            oldest = next(iter(self._ended))
            _log(f"call {oldest} ended while no daemon was attached: dropped (more than {MAX_ENDED} such ends)")
            del self._ended[oldest]
        total = sum(len(e.stdout_tail) + len(e.stderr_tail) for e in self._ended.values())
        for call_id, kept in list(self._ended.items()):
            if total <= ENDED_TAIL_BYTES:
                break
            size = len(kept.stdout_tail) + len(kept.stderr_tail)
            if size:
                self._ended[call_id] = kept.replace(stdout_tail="", stderr_tail="", dropped=kept.dropped + size)
                total -= size

    def _give_up(self, proc: SandboxProcess) -> None:
        """A call that could not be collected: SIGKILLed (its tree too, as far as ``stop`` reaches
        without waiting) and reaped whenever it goes, by the orphans, never waited for here."""
        pid, pidfd = proc.pid, os.dup(proc.fileno())
        try:
            proc.stop()
            proc.send_signal(signal.SIGKILL)
        except Exception:  # noqa: BLE001 - best effort: it is reported as killed either way
            pass

        def reap() -> bool:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    return False
            except ChildProcessError:
                pass                                      # reaped already
            os.close(pidfd)
            return True
        self._orphans.add(pidfd, reap)

    def _answer(self, event: Event, fds: "list[int] | None" = None) -> bool:
        """Send ``event``; False if no daemon took it (none attached, or it is gone)."""
        if self.sock is None:
            return False
        try:
            protocol.send(self.sock, event.encode(), fds)
        except OSError as exc:                            # the daemon is gone: EOF ends the loop
            if exc.errno == errno.EMSGSIZE and not isinstance(event, Error):
                self._answer_error(event.id, InvalidPolicy(
                    f"the answer to request {event.id} is too large for the fork server's socket; "
                    "ask for fewer paths at once"))
                return True
            _log(f"cannot answer the daemon: {exc}")
            return False
        return True

    def _answer_error(self, call_id: int, exc: BaseException) -> None:
        """A request's failure as its answer: every failure is one, none ends the loop."""
        if not isinstance(exc, SandboxdError):
            _log(f"request {call_id} failed: {type(exc).__name__}: {exc}")
            exc = SetupError("fork server", detail=f"the fork server could not handle the request "
                                                   f"({type(exc).__name__}: {exc})")
        self._answer(Error(call_id, exc.to_dict()))

    def _handle_next(self) -> bool:
        assert self.sock is not None                      # called only for the attached daemon's socket
        try:
            message, fds = protocol.receive(self.sock, protocol.requests(), self._received)
        except OSError:
            message, fds = None, []
        if message is None:
            for fd in fds:
                os.close(fd)
            return False
        if isinstance(message, Message) and message.id > self._max_id:
            self._max_id = message.id
        try:
            if isinstance(message, Malformed):
                raise InvalidPolicy(str(message))
            self._handlers[type(message)](message, fds)
        except Exception as exc:  # noqa: BLE001 - the dispatch edge: every failure is an answer
            self._answer_error(message.id, exc)
        finally:
            for fd in fds:
                os.close(fd)
        return True

    # -- the handlers: one request each, its fields typed by the codec; what is left to check
    #    (ranges, NULs, names) is checked here. The daemon is trusted, but a bug there must come
    #    back as an error answer, never end every sandbox of every user.

    def _fresh(self, call_id: int) -> None:
        if call_id <= 0 or call_id in self.running:
            raise InvalidPolicy(f"request id {call_id!r} is not a fresh positive id")

    def _launch(self, request: Launch, fds: list[int]) -> None:
        call_id = request.id
        self._fresh(call_id)
        spec = launch_spec(request.spec)
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
                             undo=close_stdio, owner=spec.owner, owner_pids=spec.limits.owner_pids)
        except BaseException:
            close_stdio()
            raise

    def _call(self, request: Call, fds: list[int]) -> None:
        self._fresh(request.id)
        session = self._session(request.session)
        if any("\0" in item for item in (*request.argv, *request.env, *request.env.values(), request.cwd)):
            raise InvalidPolicy("argv, env and cwd cannot contain NUL characters")
        limit = check_timeout(request.timeout)
        terminal = _terminal_size(request.terminal)
        if len(request.tag) > MAX_TAG:
            raise InvalidPolicy(f"a call's tag is at most {MAX_TAG} characters, got {len(request.tag)}")
        taps = fds[3:]
        self._tails.hold(request.id, [os.dup(fd) for fd in taps])  # the dispatch closes fds
        try:
            proc = self.spawner.launch_call(session, tuple(request.argv), dict(request.env), request.cwd,
                                            stdio=(fds[0], fds[1], fds[2]), tool=request.tool, terminal=terminal)
        except BaseException:
            self._tails.drop(request.id)
            raise
        self._call_facts[request.id] = (request.session, 0.0, request.tag)
        self._await_start(request.id, proc, limit)

    def _session_open(self, request: SessionOpen, fds: list[int]) -> None:
        call_id, name = request.id, request.session
        if name in self.sessions or name in self._opening:
            raise InvalidPolicy(f"session {name!r} is already open in the fork server")
        if name in self._closing:
            raise InvalidPolicy(f"session {name!r} is still being closed in the fork server")
        spec = launch_spec(request.spec)
        check_timeout(spec.limits.timeout_seconds, "limit timeout_seconds")
        review_dir, fresh = _review_dir(request.review_dir)
        if fresh and review_dir is not None:
            _bound_review_dir(review_dir, request)
        elif review_dir is not None:
            # A rebuild (after a restart, a discard, a lost fork server): a checkpoint or rollback a
            # crash cut short is finished first, so the layers mounted are those the record names
            # (root's own directory; the records and one listing per overlay when nothing was cut).
            checkpoints.recover(review_dir)
        lent = review_dir is not None and _lend_inodes(review_dir)
        self._opening.add(name)

        def settle() -> None:
            if lent and review_dir is not None:
                _settle_inodes(review_dir)

        def undo() -> None:
            self._forget_opening(name)
            if fresh:
                _remove_review_dir(review_dir)
            else:
                settle()

        try:
            self._open_paths(call_id, spec.caller, plan_path_requests(spec),
                             lambda opened: self._build_session(call_id, name, spec, opened, review_dir, undo,
                                                                settle),
                             plan_path_check(spec), undo=undo, owner=spec.owner, owner_pids=spec.limits.owner_pids)
        except BaseException:
            undo()
            raise

    def _session_close(self, request: SessionClose, fds: list[int]) -> None:
        name = request.session
        closing = self.sessions.pop(name, None)
        if closing is not None:
            self._close_session(name, closing, request.id)
        elif name in self._closing:
            self._closing[name].append(request.id)         # closed twice: answered with the first
        else:
            if name in self._opening:
                self._closed_while_opening.add(name)       # closed as its build ends
            self._answer(SessionClosed(request.id, True))

    def _check_paths(self, request: CheckPaths, fds: list[int]) -> None:
        caller = request.caller
        call_id, who = request.id, None if caller is None else (caller.uid, caller.gid, tuple(caller.groups))

        def checked(opened: list[int]) -> None:
            try:
                real = [access.real_path(fd) for fd in opened]
            finally:
                for fd in opened:
                    os.close(fd)
            self._answer(PathsChecked(call_id, real))
        self._open_paths(call_id, who, [access.PathRequest(path, "workspace", access.WRITE) for path in request.paths],
                         checked, owner=request.owner)

    def _ping(self, request: Ping, fds: list[int]) -> None:
        self._answer(Pong(request.id))

    # -- survival: a daemon that goes, and the next one ------------------------------------------

    def _stop(self, request: Stop, fds: list[int]) -> None:
        self._stopping = True

    def _detach(self) -> None:
        """The daemon's connection ended without Stop: keep everything for the next daemon."""
        assert self.sock is not None
        self._poller.unregister(self._sock_fd)
        self.sock.close()
        self.sock, self._sock_fd = None, -1
        for call_id in self.running:
            if call_id not in self._unanswered:
                self._unread.add(call_id)
                self._tails.drain(call_id)
        detached_at = self._detached_at = time.monotonic()

        def give_up() -> None:
            if self.sock is None and self._detached_at == detached_at:
                self._orphaned_out = True
        self._timers.add(detached_at + self.orphan_seconds, give_up)
        _log(f"the daemon is gone: {len(self.sessions)} sessions and {len(self._unread)} calls kept for the next "
             f"one (for {self.orphan_seconds:g} s)")

    def _accept(self) -> None:
        """A daemon connecting to the attach point: taken if it may attach and none is attached."""
        assert self._attach_point is not None
        conn, why = self._attach_point.accept()
        if conn is None:
            return
        if not why and self.sock is not None:
            why = "another daemon is attached to this supervisor (one at a time): stop it first"
        if why:
            _log(f"attach refused: {why}")
            try:
                protocol.send(conn, Error(0, WrongState(why).to_dict()).encode(), None, socket.MSG_DONTWAIT)
                while conn.recv(64, socket.MSG_DONTWAIT):  # what it sent, read: closed with it unread,
                    pass                                  # the peer would get ECONNRESET, not the answer
            except OSError:
                pass
            conn.close()
            return
        protocol.message_limit(conn)                      # its send buffer, as the socket pair's
        self.sock, self._sock_fd, self._detached_at = conn, conn.fileno(), None
        self._poller.register(self._sock_fd, select.POLLIN)

    def _attach(self, request: Attach, fds: list[int]) -> None:
        """Tell the daemon now attached what is held: sessions (their listeners passed again),
        calls still running and calls that ended meanwhile; then ``Attached``."""
        for name, (ready, listeners) in self._ready.items():
            if name in self.sessions:
                self._answer(HeldSession(request.id, session=name, **ready.facts()),
                             [sock.fileno() for sock in listeners] or None)
        for call_id in sorted(self._unread):
            entry = self.running.get(call_id)
            if entry is not None:
                session, started_at, tag = self._call_facts.get(call_id, ("", 0.0, ""))
                self._answer(HeldCall(request.id, call_id, session, entry[0].pid, entry[0].inner_pid, started_at, tag))
        for ended in self._ended.values():
            self._answer(ended.replace(id=request.id))
        self._ended.clear()
        self._answer(Attached(request.id, self._max_id + 1, os.getpid()))

    def _review(self, request: Review, fds: list[int]) -> None:
        """A request on a review session's change set, in a child (supervisor.review_child): its
        answer's pipe goes to the daemon at once, the child is reaped whenever it goes and
        SIGKILLed at ``review_seconds``. Each owner has at most ``stuck_openers`` such children and
        path openers alive together (Openers), never waited on here."""
        from sandboxd.supervisor import review_child

        _review_dir(request.review_dir, make=False)
        who = request.caller
        key = request.owner or (f"uid-{who.uid}" if who is not None and who.uid != 0 else None)
        deadline = time.monotonic() + REVIEW_SECONDS
        # Its own copy: the dispatch closes ``fds`` when this returns, and the child may start later.
        reviewed = os.dup(fds[0]) if request.reviewed_fd else -1

        def start(slot: Slot) -> None:
            try:
                pid, pidfd, answer = review_child.start(request, reviewed)
            finally:
                if reviewed >= 0:
                    os.close(reviewed)
            try:
                self._answer(ReviewStarted(request.id), [answer])
            finally:
                os.close(answer)
            reaped = False

            def reap() -> bool:
                nonlocal reaped
                try:
                    if os.waitpid(pid, os.WNOHANG)[0] == 0:
                        return False
                except ChildProcessError:
                    pass
                reaped = True
                os.close(pidfd)
                slot.release()
                return True

            def kill() -> None:
                if not reaped:
                    try:
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            self._orphans.add(pidfd, reap)
            self._timers.add(deadline, kill)

        def refused(exc: BaseException) -> None:
            if reviewed >= 0:
                os.close(reviewed)
            self._answer_error(request.id, exc)
        self._openers.admit(key, start, refused, deadline)

    def _signal(self, request: Signal, fds: list[int]) -> None:
        if not 0 < request.signum < signal.NSIG:
            raise InvalidPolicy(f"signal {request.signum} is not a signal number")
        entry = self.running.get(request.id)
        if entry:
            entry[0].send_signal(request.signum)

    def _cancel(self, request: Cancel, fds: list[int]) -> None:
        entry = self.running.get(request.id)
        if entry:
            entry[0].stop()                               # never waits: see SandboxProcess.stop

    # -- waiting on children, never blocking ---------------------------------------------------

    def _open_paths(self, call_id: int, caller: "tuple[int, int, tuple[int, ...]] | None",
                    requests: "list[access.PathRequest]", then: "Callable[[list[int]], None]",
                    check: "Callable[[list[int]], None] | None" = None,
                    undo: "Callable[[], None]" = lambda: None, owner: str = "",
                    owner_pids: int | None = None) -> None:
        """Open ``requests`` as ``caller`` in a child (which also runs ``check`` on them, see
        access.PendingOpen), then ``then(descriptors)`` (which owns them) from the loop; a lookup
        past the deadline answers DeadlineExceeded naming its path. ``undo``: what to release when
        ``then`` is never called (a refused path, the deadline). ``owner`` (LaunchSpec.owner; "":
        the caller's uid) is whom the child counts against: its bound of live openers (Openers:
        Exhausted at once past it, when some are stuck), and on cgroup v1 its pids share
        (``owner_pids``: the share's cap, if known)."""
        # Root's paths too (the daemon's own launches, root's sessions): a hung NFS mount named by
        # accident must not hold everyone else either.
        who = access.Caller(caller[0], caller[1], tuple(caller[2])) if caller else access.Caller(0, 0, ())
        deadline = time.monotonic() + self.wait_seconds

        def start(slot: Slot) -> None:
            self._start_opener(call_id, who, requests, then, check, undo, slot, deadline, owner, owner_pids)

        def refuse(exc: BaseException) -> None:
            undo()
            self._answer_error(call_id, exc)

        # Local root's own requests (no owner) are not counted, as the quotas do not count them.
        key = owner or (f"uid-{who.uid}" if who.uid != 0 else None)
        self._openers.admit(key, start, refuse, deadline)

    def _start_opener(self, call_id: int, who: access.Caller, requests: "list[access.PathRequest]",
                      then: "Callable[[list[int]], None]", check: "Callable[[list[int]], None] | None",
                      undo: "Callable[[], None]", slot: Slot, deadline: float, owner: str,
                      owner_pids: int | None) -> None:
        """``_open_paths``'s child, once its owner has a slot for it; the slot goes with the child."""
        pending = access.PendingOpen(who, requests, check, _owner_share(owner, owner_pids))

        def reap() -> bool:
            if not pending.reap():
                return False
            slot.release()
            return True

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
                self._orphans.add(pending.pidfd, reap)
            then(opened)
            return True

        def expire() -> None:
            undo()
            waiting = pending.waiting_on()
            pending.abandon()
            what = f"{waiting.what} {waiting.path!r}" if waiting else \
                f"the symlink check along {', '.join(repr(r.path) for r in requests if r.what != 'allowed Unix socket')}"
            self._orphans.add(pending.pidfd, reap)
            slot.given_up(what, time.monotonic())         # stuck, if still there a moment later
            raise DeadlineExceeded(
                f"{what} did not answer within {self.wait_seconds:g} s when opened as uid {who.uid}: it is on a "
                "file system that does not answer (a FUSE server that does not reply, a hung NFS or sshfs "
                "mount); release that mount or leave the path out")

        self._waits.add(pending.fileno(), call_id, deadline, ready, expire)

    def _build_session(self, call_id: int, name: str, spec: LaunchSpec, opened: list[int], review_dir: str | None,
                       undo: "Callable[[], None]", settle: "Callable[[], None]") -> None:
        """Start the session's build; it is answered from the loop when its init reports. ``undo``:
        what a failed build releases (its name; a review directory made for it); ``settle``: what a
        build that mounted its overlays gives back before its sandbox serves (the store's lent inodes)."""
        try:
            build = self.spawner.begin_session(spec, opened, review_dir=review_dir)
        except BaseException:
            undo()
            raise
        if isinstance(build, SessionSandbox):
            settle()
            self._session_ready(call_id, name, build)
            return
        reader = ReportReader(build.report_fd)

        def ready() -> bool:
            if not reader.read():
                return False
            try:
                session = build.finish(reader.data, release=self._release_when_gone)
            except BaseException:
                undo()
                raise
            finally:
                self._opening.discard(name)
            settle()
            self._session_ready(call_id, name, session)
            return True

        def expire() -> None:
            self._abandon_session(build)
            undo()
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
            self._close_session(name, session, None)
            raise InvalidPolicy(f"session {name!r} was closed while its sandbox was being built")
        self.sessions[name] = session
        plan = session.plan
        roots = [root for root in plan.writable_roots if root != plan.workspace]   # as resolved, by descriptor
        # Read here, where the init is an unreaped child (its pid cannot be another process's yet).
        namespace = os.stat(f"/proc/{session.init_pid}/ns/pid").st_ino if session.init_pid else 0
        network = session.network
        if network is None:
            ready = SessionReady(call_id, session.init_pid, plan.workspace, roots, pid_namespace=namespace)
            self._ready[name] = (ready, [])
            self._answer(ready)
            return
        # The daemon serves the egress proxy (this process has no threads) on this very socket, bound
        # in the sandbox's namespace before the sandbox existed (network.egress_proxy.PROXY_ADDRESS)
        # and sent along still bound: its port is never free while the session lives.
        # Transparent capture's listener (network.transparent) goes the same way, after it.
        listener, network.proxy_listener = network.proxy_listener, None
        captured, network.transparent_listener = network.transparent_listener, None
        passed = [sock for sock in (listener, captured) if sock is not None]
        ready = SessionReady(call_id, session.init_pid, plan.workspace, roots, network.host_address,
                             network.sandbox_address, list(network.resolvers), listener is not None, namespace,
                             transparent_listener=captured is not None)
        self._answer(ready, [sock.fileno() for sock in passed] or None)
        if self._attach_point is None:
            for sock in passed:
                sock.close()                              # the daemon's copy holds the address now
            passed = []
        # A surviving supervisor keeps its copies: a later daemon gets them again (Attach).
        self._ready[name] = (ready, passed)

    def _await_start(self, call_id: int, proc: SandboxProcess, limit: float | None) -> None:
        """Answer Started once the command was exec'd (its setup report's EOF), from the loop:
        a cwd or program on a file system that does not answer holds only this request."""
        reader = ReportReader(proc.report_fileno())

        def ready() -> bool:
            if not reader.read():
                return False
            proc.started_with(reader.data)
            self._track(call_id, proc, limit)
            session, _, tag = self._call_facts.get(call_id, ("", 0.0, ""))
            self._call_facts[call_id] = (session, time.time(), tag)
            self._answer(Started(call_id, proc.pid, proc.inner_pid))
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
        if self.sock is None:                             # started after its daemon went: nobody reads it
            self._unread.add(call_id)
            self._tails.drain(call_id)

    def _close_session(self, name: str, session: SessionSandbox, answer_to: int | None) -> None:
        """Kill the session (its init: the kernel kills the rest of its PID namespace) and answer
        ``answer_to`` (and any later close of the same name) once the init's pidfd says it is gone,
        from the loop. The init's exit waits until every process of its namespace is reaped, the
        calls' supervisors included, which are ours: the loop reaps them meanwhile
        (``_collect_exits``), so the close waits on nothing here. Past ``close_seconds`` a process
        is stuck in the kernel: answered ``gone=False``, released when it goes."""
        session.kill()
        for sock in self._ready.pop(name, (None, []))[1]:
            sock.close()
        waiting = self._closing[name] = [] if answer_to is None else [answer_to]

        def answer(gone: bool) -> None:
            if self._closing.get(name) is waiting:       # not a later close of a session of the same name
                for call_id in self._closing.pop(name):
                    self._answer(SessionClosed(call_id, gone))

        def release(then: "Callable[[], None] | None" = None) -> None:
            try:
                session.close(then)
            except Exception as exc:  # noqa: BLE001 - what is left is swept; the close is still answered
                _log(f"releasing session {name!r} failed: {type(exc).__name__}: {exc}")

        if session.init_pid is None and session.cgroup is not None:
            # danger-full-access with a group: SIGKILLed and handed to the leftovers with the rest of
            # the session; answered once they have removed it, or at close_seconds.
            release(lambda: answer(True))
            self._timers.add(time.monotonic() + self.close_seconds, lambda: answer(False))
            return
        if session.reap():                                # no init and no group (danger-full-access), or gone
            release()
            answer(True)
            return

        def ready() -> bool:
            if not session.reap():
                return False
            release()
            answer(True)
            return True

        def expire() -> None:
            self._release_when_gone(session)
            answer(False)

        self._waits.add(session.pidfd, answer_to or 0, time.monotonic() + self.close_seconds, ready, expire)

    def _session(self, name: str) -> SessionSandbox:
        session = self.sessions.get(name)
        if session is None:
            raise InvalidPolicy(f"no open session {name!r} in the fork server")
        return session

    def _sweep(self) -> None:
        """Hand the sandbox groups whose creator is provably dead (a SIGKILLed predecessor's, a killed
        `sandboxd run`'s; never another live daemon's: kernel.cgroups.stale_groups) to the leftovers."""
        from sandboxd.kernel.cgroups import stale_groups
        self._next_sweep = time.monotonic() + SWEEP_SECONDS
        try:
            for group in stale_groups():
                self._leftovers.dispose(group, True, None, watch=False)   # a timer's tries: no descriptor
        except OSError as exc:                            # a cgroup file system gone odd: next time
            _log(f"sweeping stale sandbox groups failed: {exc}")

    def _shutdown(self) -> None:
        """The daemon is gone: kill everything at once, then run the loop (no more requests) until
        all of it is reaped and released, or ``close_seconds`` passed (a process stuck in the kernel:
        it is not waited for beyond that)."""
        if self._sock_fd >= 0:
            self._poller.unregister(self._sock_fd)        # at EOF for good: it would wake every turn
            self._sock_fd = -1
        self._tails.close()
        if self._attach_point is not None:                # nobody attaches to what is being stopped
            self._poller.unregister(self._attach_point.fileno())
            self._attach_point.close()
            self._attach_point = None
        self._waits.expire(math.inf, lambda _call_id, _error: None)   # SIGKILLs what they wait on
        for name, session in list(self.sessions.items()):
            self._close_session(name, session, None)
        self.sessions.clear()
        for proc, _ in self.running.values():
            proc.stop()
            proc.send_signal(signal.SIGKILL)              # no grace: nobody waits for its report
        self._sweep()                                     # what the start-up sweep was too early for
        deadline = time.monotonic() + self.close_seconds
        while (self.running or len(self._waits) or len(self._orphans) or len(self._leftovers)) and \
                time.monotonic() < deadline:
            self._turn(deadline)
        # What is left is stuck in the kernel: a stale group for the next fork server's sweep.


def _review_dir(path: str, make: bool = True) -> tuple[str | None, bool]:
    """A session's review directory as the daemon names it (STATE/review/ID: absolute, its last
    name the session's): made (0700, kernel.overlay.make_session_dir) unless ``make`` is False.
    (None, False) for "" (not review mode); else (it, whether it was made now, with no layers)."""
    if not path:
        return None, False
    base, _, name = path.rpartition("/")
    if not base.startswith("/") or "\0" in path or not name or name in (".", "..") or os.path.normpath(path) != path:
        raise InvalidPolicy(f"review directory {path!r} is not an absolute normal path")
    if not make:
        return path, False
    made, kept = overlay.make_session_dir(base, name)
    return made, not kept


def _bound_review_dir(path: str, request: SessionOpen) -> None:
    """Make the review directory ``path`` just made a bounded store (kernel.review_space): its
    share is the session's bound or what the owner's other stores (``owner_stores``, named by the
    daemon, each beside it) take now of the owner's, read from the kernel (a tmpfs mount of
    the daemon's own: nothing a caller can make wait; /proc/self/mountinfo read once, whatever
    their number). An owner holding ``owner_stores_max`` stores already (review.owner_stores; 0:
    no cap) is refused. On refusal the directory is removed."""
    from sandboxd.kernel import review_space
    if not request.session_bytes:
        return
    try:
        base = os.path.dirname(path)
        others = [other for other in request.owner_stores if os.path.dirname(other) == base and other != path
                  and os.path.normpath(other) == other]
        count, total = review_space.owner_stores(others)
        if request.owner_stores_max and count >= request.owner_stores_max:
            raise Exhausted(f"review: this owner keeps {count} review change sets, as many as review.owner_stores "
                            "allows: apply or discard some kept change sets (sandboxctl apply/discard SESSION)")
        review_space.bound(path, review_space.share(request.session_bytes, request.owner_bytes, total))
    except BaseException:
        _remove_review_dir(path)
        raise


def _lend_inodes(path: str) -> bool:
    """The store's inodes held for mounting (kernel.review_space.lend_inodes), freed for this build;
    a store made before they existed, or no store, lends none."""
    from sandboxd.kernel import review_space
    try:
        return review_space.lend_inodes(path)
    except FileNotFoundError:
        return False


def _settle_inodes(path: str) -> None:
    from sandboxd.kernel import review_space
    try:
        review_space.settle_inodes(path)
    except OSError as exc:
        _log(f"review store {path!r}: its inodes for the next mount could not be held again: {exc}")


def _remove_review_dir(path: str | None) -> None:
    """A review directory made for a build that failed: nothing was ever mounted on it."""
    if path is None:
        return
    try:
        overlay.remove_layers(path)
    except OSError as exc:
        _log(f"removing review directory {path!r} failed: {exc}")


def _owner_share(owner: str, pids: int | None) -> "Callable[[], None] | None":
    """What a path-opening child of ``owner`` runs first (access.PendingOpen's ``enter``): it moves
    itself into the owner's pids group on cgroup v1 (kernel.cgroups.owner_pids_group), so that a
    child stuck in D state counts against its owner's share. None for root's own requests (no share)
    and where pids is v2's: a v2 move costs an RCU grace period per request (about 5 ms here); the
    bound of Openers holds there alone."""
    if not owner:
        return None
    from sandboxd.kernel import cgroups
    from sandboxd.kernel.host_limits import OwnerShare
    group = cgroups.owner_pids_group(OwnerShare(owner, pids=pids))
    if group is None:
        return None

    def enter() -> None:
        try:
            cgroups.join([group])                     # single-threaded: through ``tasks``, no grace period
        except Exception:  # noqa: BLE001 - swept meanwhile: the child opens anyway; the bound holds
            pass
    return enter


def _terminal_size(value: "list[object] | None") -> tuple[int, int] | None:
    """A call's terminal, [rows, columns], checked again at this edge (terminal_call.check_terminal)."""
    from sandboxd.kernel.terminals import MAX_SIZE, MIN_SIZE
    if value is None:
        return None
    sizes = [n for n in value if type(n) is int and MIN_SIZE <= n <= MAX_SIZE]
    if len(value) != 2 or len(sizes) != 2:
        raise InvalidPolicy(f"a terminal is [rows, columns], each {MIN_SIZE} to {MAX_SIZE}, got {value!r}")
    return sizes[0], sizes[1]


def serve(sock: socket.socket, native_calls: bool = True, wait_seconds: float = DEFAULT_WAIT_SECONDS,
          call_helper: str | None = None, close_seconds: float = CLOSE_WAIT_SECONDS,
          stuck_openers: int = DEFAULT_STUCK_OPENERS, survive: str | None = None,
          orphan_seconds: float = DEFAULT_ORPHAN_SECONDS) -> None:
    """The fork server loop. Returns when the client end closes, after killing everything.
    ``native_calls``: run session calls with sandboxd-call when it is built and current
    (native_call.check_helper; ``call_helper``: another build of it than the package's, for tests);
    ``wait_seconds``: how long a request may wait on a caller's paths (see the module's doc);
    ``close_seconds``: how long a session's close may take before it is answered anyway;
    ``stuck_openers``: the path-opening children one owner may have alive (openers.Openers);
    ``survive``: the attach socket's path of a surviving supervisor (see the module's doc), which
    stops everything after ``orphan_seconds`` with no daemon attached."""
    _Server(sock, native_calls, wait_seconds, call_helper, close_seconds, stuck_openers, survive,
            orphan_seconds).serve()


def _main(fd: int, native_calls: bool = True, wait_seconds: float = DEFAULT_WAIT_SECONDS,
          call_helper: str | None = None, close_seconds: float = CLOSE_WAIT_SECONDS,
          stuck_openers: int = DEFAULT_STUCK_OPENERS, survive: str | None = None,
          orphan_seconds: float = DEFAULT_ORPHAN_SECONDS, cgroup: str | None = None) -> None:
    """Entry point of the fork server process. ``cgroup``: a surviving supervisor's own v2 group
    (kernel.supervisor_cgroup), moved into before anything else."""
    expected_parent = os.getppid()
    process.set_name("sandboxd-fork")
    if not survive:
        process.die_with_parent(expected_parent)  # this fork server never outlives the daemon
    elif cgroup:
        from sandboxd.kernel.supervisor_cgroup import move_self
        try:
            move_self(cgroup)
        except (OSError, SandboxdError) as exc:          # the daemon's start fails: its self-test says so
            _log(f"cannot move into supervisor.cgroup {cgroup!r}: {exc}")
            sys.exit(1)
    serve(socket.socket(fileno=fd), native_calls, wait_seconds, call_helper, close_seconds, stuck_openers,
          survive, orphan_seconds)


def _flag(name: str) -> str | None:
    values = [flag.partition("=")[2] for flag in sys.argv[2:] if flag.startswith(f"--{name}=")]
    return values[-1] if values else None


if __name__ == "__main__":
    _main(int(sys.argv[1]), native_calls="--python-calls" not in sys.argv[2:],
          wait_seconds=float(_flag("wait-seconds") or DEFAULT_WAIT_SECONDS), call_helper=_flag("call-helper"),
          close_seconds=float(_flag("close-seconds") or CLOSE_WAIT_SECONDS),
          stuck_openers=int(_flag("stuck-openers") or DEFAULT_STUCK_OPENERS), survive=_flag("survive"),
          orphan_seconds=float(_flag("orphan-seconds") or DEFAULT_ORPHAN_SECONDS), cgroup=_flag("cgroup"))
