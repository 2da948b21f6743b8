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
import _signal as signal  # the C module: signal.py builds IntEnums, which costs more than a launch

from sandboxd.errors import ExecFailed
from sandboxd.kernel import caps, cgroups, landlock, namespaces, netns, process, rlimits, seccomp
from sandboxd.kernel._libc import from_oserror
from sandboxd.launcher import file_tools, report, rootfs
from sandboxd.launcher.init_loop import InitLoop, receive_fd, send_fd
from sandboxd.launcher.plan import LaunchPlan

TYPE_CHECKING = False
if TYPE_CHECKING:
    from resource import struct_rusage
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


def _fork_command() -> int:
    """init's fork of the command; EAGAIN (a full pids limit, owner share or ceiling) becomes the
    ProcessLimitReached its caller gets, naming those limits."""
    try:
        return os.fork()
    except OSError as exc:
        raise from_oserror(exc, "fork") from None


def run_sandbox(plan: LaunchPlan, *, report_fd: int, status_fd: int, cgroup_dirs: list[str],
                spawner: int) -> NoReturn:
    """The spawner's child. For a confined policy it is PID 1 of a new PID namespace
    (the spawner unshared CLONE_NEWPID just for this fork) and becomes init;
    for DangerFullAccess it becomes the command. Never returns."""
    try:
        # ``spawner``: the parent's pid, taken before the fork, so the race check sees a parent
        # that died before the death signal was set (getppid() here would already be its heir).
        process.die_with_parent(OUTSIDE_PARENT if plan.confined else spawner)
        cgroups.join(cgroup_dirs)                        # before anything forks: limits cover the whole tree
        if not plan.confined:
            os.close(status_fd)
            _exec_unconfined(plan, report_fd)
        _run_init(plan, report_fd=report_fd, status_fd=status_fd)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a report
        report.fail(report_fd, exc, "sandbox")


# Seen from inside a new PID namespace, a parent outside it has pid 0.
OUTSIDE_PARENT = 0
CALL_INIT = -1  # the command's parent is a call's init, whose pid is only known after the fork


def _build_sandbox(plan: LaunchPlan, title: str) -> None:
    """Everything init does before any command exists; shared by one-shot and session inits."""
    flags = namespaces.ISOLATED_NOW | (0 if plan.network else namespaces.CLONE_NEWNET)
    namespaces.unshare(flags)                             # mount, ipc, uts, cgroup (+ net): applies to us now
    if plan.netns_fd >= 0:
        # An isolated network: a namespace the spawner built (veth, address, route) before the fork.
        namespaces.setns(plan.netns_fd, namespaces.CLONE_NEWNET)
    if not plan.network:
        netns.bring_up_loopback()                         # a new net namespace has only lo, and it is down
    namespaces.set_hostname("sandbox")
    rootfs.build(plan)                                    # mounts, then pivot_root (see rootfs.py)
    os.chdir(plan.cwd)
    # Init keeps no privilege either, and drops it before any command is forked
    # so a command starts without any: same uid, no capabilities, NNP. Not
    # dumpable, so a command cannot read init's memory or environment.
    process.set_title(title)                              # while its memory is still writable to it
    caps.drop_privileges(plan.uid, plan.gid)
    process.die_with_parent(OUTSIDE_PARENT)               # credential changes clear the death signal
    process.set_dumpable(False)


def _run_init(plan: LaunchPlan, *, report_fd: int, status_fd: int) -> NoReturn:
    """PID 1 of a one-shot sandbox: builds it, starts the command, reaps, reports, exits."""
    try:
        _build_sandbox(plan, "sandboxd-init")
    except BaseException as exc:  # noqa: BLE001
        report.fail(report_fd, exc, "init")
    broker_end, command_end = (_socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
                               if plan.brokers_connect else (None, None))
    command_pid = _fork_command()
    if command_pid == 0:
        in_child(report_fd, "command", lambda: _run_command(plan, report_fd=report_fd, listener_sink=command_end))
    listener = None
    if broker_end is not None and command_end is not None:
        command_end.close()
        listener = receive_fd(broker_end)                 # sent by the command just before exec
        broker_end.close()
    process.close_all_except({status_fd} | ({listener} if listener is not None else set()))
    _forward_signals_to(command_pid)                      # the report pipe closed with the command's exec

    def on_exit(pid: int, status: int, usage: struct_rusage) -> None:
        # When the command ends, init reports and exits, which takes the namespace
        # down: the kernel SIGKILLs whatever is left.
        if pid == command_pid:
            report.write_status(status_fd, status, usage.ru_utime, usage.ru_stime, usage.ru_maxrss)
            os._exit(0)

    loop = InitLoop(on_exit, plan.broker)
    if listener is not None:
        loop.add_listener(listener)
    loop.run()


def run_session_init(plan: LaunchPlan, *, report_fd: int, intake: "_socket.socket",
                     cgroup_dirs: list[str]) -> NoReturn:
    """PID 1 of a session's persistent sandbox. Builds it once, then only reaps orphans and
    brokers connect() for the session's commands (each call sends its filter's listener on
    ``intake``) until the session is closed: the fork server SIGKILLs it, and the namespaces,
    mounts and every process in them go with it."""
    try:
        process.die_with_parent(OUTSIDE_PARENT)
        cgroups.join(cgroup_dirs)
        _build_sandbox(plan, "sandboxd-session")
        process.close_all_except({intake.fileno()})       # closing the report pipe says "ready"
    except BaseException as exc:  # noqa: BLE001
        report.fail(report_fd, exc, "session init")
    loop = InitLoop(lambda _pid, _status, _usage: None, plan.broker)
    loop.add_intake(intake)
    loop.run()


# Namespaces a call joins besides the PID namespace (which the spawner's fork
# put it in): everything the session's init unshared.
CALL_NAMESPACES = (namespaces.CLONE_NEWNS | namespaces.CLONE_NEWNET | namespaces.CLONE_NEWIPC
                   | namespaces.CLONE_NEWUTS | namespaces.CLONE_NEWCGROUP)
KILL_TREE_SIGNAL = signal.SIGRTMIN + 2


def _no_trace(_step: str) -> None:
    pass


def _tracer(plan: LaunchPlan) -> "Callable[[str], object]":
    """What records each setup step: nothing unless a test set plan.debug.trace_path (opened
    here, before any namespace is joined: the path is the host's)."""
    if plan.debug is None or not plan.debug.trace_path:
        return _no_trace
    fd = os.open(plan.debug.trace_path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    return lambda step: os.write(fd, step.encode() + b"\n")


def run_call(plan: LaunchPlan, *, session_pidfd: int, intake_fd: int | None, report_fd: int, status_fd: int,
             cgroup_dirs: list[str]) -> NoReturn:
    """The call's init: a process in the session's PID namespace (the spawner forked it there)
    that joins the session's other namespaces and runs one command.

    It is the child subreaper of the call, so every orphan of the command's tree
    re-parents to it rather than to the session's init (a subreaper only catches
    orphans of its own PID namespace, hence its place inside). When the command
    ends, or on KILL_TREE_SIGNAL (cancel, timeout), it kills what is left of the
    call's tree, reports the command's status and exits. Like the session's init
    it drops every privilege before the command is forked.
    """
    try:
        trace = _tracer(plan)
        trace("die with parent")
        process.die_with_parent(OUTSIDE_PARENT)
        trace("join cgroups")
        cgroups.join(cgroup_dirs)
        # A pidfd of the session's init, inherited from the spawner (its pid number
        # means nothing in here): the session's root comes with its mount namespace.
        trace("join namespaces")
        namespaces.setns(session_pidfd, CALL_NAMESPACES)
        trace("chdir")
        os.chdir(plan.cwd)
        trace("child subreaper")
        process.set_child_subreaper()
        trace("set title")
        process.set_title("sandboxd-call")
        trace("drop privileges")
        caps.drop_privileges(plan.uid, plan.gid)
        trace("die with parent")
        process.die_with_parent(OUTSIDE_PARENT)
        trace("not dumpable")
        process.set_dumpable(False)
        trace("fork")
    except BaseException as exc:  # noqa: BLE001
        report.fail(report_fd, exc, "join session")
    sink = _socket.socket(fileno=intake_fd) if intake_fd is not None else None
    command_pid = _fork_command()
    if command_pid == 0:
        in_child(report_fd, "command", lambda: _run_command(plan, report_fd=report_fd, listener_sink=sink,
                                                            parent=CALL_INIT, trace=trace))
    if sink is not None:
        sink.detach()                                     # its descriptor is closed just below
    try:
        os.write(report_fd, report.encode({"pid": command_pid}))  # its pid as seen inside the session
    except OSError:
        pass
    process.close_all_except({status_fd})
    _forward_signals_to(command_pid)
    signal.signal(KILL_TREE_SIGNAL, lambda _s, _f: process.kill_descendants())

    def on_exit(pid: int, status: int, usage: struct_rusage) -> None:
        if pid != command_pid:
            return
        process.kill_descendants(reap=True)               # nothing the command started outlives the call
        report.write_status(status_fd, status, usage.ru_utime, usage.ru_stime, usage.ru_maxrss)
        os._exit(0)

    InitLoop(on_exit).run()


def _run_command(plan: LaunchPlan, *, report_fd: int, listener_sink: "_socket.socket | None",
                 parent: int = 1, trace: "Callable[[str], object]" = _no_trace) -> NoReturn:
    """The command: ``parent`` is its expected parent pid (1: a one-shot init; CALL_INIT: a call's)."""
    parent = os.getppid() if parent == CALL_INIT else parent
    debug = plan.debug
    try:
        trace("default signals")
        for signum in FORWARDED_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        trace("die with parent")
        process.die_with_parent(parent)
        trace("new session")
        process.new_session()                             # no controlling terminal: no TIOCSTI into the caller
        trace("rlimits")
        rlimits.apply(cpu_seconds=plan.limits.cpu_seconds, open_files=plan.limits.open_files)
        trace("verify dropped")
        caps.verify_dropped()                             # no caps, no_new_privs
        trace("landlock")
        abi = landlock.restrict_writes(                   # second wall for writes, by path
            [*plan.writable_roots, *landlock.EXTRA_WRITABLE], list(landlock.FILE_WRITES_ONLY),
            forced_abi=debug.landlock_abi if debug else 0)
        trace(f"landlock abi {abi}")
        trace("close-on-exec")
        if process.cloexec_from(3, use_close_range=not (debug and debug.no_close_range)):  # only 0, 1, 2 survive exec
            trace("close-on-exec by /proc/self/fd")
        trace("seccomp")
        listener = seccomp.load(plan.seccomp_program,     # last: nothing after this but exec
                                new_listener=plan.brokers_connect)
        if listener_sink is not None and plan.brokers_connect:
            trace("send listener")
            send_fd(listener_sink, listener)              # init answers this filter's notifications
            os.close(listener)
            listener_sink.close()
    except BaseException as exc:  # noqa: BLE001
        report.fail(report_fd, exc, "command setup")
    if plan.tool is not None:
        os.close(report_fd)                               # "running": there is nothing to exec
        file_tools.run(plan.tool)
    trace("exec")
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


def _forward_signals_to(target: int) -> None:
    """Pass the usual job-control and termination signals down one level (like tini)."""
    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(target, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
