"""The ordered setup sequence of a sandboxed launch. Each function runs in a
freshly forked child, never returns, and reports any failure on the report
channel before exiting 125 - the command never runs with less isolation than
asked.

Confined policies (all but DangerFullAccess) use two processes:

  spawner ──(unshare CLONE_NEWPID, fork, setns back)── init (PID 1) ──── command
                                    cgroup join, unshare (mnt ipc     setsid, rlimits,
                                    uts cgroup [net]), loopback up,   landlock, seccomp
                                    mounts, pivot_root, drop          (last), exec
                                    privileges, fork; then reap,
                                    broker connect(), report status

unshare(CLONE_NEWPID) only places the caller's *next children* in the new
namespace, so the spawner unshares it right before forking and setns()es back
to its own right after: the child is PID 1 and can mount a /proc that shows
the new namespace. When init exits the kernel kills everything left in the
namespace, so nothing outlives the sandbox, not even a double-forked daemon.
Init drops its privileges before forking the command, so the command never
holds a capability, and init holds none while the command runs.

DangerFullAccess uses one process: the spawner's child becomes the command.
"""

from __future__ import annotations

import _socket  # the C module: socket.py's enums cost more to import than a launch
import errno
import os
import select
import _signal as signal  # the C module: signal.py builds IntEnums, which costs more than a launch

from sandboxd.errors import ExecFailed
from sandboxd.kernel import caps, landlock, namespaces, netns, process, rlimits, seccomp
from sandboxd.kernel._libc import from_oserror
from sandboxd.launcher import report, rootfs
from sandboxd.launcher.connect_broker import ConnectBroker
from sandboxd.launcher.plan import LaunchPlan

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, NoReturn


def in_child(report_fd: int, step: str, body: "Callable[[], object]") -> "NoReturn":
    """Run the body of a freshly forked child. Whatever happens in it, this process
    never returns into its parent's code: any exception becomes a report, and the
    child ends here."""
    try:
        body()
    except BaseException as exc:  # noqa: BLE001
        report.fail(report_fd, exc, step)
    finally:
        os._exit(report.SETUP_FAILED_EXIT)

# Python ignores SIGPIPE and SIGXFSZ for itself; an exec'd program must get the defaults back.
RESTORED_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                     signal.SIGUSR2, signal.SIGWINCH, signal.SIGCONT)


def run_sandbox(plan: LaunchPlan, *, report_fd: int, status_fd: int, cgroup_dirs: list[str]) -> NoReturn:
    """The spawner's child. For a confined policy it is PID 1 of a new PID namespace
    (the spawner unshared CLONE_NEWPID just for this fork) and becomes init;
    for DangerFullAccess it becomes the command. Never returns."""
    try:
        process.die_with_parent(OUTSIDE_PARENT if plan.confined else os.getppid())
        _join_cgroups(cgroup_dirs)                        # before anything forks: limits cover the whole tree
        if not plan.confined:
            os.close(status_fd)
            _exec_unconfined(plan, report_fd)
        _run_init(plan, report_fd=report_fd, status_fd=status_fd)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a report
        report.fail(report_fd, exc, "sandbox")


# Seen from inside a new PID namespace, a parent outside it has pid 0.
OUTSIDE_PARENT = 0


def _run_init(plan: LaunchPlan, *, report_fd: int, status_fd: int) -> NoReturn:
    """PID 1 of the new PID namespace: builds the filesystem, starts the command, reaps, reports."""
    try:
        flags = namespaces.ISOLATED_NOW | (0 if plan.network else namespaces.CLONE_NEWNET)
        namespaces.unshare(flags)                         # mount, ipc, uts, cgroup (+ net): applies to us now
        if not plan.network:
            netns.bring_up_loopback()                     # a new net namespace has only lo, and it is down
        namespaces.set_hostname("sandbox")
        rootfs.build(plan)                                # mounts, then pivot_root (see rootfs.py)
        os.chdir(plan.cwd)
        # Init keeps no privilege either, and drops it before the command is forked
        # so the command starts without any: same uid, no capabilities, NNP. Not
        # dumpable, so the command cannot read init's memory or environment.
        process.set_title("sandboxd-init")                # while its memory is still writable to it
        caps.drop_privileges(plan.uid, plan.gid)
        process.die_with_parent(OUTSIDE_PARENT)           # credential changes clear the death signal
        process.set_dumpable(False)
    except BaseException as exc:  # noqa: BLE001
        report.fail(report_fd, exc, "init")
    broker_end, command_end = (_socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
                               if plan.brokers_connect else (None, None))
    command_pid = os.fork()
    if command_pid == 0:
        in_child(report_fd, "command", lambda: _run_command(plan, init=1, report_fd=report_fd, broker=command_end))
    listener = _receive_listener(broker_end, command_end)
    keep = {status_fd} | ({listener} if listener is not None else set())
    process.close_all_except(keep)                        # the report pipe closes with the command's exec
    _forward_signals_to(command_pid)
    _supervise(command_pid, status_fd, listener)


def _receive_listener(broker_end: "_socket.socket | None", command_end: "_socket.socket | None") -> int | None:
    """The seccomp listener the command sends before exec (None if it failed before that)."""
    if broker_end is None or command_end is None:
        return None
    command_end.close()
    listener = None
    try:
        _, ancillary, _, _ = broker_end.recvmsg(1, _socket.CMSG_SPACE(4))
        for level, kind, data in ancillary:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS and len(data) >= 4:
                listener = int.from_bytes(data[:4], "little")
    except OSError:
        pass
    broker_end.close()
    return listener


def _supervise(command_pid: int, status_fd: int, listener: int | None) -> NoReturn:
    """Reap every child (orphans re-parent to PID 1) and broker connect() calls until the
    command exits; then report its status and exit, which takes the namespace down: the
    kernel SIGKILLs whatever is left."""
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda _s, _f: None)    # a handler, so SIGCHLD wakes poll()
    poller = select.poll()
    poller.register(wake_r, select.POLLIN)
    broker = None
    if listener is not None:
        broker = ConnectBroker(listener)
        poller.register(listener, select.POLLIN)
    while True:
        _reap(command_pid, status_fd)
        for fd, events in poller.poll():
            if fd == wake_r:
                _drain(wake_r)
            elif broker is not None:
                if events & select.POLLIN:
                    try:
                        broker.handle_one()
                    except OSError:
                        pass  # the caller died mid-call; its sandbox is unaffected
                if events & (select.POLLHUP | select.POLLERR):
                    poller.unregister(fd)                 # every filtered process is gone
                    broker = None


def _reap(command_pid: int, status_fd: int) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            os._exit(0)
        if pid == 0:
            return
        if pid != command_pid:
            continue
        report.write_status(status_fd, status, usage.ru_utime, usage.ru_stime, usage.ru_maxrss)
        os._exit(0)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def _run_command(plan: LaunchPlan, *, init: int, report_fd: int, broker: "_socket.socket | None") -> NoReturn:
    try:
        for signum in FORWARDED_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        process.die_with_parent(init)
        process.new_session()                             # no controlling terminal: no TIOCSTI into the caller
        rlimits.apply(cpu_seconds=plan.limits.cpu_seconds, open_files=plan.limits.open_files)
        caps.verify_dropped()                             # inherited from init: no caps, no_new_privs
        landlock.restrict_writes(                         # second wall for writes, by path
            list(plan.writable_roots) + ["/tmp", "/dev/shm"], ["/dev", "/proc"])
        process.cloexec_from(3)                           # only 0, 1, 2 survive exec
        listener = seccomp.load(plan.seccomp_program,     # last: nothing after this but exec
                                new_listener=plan.brokers_connect)
        if broker is not None:
            broker.sendmsg([b"L"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS,  # init answers this
                                     listener.to_bytes(4, "little"))])         # filter's notifications
            os.close(listener)
            broker.close()
    except BaseException as exc:  # noqa: BLE001
        report.fail(report_fd, exc, "command setup")
    _exec(plan, report_fd)


def _exec_unconfined(plan: LaunchPlan, report_fd: int) -> NoReturn:
    """DangerFullAccess: the host as it is, but a killable tree and no TIOCSTI."""
    try:
        process.new_session()
        rlimits.apply(cpu_seconds=plan.limits.cpu_seconds, open_files=plan.limits.open_files)
        os.chdir(plan.cwd)
        process.cloexec_from(3)
        # Loaded while still privileged, so it needs no no_new_privs (full access
        # means setuid binaries keep working); it survives the uid switch below.
        seccomp.load(plan.seccomp_program)
        if (plan.uid, plan.gid) != (os.getuid(), os.getgid()):
            os.setgroups([])
            os.setresgid(plan.gid, plan.gid, plan.gid)
            os.setresuid(plan.uid, plan.uid, plan.uid)
    except BaseException as exc:  # noqa: BLE001
        report.fail(report_fd, exc, "unconfined setup")
    _exec(plan, report_fd)


def _exec(plan: LaunchPlan, report_fd: int) -> NoReturn:
    """execve the program, searching the sandbox environment's PATH like execvp(3).

    Not os.execvpe: it imports `warnings` lazily, and after the privilege drop
    the interpreter's own files may be unreadable (a Python under /root).
    """
    try:
        for signum in RESTORED_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        program, argv = plan.argv[0], list(plan.argv)
        if "/" in program:
            candidates = [program]
        else:
            search = plan.env.get("PATH") or "/usr/local/bin:/usr/bin:/bin"
            candidates = [os.path.join(d or ".", program) for d in search.split(":")]
        first_error: OSError | None = None
        for candidate in candidates:
            try:
                os.execve(candidate, argv, plan.env)
            except OSError as exc:
                # Like execvp: remember a real refusal (EACCES...), keep looking past ENOENT/ENOTDIR.
                if first_error is None or (first_error.errno in (errno.ENOENT, errno.ENOTDIR)
                                           and exc.errno not in (errno.ENOENT, errno.ENOTDIR)):
                    first_error = exc
        assert first_error is not None
        error = from_oserror(first_error, "exec", program)
        report.fail(report_fd, ExecFailed(error.step, error.errno, program, hint=error.hint), "exec")
    except BaseException as exc:  # noqa: BLE001
        report.fail(report_fd, exc, "exec")


def _join_cgroups(dirs: list[str]) -> None:
    try:
        for path in dirs:
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write("0")
    except OSError as exc:
        raise from_oserror(exc, "cgroup join") from None


def _forward_signals_to(target: int) -> None:
    """Pass the usual job-control and termination signals down one level (like tini)."""
    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(target, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
