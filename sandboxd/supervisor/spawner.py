"""The spawner: the only code that forks a sandbox.

It must run in a single-threaded process (a forked child of a threaded
process may deadlock on a lock another thread held, and unshare of user
namespaces refuses threaded callers). ``sandboxd run`` is such a process and
calls it directly; the daemon runs it inside the fork server
(``sandboxd.supervisor.fork_server``). Either way the same ``launch`` runs.
"""

from __future__ import annotations

import _signal as signal  # the C module: signal.py builds IntEnums, which costs more than a launch
import _socket  # likewise for socket.py
import errno
import itertools
import os
import select
import time

from sandboxd._record import Record
from sandboxd.errors import LimitsUnavailable, SetupError
from sandboxd.kernel import namespaces
from sandboxd.kernel.cgroups import CgroupSet, group_name
from sandboxd.kernel.host_limits import Ceiling, OwnerShare
from sandboxd.kernel.oom_counter import OomCounter
from sandboxd.kernel.overlay import save as save_layers
from sandboxd.launcher import report, sequence
from sandboxd.launcher.plan import LaunchPlan, prepare
from sandboxd.policy import LaunchSpec

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable

    from sandboxd.kernel.netns import IsolatedNetwork
    from sandboxd.network.loopback_proxy import LoopbackProxy

    # What becomes of a sandbox's cgroup once its sandbox has ended: (group, kill, then). ``kill``:
    # SIGKILL what is left in it (else what is left may live on: a danger-full-access command's
    # background jobs); ``then``: called once it is gone (None: nobody waits for that).
    Dispose = Callable[[CgroupSet, bool, "Callable[[], None] | None"], None]

_counter = itertools.count(1)


def dispose_waiting(group: CgroupSet, kill: bool, then: "Callable[[], None] | None" = None) -> None:
    """A group's end in a process with nothing else to do (`sandboxd run`, the doctor): killed and
    removed, waiting (bounded) for both; or its survivors released and the group removed. The fork
    server never waits: it hands its groups to supervisor.waits.Leftovers instead."""
    if kill:
        group.kill()
    else:
        group.release()
    if kill or not group.nested:          # a nested group keeps its survivors: it goes with its session's
        group.remove()
    if then is not None:
        then()


class ExitInfo(Record):
    """How a sandboxed command ended."""

    exit_code: int | None        # the command's own exit code, when it exited
    signal: int | None           # the signal that killed it, when one did
    timed_out: bool
    wall_seconds: float
    cpu_seconds: float | None
    peak_memory_bytes: int | None
    oom_killed: bool

    @property
    def shell_status(self) -> int:
        """The conventional status: own code, 128+N for signal N, 124 on timeout."""
        if self.timed_out:
            return 124
        if self.signal is not None:
            return 128 + self.signal
        return self.exit_code if self.exit_code is not None else 125

    def to_dict(self) -> dict[str, object]:
        return self.as_dict()


CALL_KILL_GRACE = 5.0
NO_GROUP_FOR_CALLER = ("a non-root caller's danger-full-access session needs a cgroup to keep its commands' tree "
                       "killable (it has no PID namespace), and none could be made: give the session a memory or "
                       "pids limit, or mount cgroup v2 (cgroup.kill); else use workspace-write")
# Ignored in the fork server (Python ignores SIGPIPE and SIGXFSZ) or handled by it: a
# spawned helper gets the defaults back, since exec keeps ignored signals ignored.
SPAWN_DEFAULT_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM, signal.SIGHUP,
                         signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD)


# poll() takes an int of milliseconds: longer waits are cut into turns of this many seconds.
_MAX_WAIT_TURN = 3600.0


def _readable(fd: int, timeout: float | None) -> bool:
    """Wait until ``fd`` (a pidfd: its process ended) is readable, at most ``timeout`` seconds
    (None: no limit). poll, not select: select cannot take descriptors past 1024."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    turn = _MAX_WAIT_TURN if timeout is None or not timeout < _MAX_WAIT_TURN else max(0.0, timeout)
    return bool(poller.poll(int(turn * 1000 + 0.999)))


class SandboxProcess:
    """A launched sandbox as its parent sees it."""

    def __init__(self, plan: LaunchPlan, pid: int, report_fd: int, status_fd: int,
                 cgroup: "CgroupSet | None", *, kill_signal: int = signal.SIGKILL,
                 network: "IsolatedNetwork | LoopbackProxy | None" = None,
                 dispose: "Dispose" = dispose_waiting) -> None:
        self.plan = plan
        self._dispose = dispose
        self.network = network                        # an isolated network: for the egress proxy
        # SIGKILL for a sandbox's init (the PID namespace goes with it); for a session
        # call, the signal that makes its supervisor kill the call's tree and report.
        self._kill_signal = kill_signal
        self.pid = pid
        self.started = time.monotonic()
        self._report_fd = report_fd
        self._status_fd = status_fd
        self._cgroup = cgroup
        self._pidfd = os.pidfd_open(pid)
        self._exit_status: int | None = None
        self._timed_out = False
        # When ``stop`` asked a session call's supervisor to kill its tree: SIGKILL follows
        # CALL_KILL_GRACE later (``poll``), if it has not ended by then.
        self._stopped_at: float | None = None
        self._stopped = False                 # killed or stopped: nothing of it may outlive it
        self.inner_pid: int | None = None     # the command's pid inside its sandbox, when known
        # A session call has no group of its own: it counts the session group's OOM kills.
        self._oom_group: "CgroupSet | OomCounter | None" = None
        self._oom_kills_before = 0

    def count_oom_kills_in(self, group: "CgroupSet | OomCounter | None", before: int) -> None:
        """Report ``oom_killed`` when ``group`` (a session's) counted more OOM kills at the end than
        ``before`` (read before this call started). With calls running side by side in one session,
        a kill is reported to every call that was running when it happened. An OomCounter given
        here is this call's: closed when the call is collected."""
        self._oom_group, self._oom_kills_before = group, before

    def _oom_killed(self) -> bool:
        if self._oom_group is not None:              # a session call: its session's group has the limit
            return self._oom_group.oom_kills() > self._oom_kills_before
        return self._cgroup is not None and self._cgroup.oom_killed()

    def wait_started(self) -> None:
        """Block until the command was exec'd; raise SetupError (cleaning up) if setup failed."""
        self.started_with(report.read_all(self._report_fd))

    def report_fileno(self) -> int:
        """The setup report's pipe: EOF once the command was exec'd (or setup failed). A poll
        loop reads it to its end (``report.read_all`` blocks: a command whose cwd or program
        lies on a file system that does not answer never gets there), then ``started_with``."""
        return self._report_fd

    def started_with(self, data: bytes) -> None:
        """``wait_started`` with the report read already; raise SetupError (cleaning up) if setup failed."""
        error, self.inner_pid = report.parse_outcome(data)
        os.close(self._report_fd)
        self._report_fd = -1
        if error is not None:
            self._reap(block=True)
            self._cleanup()
            raise error

    def send_signal(self, signum: int) -> None:
        """Deliver ``signum`` to the command (through init, which forwards it)."""
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """Kill the whole tree: init (whose death takes the PID namespace down) and the cgroup;
        or, for a session call, everything the call started (its supervisor does it). Waits
        (bounded): `sandboxd run` only (a poll loop uses ``stop``)."""
        self._stopped = True
        self.send_signal(self._kill_signal)
        if self._kill_signal != signal.SIGKILL:
            if not _readable(self._pidfd, CALL_KILL_GRACE):
                self.send_signal(signal.SIGKILL)      # the supervisor is stuck: take it down at least
        if self._cgroup is not None:
            self._cgroup.kill()

    def stop(self) -> None:
        """``kill`` without waiting (for a poll loop): a session call's supervisor is asked to kill
        its tree, and ``poll`` sends SIGKILL CALL_KILL_GRACE later if it is still there (it may be
        stuck on a file system that does not answer); ``poll`` reaps it once ``fileno`` is readable."""
        self._stopped = True
        self.send_signal(self._kill_signal)
        if self._kill_signal != signal.SIGKILL and self._stopped_at is None:
            self._stopped_at = time.monotonic()
        if self._cgroup is not None:
            self._cgroup.signal_once()                # a poll loop's: disposed of for good when reaped (_cleanup)

    def wake_at(self, timeout: float | None) -> float | None:
        """When a poll loop must next call ``poll``: the time limit, or the end of a stop's grace."""
        if self._stopped_at is not None:
            return self._stopped_at + CALL_KILL_GRACE
        return None if self._timed_out else self.deadline(timeout)

    def fileno(self) -> int:
        """A descriptor that becomes readable when the sandbox has ended (for select/poll loops)."""
        return self._pidfd

    def deadline(self, timeout: float | None) -> float | None:
        return None if timeout is None else self.started + timeout

    def poll(self, timeout: float | None = None) -> ExitInfo | None:
        """Non-blocking: the ExitInfo if the sandbox ended (killing it first if ``timeout`` passed), else None."""
        if self._exit_status is None:
            self._reap(block=False)
        if self._exit_status is None:
            now = time.monotonic()
            if self._stopped_at is not None:
                if now >= self._stopped_at + CALL_KILL_GRACE:
                    self._stopped_at = None
                    self.send_signal(signal.SIGKILL)  # the supervisor is stuck: take it down at least
                return None
            deadline = self.deadline(timeout)
            if self._timed_out or deadline is None or now < deadline:
                return None
            # Never waits: a tree stuck on a file system that does not answer must not hold the
            # fork server's loop. It is reaped by a later poll, when ``fileno`` is readable.
            self._timed_out = True
            self.stop()
            return None
        return self._finish()

    def wait(self, timeout: float | None = None) -> ExitInfo:
        """Wait for the command, killing the tree at ``timeout`` seconds after start."""
        deadline = self.deadline(timeout)
        while self._exit_status is None:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if _readable(self._pidfd, remaining):
                self._reap(block=True)
            elif deadline is not None and time.monotonic() >= deadline:
                self._timed_out = True
                self.kill()
        return self._finish()

    def _reap(self, *, block: bool) -> None:
        if self._exit_status is not None:
            return
        pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
        if pid == self.pid:
            self._exit_status = status

    def _finish(self) -> ExitInfo:
        assert self._exit_status is not None
        status, usage = self._exit_status, {}
        if self.plan.confined:
            usage = report.read_status(self._status_fd)
            if "status" in usage:
                status = int(usage["status"])          # the command's own, as init saw it
            elif not self._timed_out and os.WIFEXITED(status):
                # init died without a word: only possible when killed from outside
                status = signal.SIGKILL
        info = ExitInfo(
            exit_code=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            timed_out=self._timed_out,
            wall_seconds=time.monotonic() - self.started,
            cpu_seconds=(usage["utime"] + usage["stime"]) if "utime" in usage else None,
            peak_memory_bytes=self._cgroup.peak_memory() if self._cgroup else (
                int(usage["maxrss_kib"]) * 1024 if "maxrss_kib" in usage else None),
            oom_killed=self._oom_killed(),
        )
        self._cleanup()
        return info

    def _cleanup(self) -> None:
        for fd in (self._report_fd, self._status_fd, self._pidfd):
            if fd >= 0:
                os.close(fd)
        self._report_fd = self._status_fd = self._pidfd = -1
        if isinstance(self._oom_group, OomCounter):
            self._oom_group.close()
        if self._cgroup is not None:
            # DangerFullAccess: background jobs may outlive the command, as on the host, unless it
            # timed out or was stopped. A confined sandbox's init is gone: so is everything in it.
            self._dispose(self._cgroup, self.plan.confined or self._timed_out or self._stopped, None)
            self._cgroup = None
        if self.network is not None:                  # after init is gone: nothing uses the link
            self.network.close()
            self.network = None


class Spawner:
    """Forks sandboxes. Create it, and call ``launch``, only in a single-threaded process."""

    def __init__(self, native_helper: str | None = None, dispose: "Dispose" = dispose_waiting) -> None:
        """``native_helper``: the built sandboxd-call, which then runs session calls (native_call.py).
        ``dispose``: what becomes of a sandbox's cgroup once it has ended (``dispose_waiting``; the
        fork server's loop must never wait, and hands them to its Leftovers)."""
        self.pid = os.getpid()
        self._dispose = dispose
        self._new_pid_namespace = namespaces.PidNamespaceForNextChild()
        self.native_helper = native_helper

    def launch(self, spec: LaunchSpec, stdio: tuple[int, int, int] = (0, 1, 2),
               opened: "list[int] | None" = None, *, review_dir: str | None = None) -> SandboxProcess:
        """A one-shot sandbox running ``spec.argv`` (what `sandboxd run` does). ``opened``: its
        paths' descriptors, opened already (plan.path_requests, plan.prepare). ``review_dir``:
        review mode, the writable roots' changes kept there (plan.prepare)."""
        plan = prepare(spec, opened, review_dir=review_dir)
        try:
            network, plan = _loopback_proxy(plan) if plan.rootless else _isolated_network(plan)
        except BaseException:
            plan.close_trees()
            raise
        try:
            cgroup = self._cgroup_for(plan)
        except BaseException:
            _close_network(network, plan)
            raise
        # A confined init is PID 1 of a namespace that bounds its whole tree: it joins only the groups
        # that limit it, as session calls do (CgroupSet.limiting_dirs).
        dirs = (cgroup.limiting_dirs() if plan.confined and not plan.rootless else list(cgroup.dirs)) if cgroup else []
        # Rootless, the child makes the PID namespace itself, inside its user namespace (launcher.rootless).
        proc = self._fork(plan, stdio, cgroup, pid_namespace=plan.confined and not plan.rootless, network=network,
                          body=lambda report_w, status_w: (
                              sequence.run_sandbox(plan, report_fd=report_w, status_fd=status_w, cgroup_dirs=dirs,
                                                   spawner=self.pid)))
        _close_child_ends(plan)                           # a failed fork closed them already
        return proc

    def _fork(self, plan: LaunchPlan, stdio: tuple[int, int, int], cgroup: "CgroupSet | None", *,
              pid_namespace: "bool | int", body: "Callable[[int, int], object]",
              kill_signal: int = signal.SIGKILL, network: "IsolatedNetwork | LoopbackProxy | None" = None
              ) -> SandboxProcess:
        report_r, report_w = os.pipe2(os.O_CLOEXEC)
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = self._fork_child(pid_namespace)
        except SetupError:
            for fd in (report_r, report_w, status_r, status_w):
                os.close(fd)
            if cgroup:
                cgroup.remove()
            _close_network(network, plan)
            raise
        if pid == 0:
            def child() -> None:
                os.close(report_r)
                os.close(status_r)
                for target, source in enumerate(stdio):
                    if source != target:
                        os.dup2(source, target)
                body(report_w, status_w)
            sequence.in_child(report_w, "sandbox", child)
        os.close(report_w)
        os.close(status_w)
        return SandboxProcess(plan, pid, report_r, status_r, cgroup, kill_signal=kill_signal, network=network,
                              dispose=self._dispose)

    def _fork_child(self, pid_namespace: "bool | int") -> int:
        """fork(); with ``pid_namespace`` True the child is PID 1 of a new PID namespace; given
        a pidfd, the child joins that process's PID namespace."""
        if pid_namespace is not False:
            self._new_pid_namespace.enter(None if pid_namespace is True else pid_namespace)
        try:
            pid = os.fork()
        except OSError as exc:
            raise SetupError("fork", exc.errno or 0, hint="the system is out of processes or memory") from None
        finally:
            if pid_namespace is not False and os.getpid() == self.pid:
                self._new_pid_namespace.leave()
        return pid

    def open_session(self, spec: LaunchSpec, opened: "list[int] | None" = None) -> SessionSandbox:
        """Build a session's sandbox once (``spec.argv`` is not run), waiting for the build."""
        build = self.begin_session(spec, opened)
        if isinstance(build, SessionSandbox):
            return build
        return build.finish(report.read_all(build.report_fd))

    def begin_session(self, spec: LaunchSpec, opened: "list[int] | None" = None, *,
                      review_dir: str | None = None) -> "SessionSandbox | SessionBuild":
        """Start building a session's sandbox (``spec.argv`` is not run): the session, when
        there is nothing to build (DangerFullAccess has no sandbox: its calls are plain
        unconfined launches), else the build under way: read its ``report_fd`` to EOF, then
        ``finish``. ``opened``: the spec's paths' descriptors, opened already. ``review_dir``:
        review mode (plan.prepare), the layers' record saved there before the sandbox exists (what
        a rebuild, a listing or an apply starts from)."""
        plan = prepare(spec, opened, review_dir=review_dir)
        cgroup = None
        try:
            if review_dir is not None:
                save_layers(review_dir, list(plan.review_layers.values()))
            if plan.limits.memory_bytes or plan.limits.pids or plan.caller_groups is not None or plan.placement:
                cgroup = self._cgroup_for(plan)
            if plan.caller_groups is not None and (cgroup is None or not cgroup.dirs):
                raise LimitsUnavailable("cgroup setup", errno.ENOENT, hint=NO_GROUP_FOR_CALLER)
            if not plan.confined:
                return SessionSandbox(plan, None, None, cgroup, dispose=self._dispose)
            network, plan = _isolated_network(plan)
        except BaseException:
            plan.close_trees()
            if cgroup:
                cgroup.remove()
            raise
        report_r, report_w = os.pipe2(os.O_CLOEXEC)
        ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
        try:
            pid = self._fork_child(pid_namespace=True)
        except SetupError:
            for closable in (report_r, report_w):
                os.close(closable)
            ours.close()
            theirs.close()
            if cgroup:
                cgroup.remove()
            _close_network(network, plan)
            raise
        if pid == 0:
            sequence.in_child(report_w, "session", lambda: sequence.run_session_init(
                plan, report_fd=report_w, intake=theirs, cgroup_dirs=list(cgroup.dirs) if cgroup else []))
        os.close(report_w)
        theirs.close()
        _close_child_ends(plan)
        return SessionBuild(SessionSandbox(plan.replace(netns_fd=-1, root_trees={}), pid, ours, cgroup, network,
                                           dispose=self._dispose), report_r)

    def launch_call(self, session: SessionSandbox, argv: tuple[str, ...], env: dict[str, str], cwd: str,
                    stdio: tuple[int, int, int] = (0, 1, 2), tool: dict[str, object] | None = None,
                    terminal: tuple[int, int] | None = None) -> SandboxProcess:
        """Run one command in a session's sandbox: about a fork and an exec, no new sandbox.
        With ``tool``, the confined child runs that file tool instead of exec'ing (file_tools).
        With ``terminal`` (rows, columns), on a terminal whose master goes back on stdin (plan.terminal).
        Commands go to the native helper when the spawner has one (native_call.py)."""
        # The call's own descriptor of its session group's OOM kills, read before it starts and
        # after it ends, closed with it (SessionSandbox says why it is not the session's).
        counter = OomCounter(session.cgroup) if session.cgroup is not None else None
        try:
            oom_kills_before = counter.oom_kills() if counter else 0
            proc = self._launch_call(session, argv, env, cwd, stdio, tool, terminal)
        except BaseException:
            if counter is not None:
                counter.close()
            raise
        proc.count_oom_kills_in(counter, oom_kills_before)
        return proc

    def _launch_call(self, session: SessionSandbox, argv: tuple[str, ...], env: dict[str, str], cwd: str,
                     stdio: tuple[int, int, int], tool: dict[str, object] | None,
                     terminal: tuple[int, int] | None = None) -> SandboxProcess:
        plan = session.plan.replace(argv=tuple(argv), env=dict(env), cwd=cwd, tool=tool, terminal=terminal)
        if self.native_helper is not None and tool is None and plan.confined and session.init_pid is not None:
            return self._spawn_native(self.native_helper, session, plan, stdio)
        # danger-full-access (root's or a plain caller's) has no sandbox for the helper to join:
        # the Python path is its only one (launcher/sequence.py says so too).
        if plan.caller_groups is not None:
            return self._launch_as_caller(session, plan, stdio)
        if not plan.confined or session.init_pid is None:
            cgroup_dirs = list(session.cgroup.dirs) if session.cgroup else []   # no PID namespace: every group
            return self._fork(plan, stdio, None, pid_namespace=False, body=lambda report_w, status_w: (
                sequence.run_sandbox(plan, report_fd=report_w, status_fd=status_w, cgroup_dirs=cgroup_dirs,
                                     spawner=self.pid)))
        cgroup_dirs = session.cgroup.limiting_dirs() if session.cgroup else []
        pidfd, intake = session.call_pidfd(), session.intake
        try:
            return self._fork(plan, stdio, None, pid_namespace=pidfd, body=lambda report_w, status_w: (
                sequence.run_call(plan, session_pidfd=pidfd, intake_fd=intake.fileno() if intake else None,
                                  report_fd=report_w, status_fd=status_w, cgroup_dirs=cgroup_dirs)),
                kill_signal=sequence.KILL_TREE_SIGNAL)
        finally:
            os.close(pidfd)                               # the child has its own copy (fork)

    def _launch_as_caller(self, session: SessionSandbox, plan: LaunchPlan,
                          stdio: tuple[int, int, int]) -> SandboxProcess:
        """A call of a non-root caller's danger-full-access session (sequence._exec_as_caller). It
        has no PID namespace, so its tree is held by a cgroup of its own inside the session's
        (under the session's limits and the owner's share): a timeout or cancel kills that group,
        daemons that double-forked included; what is left when the command ends on its own moves
        to the session's group (background jobs live on, as on the host) until the session closes."""
        if session.cgroup is None or not session.cgroup.dirs:
            raise LimitsUnavailable("cgroup setup", errno.ENOENT, hint=NO_GROUP_FOR_CALLER)
        group = session.cgroup.child(f"call-{next(_counter)}-{os.urandom(3).hex()}")
        dirs = list(group.dirs)
        return self._fork(plan, stdio, group, pid_namespace=False, body=lambda report_w, status_w: (
            sequence.run_sandbox(plan, report_fd=report_w, status_fd=status_w, cgroup_dirs=dirs, spawner=self.pid)))

    def _spawn_native(self, helper: str, session: SessionSandbox, plan: LaunchPlan,
                      stdio: tuple[int, int, int]) -> SandboxProcess:
        """A session call run by sandboxd-call: posix_spawn (a vfork) of the helper in the
        session's PID namespace, with the descriptors laid out as it expects."""
        import fcntl

        from sandboxd.launcher import native_call

        report_r, report_w = os.pipe2(os.O_CLOEXEC)
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        program_r, program_w = os.pipe2(os.O_CLOEXEC)
        closing = [report_w, status_w, program_r, program_w]
        try:
            pidfd = session.call_pidfd()
            closing.append(pidfd)
            os.write(program_w, plan.seccomp_program)    # a few KiB: the pipe holds it
            environment = native_call.environment_file(plan.env)
            closing.append(environment)
            sources = [*stdio, report_w, status_w, pidfd,
                       session.intake.fileno() if session.intake else None, program_r, environment]
            actions = []
            for target, source in enumerate(sources):
                if source is None:
                    continue
                if source < len(sources):
                    # A source among the targets is duplicated out of the way first, so no dup2
                    # overwrites it before it is moved (or leaves it close-on-exec in its place).
                    # The others are moved as they are: a call's descriptors are mostly high, and
                    # each duplicate is two more system calls on the fork server's loop.
                    source = fcntl.fcntl(source, fcntl.F_DUPFD_CLOEXEC, 64)
                    closing.append(source)
                actions.append((os.POSIX_SPAWN_DUP2, source, target))
            argv = native_call.command_line(helper, plan, namespaces=sequence.CALL_NAMESPACES,
                                            cgroup_dirs=session.cgroup.limiting_dirs() if session.cgroup else [])
            self._new_pid_namespace.enter(pidfd)
            try:
                pid = os.posix_spawn(helper, argv, {}, file_actions=actions, setsigmask=(),
                                     setsigdef=SPAWN_DEFAULT_SIGNALS)
            except OSError as exc:
                raise SetupError("spawn call helper", exc.errno or 0, helper) from None
            finally:
                self._new_pid_namespace.leave()
        except BaseException:
            os.close(report_r)
            os.close(status_r)
            raise
        finally:
            for fd in closing:
                os.close(fd)
        return SandboxProcess(plan, pid, report_r, status_r, None, kill_signal=sequence.KILL_TREE_SIGNAL)

    def _cgroup_for(self, plan: LaunchPlan) -> CgroupSet | None:
        """A cgroup with the asked limits, or none when there are no limits and the PID
        namespace already bounds the tree. Joining a cgroup costs an RCU grace period
        in the kernel (0.5 to 25 ms here), the largest single cost of a launch.
        DangerFullAccess has no PID namespace, so with a timeout it gets a cgroup whenever
        possible: the timeout must also kill what left the command's session. A plan with an
        owner goes into that owner's group, under its share of the ceiling."""
        name = group_name(f"{next(_counter)}-{os.urandom(3).hex()}")
        limits = plan.limits
        if plan.placement:                 # a pod's session: always a group there, or the daemon would pay for it
            from sandboxd.kernel.pod_placement import create_placed
            return create_placed(name, plan.placement, memory_bytes=limits.memory_bytes, pids=limits.pids)
        owner = None
        if plan.owner:
            owner = OwnerShare(plan.owner, pids=limits.owner_pids, memory_bytes=limits.owner_memory_bytes)
        if limits.memory_bytes or limits.pids:
            ceiling = None
            if limits.total_pids or limits.total_memory_bytes:
                ceiling = Ceiling(pids=limits.total_pids, memory_bytes=limits.total_memory_bytes)
            return CgroupSet.create(name, memory_bytes=limits.memory_bytes, pids=limits.pids, ceiling=ceiling,
                                    owner=owner)
        if plan.confined or (limits.timeout_seconds is None and plan.caller_groups is None):
            return None
        try:
            group = CgroupSet.create(name, memory_bytes=None, pids=None, owner=owner)
        except SetupError:
            return None  # no writable cgroup hierarchy: the PID namespace still bounds the tree
        return group if group.dirs else None


class SessionSandbox:
    """A session's persistent sandbox, as the fork server holds it: the session's init
    (PID 1 of its namespaces) and the socket its calls send seccomp listeners on.

    It holds as few descriptors as it can (the intake socket, and a pidfd only once its close
    began): every descriptor the fork server holds is copied into each helper it spawns and
    closed again at the helper's exec, so one held per open session made every call cost more
    for each session open (about 0.3 ms per thousand descriptors here). A call takes a pidfd
    of its own (``call_pidfd``) and its own OOM-kill counter (Spawner.launch_call), for as long
    as it runs."""

    def __init__(self, plan: LaunchPlan, init_pid: int | None, intake: "_socket.socket | None",
                 cgroup: "CgroupSet | None", network: "IsolatedNetwork | None" = None,
                 dispose: "Dispose" = dispose_waiting) -> None:
        self.plan = plan
        self._dispose = dispose
        self.network = network
        self.init_pid = init_pid
        self._pidfd = -1
        self.intake = intake
        self.cgroup = cgroup

    @property
    def pidfd(self) -> int:
        """The init's pidfd (-1 without an init), opened when first asked (a close waits on it)
        and kept until ``close``."""
        if self._pidfd < 0 and self.init_pid is not None:
            self._pidfd = os.pidfd_open(self.init_pid)
        return self._pidfd

    def call_pidfd(self) -> int:
        """A new pidfd of the init, for one call (the caller closes it). By pid, safely: the init
        is this process's child, and its pid stays its own until ``reap`` collects it."""
        assert self.init_pid is not None, "a call runs only in a session that has an init"
        return os.pidfd_open(self.init_pid)

    def kill(self) -> None:
        """SIGKILL the session's init: the kernel kills everything in its PID namespace.

        Its exit completes only once every process of the namespace has been reaped,
        including the calls' inits, which are the spawner's children: so the spawner
        must go on reaping those (``SandboxProcess.poll``) until ``reap`` succeeds."""
        if self.init_pid is not None:
            try:
                os.kill(self.init_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def reap(self) -> bool:
        """True once the session's init is gone (never blocks)."""
        if self.init_pid is None:
            return True
        try:
            pid, _ = os.waitpid(self.init_pid, os.WNOHANG)
        except ChildProcessError:
            pid = self.init_pid
        if pid == 0:
            return False
        self.init_pid = None
        return True

    def close(self, then: "Callable[[], None] | None" = None) -> None:
        """Kill everything in the session and release its namespaces, mounts and cgroups (for a
        session without running calls, whose init is reaped already when a poll loop calls this;
        see ``kill`` otherwise). Its cgroup goes to ``dispose``; ``then()`` once that is gone."""
        self.kill()
        if self.init_pid is not None:
            try:
                os.waitpid(self.init_pid, 0)
            except ChildProcessError:
                pass
            self.init_pid = None
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        if self.intake is not None:
            self.intake.close()
            self.intake = None
        cgroup, self.cgroup = self.cgroup, None
        if cgroup is not None:
            self._dispose(cgroup, True, then)
        elif then is not None:
            then()
        if self.network is not None:
            self.network.close()
            self.network = None


class SessionBuild:
    """A session's sandbox being built: its init reports on ``report_fd`` (EOF: ready)."""

    def __init__(self, session: SessionSandbox, report_fd: int) -> None:
        self.session = session
        self.report_fd = report_fd

    def finish(self, data: bytes, release: "Callable[[SessionSandbox], None] | None" = None) -> SessionSandbox:
        """The session, given its init's whole report; SetupError (the session closed) if the build
        failed: closed here (waiting for its init), or killed and given to ``release`` (a poll loop's,
        which closes it once its init is gone)."""
        os.close(self.report_fd)
        error = report.parse_outcome(data)[0]
        if error is not None:
            if release is None:
                self.session.close()
            else:
                self.session.kill()
                release(self.session)
            raise error
        return self.session

    def abandon(self) -> SessionSandbox:
        """Give up on the build: its init is SIGKILLed; the caller reaps the session (``reap``, then ``close``)."""
        os.close(self.report_fd)
        self.session.kill()
        return self.session


def _loopback_proxy(plan: LaunchPlan) -> "tuple[LoopbackProxy | None, LaunchPlan]":
    """A rootless launch's --allow-domain (plan.check_rootless refuses the rest of the isolated
    network): the socket pair its init hands the proxy's listener over (network.loopback_proxy)."""
    if not plan.network_isolated:
        return None, plan
    from sandboxd.defaults import PROXY_PORT
    from sandboxd.network.egress_proxy import proxy_environment
    from sandboxd.network.loopback_proxy import LoopbackProxy

    proxy = LoopbackProxy(plan.dns)
    return proxy, plan.replace(proxy_sink_fd=proxy.child_end(), proxy_port=PROXY_PORT,
                               env={**plan.env, **proxy_environment()})


def _isolated_network(plan: LaunchPlan) -> "tuple[IsolatedNetwork | None, LaunchPlan]":
    """For an isolated network, build it now (before any fork) and hand the child its namespace
    (a descriptor, closed in the parent by ``_close_child_ends`` after the fork) and resolv.conf."""
    if not plan.network_isolated:
        return None, plan
    from sandboxd.kernel.netns import create_isolated

    from sandboxd.kernel.netns import DEFAULT_POOL

    network = create_isolated(pool=plan.network_pool or DEFAULT_POOL, resolvers=list(plan.dns) if plan.dns else None,
                              allowed_hosts=plan.allowed_hosts, via_proxy=plan.proxied)
    try:
        netns_fd = os.dup(network.netns_fd)
        env = dict(plan.env)
        if plan.proxied:
            from sandboxd.network.egress_proxy import EgressProxy, proxy_environment
            from sandboxd.network.transparent import listen_captured

            # On the sandbox's loopback, bound before the command can exist, so its first request
            # finds the proxy there; whoever runs it (sandboxd run, the daemon) starts serving it.
            network.proxy_listener = EgressProxy.listen(network.netns_fd)
            # And the one its ports 80 and 443 are redirected to (kernel.nftables.egress_ruleset):
            # for programs that ignore the proxy variables.
            network.transparent_listener = listen_captured(network.netns_fd)
            env.update(proxy_environment())
    except BaseException:
        network.close()
        raise
    return network, plan.replace(netns_fd=netns_fd, resolv_conf=network.resolv_conf(), env=env)


def _close_child_ends(plan: LaunchPlan) -> None:
    """What the parent opened for the child only: the isolated network's namespace, the roots'
    mount trees. After the fork (the child has its copies), or when the launch is given up."""
    if plan.netns_fd >= 0:
        os.close(plan.netns_fd)
    if plan.proxy_sink_fd >= 0:
        os.close(plan.proxy_sink_fd)
    plan.close_trees()


def _close_network(network: "IsolatedNetwork | LoopbackProxy | None", plan: LaunchPlan) -> None:
    _close_child_ends(plan)
    if network is not None:
        network.close()
