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

DangerFullAccess uses one process: the spawner's child becomes the command. For root
(``_exec_unconfined``) that is the host as it is; for a non-root caller (``_exec_as_caller``)
it is the host as that caller has it: its own uid, gid and groups, no capability, no_new_privs.
Both are Python-only: the native helper (sandboxd_call.c) exists to join a session sandbox's
namespaces quickly, and a danger-full-access session has no sandbox (no init, no namespace) to
join; the spawner sends it confined calls only (Spawner._launch_call).
"""

from __future__ import annotations

import _socket  # the C module: socket.py's enums cost more to import than a launch
import errno
import os
import _signal as signal  # the C module: signal.py builds IntEnums, which costs more than a launch

from sandboxd.errors import ExecFailed, SetupError
from sandboxd.kernel import caps, cgroups, landlock, namespaces, process, rlimits, seccomp, sock_diag, syscalls, terminals
from sandboxd.kernel._libc import from_oserror
from sandboxd.launcher import channel_registry, file_tools, report, rootfs, rootless
from sandboxd.launcher.call_plan import Step
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
FORWARDED_SIGNALS = process.FORWARDED_SIGNALS           # also the C helper's (native_call's header)


def _fork_command() -> int:
    """init's fork of the command; EAGAIN (a full pids limit, owner share or ceiling) becomes the
    ProcessLimitReached its caller gets, naming those limits."""
    try:
        return syscalls.current.fork()
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
        process.die_with_parent(OUTSIDE_PARENT if plan.confined and not plan.rootless else spawner)
        cgroups.join(cgroup_dirs)                        # before anything forks: limits cover the whole tree
        if plan.confined:
            plan = _with_channel_registries(plan)
        if plan.confined and plan.rootless:              # a plain user: init comes from a user namespace
            rootless.run_outer(plan, spawner, lambda: _run_rootless_init(plan, report_fd, status_fd))
        if not plan.confined:
            os.close(status_fd)
            if plan.caller_groups is not None:
                _exec_as_caller(plan, report_fd, spawner)
            _exec_unconfined(plan, report_fd)
        _run_init(plan, report_fd=report_fd, status_fd=status_fd)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a report
        report.fail(report_fd, exc, "sandbox")


def _run_rootless_init(plan: LaunchPlan, report_fd: int, status_fd: int) -> NoReturn:
    """init of a rootless launch: PID 1 of the PID namespace the outer process (rootless.run_outer)
    made in its user namespace; from here on the same sequence as root's."""
    try:
        process.die_with_parent(OUTSIDE_PARENT)
    except BaseException as exc:  # noqa: BLE001
        report.fail(report_fd, exc, "init")
    _run_init(plan, report_fd=report_fd, status_fd=status_fd)


def _with_channel_registries(plan: LaunchPlan) -> LaunchPlan:
    """The plan with its broker holding the approval-channel registries open (launcher.channel_registry),
    and a sock_diag socket of the host's network namespace, where the channels' sockets are:
    opened here, in the host's namespaces, before anything hides them."""
    fds = channel_registry.open_registries(plan.broker.channel_dirs)
    if not fds:
        return plan
    try:
        namespace = os.stat("/proc/self/ns/net").st_ino
        diag = sock_diag.open_shared()
    except OSError:
        diag, namespace = -1, 0           # the broker then refuses every registered channel's file
    return plan.replace(broker=plan.broker.replace(channel_fds=fds, host_diag_fd=diag,
                                                   host_network_namespace=namespace))


def _broker_fds(plan: LaunchPlan) -> set[int]:
    """What init keeps open for its connect brokers (_with_channel_registries)."""
    return {*plan.broker.channel_fds, plan.broker.host_diag_fd} - {-1}


# Seen from inside a new PID namespace, a parent outside it has pid 0.
OUTSIDE_PARENT = 0
CALL_INIT = -1  # the command's parent is a call's init, whose pid is only known after the fork


def _build_sandbox(plan: LaunchPlan, title: str) -> None:
    """Everything init does before any command exists; shared by one-shot and session inits."""
    kernel = syscalls.current                             # the real kernel, or a test's recorder
    # Rootless, the isolated network is a loopback-only namespace with the egress proxy's listener.
    loopback_only = not plan.network or (plan.rootless and plan.network_isolated)
    flags = namespaces.ISOLATED_NOW | (namespaces.CLONE_NEWNET if loopback_only else 0)
    kernel.unshare(flags)                                 # mount, ipc, uts, cgroup (+ net): applies to us now
    if plan.netns_fd >= 0:
        # An isolated network: a namespace the spawner built (veth, address, route) before the fork.
        kernel.setns(plan.netns_fd, namespaces.CLONE_NEWNET)
    if loopback_only:
        kernel.bring_up_loopback()                        # a new net namespace has only lo, and it is down
        rootless.hand_over_proxy_listener(plan)
    kernel.set_hostname("sandbox")
    rootfs.build(plan)                                    # mounts, then pivot_root (see rootfs.py)
    kernel.chdir(plan.cwd)
    # Init keeps no privilege either, and drops it before any command is forked
    # so a command starts without any: same uid, no capabilities, NNP. Not
    # dumpable, so a command cannot read init's memory or environment.
    kernel.set_title(title)                               # while its memory is still writable to it
    # Rootless, setgroups is denied in the user namespace (userns.enter_own): the groups stay.
    kernel.drop_privileges(plan.uid, plan.gid, keep_groups=plan.rootless)
    kernel.die_with_parent(OUTSIDE_PARENT)                # credential changes clear the death signal
    kernel.set_dumpable(False)


def _run_init(plan: LaunchPlan, *, report_fd: int, status_fd: int) -> NoReturn:
    """PID 1 of a one-shot sandbox: builds it, starts the command, reaps, reports, exits."""
    try:
        _build_sandbox(plan, "sandboxd-init")
    except BaseException as exc:  # noqa: BLE001
        report.fail(report_fd, exc, "init")
    broker_end, command_end = (_socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
                               if plan.brokers_connect else (None, None))
    # The command can be up and printing before the forwarding below exists (under load, by far): a
    # signal sent meanwhile is held, not taken by Python's own handlers (a KeyboardInterrupt that
    # ended init), and forwarded once the handlers are in place. The command clears what it inherits.
    syscalls.current.hold_signals()
    command_pid = _fork_command()
    if command_pid == 0:
        in_child(report_fd, "command", lambda: _run_command(plan, report_fd=report_fd, listener_sink=command_end))
    listener = None
    if broker_end is not None and command_end is not None:
        command_end.close()
        listener = receive_fd(broker_end)                 # sent by the command just before exec
        broker_end.close()
    process.close_all_except({status_fd, *_broker_fds(plan)} | ({listener} if listener is not None else set()))
    process.forward_signals_to(command_pid)               # the report pipe closed with the command's exec
    process.release_forwarded_signals()                   # what came meanwhile goes on now

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
        plan = _with_channel_registries(plan)
        _build_sandbox(plan, "sandboxd-session")
        process.close_all_except({intake.fileno(), *_broker_fds(plan)})   # closing the report pipe says "ready"
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
        kernel = syscalls.current                         # the real kernel, or a test's recorder
        trace = _tracer(plan)
        trace(Step.DIE_WITH_PARENT)
        kernel.die_with_parent(OUTSIDE_PARENT)
        trace(Step.JOIN_CGROUPS)
        kernel.join_cgroups(cgroup_dirs)
        # A pidfd of the session's init, inherited from the spawner (its pid number
        # means nothing in here): the session's root comes with its mount namespace.
        trace(Step.JOIN_NAMESPACES)
        kernel.setns(session_pidfd, CALL_NAMESPACES)
        trace(Step.CHDIR)
        kernel.chdir(plan.cwd)
        trace(Step.CHILD_SUBREAPER)
        kernel.set_child_subreaper()
        trace(Step.SET_TITLE)
        kernel.set_title("sandboxd-call")
        trace(Step.OOM_SCORE)
        kernel.prefer_for_oom_kill()                      # while its /proc entry is still writable to it
        trace(Step.DROP_PRIVILEGES)
        kernel.drop_privileges(plan.uid, plan.gid)
        trace(Step.DIE_WITH_PARENT)
        kernel.die_with_parent(OUTSIDE_PARENT)
        trace(Step.NOT_DUMPABLE)
        kernel.set_dumpable(False)
        terminal_peer = None
        if plan.terminal is not None:
            trace(Step.OPEN_TERMINAL)
            terminal_peer = open_terminal(plan.terminal)
        trace(Step.FORK)
    except BaseException as exc:  # noqa: BLE001
        report.fail(report_fd, exc, "join session")
    sink = _socket.socket(fileno=intake_fd) if intake_fd is not None else None
    command_pid = _fork_command()
    if command_pid == 0:
        in_child(report_fd, "command", lambda: _run_command(plan, report_fd=report_fd, listener_sink=sink,
                                                            parent=CALL_INIT, trace=trace,
                                                            terminal_peer=terminal_peer))
    if sink is not None:
        sink.detach()                                     # its descriptor is closed just below
    try:
        os.write(report_fd, report.encode({"pid": command_pid}))  # its pid as seen inside the session
    except OSError:
        pass
    process.close_all_except({status_fd})
    process.forward_signals_to(command_pid)
    signal.signal(KILL_TREE_SIGNAL, lambda _s, _f: process.kill_descendants())

    def on_exit(pid: int, status: int, usage: struct_rusage) -> None:
        if pid != command_pid:
            return
        process.kill_descendants(reap=True)               # nothing the command started outlives the call
        report.write_status(status_fd, status, usage.ru_utime, usage.ru_stime, usage.ru_maxrss)
        os._exit(0)

    InitLoop(on_exit).run()


def open_terminal(size: tuple[int, int]) -> int:
    """A terminal of ``size`` (rows, columns) from the devpts this process sees (a session's own,
    inside it); its master is sent on fd 0, the call's terminal channel, to the daemon, which
    relays it. Returns the peer, for the command (``terminals.take_as_controlling``)."""
    try:
        master, peer = terminals.open_pair(*size, ptmx=terminals.PTMX_PATH)
    except OSError as exc:                                # ENOSPC: the devpts' max= (limits.ptys) is reached
        raise SetupError(Step.OPEN_TERMINAL, exc.errno or 0, terminals.PTMX_PATH) from None
    channel = _socket.socket(fileno=0)
    try:
        send_fd(channel, master)
    except BaseException:
        os.close(peer)
        raise
    finally:
        channel.detach()
        os.close(master)
    return peer


def _run_command(plan: LaunchPlan, *, report_fd: int, listener_sink: "_socket.socket | None",
                 parent: int = 1, trace: "Callable[[str], object]" = _no_trace,
                 terminal_peer: int | None = None) -> NoReturn:
    """The command: ``parent`` is its expected parent pid (1: a one-shot init; CALL_INIT: a call's).
    ``terminal_peer``: its terminal (run_call opened it), made its controlling one and its stdio."""
    is_call = parent == CALL_INIT
    parent = os.getppid() if is_call else parent
    debug = plan.debug
    kernel = syscalls.current                             # the real kernel, or a test's recorder
    try:
        trace(Step.DEFAULT_SIGNALS)
        kernel.default_signals()                          # and nothing held: init held them across its fork
        trace(Step.DIE_WITH_PARENT)
        kernel.die_with_parent(parent)
        trace(Step.NEW_SESSION)
        kernel.new_session()                              # no controlling terminal: no TIOCSTI into the caller
        if terminal_peer is not None:
            trace(Step.CONTROLLING_TERMINAL)
            terminals.take_as_controlling(terminal_peer)  # the session's own pty, not the caller's
        if is_call:
            # The session's init (PID 1 here) brokers this command's connects: it reads their
            # address and duplicates their socket, ptrace-attach checks that Yama's ptrace_scope 1
            # passes only for an ancestor (a one-shot init is one; a call's is not) or a declared
            # ptracer. Not inherited: what the command forks is not covered (docs/policies.md).
            trace(Step.DECLARE_PTRACER)
            kernel.declare_ptracer(1)
        trace(Step.RLIMITS)
        kernel.apply_rlimits(cpu_seconds=plan.limits.cpu_seconds, open_files=plan.limits.open_files)
        trace(Step.VERIFY_DROPPED)
        kernel.verify_dropped()                           # no caps, no_new_privs
        trace(Step.LANDLOCK)
        abi = kernel.restrict_writes(                     # second wall for writes, by path
            [*plan.writable_roots, *landlock.EXTRA_WRITABLE], list(landlock.FILE_WRITES_ONLY),
            forced_abi=debug.landlock_abi if debug else 0)
        trace(Step.LANDLOCK_ABI % abi)
        trace(Step.CLOSE_ON_EXEC)
        if kernel.cloexec_from(3, use_close_range=not (debug and debug.no_close_range)):  # only 0, 1, 2 survive exec
            trace(Step.CLOSE_ON_EXEC_WALK)
        trace(Step.SECCOMP)
        listener = kernel.load_seccomp(plan.seccomp_program,  # last: nothing after this but exec
                                       new_listener=plan.brokers_connect)
        if listener_sink is not None and plan.brokers_connect:
            trace(Step.SEND_LISTENER)
            send_fd(listener_sink, listener)              # init answers this filter's notifications
            os.close(listener)
            listener_sink.close()
    except BaseException as exc:  # noqa: BLE001
        report.fail(report_fd, exc, "command setup")
    if plan.tool is not None:
        os.close(report_fd)                               # "running": there is nothing to exec
        file_tools.run(plan.tool)
    trace(Step.EXEC)
    _exec(plan, report_fd)


def _exec_unconfined(plan: LaunchPlan, report_fd: int) -> NoReturn:
    """DangerFullAccess: the host as it is, but a killable tree and no TIOCSTI."""
    try:
        process.default_signals()                         # `sandboxd run` held them across its fork
        process.new_session()
        rlimits.apply(cpu_seconds=plan.limits.cpu_seconds, open_files=plan.limits.open_files)
        os.chdir(plan.cwd)
        process.cloexec_from(3)
        # Loaded while still privileged, so it needs no no_new_privs (full access
        # means setuid binaries keep working); it survives the uid switch below. A plain user
        # (rootless sandboxd run) may load a filter only under no_new_privs: no setuid then.
        if os.geteuid() != 0:
            caps.set_no_new_privs()
        seccomp.load(plan.seccomp_program)
        if (plan.uid, plan.gid) != (os.getuid(), os.getgid()):
            os.setgroups([])
            os.setresgid(plan.gid, plan.gid, plan.gid)
            os.setresuid(plan.uid, plan.uid, plan.uid)
        if plan.terminal is not None:                     # the host's devpts: this is the host as it is
            terminals.take_as_controlling(open_terminal(plan.terminal))
    except BaseException as exc:  # noqa: BLE001
        report.fail(report_fd, exc, "unconfined setup")
    if plan.tool is not None:                             # a file tool (ApplyPatch's too): nothing to exec
        process.close_all_except({0, 1, 2})
        file_tools.run(plan.tool)
    _exec(plan, report_fd)


def _exec_as_caller(plan: LaunchPlan, report_fd: int, spawner: int) -> NoReturn:
    """A non-root caller's danger-full-access command (or file tool): the host with exactly the
    caller's own rights. Unlike root's (``_exec_unconfined``), every privilege goes before anything
    the caller names is touched: its uid, gid and supplementary groups, empty capability sets
    (bounding and ambient too), securebits locked and no_new_privs, so a setuid binary or file
    capability elevates nothing. The spawner put it in a cgroup of its own below the session's
    (run_sandbox joined it first), which is what keeps the tree killable without a PID namespace."""
    try:
        process.default_signals()
        process.new_session()                             # no controlling terminal: no TIOCSTI into the caller
        rlimits.apply(cpu_seconds=plan.limits.cpu_seconds, open_files=plan.limits.open_files)
        process.cloexec_from(3)                           # no descriptor of the fork server survives exec
        caps.drop_privileges(plan.uid, plan.gid, plan.caller_groups or ())
        # Until exec this process holds the fork server's memory: not the caller's to read or trace.
        process.set_dumpable(False)
        process.die_with_parent(spawner)                  # the credential change cleared it
        caps.verify_dropped()
        os.chdir(plan.cwd)                                # as the caller: a cwd it could not enter fails here
        seccomp.load(plan.seccomp_program)                # no_new_privs is set: no privilege needed
        if plan.terminal is not None:                     # the host's devpts, opened as the caller
            terminals.take_as_controlling(open_terminal(plan.terminal))
    except BaseException as exc:  # noqa: BLE001
        report.fail(report_fd, exc, "full access setup")
    if plan.tool is not None:
        process.close_all_except({0, 1, 2})               # the report pipe too: "running", nothing to exec
        file_tools.run(plan.tool)
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
                syscalls.current.execve(candidate, argv, plan.env)
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


